"""SASRec (Kang and McAuley, ICDM 2018): a causal transformer over a user's item sequence, scoring a candidate
by the dot product of the last position's output with the candidate's item embedding.

It is the baseline of the next-item task (``gem_data.sequential``): the history is one event type whose item
id feature and the candidate's item id feature look up the *same* table (one TorchRec EmbeddingCollection
table serving both feature names), so the score ``<user, item>`` ranks every item of the catalogue with one
matrix product. ``score_candidates`` is that path: the user side runs once per request.

Per example: the last ``max_seq_len`` history items, embedded and scaled by ``sqrt(dim)``, plus a learned
position (counted back from the most recent item, as SASRec's left padding does), then ``num_blocks`` pre-norm
blocks of causal multi-head self-attention and a ReLU feed-forward, a final LayerNorm, and the most recent
position's vector is the user representation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

from gem_kunlun.batch import Batch, check_item_ids
from gem_kunlun.candidates import CandidateInput
from gem_kunlun.config_checks import check_at_least
from gem_kunlun.cuda_graphs import GraphedForward
from gem_kunlun.features import FeatureSpec
from gem_kunlun.heads import ModelOutput
from gem_kunlun.retrieval import dot_scores, retrieval_logits, scored_item_ids


@dataclass(frozen=True)
class SasrecConfig:
    dim: int = 64
    num_blocks: int = 2
    num_heads: int = 2
    dropout: float = 0.2
    max_seq_len: int = 50
    history: str = "history"  # the event type holding the item sequence
    history_item: str = "history_item_id"  # its item id feature
    candidate_item: str = "item_id"  # the candidate's item id feature (non-sequence)
    # "grouped": examples sorted by length and padded in groups of rows_per_group, each to its own longest
    # (least compute; a host sync per group); "padded": the whole batch padded to max_seq_len (static shapes,
    # no host sync: what a GPU wants, where the launches cost more than the padding); "auto": padded on CUDA
    layout: str = "auto"
    rows_per_group: int = 64
    init_std: float = 0.02  # item embeddings start as N(0, init_std); TorchRec's default (1/sqrt(rows)) is far smaller

    def __post_init__(self) -> None:
        check_at_least(self, {"dim": 1, "num_blocks": 1, "num_heads": 1, "max_seq_len": 1, "rows_per_group": 1})
        if self.init_std <= 0:
            raise ValueError(f"init_std must be > 0, got {self.init_std}")
        if self.layout not in ("auto", "grouped", "padded"):
            raise ValueError(f"layout must be 'auto', 'grouped' or 'padded', got {self.layout!r}")
        if self.dim % self.num_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by num_heads ({self.num_heads})")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must lie in [0, 1), got {self.dropout}")


class SasrecBlock(nn.Module):
    """Pre-norm causal self-attention and point-wise feed-forward, each with dropout and a residual, over
    right-padded sequences (padding only ever follows a sequence, so causality hides it from real tokens)."""

    def __init__(self, dim: int, num_heads: int, dropout: float, device=None) -> None:
        super().__init__()
        self.num_heads, self.dropout = num_heads, dropout
        self.attention_norm = nn.LayerNorm(dim, device=device)
        self.qkv = nn.Linear(dim, 3 * dim, device=device)
        self.out = nn.Linear(dim, dim, device=device)
        self.ffn_norm = nn.LayerNorm(dim, device=device)
        self.ffn = nn.Sequential(
            nn.Linear(dim, dim, device=device), nn.ReLU(), nn.Dropout(dropout), nn.Linear(dim, dim, device=device), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, L, D]`` -> ``[B, L, D]``."""
        b, length, d = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(b, length, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        # NOTE: no dropout on the attention weights: it would force SDPA's materialising math path on the CPU
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.dropout(self.out(o.transpose(1, 2).reshape(b, length, d)), self.dropout, self.training)
        return x + self.ffn(self.ffn_norm(x))


class SasrecModel(nn.Module):
    """``forward(batch) -> ModelOutput(logits [B, 1], aux_loss = 0, representation [B, dim])``;
    ``score_candidates(requests, candidates [U, C]) -> [U, C]``. See the module docstring."""

    def __init__(self, spec: FeatureSpec, config: SasrecConfig = SasrecConfig(), device: torch.device | None = None) -> None:
        super().__init__()
        c = config
        events = {e.name: e for e in spec.events}
        sparse = {f.name: f for f in spec.sparse}
        if c.history not in events or c.history_item not in {f.name for f in events[c.history].features}:
            raise ValueError(f"SASRec needs event type {c.history!r} with feature {c.history_item!r}; the data has {list(events)}")
        if c.candidate_item not in sparse:
            raise ValueError(f"SASRec needs the candidate feature {c.candidate_item!r}; the data has {list(sparse)}")
        if spec.representations:
            raise ValueError(f"SASRec reads item ids only, not representation features "
                             f"({[r.name for r in spec.representations]}): use Kunlun, InterFormer or the baseline")
        num_items = sparse[c.candidate_item].num_embeddings
        history_items = next(f for f in events[c.history].features if f.name == c.history_item).num_embeddings
        if history_items != num_items:
            raise ValueError(f"{c.history_item!r} ({history_items} ids) and {c.candidate_item!r} ({num_items} ids) must share one item table")
        if len(spec.tasks) != 1:
            raise ValueError(f"SASRec scores one next-item task, the data has {list(spec.tasks)}")
        self.spec, self.config, self.num_items = spec, config, num_items
        self.candidate_input = CandidateInput.IDS
        self.items = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name="t_item", embedding_dim=c.dim, num_embeddings=num_items,
                    feature_names=[c.history_item, c.candidate_item],
                    init_fn=lambda weight: nn.init.normal_(weight, std=c.init_std),
                )
            ],
            device=device,
        )
        # a bare parameter, not nn.Embedding: DMP materialising a meta-built model calls the owning module's
        # reset_parameters, and nn.Embedding's would draw N(0, 1), drowning the item vectors
        self.position = nn.Parameter(torch.empty(c.max_seq_len, c.dim, device=device))
        # one Sequential: compiled with CUDA graphs, the whole stack is one graph (see gem_parallel.dense.compile_units)
        self.blocks = nn.Sequential(*(SasrecBlock(c.dim, c.num_heads, c.dropout, device=device)
                                      for _ in range(c.num_blocks)))
        self.final_norm = nn.LayerNorm(c.dim, device=device)
        self.representation_dim = c.dim
        # ``every_position_padded`` replayed as CUDA graphs (``gem_kunlun.apply_cuda_graphs``), or None: eager
        self.graphs: GraphedForward | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.position, std=self.config.init_std)

    def _lookup(self, history: KeyedJaggedTensor, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Item vectors of the history events ``[T, D]`` and of the flattened candidates ``[N, D]``, in one
        lookup (a sharded EmbeddingCollection takes a single KJT)."""
        c = self.config
        history_ids = history[c.history_item]
        b = history_ids.lengths().numel()
        n = candidates.numel()
        # the candidate ids ride in the same KJT, padded to a common stride: B rows of history, N rows of one id
        stride = max(b, n)
        lengths = torch.cat([
            F.pad(history_ids.lengths(), (0, stride - b)),
            F.pad(torch.ones(n, dtype=torch.int64, device=candidates.device), (0, stride - n)),
        ])
        # NOTE: the per-key lengths come from the shapes: TorchRec would otherwise read them back from the device
        ids = KeyedJaggedTensor(
            keys=[c.history_item, c.candidate_item],
            values=torch.cat([history_ids.values(), candidates.reshape(-1)]),
            lengths=lengths, offsets=F.pad(torch.cumsum(lengths, 0), (1, 0)), stride=stride,
            length_per_key=[history_ids.values().numel(), n],
        )
        looked_up = self.items(ids)
        return looked_up[c.history_item].values(), looked_up[c.candidate_item].values()

    def user_representation(self, history_vectors: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``history_vectors [T, D]`` (jagged by ``lengths [B]``, time order) -> ``[B, D]`` the output at each
        example's most recent item (the learned position-0 vector alone for an empty history)."""
        return self._encode(history_vectors, lengths, every=False)

    def position_representations(self, history_vectors: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``[T, D]``: the output at every history event, each seeing only the events up to it (causal),
        which is what training on every position of a sequence at once needs. The learned positions count back
        from the newest event, as SASRec's left padding does: an event's output tells how many events follow it,
        though not what they are."""
        message = (f"a history is longer than model.sasrec.max_seq_len ({self.config.max_seq_len}): every-position "
                   "training needs data.sequential.max_history <= it")
        if lengths.numel() and lengths.device.type == "cuda":
            torch._assert_async(lengths.max() <= self.config.max_seq_len, message)  # no host sync on a GPU
        elif lengths.numel() and int(lengths.max()) > self.config.max_seq_len:
            raise ValueError(message)
        return self._encode(history_vectors, lengths, every=True)

    def _padded(self, device: torch.device) -> bool:
        return self.config.layout == "padded" or (self.config.layout == "auto" and device.type == "cuda")

    def every_position_padded(self, vectors: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor]:
        """The padded layout's every-position encoder, shaped by the batch size alone: ``vectors [B * max_seq_len
        + 1, D]`` (a batch's history vectors, time order, then zero rows; each length at most ``max_seq_len``) ->
        ``([B * max_seq_len + 1, D],)``, each event's output in its row (the rows past the events are padding). Fixed
        shapes and no host sync: ``apply_cuda_graphs`` replays it (prologue, blocks, scatter, final norm) as one
        forward and one backward graph."""
        c = self.config
        zero_row = vectors.shape[0] - 1  # past every event: the padding reads it and takes the padding's writes
        ends = torch.cumsum(lengths, 0)
        column = torch.arange(c.max_seq_len, device=vectors.device)
        valid = column[None, :] < lengths[:, None]
        source = torch.where(valid, ends[:, None] - lengths[:, None] + column[None, :], zero_row)
        recency = (lengths[:, None] - 1 - column[None, :]).clamp(min=0)
        x = F.embedding(source, vectors * math.sqrt(c.dim)) + F.embedding(recency, self.position) * valid[..., None]
        x = self.blocks(F.dropout(x, c.dropout, self.training))
        # NOTE: positions count back from the newest event (SASRec's left-padded layout), so an event's output
        # depends on how many events follow it in the window, as in SASRec's own training
        every_output = vectors.new_zeros(vectors.shape).index_put((source.flatten(),), x.flatten(0, 1))
        return (self.final_norm(every_output),)

    def graph_parameters(self) -> list[nn.Parameter]:
        """The parameters ``every_position_padded`` reads: all but the item table's (the table's gradient leaves
        through the vectors' gradient, to TorchRec's fused optimizer)."""
        table = {id(p) for p in self.items.parameters()}
        return [p for p in self.parameters() if id(p) not in table]

    def _encode(self, history_vectors: torch.Tensor, lengths: torch.Tensor, every: bool) -> torch.Tensor:
        """Run the blocks over the examples padded into ``[rows, width, D]`` groups (``config.layout``): all
        rows at ``max_seq_len`` (no host sync), or rows sorted by length in groups of ``rows_per_group``, each
        padded to its own longest: prefixes are mostly short (Beauty: 8 events on average, 50 at most), so
        padding everything to the longest is mostly zeros, which a CPU pays for and a GPU hardly notices."""
        c = self.config
        b = lengths.numel()
        device = history_vectors.device
        if every and self._padded(device):
            events, rows = history_vectors.shape[0], b * c.max_seq_len + 1
            if events >= rows:  # lengths above max_seq_len (position_representations checks them on the device too)
                raise ValueError(f"{events} history events in {b} examples: more than model.sasrec.max_seq_len "
                                 f"({c.max_seq_len}) per example")
            vectors = F.pad(history_vectors, (0, 0, 0, rows - events))
            encode = self.graphs if self.graphs is not None else self.every_position_padded
            (outputs,) = encode(vectors, lengths)
            return outputs[:events]
        kept = lengths.clamp(max=c.max_seq_len)
        ends = torch.cumsum(lengths, 0)
        zero_row = history_vectors.shape[0]  # an appended zero vector fills the padding
        vectors = torch.cat([history_vectors, history_vectors.new_zeros(1, c.dim)]) * math.sqrt(c.dim)
        if self._padded(device):
            order, groups = None, [(slice(None), c.max_seq_len)]  # every row, in order: no gather
        else:
            order = torch.argsort(kept, stable=True)
            groups = [(rows, None) for rows in order.split(c.rows_per_group) if rows.numel()]  # none for 0 rows
        outputs = []
        # one spare row past the events takes the padding's writes, so no boolean indexing (a host sync) is needed
        every_output = history_vectors.new_zeros(zero_row + 1, c.dim) if every else None
        for rows, width in groups:
            n = kept[rows]
            width = width or max(int(n.max()), 1)
            column = torch.arange(width, device=device)
            valid = column[None, :] < n[:, None]
            source = torch.where(valid, ends[rows, None] - n[:, None] + column[None, :], zero_row)
            recency = (n[:, None] - 1 - column[None, :]).clamp(min=0)
            # NOTE: F.embedding rather than indexing: its backward is a fast dense scatter, not index_put
            x = F.embedding(source, vectors) + F.embedding(recency, self.position) * valid[..., None]
            x = F.dropout(x, c.dropout, self.training)
            x = self.blocks(x)
            if every:
                # NOTE: positions count back from the newest event (SASRec's left-padded layout), so an event's
                # output depends on how many events follow it in the window, as in SASRec's own training
                every_output = every_output.index_put((source.flatten(),), x.flatten(0, 1))
            else:
                outputs.append(x[torch.arange(n.numel(), device=device), (n - 1).clamp(min=0)])
        if every:
            return self.final_norm(every_output[:zero_row])
        last = torch.cat(outputs) if outputs else history_vectors.new_zeros(0, c.dim)
        if order is not None:
            last = last[torch.argsort(order)]
        last = torch.where((kept == 0)[:, None], self.position[0].expand(b, -1), last)
        return self.final_norm(last)

    def forward(self, batch: Batch) -> ModelOutput:
        """Pointwise (``logits [B, 1]`` for each row's candidate) or, when ``batch.next_items`` is set,
        retrieval logits of every query against its scored items (see ``gem_kunlun.retrieval``)."""
        c = self.config
        history = batch.sequences[c.history]
        targets = batch.next_items
        if targets is None:
            candidates = batch.sparse[c.candidate_item]
            # one candidate per example, read in order: another count would pair users with others' candidates
            # (on a GPU asserted on the device: a host check would wait for it every step)
            one_each = (candidates.lengths() == 1).all()
            if one_each.device.type == "cuda":
                torch._assert_async(one_each, f"SASRec: batch.sparse[{c.candidate_item!r}] must hold one id per example")
            elif not bool(one_each):
                raise ValueError(f"SASRec scores one candidate per example: batch.sparse[{c.candidate_item!r}] must "
                                 f"hold exactly one id per example")
            history_vectors, candidate_vectors = self._lookup(history.ids, candidates.values())
            user = self.user_representation(history_vectors, history.lengths())
            logits = (user * candidate_vectors).sum(-1, keepdim=True)
            return ModelOutput(logits=logits, aux_loss=logits.new_zeros((), dtype=torch.float32), representation=user)
        history_vectors, item_vectors = self._lookup(history.ids, scored_item_ids(targets, self.num_items))
        if targets.every:
            queries = self.position_representations(history_vectors, history.lengths())
        else:
            queries = self.user_representation(history_vectors, history.lengths())
        if queries.shape[0] != targets.num_queries:
            raise ValueError(f"batch.next_items has {targets.num_queries} positives for {queries.shape[0]} queries "
                             f"({'every history event' if targets.every else 'one per example'})")
        logits = retrieval_logits(queries, item_vectors, targets)
        return ModelOutput(logits=logits, aux_loss=logits.new_zeros((), dtype=torch.float32), representation=queries,
                           item_vectors=item_vectors)

    def score_candidates(self, requests: Batch, candidates: torch.Tensor) -> torch.Tensor:
        """One request row per user (its candidate feature is ignored) and ``candidates [U, C]`` item ids ->
        ``[U, C]`` scores, equal to ``forward`` on every (user, candidate) row; the transformer runs U times
        and the candidates need nothing but their ids (the shared item table)."""
        check_item_ids("candidates", candidates, self.num_items)
        history = requests.sequences[self.config.history]
        history_vectors, candidate_vectors = self._lookup(history.ids, candidates)
        user = self.user_representation(history_vectors, history.lengths())
        return dot_scores(user, candidate_vectors.view(*candidates.shape, -1))

    def flops(self, batch: Batch) -> dict[str, float]:
        """Forward FLOPs per component over real lengths (embedding lookups excluded); multiply by 3 for training."""
        c, d = self.config, self.config.dim
        # NOTE: in NumPy: the trainer counts a step's FLOPs on the host while its kernels run, and a NumPy op on a
        # short array costs a fraction of a torch op (a small model's step waits on the host)
        lengths = np.minimum(batch.sequences[c.history].lengths().cpu().numpy(), c.max_seq_len).astype(np.float64)
        tokens = float(lengths.sum())
        pairs = float((lengths * (lengths + 1) / 2).sum())
        per_block = 2.0 * d * 3 * d * tokens + 4.0 * d * pairs + 2.0 * d * d * tokens + 2.0 * 2 * d * d * tokens
        targets = batch.next_items
        if targets is None:
            scores = float(batch.batch_size)
        else:
            scores = targets.num_queries * float(self.num_items if targets.negatives is None else 1 + targets.negatives.shape[1])
        return {f"block{i}": per_block for i in range(c.num_blocks)} | {"score": 2.0 * d * scores}

    def embedding_bytes(self, batch: Batch) -> float:
        history = batch.sequences[self.config.history].ids[self.config.history_item]
        return 4.0 * self.config.dim * (history.values().numel() + batch.batch_size)

