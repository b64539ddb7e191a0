"""The launches of the fused transforms' Triton kernels (quest.attention.triton_kernels), one function per kernel,
each returning what its PyTorch reference (quest.attention.fused_reference) returns.

Every launch runs under a device guard for its input's device: Triton launches on the *current* CUDA device, so a
tensor on ``cuda:1`` while the current device is ``cuda:0`` would otherwise reach the kernel as a pointer it cannot
read ("Pointer argument cannot be accessed from Triton"). Where Triton cannot run on a tensor (a CPU tensor outside
Triton's interpreter: the GPU proxy of bench/dispatch_proxy.py), :data:`STAND_IN` computes the reference instead, so
that a caller that forces the fused path on the CPU still gets the values.
"""
from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import Tensor

from . import fused_reference as ref

__all__ = ["l2_normalize_forward", "l2_normalize_backward", "layer_norm_forward", "layer_norm_backward",
           "elliptical_m", "device_guard", "triton_runs", "column_alignment", "STAND_IN"]

_ROWS = 16  # rows per program (a (16, d) tile: d = 64 fills four warps)


def _reference(name: str, reference: Callable[..., Any], args: tuple) -> Any:
    return reference(*args)


#: ``STAND_IN(kernel name, reference, args)``: what a launch computes where Triton cannot run; the GPU proxy replaces
#: it to count one kernel per fused operator
STAND_IN: Callable[[str, Callable[..., Any], tuple], Any] = _reference


def triton_runs(x: Tensor) -> bool:
    """Whether Triton can run a kernel on ``x``: a CUDA tensor, or any under Triton's interpreter."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def device_guard(device: torch.device) -> ContextManager[Any]:
    """``device`` made the current CUDA device for a launch (nothing to do off CUDA)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _kernels() -> Any:
    # imported at the first launch only: Triton's import costs a second, and a build without it fails here, inside
    # the self-check (quest.attention.fused_check), not when quest is imported
    from . import triton_kernels
    return triton_kernels


