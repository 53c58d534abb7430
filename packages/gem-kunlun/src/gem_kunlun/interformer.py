"""An InterFormer-style ranking model (arXiv 2411.09852), a baseline beside Kunlun in the same framework.

Each layer runs three arches side by side and lets them inform each other:

- **interaction**: a DCN-v2 cross network over the flattened non-sequence tokens together with the
  current sequence summary, projected back to tokens;
- **sequence**: a personalized FFN (pFFN, weights from the non-sequence tokens, as in Kunlun) followed by
  full multi-head self-attention over the history;
- **cross**: the sequence is summarised for the next layer's interaction by PMA (learned queries) plus its
  most recent event (a CLS-like "last" token).

Inputs go through the same encoder as Kunlun (embedding, per-type encoders, time-ordered merge).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gem_kunlun.batch import Batch
from gem_kunlun.config_checks import check_activation_and_kernel, check_at_least, check_widths
from gem_kunlun.features import FeatureSpec
from gem_kunlun.heads import ModelOutput, MultiTaskHeads
from gem_kunlun.kunlun import KunlunConfig, KunlunEncoder
from gem_kunlun.local_attention import LocalAttention
from gem_kunlun.norm import LayerNorm
from gem_kunlun.pffn import PersonalizedFFN
from gem_kunlun.summarization import PMA


@dataclass(frozen=True)
class InterFormerConfig:
    d_model: int = 32
    num_layers: int = 2
    num_heads: int = 2
    num_seeds: int = 2  # PMA summary tokens per layer
    cross_layers: int = 2  # DCN-v2 cross layers per interaction arch
    pffn_activation: str = "gelu"
    hidden: tuple[int, ...] = (128,)
    max_seq_len: int = 64
    kernel: str = "auto"

    def __post_init__(self) -> None:
        check_at_least(self, {"d_model": 2, "num_layers": 1, "num_heads": 1, "num_seeds": 1, "cross_layers": 1,
                              "max_seq_len": 1})
        check_widths(self, "hidden")
        check_activation_and_kernel(self)
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")

    def encoder_config(self) -> KunlunConfig:
        """The shared input encoder is Kunlun's, without ROTE (InterFormer's attention uses no time positions),
        handing the history over in float32 (InterFormer's layers keep their residual stream in it)."""
        return KunlunConfig(d_model=self.d_model, num_heads=self.num_heads, max_seq_len=self.max_seq_len,
                            rote=False, kernel=self.kernel, fp32_residual=True)


class CrossNetwork(nn.Module):
    """DCN-v2: ``x_{l+1} = x_0 * (W_l x_l + b_l) + x_l`` on ``[B, F]`` vectors."""

    def __init__(self, width: int, num_layers: int, device=None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, device=device) for _ in range(num_layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for layer in self.layers:
            x = x0 * layer(x) + x
        return x

    def flops_per_example(self) -> float:
        return sum(2.0 * l.in_features * l.out_features for l in self.layers)


class InterFormerLayer(nn.Module):
    def __init__(self, config: InterFormerConfig, num_tokens: int, device=None) -> None:
        super().__init__()
        c, d = config, config.d_model
        self.config, self.num_tokens = config, num_tokens
        summary_tokens = c.num_seeds + 1
        self.interaction_norm = LayerNorm(d, kernel=c.kernel, device=device)
        self.cross = CrossNetwork((num_tokens + summary_tokens) * d, c.cross_layers, device=device)
        self.back_to_tokens = nn.Linear((num_tokens + summary_tokens) * d, num_tokens * d, device=device)
        self.pffn = PersonalizedFFN(d, c.num_heads, num_tokens, c.pffn_activation, c.kernel, device=device)
        self.attention = LocalAttention(d, c.num_heads, "window", 1, 1, c.max_seq_len, False, c.kernel, device=device)
        self.summary_norm = LayerNorm(d, kernel=c.kernel, device=device)
        self.summary = PMA(d, c.num_seeds, c.num_heads, kernel=c.kernel, device=device)

    def summarize(self, seq: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """PMA tokens plus the most recent event (zeros for an empty history): ``[B, num_seeds + 1, D]``."""
        normed = self.summary_norm(seq)
        pooled = self.summary(normed, offsets, self.config.max_seq_len)
        lengths = offsets[1:] - offsets[:-1]
        last = normed.new_zeros(lengths.numel(), normed.shape[1])
        nonempty = lengths > 0
        last[nonempty] = normed[offsets[1:][nonempty] - 1]
        return torch.cat([pooled, last[:, None]], 1)

    def forward(self, x, seq, offsets, positions, summary=None):
        """``summary`` None (the first layer): the history as this layer's cross arch summarises it, computed here,
        inside the layer's call (a sharded layer's parameters are gathered only around it)."""
        if summary is None:
            summary = self.summarize(seq, offsets)
        b, d = x.shape[0], self.config.d_model
        tokens = self.interaction_norm(torch.cat([x, summary], 1)).flatten(1)
        x = x + self.back_to_tokens(self.cross(tokens)).view(b, self.num_tokens, d)
        seq = self.pffn(seq, offsets, x, self.config.max_seq_len)
        seq = self.attention(seq, offsets, positions, self.config.max_seq_len)
        return x, seq, self.summarize(seq, offsets)

    def flops(self, lengths: torch.Tensor) -> dict[str, float]:
        b, tokens = lengths.numel(), float(lengths.sum())
        width = self.back_to_tokens.in_features
        return {
            "interaction": (self.cross.flops_per_example() + 2.0 * width * self.back_to_tokens.out_features) * b,
            "pffn": self.pffn.flops(tokens, b),
            "attention": self.attention.flops(lengths),
            "summary": self.summary.flops(tokens, b),
        }


class InterFormerModel(nn.Module):
    """``forward(batch) -> ModelOutput``; see the module docstring."""

    def __init__(self, spec: FeatureSpec, config: InterFormerConfig = InterFormerConfig(), device=None) -> None:
        super().__init__()
        self.spec, self.config = spec, config
        self.encoder = KunlunEncoder(spec, config.encoder_config(), device=device)
        n, d = self.encoder.num_tokens, config.d_model
        self.layers = nn.ModuleList(InterFormerLayer(config, n, device=device) for _ in range(config.num_layers))
        self.final_norm = LayerNorm(d, kernel=config.kernel, device=device)
        widths = [(n + config.num_seeds + 1) * d, *config.hidden]
        self.mlp = nn.Sequential(*[m for i, o in zip(widths, widths[1:]) for m in (nn.Linear(i, o, device=device), nn.GELU())])
        self.representation_dim = widths[-1]
        self.heads = MultiTaskHeads(self.representation_dim, len(spec.tasks), spec.num_surfaces, device=device)

    def forward(self, batch: Batch) -> ModelOutput:
        x, seq, offsets, positions = self.encoder(batch)
        summary = None  # the first interaction reads the history as the first layer's cross arch summarises it
        for layer in self.layers:
            x, seq, summary = layer(x, seq, offsets, positions, summary)
        representation = self.mlp(self.final_norm(torch.cat([x, summary], 1)).flatten(1))
        aux = representation.new_zeros((), dtype=torch.float32)
        return ModelOutput(self.heads(representation, batch.surface), aux, representation)

    def flops(self, batch: Batch) -> dict[str, float]:
        """Forward model FLOPs of ``batch`` per component; multiply by 3 for training."""
        table = self.encoder.flops(batch)
        lengths = self.encoder.merged_lengths(batch)
        table["first_summary"] = self.layers[0].summary.flops(float(lengths.sum()), batch.batch_size)
        for i, layer in enumerate(self.layers):
            for name, value in layer.flops(lengths).items():
                table[f"layer{i}.{name}"] = value
        table["mlp"] = sum(2.0 * m.in_features * m.out_features for m in self.mlp if isinstance(m, nn.Linear)) * batch.batch_size
        table["heads"] = self.heads.flops_per_example() * batch.batch_size
        return table

    def embedding_bytes(self, batch: Batch) -> float:
        return self.encoder.embedding_bytes(batch)
