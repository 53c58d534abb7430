"""Length-balanced batching: give every rank the same sequence work, not the same number of examples.

Cost model: an example with ``L`` events (all event types together, since the model merges them into one
sequence) costs ``L`` tokens for the linear parts and ``L**2`` for self-attention. The balancer takes a
global window of examples, scores each with ``(1 - a) * L / sum(L) + a * L**2 / sum(L**2)`` (``a`` =
``attention_weight``) and assigns them by greedy LPT (largest first, to the least-loaded bin), optionally
with equal example counts per bin, which TorchRec's sharded embeddings and equal-weight gradient averaging
expect (``equal_counts=False`` lets counts float for the best balance).

Within a batch, examples are ordered by decreasing length (``sort_by_length``): it pays for kernels that tile the
jagged batch (neighbouring examples share tile shapes, less padding) and for schedulers that start the longest
problems first.

Against one process: with a window of one global batch, the ranks together train on the same examples at each
step, and per-example models compute the same up to float rounding (the tables' gradients are summed in another
order; over many steps a normalising optimizer and a ReLU near zero can grow that into a visible drift). A model
whose result depends on the order of the examples does not: a MoE with a capacity claims it in example order (rank
by rank), and the ranks' sorted shares are not the global batch sorted, so other assignments may be dropped. A
window of several global batches spreads its examples over the steps by rank (bin ``r + k * world_size`` to rank
``r``), so a step's examples then depend on the ranks too.
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from gem_kunlun import Batch, FeatureSpec

from gem_data.batch_ops import concat_batches, select_examples
from gem_data.source import BatchSource


def example_costs(lengths: torch.Tensor, attention_weight: float = 0.5) -> torch.Tensor:
    """``[N]`` event counts -> ``[N]`` float64 costs mixing token and attention shares (see the module docstring)."""
    lengths = lengths.double()
    tokens, attention = lengths.sum().clamp(min=1), (lengths * lengths).sum().clamp(min=1)
    return (1 - attention_weight) * lengths / tokens + attention_weight * lengths * lengths / attention


def partition_by_cost(costs: torch.Tensor, num_parts: int, equal_counts: bool = True) -> list[torch.Tensor]:
    """Greedy LPT: ``[N]`` costs -> ``num_parts`` index tensors with near-equal total cost.

    With ``equal_counts`` every part gets ``floor(N / P)`` or ``ceil(N / P)`` examples (the first ``N % P``
    parts the larger count). Each part's indices are in decreasing-cost order.
    """
    n = costs.numel()
    capacity = [n // num_parts + (1 if p < n % num_parts else 0) for p in range(num_parts)] if equal_counts else [n] * num_parts
    members: list[list[int]] = [[] for _ in range(num_parts)]
    heap = [(0.0, p) for p in range(num_parts) if capacity[p] > 0]
    heapq.heapify(heap)
    values = costs.tolist()
    for i in torch.argsort(costs, descending=True, stable=True).tolist():
        load, p = heapq.heappop(heap)
        members[p].append(i)
        if len(members[p]) < capacity[p]:
            heapq.heappush(heap, (load + values[i], p))
    return [torch.tensor(m, dtype=torch.int64) for m in members]


def contiguous_parts(n: int, num_parts: int) -> list[torch.Tensor]:
    """What plain sharding gives: ``num_parts`` contiguous runs of ``[0, n)`` (the baseline for imbalance)."""
    return [t for t in torch.arange(n).tensor_split(num_parts)]


def imbalance(loads: torch.Tensor) -> float:
    """``max / mean`` of per-rank loads ``[W]`` (1.0 is perfect; 0 loads count as balanced)."""
    loads = loads.double()
    mean = float(loads.mean())
    return float(loads.max()) / mean if mean > 0 else 1.0


def part_loads(lengths: torch.Tensor, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-part ``tokens`` (sum of L) and ``attention`` (sum of L**2) loads, each ``[P]`` float64."""
    lengths = lengths.double()
    return {
        "tokens": torch.stack([lengths[p].sum() for p in parts]),
        "attention": torch.stack([(lengths[p] ** 2).sum() for p in parts]),
    }