def _rows_like(x: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """A new (B, H, N, d) tensor laid out as (B, N, H, d), the qkv projection's layout, so SDPA's output keeps it
    and the heads merge without a copy (as the PyTorch path's outputs do)."""
    b, h, n, d = x.shape
    return x.new_empty((b, n, h, d), dtype=dtype or x.dtype).transpose(1, 2)


def _grid(rows: int) -> tuple[int]:
    return (-(-rows // _ROWS),)


def _block(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


_MAX_ALIGN = 16  # elements: 16 bytes (one vector access) hold at most 8 half-precision or 4 float32 values


def column_alignment(*sizes: int) -> int:
    """The largest power of two (at most 16) dividing every one of ``sizes`` (d and the row strides, in elements):
    the kernels' ``D_ALIGN``, so every row starts on that many elements and d ends on it."""
    align = _MAX_ALIGN
    for size in sizes:
        while size % align:
            align //= 2
    return align


def _align(d: int, *tensors: Tensor) -> int:
    """The kernels' ``D_ALIGN`` for these tensors' rows: a compile-time fact that gives widths such as 40 and 88
    vector loads (quest.attention.triton_kernels), where Triton's own specialisation sees multiples of 16 only."""
    return column_alignment(d, *(stride for t in tensors for stride in t.stride()[:3]))


def _unit_stride(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _scale_kind(scale: Optional[Tensor], heads: int) -> int:
    if scale is None:
        return 0
    if scale.numel() == 1:
        return 1
    if scale.numel() == heads:
        return 2
    raise ValueError(f"a fused l2 normalisation takes one scale or one per head ({heads}), not {tuple(scale.shape)}")


def l2_normalize_forward(x: Tensor, eps: float, scale: Optional[Tensor]) -> tuple[Tensor, Tensor, None]:
    """(y, inv, None) as :func:`~quest.attention.fused_reference.l2_normalize_reference` (the kernel's backward
    recomputes ``||x|| >= eps`` itself); inv float32 (B, H, N, 1)."""
    if not triton_runs(x):
        return STAND_IN("l2_normalize", _l2_forward_reference, (x, eps, scale))
    b, h, n, d = x.shape
    x, out = _unit_stride(x), _rows_like(x)
    inv = torch.empty((b, h, n, 1), device=x.device, dtype=torch.float32)
    kind = _scale_kind(scale, h)
    with device_guard(x.device):
        _kernels().l2_normalize_fwd[_grid(b * h * n)](
            x, out, inv, scale if scale is not None else inv, b * h * n, h, n, d, *x.stride()[:3],
            *out.stride()[:3], eps, SCALE_KIND=kind, ROWS=_ROWS, BLOCK_D=_block(d),
            D_ALIGN=_align(d, x, out))
    return out, inv, None


def _laid_out(reference: Callable[..., tuple], x_at: int = 0) -> Callable[..., tuple]:
    """``reference`` with its first result written in the kernels' layout (:func:`_rows_like` of argument
    ``x_at``), as the kernel writes it."""
    def stand_in(*args: Any) -> tuple:
        first, *rest = reference(*args)
        return (_rows_like(args[x_at]).copy_(first), *rest)
    return stand_in


def _work(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.to(ref.work_dtype(t.dtype))


def _l2_forward_reference(x: Tensor, eps: float, scale: Optional[Tensor]) -> tuple[Tensor, Tensor, None]:
    # the kernel's arithmetic: the formula in float32, written in x's dtype
    y, inv, _ = ref.l2_normalize_reference(_work(x), eps, _work(scale))
    return _rows_like(x).copy_(y), inv, None


def _l2_backward_reference(g: Tensor, x: Tensor, inv: Tensor, scale: Optional[Tensor],
                           eps: float) -> tuple[Tensor, Tensor]:
    xf = _work(x)
    above = torch.linalg.vector_norm(xf, dim=-1, keepdim=True) >= eps  # as the kernel: recomputed
    gx, dot = ref.l2_normalize_backward_reference(_work(g), xf, inv, _work(scale), above)
    return _rows_like(x).copy_(gx), dot


def l2_normalize_backward(g: Tensor, x: Tensor, inv: Tensor, scale: Optional[Tensor],
                          eps: float) -> tuple[Tensor, Tensor]:
    """(dL/dx, g . u per row) as :func:`~quest.attention.fused_reference.l2_normalize_backward_reference`."""
    if not triton_runs(x):
        return STAND_IN("l2_normalize_backward", _l2_backward_reference, (g, x, inv, scale, eps))
    b, h, n, d = x.shape
    g, x, out = _unit_stride(g), _unit_stride(x), _rows_like(x)
    dot = torch.empty_like(inv)
    with device_guard(x.device):
        _kernels().l2_normalize_bwd[_grid(b * h * n)](
            g, x, inv, scale if scale is not None else inv, out, dot, b * h * n, h, n, d, *g.stride()[:3],
            *x.stride()[:3], *out.stride()[:3], eps, SCALE_KIND=_scale_kind(scale, h), ROWS=_ROWS,
            BLOCK_D=_block(d), D_ALIGN=_align(d, g, x, out))
    return out, dot


def layer_norm_forward(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd) as :func:`~quest.attention.fused_reference.layer_norm_reference`; mean, rstd float32."""
    if not triton_runs(x):
        return STAND_IN("layer_norm", _laid_out(ref.layer_norm_reference), (x, weight, bias, eps))
    b, h, n, d = x.shape
    x, out = _unit_stride(x), _rows_like(x)
    mean = torch.empty((b, h, n, 1), device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    with device_guard(x.device):
        _kernels().layer_norm_fwd[_grid(b * h * n)](
            x, weight, bias, out, mean, rstd, b * h * n, h, n, d, *x.stride()[:3], *out.stride()[:3], eps,
            ROWS=_ROWS, BLOCK_D=_block(d), D_ALIGN=_align(d, x, out))
    return out, mean, rstd


def layer_norm_backward(g: Tensor, x: Tensor, weight: Tensor, mean: Tensor,
                        rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dL/dx, dL/dweight, dL/dbias) as :func:`~quest.attention.fused_reference.layer_norm_backward_reference`."""
    if not triton_runs(x):
        return STAND_IN("layer_norm_backward", _laid_out(ref.layer_norm_backward_reference, 1),
                        (g, x, weight, mean, rstd))
    b, h, n, d = x.shape
    g, x, out = _unit_stride(g), _unit_stride(x), _rows_like(x)
    blocks = _grid(b * h * n)[0]
    gw = torch.empty((blocks, d), device=x.device, dtype=torch.float32)
    gb = torch.empty_like(gw)
    with device_guard(x.device):
        _kernels().layer_norm_bwd[(blocks,)](
            g, x, weight, mean, rstd, out, gw, gb, b * h * n, h, n, d, *g.stride()[:3], *x.stride()[:3],
            *out.stride()[:3], ROWS=_ROWS, BLOCK_D=_block(d), D_ALIGN=_align(d, g, x, out))
    return out, gw.sum(0), gb.sum(0)


def elliptical_m(v: Tensor, v_prev: Tensor, eps: float) -> Tensor:
    """Elliptical attention's m as :func:`~quest.attention.fused_reference.elliptical_m_reference`."""
    if not triton_runs(v):
        return STAND_IN("elliptical_m", ref.elliptical_m_reference, (v, v_prev, eps))
    b, h, n, d = v.shape
    v, v_prev = _unit_stride(v), _unit_stride(v_prev)
    m = v.new_empty((b, h, 1, d))
    with device_guard(v.device):
        _kernels().elliptical_m[(b * h,)](
            v, v_prev, m, h, n, d, v.stride(0), v.stride(1), v.stride(2), v_prev.stride(0), v_prev.stride(1),
            v_prev.stride(2), eps, BLOCK_N=32, BLOCK_D=_block(d), D_ALIGN=_align(d, v, v_prev))
    return m
