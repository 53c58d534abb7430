"""The held-out evaluation loops: binary metrics over evaluation batches, ranking metrics over each user's
candidates. Every rank takes its share and the results are gathered, so all ranks return the same numbers;
model calls run in lockstep (sharded tables and expert parallelism communicate inside forward)."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gem_kunlun import CandidateInput, CandidateScorer, FeatureSpec
from gem_trainer.config import RANKING_CUTOFFS
from gem_trainer.distributed import DistributedEnv
from gem_trainer.evaluation import binary_metrics, ranking_metrics, target_ranks
from gem_trainer.metrics import progress


@dataclasses.dataclass
class Evaluator:
    """The loops over one (sharded) model: where it runs, how (``autocast`` returns a context manager) and
    whether rank 0 shows a progress bar."""

    model: nn.Module
    env: DistributedEnv
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    show_progress: bool = False

    def in_lockstep(self, items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
        """Yield ``(item, real)`` so that every rank makes the same number of model calls: a rank that runs out
        repeats its last item with ``real`` False, whose result it discards, until every rank is done."""
        items, last = iter(items), None
        while True:
            item = next(items, None)
            more = torch.tensor(int(item is not None), device=self.env.device)
            if self.env.world_size > 1:
                dist.all_reduce(more, op=dist.ReduceOp.MAX)
            if not more:
                return
            if item is None:
                if last is None:
                    raise RuntimeError(f"rank {self.env.rank} has no evaluation work while others have: evaluate at "
                                       f"least as many batches / users as there are ranks")
                yield last, False
            else:
                last = item
                yield item, True

    def gather(self, local: Any) -> list[Any]:
        gathered = [None] * self.env.world_size
        dist.all_gather_object(gathered, local)
        return gathered

    def binary(self, batches: Iterable, spec: FeatureSpec, total: int | None = None) -> dict[str, float]:
        """NE, AUC and calibration per task and surface over this rank's evaluation ``batches`` and the others'."""
        scores, labels, surfaces = [], [], []
        for batch, real in progress(self.in_lockstep(batches), total, "eval", self.show_progress):
            batch = batch.to(self.env.device)
            with self.autocast():
                logits = self.model(batch).logits
            if not real:
                continue
            scores.append(logits.float().cpu())
            labels.append(batch.labels.cpu())
            surfaces.append(batch.surface.cpu())
        z, y, s = (torch.cat(g) for g in zip(*self.gather((torch.cat(scores), torch.cat(labels), torch.cat(surfaces)))))
        return binary_metrics(z, y, s, spec.tasks, spec.num_surfaces)

    def ranking(self, dataset, settings, seed: int) -> dict[str, float]:
        """HR@K / NDCG@K / MRR of each protocol of ``settings`` (``data.sequential``), per seed of the negative
        draw and their mean and spread, over every user (or a fixed subset drawn with ``seed``)."""
        fixed_mmap_threshold()
        result: dict[str, float] = {}
        for protocol in settings.eval_protocols:
            ks = RANKING_CUTOFFS[protocol]
            per_seed = []
            for draw in settings.eval_seeds if protocol == "sampled" else settings.eval_seeds[:1]:
                ranking = dataset.ranking_examples(settings.eval_split, protocol, settings.eval_negatives, draw)
                users = torch.arange(ranking.num_users)
                if settings.eval_users is not None and settings.eval_users < ranking.num_users:
                    # the same fixed subset for every protocol and seed
                    chosen = torch.randperm(ranking.num_users, generator=torch.Generator().manual_seed(seed))
                    users = chosen[: settings.eval_users].sort().values
                mine = users[self.env.rank :: self.env.world_size]
                # full ranking leaves out what the user interacted with before (the published protocol)
                scores = ranking.mask_seen(self.score(dataset, ranking, mine, settings.eval_chunk), mine)
                ranks = target_ranks(scores, ranking.target_index[mine])
                ranks = torch.cat(self.gather(ranks))
                metrics = ranking_metrics(ranks, ks)
                per_seed.append(metrics)
                result.update({f"{protocol}/seed{draw}/{k}": v for k, v in metrics.items()})
            for key in per_seed[0]:
                values = torch.tensor([m[key] for m in per_seed], dtype=torch.float64)
                result[f"{protocol}/{key}"] = float(values.mean())
                result[f"{protocol}/{key}/std"] = float(values.std(unbiased=False))
            # a time split's next period holds several queries (next items) per user: both are counted
            result[f"{protocol}/queries"] = float(ranks.numel())
            result[f"{protocol}/users"] = float(ranking.users[users].unique().numel())
        return result

    def score(self, dataset, ranking, users: torch.Tensor, chunk_rows: int) -> torch.Tensor:
        """Scores ``[len(users), C]`` of each user's candidates: through the model's ``score_candidates`` (the
        user side computed once per user) when it is a ``CandidateScorer``, else one row per (user, candidate)."""
        core = getattr(self.model, "module", self.model)
        candidates = ranking.candidates[users]
        if isinstance(core, CandidateScorer):
            return self._score_per_user(core, dataset, ranking, users, candidates, chunk_rows)
        subset = dataclasses.replace(ranking, users=ranking.users[users], history_length=ranking.history_length[users],
                                     candidates=candidates, target_index=ranking.target_index[users])
        scores = torch.empty(candidates.shape)
        for (start, batch), real in self.in_lockstep(dataset.scoring_batches(subset, chunk_rows)):
            with self.autocast():
                logits = self.model(batch.to(self.env.device)).logits
            if real:
                scores.view(-1)[start : start + batch.batch_size] = logits[:, 0].float().cpu()
        return scores

    def _score_per_user(self, core: CandidateScorer, dataset, ranking, users, candidates, chunk_rows) -> torch.Tensor:
        kind = core.candidate_input
        catalogue = dataset.catalogue().to(self.env.device) if kind is CandidateInput.CATALOGUE else None
        scores = []
        chunk = max(1, chunk_rows // candidates.shape[1])
        for start, real in self.in_lockstep(range(0, users.numel(), chunk)):
            rows = users[start : start + chunk]
            user_ids = ranking.users[rows]
            history = dataset.history(user_ids, ranking.history_length[rows])
            requests = dataset.assemble(user_ids, history, ranking.targets()[rows], torch.ones(rows.numel())).to(self.env.device)
            block = candidates[start : start + chunk]
            inputs = {}
            if kind is CandidateInput.FEATURES:
                # each candidate's own features, which only the data set knows; their histories stay empty
                owners = user_ids.repeat_interleave(block.shape[1])
                inputs["candidate_features"] = dataset.assemble(
                    owners, dataset.history(owners, torch.zeros_like(owners)), block.reshape(-1), torch.zeros(owners.numel())
                ).to(self.env.device)
            elif kind is CandidateInput.CATALOGUE:
                inputs["catalogue"] = catalogue
            with self.autocast():
                block_scores = core.score_candidates(requests, block.to(self.env.device), **inputs).float().cpu()
            if real:
                scores.append(block_scores)
        return torch.cat(scores) if scores else torch.zeros(0, candidates.shape[1])


def fixed_mmap_threshold(size: int = 1 << 20) -> bool:
    """glibc: blocks of ``size`` bytes or more are mapped and returned to the system when freed (process-wide;
    False where the C library is not glibc)."""
    # NOTE: glibc raises its mmap threshold to the largest block freed so far; a full-ranking evaluation then
    # serves its ~25 MB temporaries from the heap, which fragments: one process running 13 Beauty runs grew past
    # the machine's 23 GB, and two distillation runs evaluating side by side were killed. A fixed threshold keeps
    # every evaluation flat (~0.8 GB).
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, size))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False
