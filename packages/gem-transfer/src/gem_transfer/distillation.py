"""Knowledge distillation from a foundation model (teacher) into a serving model (student).

Three pieces, after ExFM (arXiv 2502.17494):

- An **auxiliary head** on the student takes the teacher's supervision, so the serving head is trained on
  true labels only and the teacher's biases do not leak into what is served; the shared trunk still
  learns from both.
- A **student adapter** corrects the teacher's prediction before it is used: teachers are refreshed less
  often than students, so their predictions are stale. A small per-task map from the teacher's logit
  (and the surface) to a corrected logit is fitted on fresh labels; its output, detached, is the
  distillation target.
- The **soft-label loss**: binary cross-entropy between the student's auxiliary logits and the corrected
  teacher probabilities, at a temperature.

Retrieval students (``batch.next_items`` set) distil listwise: each query's scores over its candidates (the
positive and the sampled negatives, the same for teacher and student) become a softmax, and the student's
auxiliary query head is trained on the teacher's distribution (``listwise_soft_label_loss``); the adapter is
then a learned sharpness of the teacher's scores (``ListwiseAdapter``), fitted on which candidate came next.
A teacher stored as its top-k (``TopKLogits``: its best items of the catalogue, other than the next one) gives
each query its own candidates: the next item and those k (and a sampled tail of the rest, weighted by how many
items each sample stands for), which the student's auxiliary head scores with the student's own item vectors,
whatever the serving head is trained against (sampled items or the catalogue).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.nn import functional as F

from gem_kunlun import ModelOutput, MultiTaskHeads, dot_scores, retrieval_logits
from gem_transfer.soft_labels import TopKLogits


def _check_pair(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} must have the same shape")


def soft_label_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over examples and tasks of BCE(sigmoid(student / T), sigmoid(teacher / T)) * T^2, in float32.

    Zero exactly when the student's logits equal the teacher's; the T^2 keeps gradient sizes comparable
    across temperatures.
    """
    _check_pair(student_logits, teacher_logits, temperature)
    targets = torch.sigmoid(teacher_logits.float() / temperature)
    loss = F.binary_cross_entropy_with_logits(student_logits.float() / temperature, targets)
    # subtract the targets' own entropy so that a perfect match scores 0. NOTE: from the logits: CUDA autocast refuses
    # F.binary_cross_entropy outright, and the trainer runs the student's loss under it
    entropy = F.binary_cross_entropy_with_logits(teacher_logits.float() / temperature, targets)
    return (loss - entropy) * temperature**2


