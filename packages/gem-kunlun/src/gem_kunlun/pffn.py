"""pFFN, the personalized FFN: a per-example FFN over the history whose weights come from the non-sequence side,
expressed as one GDPA call (q = sequence tokens, k/v = per-head projections of the example's summary tokens)."""

from __future__ import annotations

import torch
from torch import nn

from gem_kernels import gdpa
from gem_kunlun.norm import LayerNorm


class PersonalizedFFN(nn.Module):
    """pFFN: ``S += W_o GDPA(q = W_q S, k/v = per-head projections of the example's X_sum)``.

    With a pointwise activation this is a per-example two-layer FFN whose hidden units are the summary
    tokens: the non-sequence side parameterises how every event of the history is transformed.
    """

    def __init__(self, dim: int, num_heads: int, num_tokens: int, activation: str, kernel: str, device=None) -> None:
        super().__init__()
        self.dim, self.num_heads, self.num_tokens, self.activation, self.kernel = dim, num_heads, num_tokens, activation, kernel
        self.norm = LayerNorm(dim, kernel=kernel, device=device)
        self.q = nn.Linear(dim, dim, device=device)
        self.kv = nn.Linear(dim, 2 * dim, device=device)
        self.out = nn.Linear(dim, dim, device=device)

    def forward(self, seq: torch.Tensor, offsets: torch.Tensor, x_sum: torch.Tensor, max_len: int,
                pending: torch.Tensor | None = None, defer: bool = False, normed: torch.Tensor | None = None):
        """``seq + update``; with ``defer`` ``(seq, update)``, the add left to the next norm (``LayerNorm``'s
        ``pending``). ``pending``: an update of seq not yet added, added inside this block's norm. ``normed``:
        ``self.norm(seq)`` made already (in one pass with another norm of the same seq: ``LayerNorm(also=...)``)."""
        h, d, b = self.num_heads, self.dim // self.num_heads, x_sum.shape[0]
        if normed is None:
            normed, seq = self.norm(seq, skip=True, pending=pending)
        elif pending is not None:
            raise ValueError("PersonalizedFFN: an update pending for seq was not in the given normed rows")
        q = self.q(normed).view(-1, h, d)
        kv = self.kv(x_sum).reshape(-1, 2, h, d)  # [B * n, 2, H, d]: k and v packed
        kv_offsets = torch.arange(0, (b + 1) * self.num_tokens, self.num_tokens, device=seq.device)
        o = gdpa(q, kv, None, offsets, kv_offsets, activation=self.activation, max_seq_len_q=max_len,
                 max_seq_len_kv=self.num_tokens, kernel=self.kernel, validate=False)
        update = self.out(o.reshape(-1, self.dim))
        return (seq, update) if defer else seq + update

    def flops(self, tokens: float, batch_size: int) -> float:
        return (2.0 * self.dim * 2 * self.dim * tokens + 2.0 * self.dim * 2 * self.dim * self.num_tokens * batch_size
                + 4.0 * self.num_tokens * self.dim * tokens)
