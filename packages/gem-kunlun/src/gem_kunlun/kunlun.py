"""The Kunlun model (arXiv 2602.10016): interleaved non-sequence compression, sequence summarization, a
mixture-of-experts cross interaction and sequence updates (pFFN and local self-attention) per layer.

Data path of one layer, for ``B`` examples with non-sequence tokens ``X [B, N, D]`` and one merged jagged
history ``S [T, D]``:

1. ``X_sum = C(X)``: a token-axis linear N -> n_sum tokens, then a per-token MLP (residual).
2. ``P = PMA(S)`` or ``HSP(S)``: a few summary tokens of the history.
3. ``U = [X_sum; P] + MoE([X_sum; P])``: Wukong-style experts, top-k gated per example.
4. ``S += pFFN(S; X_sum')``: GDPA with q = sequence tokens and k/v = per-head projections of the
   example's X_sum' (a per-example FFN whose weights come from the non-sequence side).
5. ``S += LocalAttention(S)``: BlockAttention or a sliding window, with ROTE positions.

``U`` is the next layer's ``X``; after the last layer, a final PMA over the updated history joins ``U`` at
the heads. CompSkip switches sequence components off per layer: a skipped component
passes its input on unchanged. Before the layers, each event type may get its own width, heads, window and
depth (event-level personalization), then all types are projected to ``D`` and merged in time order.

Each component has its own module: ``pffn`` (PersonalizedFFN), ``local_attention`` (LocalAttention),
``compskip`` (the skip schedule), ``event_personalization`` (EventPersonalization, EventEncoder),
``summarization`` (PMA, HSP), ``moe`` (the Wukong experts), ``rote``; this one assembles them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F
from torchrec import KeyedJaggedTensor

from gem_kunlun.batch import Batch, check_item_ids
from gem_kunlun.candidates import CandidateInput
from gem_kunlun.compskip import check_skip_schedule, skipped_components
from gem_kunlun.config_checks import check_activation_and_kernel, check_at_least, check_widths
from gem_kunlun.contrastive import two_views, view_contrastive_loss
from gem_kunlun.cuda_graphs import GraphedForward
from gem_kunlun.embedding import FeatureEmbedding, ItemTower
from gem_kunlun.event_personalization import EventEncoder, EventPersonalization, check_event_names
from gem_kunlun.features import FeatureSpec
from gem_kunlun.heads import ModelOutput, MultiTaskHeads
from gem_kunlun.local_attention import LocalAttention
from gem_kunlun.moe import MixtureOfExperts, RoutingStats
from gem_kunlun.norm import LayerNorm, norm_mlp
from gem_kunlun.pffn import PersonalizedFFN
from gem_kunlun.representation_summary import RepresentationSummary
from gem_kunlun.retrieval import CosineScore, dot_scores, retrieval_logits, scored_item_ids
from gem_kunlun.rote import time_gap_positions
from gem_kunlun.sasrec import SasrecModel
from gem_kunlun.sequence import keep_latest, merge_by_time, take_rows
from gem_kunlun.summarization import PMA, HierarchicalSeedPooling


@dataclass(frozen=True)
class KunlunConfig:
    d_model: int = 32
    num_layers: int = 2
    num_heads: int = 2
    num_summary_tokens: int = 4
    num_seeds: int = 4
    summarization: str = "pma"  # "pma" or "hsp"
    hsp_expansion: int = 4
    hsp_rank: int = 2
    num_experts: int = 4
    top_k: int = 2
    capacity_factor: float = 1.25
    expert_rank: int = 8
    expert_hidden: int = 128
    balance_loss_weight: float = 0.01
    pffn_activation: str = "gelu"
    attention: str = "block"  # "block" (BlockAttention) or "window" (sliding window)
    block_size: int = 64
    window_blocks: int = 2
    window: int = 64
    rote: bool = True
    skip: tuple[tuple[str, ...], ...] = ()  # CompSkip: per layer, the sequence components switched off
    events: dict[str, EventPersonalization] = field(default_factory=dict)
    hidden: tuple[int, ...] = (128,)
    recent_tokens: int = 0  # the newest events of the updated history that join the final summary as tokens
    dropout: float = 0.0  # on the trunk's inputs (non-sequence tokens, events) and its MLP's hidden units
    # training encodes each example twice (two dropout masks) and adds this weight x the InfoNCE loss that
    # pulls the two representations together (``gem_kunlun.contrastive``); needs dropout
    contrastive_weight: float = 0.0
    contrastive_temperature: float = 1.0  # of the cosine similarities in that loss
    max_seq_len: int = 256
    kernel: str = "auto"
    # under autocast the history's residual stream (its event vectors and every update added to them) is kept in
    # autocast's dtype, as the updates are (the default of torchtitan's and Megatron-LM's mixed precision); True
    # keeps it in float32, at twice the bytes through every norm, merge and residual add over the history
    fp32_residual: bool = False
    two_tower: bool = False  # see KunlunModel
    # two-tower: the item tower embeds the candidate's id through the history's table of the same ids
    # (FeatureSpec.shared_ids), so that an item's vector learns from its place in histories too
    share_item_table: bool = False
    # two-tower: how a query meets an item. "dot": the dot product. "cosine": both unit-normalised, times a learned
    # scale (initialised and capped as CLIP's: 1/0.07, at most 100), so that an item's score no longer grows with
    # its vector's norm, which a whole-catalogue softmax pushes on every item at every step
    score: str = "dot"

    def __post_init__(self) -> None:
        check_at_least(self, {"d_model": 2, "num_layers": 1, "num_heads": 1, "num_summary_tokens": 1, "num_seeds": 1,
                              "hsp_expansion": 1, "hsp_rank": 1, "num_experts": 1, "expert_rank": 1, "expert_hidden": 1,
                              "balance_loss_weight": 0, "block_size": 1, "window_blocks": 1, "window": 0, "max_seq_len": 1,
                              "recent_tokens": 0, "contrastive_weight": 0})
        check_activation_and_kernel(self)
        check_widths(self, "hidden")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        if (self.d_model // self.num_heads) % 2 and self.rote:
            raise ValueError("ROTE needs an even head dim (d_model / num_heads)")
        for name, p in self.events.items():  # an event type's own attention layers, at its own width
            width = p.width or self.d_model
            if p.num_layers and width % p.num_heads:
                raise ValueError(f"events[{name!r}]: width ({width}) must be divisible by num_heads ({p.num_heads})")
            if p.num_layers and (width // p.num_heads) % 2 and self.rote:
                raise ValueError(f"events[{name!r}]: ROTE needs an even head dim (width {width} / num_heads {p.num_heads})")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must lie in [1, num_experts = {self.num_experts}]")
        if self.summarization not in ("pma", "hsp"):
            raise ValueError(f"summarization must be 'pma' or 'hsp', got {self.summarization!r}")
        if self.attention not in ("block", "window"):
            raise ValueError(f"attention must be 'block' or 'window', got {self.attention!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must lie in [0, 1), got {self.dropout}")
        if self.contrastive_weight and not self.dropout:
            raise ValueError("contrastive_weight needs dropout > 0: without it the two views are the same")
        if self.share_item_table and not self.two_tower:
            raise ValueError("share_item_table needs two_tower: only the item tower reads the history's item table")
        if self.score not in ("dot", "cosine"):
            raise ValueError(f"score must be 'dot' or 'cosine', got {self.score!r}")
        if self.score == "cosine" and not self.two_tower:
            raise ValueError("score = 'cosine' needs two_tower: only the two towers' vectors meet in a score")
        if self.contrastive_temperature <= 0:
            raise ValueError(f"contrastive_temperature must be > 0, got {self.contrastive_temperature}")
        check_skip_schedule(self.skip, self.num_layers)

    def skipped(self, layer: int) -> set[str]:
        return skipped_components(self.skip, layer)


KUNLUN_SIZES = {
    # tiny is sized for a 2-core CPU: the PyTorch reference kernels pad to the declared length
    "tiny": KunlunConfig(max_seq_len=64, block_size=16, window_blocks=2, window=16),
    "small": KunlunConfig(d_model=128, num_layers=3, num_heads=4, num_summary_tokens=6, num_seeds=6,
                          num_experts=8, expert_hidden=256, hidden=(256,), max_seq_len=1024, window_blocks=4),
    "base": KunlunConfig(d_model=512, num_layers=4, num_heads=4, num_summary_tokens=8, num_seeds=8,
                         num_experts=8, expert_rank=16, expert_hidden=1024, hidden=(1024, 256),
                         max_seq_len=8192, window_blocks=8),
    "large": KunlunConfig(d_model=1024, num_layers=8, num_heads=8, num_summary_tokens=16, num_seeds=16,
                          num_experts=16, expert_rank=32, expert_hidden=2048, hidden=(2048, 512),
                          max_seq_len=8192, window_blocks=8),
}


class KunlunLayer(nn.Module):
    def __init__(self, config: KunlunConfig, num_tokens_in: int, index: int, device=None) -> None:
        super().__init__()
        c, d = config, config.d_model
        self.config, self.skipped = config, config.skipped(index)
        self.num_tokens_in = num_tokens_in
        self.token_mix = nn.Parameter(torch.empty(num_tokens_in, c.num_summary_tokens, device=device))
        self.compress_norm = LayerNorm(d, kernel=c.kernel, device=device)
        self.compress_mlp = nn.Sequential(nn.Linear(d, 2 * d, device=device), nn.GELU(), nn.Linear(2 * d, d, device=device))
        self.summary = None
        if "summary" not in self.skipped:
            self.summary_norm = LayerNorm(d, kernel=c.kernel, device=device)
            if c.summarization == "pma":
                self.summary = PMA(d, c.num_seeds, c.num_heads, kernel=c.kernel, device=device)
            else:
                self.summary = HierarchicalSeedPooling(d, c.num_seeds, c.num_heads, c.hsp_expansion, c.hsp_rank,
                                                       kernel=c.kernel, device=device)
        tokens = c.num_summary_tokens + c.num_seeds
        self.moe_norm = LayerNorm(d, kernel=c.kernel, device=device)
        self.moe = MixtureOfExperts(tokens, d, c.num_experts, c.top_k, c.capacity_factor, c.expert_rank,
                                    c.expert_hidden, device=device)
        self.pffn = None if "pffn" in self.skipped else PersonalizedFFN(
            d, c.num_heads, c.num_summary_tokens, c.pffn_activation, c.kernel, device=device)
        self.attention = None if "attention" in self.skipped else LocalAttention(
            d, c.num_heads, c.attention, c.block_size, c.window_blocks, c.window, c.rote, c.kernel, device=device)
        self.graphs: GraphedForward | None = None  # ``cross`` replayed as CUDA graphs (``apply_cuda_graphs``)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.token_mix, std=self.num_tokens_in**-0.5)

    def forward(self, x, seq, offsets, positions, max_len, previous_summary, pending=None):
        """``(U, seq, summary, pending)``: the sequence leaves as ``seq + pending`` (pending None: seq), its last
        update left for the next norm to add in its own pass (``LayerNorm``'s ``pending``); ``pending`` in is the
        previous layer's. ``offsets`` may hold padding segments past ``x``'s examples (``pad_history``): the
        per-example side reads the real examples' summaries only, and pFFN gives the padding zero rows of U."""
        c = self.config
        examples, segments = x.shape[0], offsets.shape[0] - 1
        pffn_normed = None
        if self.summary is None:
            summary = previous_summary
        else:
            # seq goes on through the skip path, with the pending update added; pFFN's norm reads the same
            # stream: both norms in one pass over it
            if self.pffn is not None:
                normed, pffn_normed, seq = self.summary_norm(seq, skip=True, pending=pending, also=self.pffn.norm)
            else:
                normed, seq = self.summary_norm(seq, skip=True, pending=pending)
            pending = None
            summary = self.summary(normed, offsets, max_len)[:examples]
        # stand-in rows (``stand_in_rows``) run eagerly: a graph holds the routing of the rows it was captured with
        graphed = self.graphs is not None and self.moe.counts_rows
        u, assigned, kept, balance = (self.graphs if graphed else self.cross)(x, summary)
        self.moe.last_stats = RoutingStats(assigned=assigned, kept=kept, balance_loss=balance)
        if self.pffn is not None:
            queries = u[:, : c.num_summary_tokens]
            if segments > examples:
                queries = F.pad(queries, (0, 0, 0, 0, 0, segments - examples))
            seq, pending = self.pffn(seq, offsets, queries, max_len, pending=pending, defer=True, normed=pffn_normed)
        if self.attention is not None:
            seq, pending = self.attention(seq, offsets, positions, max_len, pending=pending, defer=True)
        return u, seq, summary, pending

    def cross(self, x: torch.Tensor, summary: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The layer's per-example side, on fixed shapes ``[B, tokens, D]``: the non-sequence tokens compressed,
        joined by the history's summary tokens, crossed by the MoE (residual). ``(U, assigned, kept, balance loss)``:
        the MoE's statistics returned, so that a CUDA graph of it (``cross_graph_parameters``) hands them back."""
        compressed = torch.einsum("bnd,nm->bmd", x, self.token_mix.to(x.dtype))
        x_sum = compressed + norm_mlp(self.compress_norm, self.compress_mlp, compressed)
        u = torch.cat([x_sum, summary], 1)
        out, assigned, kept, balance = self.moe.routed(self.moe_norm(u))
        return u + out, assigned, kept, balance

    def cross_graph_parameters(self) -> list[nn.Parameter]:
        """What ``cross`` reads."""
        return [self.token_mix, *(p for m in (self.compress_norm, self.compress_mlp, self.moe_norm, self.moe)
                                  for p in m.parameters())]

    def flops(self, lengths: torch.Tensor) -> dict[str, float]:
        c, d, b = self.config, self.config.d_model, lengths.numel()
        tokens = float(lengths.sum())
        table = {
            "compress": 2.0 * self.num_tokens_in * c.num_summary_tokens * d * b
            + 2.0 * (2 * d * d * 2) * c.num_summary_tokens * b,
            "moe": self.moe.flops(b),
        }
        if self.summary is not None:
            table["summary"] = self.summary.flops(tokens, b)
        if self.pffn is not None:
            table["pffn"] = self.pffn.flops(tokens, b)
        if self.attention is not None:
            table["attention"] = self.attention.flops(lengths)
        return table


class KunlunEncoder(nn.Module):
    """The input side: feature embedding, per-event-type encoders (personalization), the time-ordered merge.

    ``forward(batch) -> (x [B, N, D] non-sequence tokens, seq [T, D], offsets [B+1], positions [T])``; the
    tokens are the sparse features', the dense features' and one per representation feature (LoopFM).
    """

    def __init__(self, spec: FeatureSpec, config: KunlunConfig, device: torch.device | None = None,
                 shared: dict[str, str] | None = None, dense_columns: tuple[int, ...] | None = None) -> None:
        super().__init__()
        c, d = config, config.d_model
        check_event_names(c.events, spec)
        self.spec, self.config = spec, config
        personal = {e.name: c.events.get(e.name) or EventPersonalization() for e in spec.events}
        widths = {name: p.width or d for name, p in personal.items()}
        # ``shared``: other features (the candidate's id) embedded through an event feature's table (FeatureEmbedding)
        self.embedding = FeatureEmbedding(spec, d, event_dims=widths, device=device, shared=shared, dense_columns=dense_columns)
        self.event_encoders = nn.ModuleDict(
            {name: EventEncoder(widths[name], d, p, c.rote, c.kernel, device=device) for name, p in personal.items()}
        )
        self.event_type = nn.Embedding(len(spec.events), d, device=device)
        # LoopFM's representation sequences, if the data has them: one more non-sequence token each
        self.representations = RepresentationSummary(spec.representations, d, device=device) if spec.representations else None
        self.num_tokens = len(spec.sparse) + 1 + len(spec.representations)

    def forward(self, batch: Batch, shared_ids: dict[str, torch.Tensor] | None = None):
        """The four inputs of the trunk; with ``shared_ids`` (the item tower's ids of shared tables) ``(those four,
        {name: [N, D]})``, the vectors looked up with the events (``FeatureEmbedding``)."""
        c, names = self.config, [e.name for e in self.spec.events]
        sparse, dense, events, *shared = self.embedding(batch, shared_ids)
        device = batch.dense.device.type
        stream_dtype = None if c.fp32_residual or not torch.is_autocast_enabled(device) else torch.get_autocast_dtype(device)
        values, lengths, times, host_kept = [], [], [], []
        for name in names:
            sequence, encoder = batch.sequences[name], self.event_encoders[name]
            # sizes from the host's copy of the lengths where there is one: no wait for the device
            host = sequence.host_lengths()
            host_kept.append(None if host is None else [min(n, c.max_seq_len) for n in host])
            if host is not None and max(host, default=0) <= c.max_seq_len:
                # NOTE: nothing to truncate: the rows as they are, where a gather would copy every event vector
                # (and its backward every gradient)
                kept_events, t, kept_offsets = events[name], sequence.timestamps, sequence.offsets()
            else:
                total = None if host is None else sum(host_kept[-1])
                index, kept_offsets = keep_latest(sequence.offsets(), c.max_seq_len, total)
                kept_events, t = take_rows(events[name], index), sequence.timestamps[index]
            # positions only for an encoder with attention layers to rotate
            positions = time_gap_positions(t, kept_offsets) if len(encoder.layers) else None
            encoded = encoder(kept_events, kept_offsets, positions, c.max_seq_len)
            # the residual stream's dtype from here (see KunlunConfig.fp32_residual): the merge moves half the bytes
            values.append(encoded if stream_dtype in (None, encoded.dtype) else encoded.to(stream_dtype))
            lengths.append(kept_offsets[1:] - kept_offsets[:-1])
            times.append(t)
        merged, offsets, timestamps, event_type = merge_by_time(values, lengths, times)
        merged_host = [sum(per_type) for per_type in zip(*host_kept)] if all(k is not None for k in host_kept) else None
        if merged_host is None or max(merged_host, default=0) > c.max_seq_len:
            total = None if merged_host is None else sum(min(n, c.max_seq_len) for n in merged_host)
            index, offsets = keep_latest(offsets, c.max_seq_len, total)
            merged, event_type, timestamps = take_rows(merged, index), event_type[index], timestamps[index]
        seq = self._with_event_types(merged, event_type)
        tokens = [sparse, dense[:, None]]
        if self.representations is not None:
            tokens.append(self.representations(batch).to(sparse.dtype))
        x = torch.cat(tokens, 1)
        # the merge leaves every example's events in time order
        inputs = x, seq, offsets, time_gap_positions(timestamps, offsets, in_time_order=True)
        return inputs if shared_ids is None else (inputs, shared[0])

    def _with_event_types(self, events: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        """``events [T, D] + event_type(types)``, as one product with the types' one-hot rows added to the events.

        NOTE: an embedding's backward sorts every event's type to sum the gradient of a handful of vectors; as a
        product that gradient is one matrix product over the history. In the events' dtype (the residual
        stream's), outside autocast: the sum starts the stream."""
        weight = self.event_type.weight
        one_hot = (types[:, None] == torch.arange(weight.shape[0], device=types.device)).to(events.dtype)
        with torch.autocast(events.device.type, enabled=False):
            return torch.addmm(events, one_hot, weight.to(events.dtype))

    def merged_lengths(self, batch: Batch) -> torch.Tensor:
        """Events per example after truncation and merge, ``[B]`` on the CPU."""
        total = torch.zeros(batch.batch_size, dtype=torch.int64)
        for e in self.spec.events:
            total += batch.sequences[e.name].lengths().cpu().clamp(max=self.config.max_seq_len)
        return total.clamp(max=self.config.max_seq_len)

    def flops(self, batch: Batch) -> dict[str, float]:
        d = self.config.d_model
        table = {"embedding.dense_proj": 2.0 * self.spec.num_dense * d * batch.batch_size}
        for e in self.spec.events:
            lengths = batch.sequences[e.name].lengths().cpu().clamp(max=self.config.max_seq_len)
            value = self.event_encoders[e.name].flops(lengths, d)
            if value:
                table[f"events.{e.name}"] = value
        if self.representations is not None:
            table.update(self.representations.flops({n: r.lengths.cpu() for n, r in batch.representations.items()}))
        return table

    def embedding_bytes(self, batch: Batch) -> float:
        """Bytes read from embedding tables by the forward pass of ``batch`` (float32 rows)."""
        total = batch.sparse.values().numel() * 4.0 * self.config.d_model
        for e in self.spec.events:
            width = self.event_encoders[e.name].width
            total += batch.sequences[e.name].ids.values().numel() * 4.0 * width
        return total


def pad_history(seq: torch.Tensor, offsets: torch.Tensor, positions: torch.Tensor, bucket: int,
                max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The jagged history ``seq [T, D]`` (``offsets [B + 1]``, ``positions [T]``) padded to the next multiple of
    ``bucket`` tokens (at least one bucket) by ``ceil(bucket / max_len)`` padding segments after the examples, each
    at most ``max_len`` tokens (zero rows, position 0; segments past the padding are empty). Shapes then depend on
    ``B`` and the bucket alone, which a CUDA graph of the trunk needs; every jagged op works per segment, so the
    examples' outputs do not change. Offsets are made on the device from host-known sizes: no host sync."""
    tokens = seq.shape[0]
    total = max(-(-tokens // bucket), 1) * bucket
    segments = -(-bucket // max_len)
    ends = (torch.arange(1, segments + 1, device=offsets.device, dtype=offsets.dtype) * max_len).clamp(max=total - tokens)
    return (F.pad(seq, (0, 0, 0, total - tokens)), torch.cat([offsets, offsets[-1:] + ends]),
            F.pad(positions, (0, total - tokens)))


def newest_events(seq: torch.Tensor, offsets: torch.Tensor, count: int) -> torch.Tensor:
    """``[B, count, D]``: each example's newest ``count`` events of the jagged ``seq [T, D]``, newest first,
    zeros where a history is shorter. Next-item tasks hinge on the last few events, which a pooled
    summary blurs; ``recent_tokens`` hands them to the heads as they are."""
    ends = offsets[1:, None] - 1 - torch.arange(count, device=seq.device)[None, :]  # [B, count]
    valid = ends >= offsets[:-1, None]
    padded = torch.cat([seq, seq.new_zeros(1, seq.shape[1])])
    return padded[torch.where(valid, ends, seq.shape[0])]


class KunlunTrunk(nn.Module):
    """The Kunlun layers, a final summary of the updated history and the MLP to a representation.

    ``forward(x, seq, offsets, positions) -> (representation [B, R], aux_loss)``.
    """

    def __init__(self, config: KunlunConfig, num_tokens_in: int, device: torch.device | None = None) -> None:
        super().__init__()
        c, d = config, config.d_model
        self.config = config
        layers = []
        for i in range(c.num_layers):
            layers.append(KunlunLayer(c, num_tokens_in, i, device=device))
            num_tokens_in = c.num_summary_tokens + c.num_seeds
        self.layers = nn.ModuleList(layers)
        # the history as updated by the last layer is summarised once more, so that every layer's sequence
        # update reaches the heads
        self.final_summary_norm = LayerNorm(d, kernel=c.kernel, device=device)
        self.final_summary = PMA(d, c.num_seeds, c.num_heads, kernel=c.kernel, device=device)
        self.final_norm = LayerNorm(d, kernel=c.kernel, device=device)
        widths = [(num_tokens_in + c.num_seeds + c.recent_tokens) * d, *c.hidden]
        regularise = (nn.Dropout(c.dropout),) if c.dropout else ()
        self.mlp = nn.Sequential(
            *[m for i, o in zip(widths, widths[1:]) for m in (nn.Linear(i, o, device=device), nn.GELU(), *regularise)]
        )
        self.representation_dim = widths[-1]
        self.graphs: GraphedForward | None = None  # ``head`` replayed as CUDA graphs (``apply_cuda_graphs``)
        # > 0: the history padded to multiples of this many tokens (``pad_history``) and the whole trunk run as
        # ``padded``, replayed as CUDA graphs by ``trunk_graphs`` (``apply_cuda_graphs(history_bucket=)``)
        self.history_bucket = 0
        self.trunk_graphs: GraphedForward | None = None

    def forward(self, x, seq, offsets, positions):
        c = self.config
        # NOTE: evaluation never replays (its outputs would alias the graphs' memory): it skips the padding too
        if not (self.history_bucket and self.training):
            head = self.head if self.graphs is None else self.graphs
            representation, aux, _ = self._layers(x, seq, offsets, positions, head)
            return representation, aux
        seq, offsets, positions = pad_history(seq, offsets, positions, self.history_bucket, c.max_seq_len)
        graphed = self.trunk_graphs is not None and all(layer.moe.counts_rows for layer in self.layers)
        trunk = self.trunk_graphs if graphed else self.padded
        representation, aux, *stats = trunk(x, seq, offsets, positions)
        for layer, (assigned, kept, balance) in zip(self.layers, zip(stats[0::3], stats[1::3], stats[2::3])):
            layer.moe.last_stats = RoutingStats(assigned=assigned, kept=kept, balance_loss=balance)
        return representation, aux

    def padded(self, x, seq, offsets, positions) -> tuple[torch.Tensor, ...]:
        """The trunk over a padded history (``pad_history``: shapes set by the batch size and the bucket):
        ``(representation, aux_loss, then each layer's MoE assigned, kept and balance loss)``, the statistics handed
        back so that a CUDA graph of it (``trunk_graphs``) returns them."""
        representation, aux, stats = self._layers(x, seq, offsets, positions, self.head)
        return representation, aux, *(t for s in stats for t in (s.assigned, s.kept, s.balance_loss))

    def _layers(self, x, seq, offsets, positions, head) -> tuple[torch.Tensor, torch.Tensor, list[RoutingStats]]:
        c = self.config
        examples = x.shape[0]  # offsets may hold padding segments after them
        if c.dropout:
            x, seq = F.dropout(x, c.dropout, self.training), F.dropout(seq, c.dropout, self.training)
        summary = pending = None
        aux = x.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            x, seq, summary, pending = layer(x, seq, offsets, positions, c.max_seq_len, summary, pending)
            aux = aux + c.balance_loss_weight * layer.moe.last_stats.balance_loss
        normed, seq = self.final_summary_norm(seq, skip=True, pending=pending)  # seq: the updated history, whole
        tokens = [x, self.final_summary(normed, offsets, c.max_seq_len)[:examples]]
        if c.recent_tokens:
            tokens.append(newest_events(seq, offsets, c.recent_tokens)[:examples])
        (representation,) = head(*tokens)
        return representation, aux, [layer.moe.last_stats for layer in self.layers]

    def head(self, *tokens: torch.Tensor) -> tuple[torch.Tensor]:
        """``(representation [B, R],)`` from the final tokens (each ``[B, n, D]``), on fixed shapes (a CUDA graph
        of it: ``apply_cuda_graphs``)."""
        return (self.mlp(self.final_norm(torch.cat(tokens, 1)).flatten(1)),)

    def head_graph_parameters(self) -> list[nn.Parameter]:
        """What ``head`` reads."""
        return [*self.final_norm.parameters(), *self.mlp.parameters()]

    def flops(self, lengths: torch.Tensor) -> dict[str, float]:
        """Forward FLOPs for examples with merged history ``lengths [B]``."""
        table = {}
        for i, layer in enumerate(self.layers):
            for name, value in layer.flops(lengths).items():
                table[f"layer{i}.{name}"] = value
        table["final_summary"] = self.final_summary.flops(float(lengths.sum()), lengths.numel())
        table["mlp"] = sum(2.0 * m.in_features * m.out_features for m in self.mlp if isinstance(m, nn.Linear)) * lengths.numel()
        return table


class KunlunModel(nn.Module):
    """``forward(batch) -> ModelOutput(logits [B, num_tasks], aux_loss, representation)``; see the module
    docstring.

    With ``two_tower`` the candidate's features (``spec.candidate``) stay out of the trunk, which then
    encodes the request alone; an ``ItemTower`` embeds the candidate and the logit is the dot product of
    the two. The trunk then runs once per request whatever the number of candidates (retrieval, full
    ranking over a catalogue), at the price of crossing the candidate with the history only at the end.
    """

    def __init__(self, spec: FeatureSpec, config: KunlunConfig = KunlunConfig(), device: torch.device | None = None):
        super().__init__()
        self.spec, self.config = spec, config
        request_spec, request_dense = spec, None
        if config.two_tower:
            if not spec.candidate:
                raise ValueError("two_tower needs the data's candidate features (FeatureSpec.candidate is empty)")
            if len(spec.tasks) != 1:
                raise ValueError(f"two_tower scores one task, the data has {list(spec.tasks)}")
            request = tuple(f for f in spec.sparse if f.name not in spec.candidate)
            request_dense = tuple(i for i in range(spec.num_dense) if i not in spec.candidate_dense)
            request_spec = dataclasses.replace(spec, sparse=request, candidate=(), shared_ids=(), num_dense=len(request_dense),
                                               candidate_dense=())
        # the candidate features embedded through the history's tables: looked up by the encoder, pooled by the item tower
        shared = {s: e for s, e in spec.shared_ids if s in spec.candidate} if config.share_item_table else {}
        if config.share_item_table and not shared:
            raise ValueError("share_item_table needs candidate ids that the history shares (FeatureSpec.shared_ids is empty)")
        self.encoder = KunlunEncoder(request_spec, config, device=device, shared=shared, dense_columns=request_dense)
        self.trunk = KunlunTrunk(config, self.encoder.num_tokens, device=device)
        self.representation_dim = self.trunk.representation_dim
        if config.two_tower:
            candidate = {f.name: f for f in spec.sparse}
            self.query = nn.Linear(self.representation_dim, self.representation_dim, device=device)
            for name in shared:
                if self.encoder.embedding.shared_width(name) != config.d_model:
                    raise ValueError(f"share_item_table: the history's table for {name!r} is "
                                     f"{self.encoder.embedding.shared_width(name)} wide, the item tower's {config.d_model}")
            self.item_tower = ItemTower(tuple(candidate[n] for n in spec.candidate), config.d_model,
                                        self.representation_dim, device=device, shared=tuple(shared))
            self.cosine = CosineScore(device=device) if config.score == "cosine" else None
            self.candidate_input = CandidateInput.CATALOGUE
        else:
            self.heads = MultiTaskHeads(self.representation_dim, len(spec.tasks), spec.num_surfaces, device=device)
            self.candidate_input = CandidateInput.FEATURES

    @property
    def layers(self) -> nn.ModuleList:
        return self.trunk.layers

    def forward(self, batch: Batch) -> ModelOutput:
        c = self.config
        items = self._item_features(batch)
        shared = {}
        if items is not None and self.item_tower.shared:
            # NOTE: shared ids are looked up with the history, in one call: one fused update of the table per step
            inputs, shared = self.encoder(batch, shared_ids=self.item_tower.shared_ids(items))
        else:
            inputs = self.encoder(batch)
        contrast = self.training and c.contrastive_weight > 0
        representation, aux = self.trunk(*(two_views(*inputs) if contrast else inputs))
        if contrast:
            representation, second_view = representation.chunk(2)
            aux = aux + c.contrastive_weight * view_contrastive_loss(representation, second_view, c.contrastive_temperature)
        if not c.two_tower:
            if batch.next_items is not None:
                raise ValueError("retrieval examples (batch.next_items) need model.kunlun.two_tower = true")
            return ModelOutput(logits=self.heads(representation, batch.surface), aux_loss=aux, representation=representation)
        query = self.query_vectors(representation)
        targets = batch.next_items
        vectors = self.item_vectors(items, shared)
        if targets is None:
            return ModelOutput(logits=(query * vectors).sum(-1, keepdim=True), aux_loss=aux, representation=query)
        if targets.negatives is not None:
            vectors = vectors[scored_item_ids(targets, vectors.shape[0])]
        return ModelOutput(logits=retrieval_logits(query, vectors, targets), aux_loss=aux, representation=query,
                           item_vectors=vectors)

    def _item_features(self, batch: Batch):
        """What the item tower embeds for ``batch`` (None without one): each example's candidate, or, for
        retrieval, the catalogue."""
        if not self.config.two_tower:
            return None
        targets = batch.next_items
        if targets is None:
            return batch.sparse
        if targets.every:
            raise ValueError("Kunlun encodes a whole history per query: retrieval needs data.sequential.queries = \"last\"")
        if targets.catalogue is None:
            raise ValueError("batch.next_items.catalogue is missing: the item tower needs every item's features")
        return targets.catalogue

    def query_vectors(self, representation: torch.Tensor) -> torch.Tensor:
        """``[N, D]``: the query side of the two-tower score of ``representation`` (the trunk's output)."""
        query = self.query(representation)
        return query if self.cosine is None else self.cosine.queries(query)

    def item_vectors(self, features, shared: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """``[M, D]``: the item tower's vectors of ``features`` (M items' candidate features) in the score's space;
        ``shared``: the shared ids' vectors as the history's lookup returned them (None: looked up on their own)."""
        if shared is None:
            shared = self.encoder.embedding.lookup_shared(self.item_tower.shared_ids(features))
        vectors = self.item_tower(features, shared)
        return vectors if self.cosine is None else self.cosine.items(vectors)

    def score_candidates(self, requests: Batch, candidates: torch.Tensor, candidate_features: Batch | None = None,
                         catalogue: KeyedJaggedTensor | None = None) -> torch.Tensor:
        """``[U, C]`` logits of ``candidates [U, C]`` for one request row per user, the history side encoded
        once per request. Crossing: ``candidate_features`` (``U * C`` rows) carries each candidate's own
        features and the trunk runs per candidate. Two-tower: the trunk runs once per request and the item
        tower once over ``catalogue`` (every item's candidate features)."""
        if not self.config.two_tower:
            from gem_kunlun.ranking import kunlun_score_candidates

            if candidate_features is None:
                raise ValueError("a crossing Kunlun needs candidate_features to score candidates")
            return kunlun_score_candidates(self, requests, candidates, candidate_features)
        if catalogue is None:
            raise ValueError("a two-tower Kunlun needs the catalogue to score candidates")
        check_item_ids("candidates", candidates, catalogue.stride())
        representation, _ = self.trunk(*self.encoder(requests))
        vectors = self.item_vectors(catalogue)
        return dot_scores(self.query_vectors(representation), vectors[candidates])

    def flops(self, batch: Batch) -> dict[str, float]:
        """Forward model FLOPs of ``batch`` per component (real lengths; active experts only; embedding lookups
        excluded; with a contrastive weight, in training mode, the trunk runs on two views of every example, as the
        forward does). Multiply by 3 for a training step."""
        table = self.encoder.flops(batch)
        trunk = self.trunk.flops(self.encoder.merged_lengths(batch))
        views = 2 if self.training and self.config.contrastive_weight > 0 else 1
        table.update({name: views * value for name, value in trunk.items()})
        if not self.config.two_tower:
            table["heads"] = self.heads.flops_per_example() * batch.batch_size
            return table
        r = self.representation_dim
        table["query"] = 2.0 * r * r * batch.batch_size
        targets = batch.next_items
        if targets is None:
            table["item_tower"] = self.item_tower.flops(batch.batch_size)
            table["score"] = 2.0 * r * batch.batch_size
        else:
            num_items = targets.catalogue.stride() if targets.catalogue is not None else 0
            scored = num_items if targets.negatives is None else 1 + targets.negatives.shape[1]
            table["item_tower"] = self.item_tower.flops(num_items)
            table["score"] = 2.0 * r * targets.num_queries * scored
        return table

    def embedding_bytes(self, batch: Batch) -> float:
        return self.encoder.embedding_bytes(batch)


def apply_cuda_graphs(model: nn.Module, max_shapes: int = 8, history_bucket: int = 0) -> None:
    """Replay the fixed-shape parts of every Kunlun layer and trunk and every SASRec in ``model`` as CUDA graphs in
    training, one forward and one backward graph per batch shape (up to ``max_shapes``; other shapes, evaluation and
    CPU calls run eagerly): each layer's per-example side (``KunlunLayer.cross``: compression, MoE routing and
    experts), the trunk's head (``KunlunTrunk.head``) and SASRec's every-position encoder in its padded layout
    (``SasrecModel.every_position_padded``). Kunlun's jagged history stays eager (its token count changes every
    batch), unless ``history_bucket`` > 0: the history is then padded to multiples of that many tokens
    (``pad_history``) and each trunk replays whole (``KunlunTrunk.padded``), one pair of graphs per batch size and
    bucket.

    Why: a small model's step on a GPU is bound by the host's launches, and these parts are a few hundred small
    kernels a step (the MoE's routing and slot dispatch most). One process only: a MoE counting capacity over a
    batch group holds a collective, which a graph must not."""
    if history_bucket < 0:
        raise ValueError(f"apply_cuda_graphs: history_bucket must be >= 0, got {history_bucket}")
    for module in model.modules():
        if isinstance(module, KunlunLayer):
            if module.moe.batch_group is not None:
                raise ValueError("apply_cuda_graphs: a MoE counts capacity over a batch group (a collective in its forward)")
            if module.moe.capacity_factor <= 0:
                raise ValueError("apply_cuda_graphs: a MoE without a capacity (capacity_factor <= 0) sizes its rows by a "
                                 "count read on the host, which a CUDA graph cannot hold")
            if not history_bucket:
                module.graphs = GraphedForward(module.cross, module, module.cross_graph_parameters(), max_shapes=max_shapes)
        elif isinstance(module, KunlunTrunk):
            if history_bucket:
                module.history_bucket = history_bucket
                module.trunk_graphs = GraphedForward(module.padded, module, max_shapes=max_shapes)
            else:
                module.graphs = GraphedForward(module.head, module, module.head_graph_parameters(), max_shapes=max_shapes)
        elif isinstance(module, SasrecModel):
            module.graphs = GraphedForward(module.every_position_padded, module, module.graph_parameters(),
                                           max_shapes=max_shapes)
