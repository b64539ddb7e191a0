"""The PyTorch references of the fused q/k transforms: what each Triton kernel (quest.attention.triton_kernels) must
equal, and, for the l2 normalisation, what the formulations compute wherever the kernels do not run
(quest.attention.fused; LayerNorm's PyTorch path is ``nn.LayerNorm``, elliptical's m ``elliptical_weights``).

The l2 normalisation computes in the precision its inputs and autocast give (the PyTorch path's own: under CUDA's
bf16 autocast its norm comes out in float32 and so does its result); the kernels compute the same formula in float32
and write the input's dtype, so their checks run the reference on float32 (float64) copies (:func:`work_dtype`).
LayerNorm and elliptical's m compute in the work precision and write the input's dtype, as their kernels do. The
backwards are written out (the l2 normalisation's three passes where autograd's derivative of ``F.normalize`` takes
about ten), once for both paths: tests/attention/test_fused_kernels.py holds each against autograd's derivative of the formula
in float64.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["l2_normalize_reference", "l2_normalize_backward_reference", "layer_norm_reference",
           "layer_norm_backward_reference", "elliptical_m_reference", "work_dtype"]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision the transforms compute in: float32, or float64 where the input is."""
    return torch.promote_types(dtype, torch.float32)


def _factor(inv: Tensor, scale: Optional[Tensor]) -> Tensor:
    return inv if scale is None else inv * scale


def times_inverse(x: Tensor, inv: Tensor, scale: Optional[Tensor]) -> Tensor:
    """x * inv * scale: the one expression of every path (eager, the recompute, TorchScript / FX), so that they agree
    to the bit."""
    return x * _factor(inv, scale)


def l2_normalize_reference(x: Tensor, eps: float, scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(x * scale / max(||x||, eps), 1 / max(||x||, eps), ||x|| >= eps) over the last dimension; ``scale`` broadcasts
    against x (one value, or (H, 1, 1) per head). The last two are what the backward needs."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    inv = norm.clamp_min(eps).reciprocal()
    return times_inverse(x, inv, scale), inv, norm >= eps


def l2_normalize_backward_reference(g: Tensor, x: Tensor, inv: Tensor, scale: Optional[Tensor],
                                    above: Tensor) -> tuple[Tensor, Tensor]:
    """(dL/dx, g . u per row) for y = s u, u = x * inv: dL/dx = s inv (g - u (g . u)) where ``above`` (||x|| >= eps),
    s inv g below (there the norm is the constant eps); the caller sums g . u into the scale's gradient. In the
    promoted dtype of its inputs (autograd casts dL/dx to x's)."""
    u = x * inv
    dot = (g * u).sum(-1, keepdim=True)
    return torch.addcmul(g, u, dot * above, value=-1).mul_(_factor(inv, scale)), dot


def layer_norm_reference(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(LayerNorm of x over its last dimension with ``weight`` and ``bias``, mean, 1 / std) per row."""
    xf = x.to(work_dtype(x.dtype))
    var, mean = torch.var_mean(xf, dim=-1, keepdim=True, correction=0)
    rstd = (var + eps).rsqrt()
    return ((xf - mean) * rstd * weight.to(xf.dtype) + bias.to(xf.dtype)).to(x.dtype), mean, rstd


def layer_norm_backward_reference(g: Tensor, x: Tensor, weight: Tensor, mean: Tensor,
                                  rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dL/dx, dL/dweight, dL/dbias) of :func:`layer_norm_reference`, the last two in the work precision."""
    work = mean.dtype
    xhat = (x.to(work) - mean) * rstd
    gf = g.to(work)
    gw = gf * weight.to(work)
    gx = (gw - xhat * (gw * xhat).mean(-1, keepdim=True) - gw.mean(-1, keepdim=True)) * rstd
    rows = tuple(range(x.dim() - 1))
    return gx.to(x.dtype), (gf * xhat).sum(dim=rows), gf.sum(dim=rows)


def elliptical_m_reference(v: Tensor, v_prev: Tensor, eps: float) -> Tensor:
    """Elliptical attention's m (B, H, 1, d): the mean over tokens of |v - v_prev|, divided by its largest entry
    (floored at eps), in v's dtype; no gradient."""
    work = work_dtype(v.dtype)
    m = (v.detach().to(work) - v_prev.detach().to(work)).abs().mean(dim=-2, keepdim=True)
    return (m / m.amax(dim=-1, keepdim=True).clamp_min(eps)).to(v.dtype)
