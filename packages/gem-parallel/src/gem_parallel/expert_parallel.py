"""Expert parallelism for gem-kunlun's mixture of experts: experts split over an EP group, examples moved to
their experts' owners and back by all-to-all (with autograd), through the MoE's ``dispatch`` hook.

Rank ``p`` of an EP group of ``P`` ranks owns experts ``[p * E / P, (p + 1) * E / P)`` and keeps only
those (under their global names, so checkpoints do not depend on ``P``). One forward:

1. the kept assignments, sorted by expert, are sent to the owners (``all_to_all_single``);
2. each owner runs its experts on what it received, grouped by expert;
3. the outputs travel back by the reverse all-to-all and are combined with the gate weights.

Two ways to size the messages:

- ``padded = False`` (exact): per-expert counts are exchanged first (one small all-to-all and a host
  round trip for the split sizes), then exactly the kept rows travel. Combined with the MoE's global
  capacity (``batch_group``) the result equals one process holding the global batch.
- ``padded = True`` (equal split): every rank sends each expert exactly ``capacity(rank_batch_bound)`` rows,
  zero-padded: fixed shapes, no count exchange, no host synchronisation, at the price of the padding's
  traffic and compute. Capacity is then per rank (each rank may fill ``capacity(local batch)`` of an expert, no
  more), which drops more than the global policy when the routing is uneven across ranks; in eval mode, where
  nothing is dropped, the exact path runs. The messages are sized by ``rank_batch_bound``, the most examples any
  rank passes the MoE in one call, and not by the local batch: ranks hold different numbers of examples (a
  domain's rows, a filtered surface, a stand-in row), and an all-to-all of equal splits needs one size on all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

from gem_kunlun import MixtureOfExperts, Routing

from gem_parallel.parallel_dims import LayoutError


class ExpertParallel:
    """The ``dispatch`` hook of one ``MixtureOfExperts`` under expert parallelism (see the module docstring)."""

    def __init__(self, moe: MixtureOfExperts, group: dist.ProcessGroup, padded: bool = False,
                 rank_batch_bound: int | None = None) -> None:
        self.group, self.padded, self.rank_batch_bound = group, padded, rank_batch_bound
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_experts, self.capacity = moe.num_experts, moe.capacity
        if self.num_experts % self.size:
            raise LayoutError(f"expert ({self.size}) must divide the number of experts ({self.num_experts})")
        if padded and (rank_batch_bound is None or rank_batch_bound < 1):
            raise LayoutError(f"expert_padded needs rank_batch_bound >= 1, the most examples one rank passes a MoE in one "
                              f"call (it sizes every rank's messages), got {rank_batch_bound}")
        self.per_rank = self.num_experts // self.size
        # each expert's rows in one rank's message: as many as the largest batch any rank may send can keep
        self.message_slots = min(rank_batch_bound, int(self.capacity(rank_batch_bound))) if padded else None

    def local_experts(self) -> range:
        return range(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)

    def __call__(self, experts: nn.Module, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        if self.padded and experts.training:
            return self._padded(experts, x, routing)
        keep = routing.keep
        order = torch.sort(routing.expert[keep], stable=True).indices
        expert, example, weight = routing.expert[keep][order], routing.example[keep][order], routing.weight[keep][order]
        rows = x[example].flatten(1)  # [A_kept, n * D], sorted by expert
        returned = self._exact(experts, rows, expert, x.shape[1:])
        out = torch.zeros_like(x)
        return out.index_add_(0, example, returned.view(-1, *x.shape[1:]) * weight.to(x.dtype)[:, None, None])

    def _exact(self, experts, rows, expert, token_shape) -> torch.Tensor:
        p, e = self.size, self.num_experts
        # [E], rows for each expert, in owner order (by scatter-add: bincount reads its input's range back)
        send_expert = torch.zeros(e, dtype=torch.int64, device=rows.device).scatter_add_(0, expert, torch.ones_like(expert))
        received_expert = torch.empty_like(send_expert)
        dist.all_to_all_single(received_expert, send_expert, group=self.group)  # [P sources x per_rank]
        received_expert = received_expert.view(p, self.per_rank)
        # NOTE: the split sizes of the row all-to-all live on the host: this is the exact mode's one sync (the
        # most rows of one expert, which sizes the experts' grid, comes back with them)
        per_expert = received_expert.sum(0)
        host = torch.cat([send_expert.view(p, self.per_rank).sum(1), received_expert.sum(1), per_expert.max()[None]]).tolist()
        send, receive, most = host[:p], host[p : 2 * p], host[-1]
        received = _all_to_all(rows, receive, send, self.group)
        # received rows come grouped by source, each source's by expert: regroup by expert to run them together
        local = torch.arange(self.per_rank, device=rows.device).repeat(p)
        owner = torch.repeat_interleave(local, received_expert.flatten(), output_size=received.shape[0])
        by_expert = torch.sort(owner, stable=True).indices
        outputs = self._run_grouped(experts, received[by_expert], owner[by_expert], per_expert, max(most, 1), token_shape)
        return _all_to_all(outputs[torch.argsort(by_expert)], send, receive, self.group)

    def _padded(self, experts, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Every assignment to its ``(expert, slot)`` cell of an ``[E, slots]`` send buffer by comparisons and
        sums only (no masks, no counts read back): fixed shapes end to end, no host wait."""
        e, token_shape, slots = self.num_experts, x.shape[1:], self.message_slots
        if x.shape[0] > self.rank_batch_bound:
            raise ValueError(f"padded expert parallelism: a batch of {x.shape[0]} examples reached a MoE sized for at "
                             f"most rank_batch_bound = {self.rank_batch_bound} per rank")
        expert, keep = routing.expert, routing.keep
        # each kept assignment's slot: how many kept assignments of its expert come before it; the dropped ones
        # (the MoE keeps capacity(local batch) per rank, never more than slots) go to a trash cell past the end
        onehot = ((expert.unsqueeze(1) == torch.arange(e, device=x.device)) & keep.unsqueeze(1)).long()
        slot = (torch.cumsum(onehot, 0) - onehot).gather(1, expert.unsqueeze(1)).squeeze(1)
        cell = torch.where(keep & (slot < slots), expert * slots + slot, torch.full_like(slot, e * slots))
        rows = x[routing.example].flatten(1)  # [A, n * D]
        width = rows.shape[1]
        send = rows.new_zeros(e * slots + 1, width).index_copy(0, cell, rows)[:-1]
        received = _all_to_all(send, None, None, self.group)  # [P sources x per_rank x slots]
        # regroup [source, expert, slot] as [expert, source, slot] so that the experts run once on all their rows
        grouped = received.view(self.size, self.per_rank, slots, width).transpose(0, 1)
        outputs = experts(grouped.reshape(self.per_rank, self.size * slots, *token_shape)).flatten(2)
        back = outputs.view(self.per_rank, self.size, slots, width).transpose(0, 1).reshape(-1, width)
        # the dropped assignments read a zero row
        returned = torch.cat([_all_to_all(back, None, None, self.group), back.new_zeros(1, width)])[cell]
        weighted = returned.view(-1, *token_shape) * routing.weight.to(x.dtype)[:, None, None]
        return torch.zeros_like(x).index_add_(0, routing.example, weighted)

    def _run_grouped(self, experts, rows, expert, counts, slots, token_shape) -> torch.Tensor:
        """This rank's experts on ``rows`` [R, n * D] grouped by local expert (``expert [R]`` each row's,
        ``counts [E_here]`` rows each, at most ``slots``): laid out on an ``[E_here, slots]`` grid, zero rows past
        each expert's count, run at once (one call of the experts' module), each row's output read back."""
        start = torch.cumsum(counts, 0) - counts
        cell = expert * slots + torch.arange(rows.shape[0], device=rows.device) - start[expert]
        grid = rows.new_zeros(self.per_rank * slots, rows.shape[1]).index_copy(0, cell, rows)
        outputs = experts(grid.view(self.per_rank, slots, *token_shape))
        return outputs.reshape(self.per_rank * slots, -1)[cell]


