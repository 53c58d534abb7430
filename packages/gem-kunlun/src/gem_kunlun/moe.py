"""Cross interaction: a mixture of Wukong-style experts over a few feature tokens per example.

Each expert is a Wukong block (arXiv 2403.02545): a factorisation-machine block (pairwise token
interactions through a low-rank projection, then an MLP) beside a linear-compression block (a learned
mix of the tokens), concatenated back to the input's token count. A gate picks the top-k experts per
example; experts have a capacity, assignments past it are dropped (the residual carries the input on);
a load-balancing loss keeps the gate from collapsing onto a few experts.
"""

from __future__ import annotations

import math
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd
from torch import nn
from torch.nn import functional as F


class WukongBlock(nn.Module):
    """``[B, n, D] -> [B, n, D]``: FM block (``n_fm`` tokens) beside a linear-compression block (the rest).

    Its token products go through ``low_precision_matmul`` (``torch.matmul`` unless a low-precision recipe
    replaces it), because they use raw parameters that a swap of ``nn.Linear`` layers would not reach."""

    low_precision_matmul = torch.matmul

    def __init__(self, num_tokens: int, dim: int, rank: int = 8, hidden: int = 256, device=None) -> None:
        super().__init__()
        self.num_tokens, self.dim, self.rank = num_tokens, dim, rank
        self.n_fm = max(1, num_tokens // 2)
        self.n_lc = num_tokens - self.n_fm
        self.projection = nn.Parameter(torch.empty(num_tokens, rank, device=device))
        self.fm_norm = nn.LayerNorm(num_tokens * rank, device=device)
        self.fm_mlp = nn.Sequential(
            nn.Linear(num_tokens * rank, hidden, device=device), nn.GELU(), nn.Linear(hidden, self.n_fm * dim, device=device)
        )
        self.compress = nn.Parameter(torch.empty(num_tokens, self.n_lc, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.projection, std=self.num_tokens**-0.5)
        nn.init.normal_(self.compress, std=self.num_tokens**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        # X (X^T Y): every token's interaction with rank-many projected summaries, O(n * D * rank)
        matmul = self.low_precision_matmul
        summaries = matmul(x.transpose(1, 2), self.projection.to(x.dtype))  # [B, D, rank]
        interactions = matmul(x, summaries).reshape(b, self.num_tokens * self.rank)
        fm = self.fm_mlp(self.fm_norm(interactions)).view(b, self.n_fm, self.dim)
        lc = matmul(self.compress.to(x.dtype).t(), x)  # [B, n_lc, D]
        return torch.cat([fm, lc], 1)

    def flops_per_example(self) -> float:
        n, d, k = self.num_tokens, self.dim, self.rank
        mlp = sum(2.0 * m.in_features * m.out_features for m in self.fm_mlp if isinstance(m, nn.Linear))
        return 2.0 * n * d * k * 2 + mlp + 2.0 * n * self.n_lc * d


@dataclass
class RoutingStats:
    """What the gate did in the last forward: assignments per expert (before and after capacity) and the loss."""

    assigned: torch.Tensor  # [E] int64, top-k choices per expert, over the whole global batch
    kept: torch.Tensor  # [E] int64, this rank's assignments kept after the capacity limit
    balance_loss: torch.Tensor  # scalar


@dataclass
class Routing:
    """The gate's decisions for one local batch, as ``A = k * B`` assignments in slot-major order (every
    example's first choice, then every second choice, ...): ``example [A]`` and ``expert [A]`` (int64),
    ``weight [A]`` (float32, renormalised over the example's top-k; top-1: the gate probability) and ``keep
    [A]`` (bool, within capacity).
    ``slots``: a bound, known on the host, of the kept assignments of any one expert here (None: none known)."""

    example: torch.Tensor
    expert: torch.Tensor
    weight: torch.Tensor
    keep: torch.Tensor
    slots: int | None = None


def local_dispatch(experts: Experts, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Run every expert of ``experts`` here on the kept examples routed to it; ``[B, n, D]`` gate-weighted sum.

    With ``routing.slots`` every expert runs on exactly that many rows (its kept examples, then padding that
    reads a zero row and adds nowhere): shapes known on the host, so nothing waits for the device. Without,
    each expert gathers its kept examples by mask, which sizes the gather from device values.

    NOTE: an expert with no example still runs (on zero or padding rows): its parameters then get zero
    gradients instead of none, so every rank reduces the same gradients whatever its routing.
    """
    keys = [int(k) for k in experts]
    if routing.slots is not None and keys and keys == list(range(keys[0], keys[0] + len(keys))):
        return _slotted_dispatch(experts, x, routing, routing.slots, keys[0])
    out = torch.zeros_like(x)
    for key, block in experts.items():
        mine = routing.keep & (routing.expert == int(key))
        rows = routing.example[mine]
        out.index_add_(0, rows, block(x[rows]) * routing.weight[mine].to(x.dtype)[:, None, None])
    return out


def _slotted_dispatch(experts: Experts, x: torch.Tensor, routing: Routing, slots: int, first: int) -> torch.Tensor:
    """``local_dispatch`` on ``slots`` rows per expert; ``experts`` hold experts ``first, first + 1, ...``."""
    b, num = x.shape[0], len(experts)
    expert = routing.expert - first  # index into this module's experts
    keep = routing.keep & (expert >= 0) & (expert < num)
    expert = expert.clamp(0, num - 1)
    # each kept assignment's slot: how many kept assignments of its expert come before it (by comparison, not
    # one_hot, which reads its input's range back to check it)
    # NOTE: [E, A], scanned along its last dim: a scan along the first dim of [A, E] runs one thread per
    # column on a GPU (~0.17 ms for 1,024 assignments on an H200)
    onehot = ((torch.arange(num, device=x.device).unsqueeze(1) == expert) & keep).long()
    slot = (torch.cumsum(onehot, 1) - onehot).gather(0, expert.unsqueeze(0)).squeeze(0)
    # kept assignments go to their (expert, slot) cell; the rest to a trash cell past the end
    cell = torch.where(keep & (slot < slots), expert * slots + slot, torch.full_like(slot, num * slots))
    rows = torch.full((num * slots + 1,), b, dtype=torch.int64, device=x.device).scatter(0, cell, routing.example)
    weights = torch.zeros(num * slots + 1, device=x.device).scatter(0, cell, routing.weight.float())
    rows, weights = rows[:-1].view(num, slots), weights[:-1].view(num, slots)
    padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])  # row b: what padding slots read
    outputs = experts(padded[rows])  # [E, slots, n, D]
    weighted = outputs * weights.to(x.dtype)[:, :, None, None]
    return torch.zeros_like(padded).index_add_(0, rows.flatten(), weighted.flatten(0, 1))[:b]


class Experts(nn.Module):
    """The experts of one ``MixtureOfExperts``, keyed by their global index (under expert parallelism a rank
    keeps only its own, under the same names), read and pruned as a mapping (``experts["3"]``, ``del``, ``items()``).

    ``forward(x [E, S, n, D]) -> [E, S, n, D]``: the ``E`` experts held here, in key order, each on its own
    ``S`` rows; all at once where they share the form ``_batched_wukong`` computes, else one by one. Being one
    module, the experts are one unit to a parallel wrapper: FSDP gathers (and reduces) all of a MoE's local
    experts in one collective each way, and the batched form still applies inside the unit (the hooks sit on
    this module, not on the experts).

    NOTE: not an ``nn.ModuleDict``: FSDP2's ``fully_shard`` in torch 2.11 refuses every ``ModuleDict`` (and
    ``ModuleList``), its own ``forward`` or not (2.13 takes one that has its own), which stopped expert parallelism
    under FSDP there.
    """

    def __init__(self, experts: Mapping[str, nn.Module]) -> None:
        super().__init__()
        for key, expert in experts.items():
            self.add_module(key, expert)

    def __getitem__(self, key: str) -> nn.Module:
        return self._modules[key]

    def __delitem__(self, key: str) -> None:
        del self._modules[key]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)

    def __contains__(self, key: object) -> bool:
        return key in self._modules

    def keys(self) -> KeysView[str]:
        return self._modules.keys()

    def values(self) -> ValuesView[nn.Module]:
        return self._modules.values()

    def items(self) -> ItemsView[str, nn.Module]:
        return self._modules.items()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = list(self.values())
        if len(blocks) != x.shape[0]:
            raise ValueError(f"Experts: {len(blocks)} experts here but rows for {x.shape[0]}")
        if _batchable(blocks):
            return _batched_wukong(blocks, x)
        return torch.stack([block(rows) for block, rows in zip(blocks, x)])


def _batchable(blocks: list[nn.Module]) -> bool:
    """Whether ``_batched_wukong`` computes what running each of ``blocks`` does: plain ``WukongBlock`` s of
    one shape (the default ``LayerNorm`` and ``Linear, GELU, Linear`` MLP, exactly those types: not a
    low-precision recipe's subclasses, nor an FSDP-wrapped expert), ``torch.matmul`` for their token
    products, and no hooks on any of their modules (which the batched path would skip)."""
    first = blocks[0]
    for block in blocks:
        if type(block) is not WukongBlock or block.low_precision_matmul is not torch.matmul:
            return False
        mlp, norm = block.fm_mlp, block.fm_norm
        if (type(mlp) is not nn.Sequential or len(mlp) != 3 or type(mlp[0]) is not nn.Linear
                or type(mlp[1]) is not nn.GELU or type(mlp[2]) is not nn.Linear
                or mlp[0].bias is None or mlp[2].bias is None):
            return False
        if type(norm) is not nn.LayerNorm or norm.weight is None or norm.bias is None:
            return False
        form = (block.num_tokens, block.dim, block.rank, block.n_fm, mlp[0].out_features, norm.eps, mlp[1].approximate)
        if form != (first.num_tokens, first.dim, first.rank, first.n_fm, first.fm_mlp[0].out_features,
                     first.fm_norm.eps, first.fm_mlp[1].approximate):
            return False
        for m in (block, norm, mlp, *mlp):
            if m._forward_pre_hooks or m._forward_hooks or m._backward_hooks or m._backward_pre_hooks:
                return False
    return True


def _batched_wukong(blocks: list[WukongBlock], x: torch.Tensor) -> torch.Tensor:
    """``[E, S, n, D] -> [E, S, n, D]``: ``blocks[e](x[e])`` for every expert ``e`` at once (see ``_batchable``).

    Why: the step is host-bound on a GPU (many small kernels, each costing more host time than device time),
    and running experts one by one launches every op of a ``WukongBlock`` (and of its backward) once per
    expert. Here each op launches once for all experts: the parameters of each kind are stacked along a
    leading expert dimension at run time (storage, names and expert parallelism's subsets stay as they are;
    gradients flow back through the stack) and the matmuls broadcast or batch over it. Autocast treats the ops
    as it treats the loop's: ``matmul`` and ``baddbmm`` (for ``Linear``) in low precision, ``layer_norm`` in
    float32 (its affine applied after it, in the norm's output precision).
    """
    first = blocks[0]
    e, s, n, d = x.shape
    norm, gelu = first.fm_norm, first.fm_mlp[1]

    def stack(tensors):
        return torch.stack(tensors) if len(tensors) > 1 else tensors[0].unsqueeze(0)

    def as_x(t):  # what the loop's ``.to(x.dtype)`` does to the raw parameters
        return t if t.dtype == x.dtype else t.to(x.dtype)

    projection = as_x(stack([blk.projection for blk in blocks]))  # [E, n, rank]
    compress = as_x(stack([blk.compress for blk in blocks]))  # [E, n, n_lc]
    norm_weight = stack([blk.fm_norm.weight for blk in blocks])  # [E, n * rank]
    norm_bias = stack([blk.fm_norm.bias for blk in blocks])
    w1 = stack([blk.fm_mlp[0].weight for blk in blocks])  # [E, hidden, n * rank]
    b1 = stack([blk.fm_mlp[0].bias for blk in blocks])
    w2 = stack([blk.fm_mlp[2].weight for blk in blocks])  # [E, n_fm * D, hidden]
    b2 = stack([blk.fm_mlp[2].bias for blk in blocks])

    # NOTE: each product puts its parameter where the batched matmul's backward hands its gradient back in
    # the parameter's own layout (weights on the left of the MLP's products: [E, out, in]; the compression on
    # the right of x^T): a transposed gradient would be copied again per expert when accumulated
    summaries = torch.matmul(x.transpose(2, 3), projection[:, None])  # [E, S, D, rank]
    interactions = torch.matmul(x, summaries).reshape(e, s, n * first.rank)
    normed = F.layer_norm(interactions, norm.normalized_shape, eps=norm.eps) * norm_weight[:, None] + norm_bias[:, None]
    # the MLP computes transposed, [E, features, S]
    hidden = F.gelu(torch.baddbmm(b1[:, :, None], w1, normed.transpose(1, 2)), approximate=gelu.approximate)
    fm = torch.baddbmm(b2[:, :, None], w2, hidden).transpose(1, 2).view(e, s, first.n_fm, d)
    lc = torch.matmul(x.transpose(2, 3), compress[:, None]).transpose(2, 3)  # [E, S, n_lc, D]
    return torch.cat([fm, lc], 2)


def _combine_weights(top: torch.Tensor) -> torch.Tensor:
    """The weights of an example's chosen experts' outputs from their gate probabilities ``top [B, k]``: renormalised
    to sum to 1 over several, the probability itself for one (Switch's): renormalised, a single weight is 1 for
    every example and the task loss would not reach the gate (only the balance loss would train it)."""
    return top if top.shape[-1] == 1 else top / top.sum(-1, keepdim=True)


class MixtureOfExperts(nn.Module):
    """Top-k gated experts over ``[B, n, D]`` token sets; returns the gate-weighted sum of expert outputs.

    ``capacity_factor`` bounds each expert to ``ceil(factor * B * k / E)`` examples (<= 0: unbounded) in
    training, where it keeps the per-expert work bounded. Higher choices (top-1 before top-2) and earlier
    examples claim capacity first. In eval mode nothing is dropped: an example's output must not depend on
    which other requests share its batch (ranking one user's candidates, serving). ``last_stats`` holds the
    routing of the last call; ``balance_loss`` is the Switch-Transformer loss ``E * sum_e f_e * p_e``.

    Two hooks let a parallel layer spread the work without this module knowing about it:

    - ``batch_group``: the process group whose ranks' local batches form one global batch (None: this
      batch alone). Capacity, claim order (rank ``r``'s examples after those of ranks ``< r``) and the
      expert fractions ``f_e`` then count over the global batch, at the cost of all-gathering ``k * E``
      counts per training forward: the routing, the drops and the gradients are those of one process
      holding the global batch. With ``capacity_per_rank`` only the fractions do, and each rank may fill
      an expert with ``capacity(local batch)`` of its own examples (fixed-size expert-parallel messages).
    - ``global_batch_bound``: with ``batch_group``, the most examples a global batch can hold, where the host
      knows it (set by whoever builds the data: None, unknown). An expert then keeps at most
      ``min(B, capacity(bound))`` of this rank's examples, a host-known size, so the experts run on fixed
      shapes instead of gathering their examples by mask (a host wait per expert and per layer, in forward and
      in backward). A global batch larger than the bound fails a device-side check, never drops silently.
    - ``dispatch(experts, x, routing) -> [B, n, D]``: where experts run (default ``local_dispatch``);
      expert parallelism keeps only its rank's experts in ``experts`` and moves examples to their owners.
    - ``counts_rows``: False while the rows stand in for an absent batch (``stand_in_rows``).

    With ``batch_group`` the balance loss is the global batch's: its mean gate probabilities are summed over the
    group (an all-reduce of ``E`` numbers whose backward all-reduces their gradients), so each rank's loss holds
    the same value and the ranks' averaged gradients are one process's, however the rows are spread.

    ``routed`` is the forward with its statistics returned: a caller replaying it in a CUDA graph (one process:
    fixed shapes, no collective) sets ``last_stats`` itself, to views of the graph's memory.
    """

    def __init__(self, num_tokens: int, dim: int, num_experts: int, top_k: int, capacity_factor: float = 1.25,
                 rank: int = 8, hidden: int = 256, device=None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.gate = nn.Linear(num_tokens * dim, num_experts, device=device)
        # keyed by expert index: under expert parallelism a rank keeps only its own, under the same names
        self.experts = Experts(
            {str(i): WukongBlock(num_tokens, dim, rank, hidden, device=device) for i in range(num_experts)}
        )
        self.expert_flops = self.experts["0"].flops_per_example()
        self.batch_group = None
        self.capacity_per_rank = False
        self.global_batch_bound: int | None = None
        self.dispatch = local_dispatch
        self.counts_rows = True
        self.last_stats: RoutingStats | None = None

    def capacity(self, batch_size):
        """Examples each expert takes from a batch of ``batch_size`` (an int, or a device tensor: no host sync)."""
        if self.capacity_factor <= 0:
            return batch_size
        if isinstance(batch_size, torch.Tensor):
            return torch.ceil(self.capacity_factor * batch_size.double() * self.top_k / self.num_experts).clamp(min=1)
        return max(1, math.ceil(self.capacity_factor * batch_size * self.top_k / self.num_experts))

    def forward(self, x: torch.Tensor, with_stats: bool = False):
        """``out [B, n, D]``, the routing statistics kept in ``last_stats``; with ``with_stats``
        ``(out, assigned [E], kept [E], balance loss)`` instead, ``last_stats`` left to the caller."""
        out, assigned, kept, balance = self._route(x)
        if with_stats:
            return out, assigned, kept, balance
        self.last_stats = RoutingStats(assigned=assigned, kept=kept, balance_loss=balance)
        return out

    def routed(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(out, assigned, kept, balance loss)``: the forward and its routing statistics as returned values (what a
        CUDA graph of a caller hands back, ``gem_kunlun.cuda_graphs``). Through the module's call, so that its
        hooks run and a compiled MoE (``nn.Module.compile``) runs compiled."""
        return self(x, with_stats=True)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        b, e, k = x.shape[0], self.num_experts, self.top_k
        probs = torch.softmax(self.gate(x.flatten(1)).float(), dim=-1)  # [B, E]
        weights, chosen = probs.topk(k, dim=-1)  # [B, k]
        weights = _combine_weights(weights)
        expert = chosen.t().reshape(-1)  # [k*B], slot-major
        slot = torch.arange(k, device=x.device).repeat_interleave(b)
        cell = slot * e + expert  # (slot, expert) of every assignment
        # NOTE: counts by scatter-add, not bincount: bincount reads the largest value back to size its output;
        # stand-in rows run the same operations with zeros (a rank's collectives match the other ranks')
        counted = int(self.counts_rows)
        cell_counts = torch.zeros(k * e, dtype=torch.int64, device=x.device).scatter_add_(0, cell, torch.full_like(cell, counted))
        ahead, counts = self._claimed_ahead(cell_counts.view(k, e))
        # position of an assignment in its expert's queue: assignments ahead of this rank's cell, then the
        # cell's own in example order
        order = torch.sort(cell, stable=True).indices
        within = torch.empty_like(order)
        within[order] = torch.arange(order.numel(), device=x.device) - (torch.cumsum(cell_counts, 0) - cell_counts)[cell[order]]
        position = ahead.view(-1)[cell] + within
        # every example makes exactly one first choice: slot 0's counts sum to the (global) batch size
        claimants = b if self.capacity_per_rank else counts[0].sum()
        keep = position < self.capacity(claimants) if self.training else torch.ones_like(position, dtype=torch.bool)
        keep = keep & self.counts_rows

        routing = Routing(example=torch.arange(b, device=x.device).repeat(k), expert=expert,
                          weight=weights.t().reshape(-1), keep=keep, slots=self._slots(b, claimants))
        out = self.dispatch(self.experts, x, routing)
        kept = torch.zeros(e, dtype=torch.int64, device=x.device).scatter_add_(0, expert, keep.long())
        rows = counts[0].sum()  # the (global) batch's counted examples: each makes one first choice
        counts = counts.sum(0)  # [E] over the global batch
        fraction = counts.float() / counts.sum().clamp(min=1)
        prob_sums = probs.sum(0) * counted
        if self.training and self.batch_group is not None:
            prob_sums = dist_autograd.all_reduce(prob_sums, group=self.batch_group)
        balance = e * (fraction * prob_sums).sum() / rows.clamp(min=1)
        return out, counts.detach(), kept.detach(), balance

    def _slots(self, b: int, claimants) -> int | None:
        """A host-known bound on any expert's kept assignments from this batch of ``b`` (None: none known).

        Each example picks an expert at most once (never more than ``b``) and an expert keeps at most
        ``capacity(claimants)`` over the batch it counts capacity on: this one, or the global batch, whose size
        ``claimants`` (a device tensor) is then bounded by ``global_batch_bound``.
        """
        if not self.training or self.capacity_factor <= 0:
            return None
        if self.batch_group is None or self.capacity_per_rank:
            return min(b, self.capacity(b))
        if self.global_batch_bound is None:
            return None
        torch._assert_async(claimants <= self.global_batch_bound,
                            f"MixtureOfExperts: a global batch holds more than global_batch_bound = {self.global_batch_bound} examples")
        return min(b, self.capacity(self.global_batch_bound))

    def _claimed_ahead(self, cell_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[k, E]`` assignments that claim each (slot, expert) cell's capacity before this rank's (earlier
        slots everywhere, then the same slot on lower ranks; this rank's earlier slots only with
        ``capacity_per_rank``) and ``[k, E]`` assignments per cell over the global batch."""
        group = self.batch_group if self.training else None
        local_ahead = torch.cumsum(cell_counts, 0) - cell_counts
        if group is None:
            return local_ahead, cell_counts
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        gathered = cell_counts.new_empty(world * cell_counts.numel())
        dist.all_gather_into_tensor(gathered, cell_counts.reshape(-1), group=group)
        gathered = gathered.view(world, *cell_counts.shape)
        total = gathered.sum(0)
        if self.capacity_per_rank:
            return local_ahead, total
        return (torch.cumsum(total, 0) - total) + gathered[:rank].sum(0), total

    def flops(self, batch_size: int) -> float:
        """Gate for every example plus the routed experts: top-k per example, as many as the slots hold in all.

        NOTE: an assignment past its expert's capacity does no work (its slot row is padding), and which are dropped
        is known only after routing, on the device: the count here takes every assignment the slots could hold, so
        it over-counts by the dropped share (a few percent of the MoE's FLOPs at an untrained router, under 0.2% of
        the H200 benchmark step's)."""
        active = min(batch_size * self.top_k, self.capacity(batch_size) * self.num_experts)
        return 2.0 * self.gate.in_features * self.num_experts * batch_size + active * self.expert_flops


@contextmanager
def stand_in_rows(module: nn.Module) -> Iterator[None]:
    """Within: the rows that ``module``'s MoEs route stand in for an absent batch (run so that every rank runs the
    same modules and collectives): they claim no capacity, count in no expert fraction and add nothing to the
    balance loss; the outputs are zeros of no meaning."""
    moes = [m for m in module.modules() if isinstance(m, MixtureOfExperts)]
    for moe in moes:
        moe.counts_rows = False
    try:
        yield
    finally:
        for moe in moes:
            moe.counts_rows = True


def dense_moe_reference(moe: MixtureOfExperts, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every example, weighted by its top-k gate weight (``_combine_weights``; zero elsewhere): what
    the routed forward computes when no expert is over capacity."""
    probs = torch.softmax(moe.gate(x.flatten(1)).float(), dim=-1)
    weights, chosen = probs.topk(moe.top_k, dim=-1)
    dense = torch.zeros_like(probs).scatter(1, chosen, _combine_weights(weights))
    outputs = torch.stack([moe.experts[str(i)](x) for i in range(moe.num_experts)], 1)  # [B, E, n, D]
    return (outputs * dense.to(x.dtype)[:, :, None, None]).sum(1)


__all__ = ["MixtureOfExperts", "Routing", "RoutingStats", "WukongBlock", "dense_moe_reference", "local_dispatch",
           "stand_in_rows"]