def listwise_soft_label_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
                             log_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over queries of the cross-entropy of softmax(student / T) against softmax(teacher / T) over each
    row's candidates, minus the teacher distribution's entropy (zero at a match, up to a shift per row), x T^2;
    float32. ``log_weights [candidates]``: how many items each candidate column stands for (a sampled tail, see
    ``TopKLogits``), added inside both softmaxes, so that the loss estimates the one over every item."""
    _check_pair(student_logits, teacher_logits, temperature)
    shift = 0.0 if log_weights is None else log_weights.float()
    teacher = F.log_softmax(teacher_logits.float() / temperature + shift, -1)
    student = F.log_softmax(student_logits.float() / temperature + shift, -1)
    return (teacher.exp() * (teacher - student)).sum(-1).mean() * temperature**2


class ListwiseAdapter(nn.Module):
    """Corrects a stale teacher's candidate scores by a learned sharpness, ``corrected = scale * teacher``
    (starting at 1: the identity), fitted by the softmax cross-entropy of the true next item (column 0)."""

    def __init__(self, device=None) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.zeros(1, device=device))  # 1-D: FSDP2 shards no scalars

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.log_scale)

    def forward(self, teacher_logits: torch.Tensor) -> torch.Tensor:
        return self.log_scale.exp() * teacher_logits.float()

    def fit_loss(self, teacher_logits: torch.Tensor, log_weights: torch.Tensor | None = None) -> torch.Tensor:
        """The cross-entropy of the true next item (column 0); ``log_weights`` as in ``listwise_soft_label_loss``:
        against a top-k alone the fit comes out too flat (the next item competes only with the teacher's best)."""
        corrected = self(teacher_logits.detach())
        if log_weights is not None:
            corrected = corrected + log_weights.float()
        return F.cross_entropy(corrected, torch.zeros(corrected.shape[0], dtype=torch.long, device=corrected.device))


class QueryMap(nn.Linear):
    """The auxiliary head of a retrieval student: a linear map of its queries, starting at the identity (its
    first auxiliary scores are the serving scores)."""

    def __init__(self, dim: int, device=None) -> None:
        super().__init__(dim, dim, device=device)

    def reset_parameters(self) -> None:
        nn.init.eye_(self.weight)
        nn.init.zeros_(self.bias)


class StudentAdapter(nn.Module):
    """Per task and surface, ``corrected = a * teacher_logit + b + MLP(teacher_logit)``, starting at the
    identity map; ``fit_loss`` trains it on true labels."""

    def __init__(self, num_tasks: int, num_surfaces: int, hidden: int = 16, device=None) -> None:
        super().__init__()
        self.num_tasks, self.num_surfaces = num_tasks, num_surfaces
        self.scale = nn.Parameter(torch.ones(num_surfaces, num_tasks, device=device))
        self.shift = nn.Parameter(torch.zeros(num_surfaces, num_tasks, device=device))
        self.residual = nn.Sequential(nn.Linear(1, hidden, device=device), nn.Tanh(), nn.Linear(hidden, 1, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.scale)
        nn.init.zeros_(self.shift)
        # the residual's output layer starts at zero, so the adapter starts as the identity map
        nn.init.zeros_(self.residual[2].weight)
        nn.init.zeros_(self.residual[2].bias)

    def forward(self, teacher_logits: torch.Tensor, surface: torch.Tensor) -> torch.Tensor:
        t = teacher_logits.float()
        correction = self.residual(t.unsqueeze(-1)).squeeze(-1)
        return self.scale[surface] * t + self.shift[surface] + correction

    def fit_loss(self, teacher_logits: torch.Tensor, surface: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self(teacher_logits.detach(), surface), labels.float())


@dataclass
class DistillationOutput(ModelOutput):
    """The student's serving ``logits`` and ``aux_loss`` (its own auxiliary loss plus, with a teacher, the
    distillation terms), the ``auxiliary_logits`` trained on the teacher, and the adapter's corrected teacher
    logits and ``distillation_loss`` (None without a teacher)."""

    auxiliary_logits: torch.Tensor | None = None
    corrected_teacher_logits: torch.Tensor | None = None
    distillation_loss: torch.Tensor | None = None


pytree.register_dataclass(DistillationOutput)  # like ModelOutput: data-parallel wrappers hook its tensors


class DistilledStudent(nn.Module):
    """A student model with an auxiliary head (and, optionally, a student adapter) for distillation.

    The student must return a ``ModelOutput`` whose ``representation`` feeds its heads; the auxiliary head
    reads the same representation. ``forward(batch, teacher_logits)`` computes the distillation terms
    inside the forward pass (so data-parallel wrappers see every parameter used there) and adds them to
    ``aux_loss``: ``weight`` x soft-label loss of the auxiliary head against the corrected teacher, plus the
    adapter's fit on ``batch.labels``. Without teacher logits it is the plain student (serving, evaluation).

    ``retrieval``: the student scores next-item candidates; the auxiliary head is then a query map (starting
    at the identity) whose queries score the student's own item vectors, and the teacher's logits are its
    scores of the same candidates (``[queries, 1 + negatives]``), or ``TopKLogits``: its scores of each query's
    next item and its own top k items (``[queries, 1 + k]``), which the student then scores as well.
    """

    def __init__(self, student: nn.Module, representation_dim: int, num_tasks: int, num_surfaces: int,
                 weight: float = 1.0, temperature: float = 1.0, adapter: bool = True, retrieval: bool = False,
                 device=None) -> None:
        super().__init__()
        self.student, self.retrieval = student, retrieval
        if retrieval:
            self.auxiliary_head = QueryMap(representation_dim, device=device)
            self.adapter = ListwiseAdapter(device=device) if adapter else None
        else:
            self.auxiliary_head = MultiTaskHeads(representation_dim, num_tasks, num_surfaces, device=device)
            self.adapter = StudentAdapter(num_tasks, num_surfaces, device=device) if adapter else None
        self.weight, self.temperature = weight, temperature
        if hasattr(student, "candidate_input"):
            # NOTE: the student's ranking path (the request side once per user) is the served model's: evaluation
            # takes it through this wrapper (gem_kunlun.CandidateScorer) rather than one row per candidate
            self.candidate_input = student.candidate_input

    def score_candidates(self, requests, candidates: torch.Tensor, **inputs) -> torch.Tensor:
        """The serving model's ``[U, C]`` scores of ``candidates`` (``gem_kunlun.CandidateScorer``)."""
        return self.student.score_candidates(requests, candidates, **inputs)

    def forward(self, batch, teacher_logits: torch.Tensor | TopKLogits | None = None) -> DistillationOutput:
        if isinstance(teacher_logits, TopKLogits):
            return self._forward_top_k(batch, teacher_logits)
        out = self.student(batch)
        if out.representation is None:
            raise ValueError(f"{type(self.student).__name__} returns no representation for an auxiliary head")
        targets = batch.next_items
        if self.retrieval != (targets is not None):
            raise ValueError(f"this student was built for {'retrieval' if self.retrieval else 'pointwise'} batches")
        if self.retrieval:
            if out.item_vectors is None:
                raise ValueError(f"{type(self.student).__name__} returns no item vectors for an auxiliary retrieval head")
            auxiliary = retrieval_logits(self.auxiliary_head(out.representation), out.item_vectors, targets)
        else:
            auxiliary = self.auxiliary_head(out.representation, batch.surface)
        plain = dict(logits=out.logits, representation=out.representation, item_vectors=out.item_vectors,
                     auxiliary_logits=auxiliary)
        if teacher_logits is None:
            return DistillationOutput(aux_loss=out.aux_loss, **plain)
        if teacher_logits.shape != auxiliary.shape:
            raise ValueError(f"teacher logits {tuple(teacher_logits.shape)} do not match the student's "
                             f"{tuple(auxiliary.shape)} (the same candidates, queries and tasks)")
        if self.retrieval:
            if targets.negatives is None:
                raise ValueError("retrieval distillation scores sampled candidates: batches need negatives "
                                 "(or a teacher stored as its top-k)")
            return self._listwise(out, auxiliary, teacher_logits, plain)
        teacher_logits = teacher_logits.detach().float()
        corrected, loss = teacher_logits, out.aux_loss.new_zeros(())
        if self.adapter is not None:
            corrected = self.adapter(teacher_logits, batch.surface)
            loss = loss + self.adapter.fit_loss(teacher_logits, batch.surface, batch.labels)
        loss = loss + self.weight * soft_label_loss(auxiliary, corrected.detach(), self.temperature)
        return DistillationOutput(aux_loss=out.aux_loss + loss, corrected_teacher_logits=corrected, distillation_loss=loss,
                                  **plain)

    def _listwise(self, out: ModelOutput, auxiliary: torch.Tensor, teacher_logits: torch.Tensor, plain: dict,
                  log_weights: torch.Tensor | None = None) -> DistillationOutput:
        """The retrieval terms: the adapter's fit and the listwise loss of ``auxiliary`` against the (corrected)
        teacher, both ``[queries, candidates]`` with the next item in column 0 (``log_weights``: a top-k's tail)."""
        teacher_logits = teacher_logits.detach().float()
        corrected, loss = teacher_logits, out.aux_loss.new_zeros(())
        if self.adapter is not None:
            corrected = self.adapter(teacher_logits)
            loss = loss + self.adapter.fit_loss(teacher_logits, log_weights)
        loss = loss + self.weight * listwise_soft_label_loss(auxiliary, corrected.detach(), self.temperature, log_weights)
        return DistillationOutput(aux_loss=out.aux_loss + loss, corrected_teacher_logits=corrected, distillation_loss=loss,
                                  **plain)

    def _forward_top_k(self, batch, teacher: TopKLogits) -> DistillationOutput:
        """A retrieval step against a teacher's top-k: the student scores each query's next item and the
        teacher's k items with its auxiliary head. Against the catalogue the student's item vectors hold them
        all; against sampled items the student runs once on a batch whose candidates also hold the teacher's
        items, and its serving scores are cut back to the batch's own candidates (the same values)."""
        targets = batch.next_items
        if not self.retrieval or targets is None:
            raise ValueError("a teacher's top-k (TopKLogits) distils retrieval students on retrieval batches")
        queries, k = targets.num_queries, teacher.top_k
        if teacher.items.shape[0] != queries:
            raise ValueError(f"the teacher's top-k holds {teacher.items.shape[0]} queries, the batch {queries}")
        widened = targets if targets.negatives is None else dataclasses.replace(
            targets, negatives=torch.cat([targets.negatives, teacher.items], 1))
        out = self.student(dataclasses.replace(batch, next_items=widened))
        if out.representation is None or out.item_vectors is None:
            raise ValueError(f"{type(self.student).__name__} returns no representation and item vectors for an auxiliary retrieval head")
        if targets.negatives is None:  # the item vectors are the catalogue's
            logits, plain_vectors = out.logits, out.item_vectors
            vectors = out.item_vectors[torch.cat([targets.positives.view(-1, 1), teacher.items], 1)]  # [Q, 1 + k, D]
        else:
            served = 1 + targets.negatives.shape[1]
            every = out.item_vectors.view(queries, served + k, -1)
            logits, plain_vectors = out.logits[:, :served], every[:, :served].reshape(queries * served, -1)
            vectors = torch.cat([every[:, :1], every[:, served:]], 1)
        auxiliary = dot_scores(self.auxiliary_head(out.representation), vectors)
        plain = dict(logits=logits, representation=out.representation, item_vectors=plain_vectors, auxiliary_logits=auxiliary)
        return self._listwise(out, auxiliary, teacher.logits, plain, teacher.log_weights)
