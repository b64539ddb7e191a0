"""The formulations' q/k transforms as fused operators on the GPU: one Triton kernel per transform and direction
(quest.attention.triton_kernels), each beside the PyTorch reference it must equal.

- ``quest::l2_normalize``: x * s / max(||x||, eps), s none, one scalar (QKNorm) or one per head (QKNorm-HS);
- ``quest::layer_norm``: LayerNorm over the head dimension with gains and biases (QKNorm-DS, timm's qk_norm);
- ``quest::elliptical_m``: elliptical attention's m from this and the previous block's values (no gradient).

Why: on a GPU each PyTorch operator of a transform is a kernel reading and writing a (B, H, N, d) tensor, and under
CUDA's autocast the norms and LayerNorm run in float32, adding casts and float32 copies that SDPA then casts back
(docs/benchmarks.md: QKNorm-DS cost 1.44x standard attention's step on an H200, 1.28x its memory). A fused operator
reads its input once in its own dtype, computes in float32 and writes in the input's dtype, forward and backward, and
keeps only its input (a view of the qkv projection, kept anyway) and one or two floats per row for the backward.

Where they run: eager code on CUDA tensors (Triton ships with torch's CUDA wheels). Everywhere else the
formulations keep their PyTorch path: on the CPU, under torch.compile (inductor fuses those operators itself),
torch.export / ONNX, TorchScript, torch.fx and torch.func transforms. :func:`fused_path` forces them on the CPU:
their operators then run the reference (or, under ``TRITON_INTERPRET=1``, the Triton kernel in Triton's
interpreter), which is how the tests check the kernels and how quest.attention.proxy counts the GPU path.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import Tensor

__all__ = ["fused_path", "fused_applies", "l2_normalize_fused", "layer_norm_fused", "elliptical_m_fused",
           "kernels_run"]

MAX_HEAD_DIM = 256  # one row per kernel program: a head dimension beyond this takes the PyTorch path
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # float64 keeps the PyTorch path: exact references
_ROWS = 16  # rows per program (a (16, d) tile: d = 64 fills four warps)
_forced: Optional[bool] = None  # None: CUDA tensors only (fused_path sets it)


@contextmanager
def fused_path(enabled: bool = True) -> Iterator[None]:
    """Run the fused operators on CPU tensors too (tests, the GPU proxy), or (``enabled=False``) nowhere."""
    global _forced
    before, _forced = _forced, enabled
    try:
        yield
    finally:
        _forced = before


def kernels_run(x: Tensor) -> bool:
    """Whether a fused operator on ``x`` runs its Triton kernel (CUDA, or Triton's interpreter) or the reference."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


@torch.jit.unused
def fused_applies(x: Tensor) -> bool:
    """Whether a formulation's transform of ``x`` (B, H, N, d) takes the fused operators here (module docstring)."""
    if isinstance(x, torch.fx.Proxy) or torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return False
    if torch._C._functorch.is_functorch_wrapped_tensor(x):  # vmap / grad: the toy study's batched models
        return False
    if x.dim() != 4 or x.shape[-1] > MAX_HEAD_DIM or x.shape[-1] == 0 or x.dtype not in _KERNEL_DTYPES:
        return False
    if _forced is not None:
        return _forced
    return x.is_cuda and not _disabled() and _triton_available()


@functools.cache
def _triton_available() -> bool:
    # torch's CUDA wheels bring Triton; a build without it (or a ROCm / other GPU torch without the kernels'
    # support) keeps the PyTorch path
    return importlib.util.find_spec("triton") is not None and torch.version.cuda is not None


def _kernel_for(x: Tensor) -> bool:
    # float64 (an exact reference's dtype) takes the PyTorch reference even where the kernels run
    return kernels_run(x) and x.dtype in _KERNEL_DTYPES


def _disabled() -> bool:
    # QUEST_FUSED=0 turns the kernels off (a comparison, or a Triton that fails on an unusual GPU)
    return os.environ.get("QUEST_FUSED", "1") == "0"


def _rows_like(x: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """A new (B, H, N, d) tensor laid out as (B, N, H, d), the qkv projection's layout, so SDPA's output keeps it
    and the heads merge without a copy (as the PyTorch path's outputs do)."""
    b, h, n, d = x.shape
    return x.new_empty((b, n, h, d), dtype=dtype or x.dtype).transpose(1, 2)


def _grid(rows: int) -> tuple[int]:
    return (-(-rows // _ROWS),)


def _block(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


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


# --- l2 normalisation -------------------------------------------------------------------------------------------
def _work(t: Tensor) -> Tensor:
    """``t`` in the precision the kernels compute in: float32, or float64 where the input is."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _l2_normalize_reference(x: Tensor, eps: float, scale: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    xf = _work(x)
    inv = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).clamp_min(eps).reciprocal()
    factor = inv if scale is None else inv * _work(scale).reshape(-1, 1, 1)
    return (xf * factor).to(x.dtype), inv


@torch.library.custom_op("quest::l2_normalize", mutates_args=())
def _l2_normalize_op(x: Tensor, eps: float, scale: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    out = _rows_like(x)
    if not _kernel_for(x):
        y, inv = _l2_normalize_reference(x, eps, scale)
        return out.copy_(y), inv
    from . import triton_kernels as tk

    b, h, n, d = x.shape
    x = _unit_stride(x)
    inv = torch.empty((b, h, n, 1), device=x.device, dtype=torch.float32)
    kind = _scale_kind(scale, h)
    tk.l2_normalize_fwd[_grid(b * h * n)](x, out, inv, scale if scale is not None else inv, b * h * n, h, n, d,
                                          *x.stride()[:3], *out.stride()[:3], eps, SCALE_KIND=kind, ROWS=_ROWS,
                                          BLOCK_D=_block(d))
    return out, inv


@_l2_normalize_op.register_fake
def _(x: Tensor, eps: float, scale: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return _rows_like(x), x.new_empty((*x.shape[:3], 1), dtype=torch.float32)


def _l2_normalize_backward_reference(g: Tensor, x: Tensor, inv: Tensor, scale: Optional[Tensor],
                                     eps: float) -> tuple[Tensor, Tensor]:
    xf, gf = _work(x), _work(g)
    u = xf * inv
    dot = (gf * u).sum(-1, keepdim=True)
    above = torch.linalg.vector_norm(xf, dim=-1, keepdim=True) >= eps
    factor = inv if scale is None else inv * _work(scale).reshape(-1, 1, 1)
    return ((gf - u * (dot * above)) * factor).to(x.dtype), dot


@torch.library.custom_op("quest::l2_normalize_backward", mutates_args=())
def _l2_normalize_backward_op(g: Tensor, x: Tensor, inv: Tensor, scale: Optional[Tensor],
                              eps: float) -> tuple[Tensor, Tensor]:
    out = _rows_like(x)
    if not _kernel_for(x):
        gx, dot = _l2_normalize_backward_reference(g, x, inv, scale, eps)
        return out.copy_(gx), dot
    from . import triton_kernels as tk

    b, h, n, d = x.shape
    g, x = _unit_stride(g), _unit_stride(x)
    dot = torch.empty_like(inv)
    tk.l2_normalize_bwd[_grid(b * h * n)](g, x, inv, scale if scale is not None else inv, out, dot, b * h * n, h, n,
                                          d, *g.stride()[:3], *x.stride()[:3], *out.stride()[:3], eps,
                                          SCALE_KIND=_scale_kind(scale, h), ROWS=_ROWS, BLOCK_D=_block(d))
    return out, dot


@_l2_normalize_backward_op.register_fake
def _(g: Tensor, x: Tensor, inv: Tensor, scale: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    return _rows_like(x), torch.empty_like(inv)


def _l2_normalize_setup(ctx, inputs, output) -> None:  # noqa: ANN001 (torch.library's signature)
    x, eps, scale = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # no zeros made for the factor's (absent) gradient: one kernel less
    ctx.save_for_backward(x, output[1], scale)
    ctx.eps = eps


def _l2_normalize_grad(ctx, g: Optional[Tensor], _g_inv: None) -> tuple[Optional[Tensor], None, Optional[Tensor]]:  # noqa: ANN001
    if g is None:
        return None, None, None
    x, inv, scale = ctx.saved_tensors
    gx, dot = _l2_normalize_backward_op(g, x, inv, scale, ctx.eps)
    gscale = None
    if scale is not None and ctx.needs_input_grad[2]:
        b, h, n, _ = x.shape
        per_head = dot.view(b, h, n).sum(dim=(0, 2))
        gscale = (per_head.sum() if scale.numel() == 1 else per_head).reshape(scale.shape).to(scale.dtype)
    return gx, None, gscale


_l2_normalize_op.register_autograd(_l2_normalize_grad, setup_context=_l2_normalize_setup)


@torch.jit.unused
def l2_normalize_fused(x: Tensor, eps: float, scale: Optional[Tensor] = None) -> Tensor:
    """x * scale / max(||x||, eps) over the last dimension of a (B, H, N, d) tensor in one kernel each way;
    ``scale`` one value or one per head (any shape of that many elements), in x's dtype."""
    return _l2_normalize_op(x, eps, scale)[0]


# --- LayerNorm ---------------------------------------------------------------------------------------------------
def _layer_norm_reference(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    xf = _work(x)
    var, mean = torch.var_mean(xf, dim=-1, keepdim=True, correction=0)
    rstd = (var + eps).rsqrt()
    return ((xf - mean) * rstd * _work(weight) + _work(bias)).to(x.dtype), mean, rstd


@torch.library.custom_op("quest::layer_norm", mutates_args=())
def _layer_norm_op(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    out = _rows_like(x)
    if not _kernel_for(x):
        y, mean, rstd = _layer_norm_reference(x, weight, bias, eps)
        return out.copy_(y), mean, rstd
    from . import triton_kernels as tk

    b, h, n, d = x.shape
    x = _unit_stride(x)
    mean = torch.empty((b, h, n, 1), device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    tk.layer_norm_fwd[_grid(b * h * n)](x, weight, bias, out, mean, rstd, b * h * n, h, n, d, *x.stride()[:3],
                                        *out.stride()[:3], eps, ROWS=_ROWS, BLOCK_D=_block(d))
    return out, mean, rstd


@_layer_norm_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    stats = x.new_empty((*x.shape[:3], 1), dtype=torch.float32)
    return _rows_like(x), stats, torch.empty_like(stats)


def _layer_norm_backward_reference(g: Tensor, x: Tensor, weight: Tensor, mean: Tensor,
                                   rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    xhat = (_work(x) - mean) * rstd
    gf = _work(g)
    gw = gf * _work(weight)
    gx = (gw - xhat * (gw * xhat).mean(-1, keepdim=True) - gw.mean(-1, keepdim=True)) * rstd
    return gx.to(x.dtype), (gf * xhat).sum(dim=(0, 1, 2)), gf.sum(dim=(0, 1, 2))


@torch.library.custom_op("quest::layer_norm_backward", mutates_args=())
def _layer_norm_backward_op(g: Tensor, x: Tensor, weight: Tensor, mean: Tensor,
                            rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    out = _rows_like(x)
    if not _kernel_for(x):
        gx, gw, gb = _layer_norm_backward_reference(g, x, weight, mean, rstd)
        return out.copy_(gx), gw, gb
    from . import triton_kernels as tk

    b, h, n, d = x.shape
    g, x = _unit_stride(g), _unit_stride(x)
    blocks = _grid(b * h * n)[0]
    gw = torch.empty((blocks, d), device=x.device, dtype=torch.float32)
    gb = torch.empty_like(gw)
    tk.layer_norm_bwd[(blocks,)](g, x, weight, mean, rstd, out, gw, gb, b * h * n, h, n, d, *g.stride()[:3],
                                 *x.stride()[:3], *out.stride()[:3], ROWS=_ROWS, BLOCK_D=_block(d))
    return out, gw.sum(0), gb.sum(0)


@_layer_norm_backward_op.register_fake
def _(g: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    d = x.shape[-1]
    return _rows_like(x), x.new_empty((d,), dtype=torch.float32), x.new_empty((d,), dtype=torch.float32)


def _layer_norm_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    x, weight, _, _ = inputs
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, weight, output[1], output[2])


def _layer_norm_grad(ctx, g: Optional[Tensor], _gm: None, _gr: None):  # noqa: ANN001, ANN202
    if g is None:
        return None, None, None, None
    x, weight, mean, rstd = ctx.saved_tensors
    gx, gw, gb = _layer_norm_backward_op(g, x, weight, mean, rstd)
    return gx, gw.to(weight.dtype), gb.to(weight.dtype), None


_layer_norm_op.register_autograd(_layer_norm_grad, setup_context=_layer_norm_setup)


@torch.jit.unused
def layer_norm_fused(x: Tensor, norm: torch.nn.LayerNorm) -> Tensor:
    """``norm`` (a LayerNorm over the last dimension, with gains and biases) of a (B, H, N, d) tensor in one kernel
    each way, computed in float32 and written in x's dtype."""
    return _layer_norm_op(x, norm.weight, norm.bias, float(norm.eps))[0]


@torch.jit.unused
def layer_norm_applies(x: Tensor, norm: torch.nn.Module) -> bool:
    """Whether ``norm`` of ``x`` takes :func:`layer_norm_fused`: an affine LayerNorm over d (timm's LayerNorm
    subclass computes the same), where fused operators apply."""
    # fused_applies first: it refuses an fx Proxy, whose shape must not reach the comparison
    return (fused_applies(x) and isinstance(norm, torch.nn.LayerNorm) and norm.weight is not None
            and norm.bias is not None and tuple(norm.normalized_shape) == (x.shape[-1],))


# --- elliptical attention's m -------------------------------------------------------------------------------------
@torch.library.custom_op("quest::elliptical_m", mutates_args=())
def _elliptical_m_op(v: Tensor, v_prev: Tensor, eps: float) -> Tensor:
    b, h, n, d = v.shape
    if not _kernel_for(v):
        work = torch.promote_types(v.dtype, torch.float32)
        m = (v.to(work) - v_prev.to(work)).abs().mean(dim=-2, keepdim=True)
        return (m / m.amax(dim=-1, keepdim=True).clamp_min(eps)).to(v.dtype)
    from . import triton_kernels as tk

    v, v_prev = _unit_stride(v), _unit_stride(v_prev)
    m = v.new_empty((b, h, 1, d))
    tk.elliptical_m[(b * h,)](v, v_prev, m, h, n, d, v.stride(0), v.stride(1), v.stride(2), v_prev.stride(0),
                              v_prev.stride(1), v_prev.stride(2), eps, BLOCK_N=32, BLOCK_D=_block(d))
    return m


@_elliptical_m_op.register_fake
def _(v: Tensor, v_prev: Tensor, eps: float) -> Tensor:
    return v.new_empty((v.shape[0], v.shape[1], 1, v.shape[3]))


@torch.jit.unused
def elliptical_m_fused(v: Tensor, v_prev: Tensor, eps: float) -> Tensor:
    """Elliptical attention's m (mean estimator) in one kernel reading each value tensor once; no gradient."""
    return _elliptical_m_op(v.detach(), v_prev.detach(), eps)
