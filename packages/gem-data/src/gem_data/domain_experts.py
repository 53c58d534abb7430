"""Domain experts: shared experts learn from every domain, domain-specific experts from one, and each
domain's prediction combines both through a gate of its own.

The experts are Kunlun trunks (gem-kunlun) over one shared encoder, so every expert reads the same
embedding tables and time-merged history; only the interaction and sequence layers are per expert. A
domain is a surface of the batch (``batch.surface``). Domain-specific experts run only on their domain's
examples, so adding domains adds parameters but not per-example compute.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from gem_kunlun import (
    Batch,
    FeatureSpec,
    KunlunConfig,
    KunlunEncoder,
    KunlunTrunk,
    ModelOutput,
    MultiTaskHeads,
    lengths_to_offsets,
    segment_ids,
    stand_in_rows,
)


class DomainExpertModel(nn.Module):
    """``forward(batch) -> ModelOutput``: per example, ``rep = sum_j g_j * expert_j`` over the shared experts
    and its domain's own experts, ``g = softmax(gate_domain(non-sequence tokens))``, then per-surface heads."""

    def __init__(self, spec: FeatureSpec, config: KunlunConfig, num_shared: int = 2, num_specific: int = 1,
                 device: torch.device | None = None) -> None:
        super().__init__()
        if num_shared < 0 or num_specific < 0 or num_shared + num_specific == 0:
            raise ValueError(f"need at least one expert, got num_shared={num_shared}, num_specific={num_specific}")
        self.spec, self.config = spec, config
        self.num_domains, self.num_shared, self.num_specific = spec.num_surfaces, num_shared, num_specific
        self.encoder = KunlunEncoder(spec, config, device=device)
        tokens = self.encoder.num_tokens
        self.shared = nn.ModuleList(KunlunTrunk(config, tokens, device=device) for _ in range(num_shared))
        self.specific = nn.ModuleList(
            nn.ModuleList(KunlunTrunk(config, tokens, device=device) for _ in range(num_specific))
            for _ in range(self.num_domains)
        )
        self.experts_per_domain = num_shared + num_specific
        self.gate = nn.Linear(tokens * config.d_model, self.num_domains * self.experts_per_domain, device=device)
        trunk = (self.shared[0] if num_shared else self.specific[0][0])
        self.representation_dim = trunk.representation_dim
        self.heads = MultiTaskHeads(self.representation_dim, len(spec.tasks), spec.num_surfaces, device=device)

    def forward(self, batch: Batch) -> ModelOutput:
        x, seq, offsets, positions = self.encoder(batch)
        b, domain = x.shape[0], batch.surface
        outputs = x.new_zeros(b + 1, self.experts_per_domain, self.representation_dim)  # row b: a stand-in's
        aux = x.new_zeros((), dtype=torch.float32)
        for j, expert in enumerate(self.shared):
            rep, expert_aux = expert(x, seq, offsets, positions)
            outputs[:b, j] = rep
            aux = aux + expert_aux
        for d, experts in enumerate(self.specific):
            rows = (domain == d).nonzero().squeeze(1)
            present = rows.numel() > 0
            # NOTE: a domain absent from this batch still runs, on a stand-in row (example 0) whose routing counts
            # nothing and whose result goes to the spare row b: every rank then runs the same modules through the
            # same autograd graph, so that their collectives (FSDP's, the MoE's) come in the same order on each.
            # Its parameters then get zero gradients (not None), which an optimizer with momentum still steps
            # (a batch of no example, a rank's empty share of a short last batch: a blank row with no history)
            taken, written = (rows, rows) if present else (domain.new_zeros(1), domain.new_full((1,), b))
            sub = _select_rows(x, seq, offsets, positions, taken) if b else _blank_row(x, seq, offsets, positions)
            with nullcontext() if present else stand_in_rows(experts):
                for j, expert in enumerate(experts):
                    rep, expert_aux = expert(*sub)
                    outputs[written, self.num_shared + j] = rep
                    aux = aux + expert_aux
        outputs = outputs[:b]
        gates = self.gate(x.flatten(1)).view(b, self.num_domains, self.experts_per_domain)
        weights = torch.softmax(gates[torch.arange(b, device=x.device), domain].float(), dim=-1).to(outputs.dtype)
        representation = (weights[:, :, None] * outputs).sum(1)
        total = self.num_shared + self.num_domains * self.num_specific
        return ModelOutput(self.heads(representation, domain), aux / total, representation)

    def flops(self, batch: Batch) -> dict[str, float]:
        """Forward FLOPs per component: shared experts on every example, specific ones on their domain's."""
        table = self.encoder.flops(batch)
        lengths = self.encoder.merged_lengths(batch)
        for j, expert in enumerate(self.shared):
            for name, value in expert.flops(lengths).items():
                table[f"shared{j}.{name}"] = value
        surface = batch.surface.cpu()
        for d, experts in enumerate(self.specific):
            mine = lengths[surface == d]
            for j, expert in enumerate(experts):
                for name, value in expert.flops(mine).items():
                    table[f"domain{d}.expert{j}.{name}"] = value
        table["gate"] = 2.0 * self.gate.in_features * self.gate.out_features * batch.batch_size
        table["heads"] = self.heads.flops_per_example() * batch.batch_size
        return table

    def embedding_bytes(self, batch: Batch) -> float:
        return self.encoder.embedding_bytes(batch)


def _blank_row(x, seq, offsets, positions):
    """One example of zeros with an empty history, in the encoder's output layout."""
    return x.new_zeros((1, *x.shape[1:])), seq[:0], offsets.new_zeros(2), positions[:0]


def _select_rows(x, seq, offsets, positions, rows):
    """Examples ``rows`` of the encoder's output: their tokens and their jagged histories."""
    starts, lengths = offsets[rows], offsets[rows + 1] - offsets[rows]
    new_offsets = lengths_to_offsets(lengths)
    owner = segment_ids(lengths)
    index = starts[owner] + torch.arange(owner.numel(), device=rows.device) - new_offsets[:-1][owner]
    return x[rows], seq[index], new_offsets, positions[index]
