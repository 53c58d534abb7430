"""Reference LayerNorm / RMSNorm with an optional fused residual add (fp32 math, output in x's dtype or
``out_dtype``, rounded once)."""

from __future__ import annotations

import torch


def pt_layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
    residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    # NOTE: the norm reads the fp32 sum, the returned residual stream is that sum rounded to x's dtype.
    hf = x.float() if residual is None else x.float() + residual.float()
    y = torch.nn.functional.layer_norm(
        hf, (hf.shape[-1],), weight.float(), None if bias is None else bias.float(), eps
    ).to(out_dtype or x.dtype)
    return y if residual is None else (y, hf.to(x.dtype))


def pt_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    hf = x.float() if residual is None else x.float() + residual.float()
    y = (hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + eps) * weight.float()).to(out_dtype or x.dtype)
    return y if residual is None else (y, hf.to(x.dtype))


def pt_layer_norm_pair(
    x: torch.Tensor, first: tuple[torch.Tensor, torch.Tensor], second: tuple[torch.Tensor, torch.Tensor], eps: float,
    residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, ...]:
    """Two affines of one LayerNorm's normalised rows: ``(y1, y2)``, and the residual stream (the fp32 sum rounded
    to x's dtype) third when a residual is given."""
    hf = x.float() if residual is None else x.float() + residual.float()
    xhat = torch.nn.functional.layer_norm(hf, (hf.shape[-1],), None, None, eps)
    ys = tuple((xhat * w.float() + b.float()).to(out_dtype or x.dtype) for w, b in (first, second))
    return ys if residual is None else (*ys, hf.to(x.dtype))