def _all_to_all(tensor: torch.Tensor, output_splits, input_splits, group) -> torch.Tensor:
    """``all_to_all_single`` with autograd (the gradient travels back the reverse way)."""
    rows = sum(output_splits) if output_splits is not None else tensor.shape[0]
    output = tensor.new_empty(rows, *tensor.shape[1:])
    return all_to_all_single(output, tensor, output_splits, input_splits, group=group)


def apply_expert_parallel(model: nn.Module, group: dist.ProcessGroup, padded: bool = False,
                          rank_batch_bound: int | None = None) -> list[MixtureOfExperts]:
    """Split the experts of every ``MixtureOfExperts`` in ``model`` over ``group``: each rank keeps its own
    experts (still on the meta device, to be materialised by ``init_dense_parameters``) and dispatches
    through ``ExpertParallel`` (``padded``: with messages sized by ``rank_batch_bound``). Returns the MoE modules
    touched; a model without one is refused (nothing would be split)."""
    moes = [m for m in model.modules() if isinstance(m, MixtureOfExperts)]
    if not moes:
        raise LayoutError(f"expert = {dist.get_world_size(group)} splits the experts of a mixture of experts over ranks, "
                          f"and {type(model).__name__} has none: leave it at 1")
    for moe in moes:
        hook = ExpertParallel(moe, group, padded, rank_batch_bound)
        mine = {str(i) for i in hook.local_experts()}
        for key in [k for k in moe.experts if k not in mine]:
            del moe.experts[key]
        moe.dispatch = hook
    return moes