def rank_imbalance(batch: Batch, group: Any = None) -> dict[str, float]:
    """Token and attention imbalance (max/mean) of this step's batches across ranks, for the trainer's log.

    All-gathers two numbers per rank when torch.distributed is initialised (on the batch's device, so it
    works under NCCL and Gloo); a single process reports 1.0.
    """
    lengths = batch.num_events().double()
    local = torch.stack([lengths.sum(), (lengths * lengths).sum()]).to(batch.dense.device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return {"tokens": 1.0, "attention": 1.0}
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    loads = torch.stack(gathered).cpu()
    return {"tokens": imbalance(loads[:, 0]), "attention": imbalance(loads[:, 1])}


class LengthBalancedStream:
    """Per-rank batches cut from a shared global stream so every rank gets the same sequence cost.

    ``source`` must yield the *global* batches (the same sequence on every rank, e.g. a stream built with
    ``rank=0, world_size=1`` and batch size ``world_size * per-rank batch``): every rank reads the window,
    all compute the same deterministic assignment, each keeps its own part. That costs reading the data
    ``world_size`` times but needs no communication. A window of ``window_batches`` global batches is split
    into ``window_batches * world_size`` balanced bins; rank ``r`` yields bins ``r, r + W, ...``.
    ``last_report`` holds the window's token and attention imbalance before (contiguous split) and after.
    """

    def __init__(
        self,
        source: BatchSource,
        rank: int,
        world_size: int,
        window_batches: int = 1,
        attention_weight: float = 0.5,
        equal_counts: bool = True,
        sort_by_length: bool = True,
    ) -> None:
        if not 0 <= rank < world_size or window_batches < 1:
            raise ValueError(f"need 0 <= rank < world_size and window_batches >= 1, got {rank}, {world_size}, {window_batches}")
        self.source, self.rank, self.world_size, self.window_batches = source, rank, world_size, window_batches
        self.attention_weight, self.equal_counts, self.sort_by_length = attention_weight, equal_counts, sort_by_length
        self._state_before = copy.deepcopy(source.state_dict())
        self._emitted = 0  # local batches of the current window already yielded
        self.last_report: dict[str, float] = {}

    @property
    def spec(self) -> FeatureSpec:
        return self.source.spec

    def __iter__(self) -> Iterator[Batch]:
        batches = iter(self.source)
        while True:
            state_before = copy.deepcopy(self.source.state_dict())
            window = []
            for _ in range(self.window_batches):
                batch = next(batches, None)
                if batch is None:
                    break
                window.append(batch)
            if not window:
                return
            local = self._split(concat_batches(window), len(window))
            if state_before != self._state_before:
                self._state_before, self._emitted = state_before, 0
            for batch in local[self._emitted :]:
                self._emitted += 1
                yield batch

    def _split(self, window: Batch, num_batches: int) -> list[Batch]:
        lengths = window.num_events()
        bins = num_batches * self.world_size
        parts = partition_by_cost(example_costs(lengths, self.attention_weight), bins, self.equal_counts)
        before = part_loads(lengths, contiguous_parts(window.batch_size, bins))
        after = part_loads(lengths, parts)
        self.last_report = {f"{k}_{when}": imbalance(v) for when, loads in (("before", before), ("after", after)) for k, v in loads.items()}
        local = []
        for part in parts[self.rank :: self.world_size]:
            if self.sort_by_length:
                part = part[torch.argsort(lengths[part], descending=True, stable=True)]
            local.append(select_examples(window, part))
        return local

    def state_dict(self) -> dict[str, Any]:
        # the source's state before the current window, and how much of the window this rank consumed
        emitted = self._emitted
        shape = {"world_size": self.world_size, "window_batches": self.window_batches}
        if emitted == self.window_batches:  # the window is done: the next one starts at the source's position
            return {"source": copy.deepcopy(self.source.state_dict()), "emitted": 0, **shape}
        return {"source": copy.deepcopy(self._state_before), "emitted": emitted, **shape}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "emitted" not in state:
            raise ValueError("the data state was saved without length balancing (data.balance): resume without it")
        # a window cut into other bins cannot be continued part-way; between windows any rank count and window can
        for name in ("world_size", "window_batches"):
            saved = state.get(name, getattr(self, name))
            if saved != getattr(self, name) and state["emitted"]:
                raise ValueError(f"balanced-stream state was saved with {name} {saved} part-way through a window; "
                                 f"resume it with {name} {saved}")
        self.source.load_state_dict(state["source"])
        self._state_before, self._emitted = copy.deepcopy(state["source"]), int(state["emitted"])
