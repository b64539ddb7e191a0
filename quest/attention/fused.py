"""The formulations' q/k transforms, each one ``torch.autograd.Function`` whose forward and backward call either its
Triton kernel (quest.attention.fused_launch) or its PyTorch reference (quest.attention.fused_reference), chosen by
one predicate, :func:`fused_applies`:

- :func:`l2_normalize_fused`: x * s / max(||x||, eps), s none, one scalar (QKNorm) or one per head (QKNorm-HS);
  quest.attention.base.l2_normalize runs it on both paths;
- :func:`layer_norm_fused`: LayerNorm over the head dimension with gains and biases (QKNorm-DS, timm's qk_norm);
- :func:`elliptical_m_fused`: elliptical attention's m from this and the previous block's values (no gradient).

Why: on a GPU each PyTorch operator of a transform is a kernel reading and writing a (B, H, N, d) tensor, and under
CUDA's autocast the norms and LayerNorm run in float32, adding casts and float32 copies that SDPA then casts back
(docs/benchmarks.md: QKNorm-DS cost 1.44x standard attention's step on an H200, 1.28x its memory). A kernel reads its
input once in its own dtype, computes in float32 and writes in the input's dtype, forward and backward, and keeps only
its input (a view of the qkv projection, kept anyway) and one or two floats per row for the backward.

Where they run (:func:`fused_applies`): eager code on CUDA tensors of float32, bfloat16 or float16 with a head width
up to 256, where ``attention.fused`` allows and the kernel passed its self-check on that device, dtype and head width
(quest.attention.fused_check). Everywhere else the PyTorch path runs: on the CPU, under torch.compile (inductor fuses
those operators itself), torch.export / ONNX, torch.fx and torch.func transforms (they trace the references, which
are plain operators), and TorchScript (base.py's scripted branch). No ``torch.library.custom_op`` is registered:
nothing traces the kernel path, and a Python call is cheaper than the dispatcher's round trip
(docs/benchmarks.md, "Host cost of a fused operator"). :func:`fused_path` forces the kernel path on CPU tensors
(tests; the GPU proxy of bench/dispatch_proxy.py), where the kernels run in Triton's interpreter under
``TRITON_INTERPRET=1`` and otherwise their reference stands in.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Union

import torch
from torch import Tensor

from . import fused_launch as launch
from .fused_check import MODES, SETTINGS, KernelCheck, check_kernels, configure, kernels_allowed, record
from .fused_reference import (
    elliptical_m_reference,
    l2_normalize_backward_reference,
    l2_normalize_reference,
    layer_norm_reference,
)

__all__ = ["fused_path", "fused_applies", "l2_normalize_fused", "layer_norm_fused", "layer_norm_applies",
           "elliptical_m_fused", "L2Normalize", "l2_normalize_apply", "check_kernels", "KernelCheck", "configure", "record",
           "l2_normalize_reference", "layer_norm_reference", "elliptical_m_reference", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256  # one row per kernel program: a head dimension beyond this takes the PyTorch path
# the kernels index rows in 32 bits (their addresses are 64-bit): beyond 2^31 rows of one tensor (q alone at 64 GiB
# and more) the PyTorch path runs
MAX_ROWS = 2 ** 31
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # float64 keeps the PyTorch path: exact references


@contextmanager
def fused_path(enabled: Union[bool, str] = True) -> Iterator[None]:
    """``True``: the kernel path on every device, unchecked (tests, the GPU proxy); ``False``: nowhere; ``"auto"``
    or ``"on"``: that setting, with CPU tensors checked and taking the kernels as CUDA tensors do (the tests'
    stand-in for a GPU), from fresh verdicts. Restores the state it found."""
    saved = (SETTINGS.mode, SETTINGS.forced, SETTINGS.cpu, SETTINGS.verdicts, SETTINGS.checks, SETTINGS.failed)
    if isinstance(enabled, bool):
        SETTINGS.forced = enabled
    elif enabled in MODES:
        SETTINGS.mode, SETTINGS.forced, SETTINGS.cpu = enabled, None, True
        SETTINGS.reset()
    else:
        raise ValueError(f"fused_path({enabled!r}): expected True, False or one of {', '.join(MODES)}")
    try:
        yield
    finally:
        (SETTINGS.mode, SETTINGS.forced, SETTINGS.cpu, SETTINGS.verdicts, SETTINGS.checks, SETTINGS.failed) = saved


@torch.jit.unused
def fused_applies(x: Tensor, kernel: str = "l2_normalize") -> bool:
    """Whether ``kernel``'s transform of ``x`` (B, H, N, d) takes the Triton kernel here (module docstring)."""
    if isinstance(x, torch.fx.Proxy) or torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return False
    # vmap / grad hand the transform batched wrappers, which have no memory of their own to launch on (the toy study
    # trains its models as one vmapped computation); functorch names no public test for them
    if torch._C._are_functorch_transforms_active():
        return False
    return (x.dim() == 4 and 0 < x.shape[-1] <= MAX_HEAD_DIM and x.dtype in _KERNEL_DTYPES
            and x.numel() < MAX_ROWS * x.shape[-1] and kernels_allowed(x, kernel))


# --- l2 normalisation -------------------------------------------------------------------------------------------
class L2Normalize(torch.autograd.Function):
    """(x * scale / max(||x||, eps), 1 / max(||x||, eps)) over the last dimension, by the kernel (``kernel=True``) or
    the reference, forward and backward. The backward is three passes where autograd's derivative of
    ``F.normalize`` and a multiply takes about ten: most of the difference between QUEST/QNorm/QKNorm and standard
    attention in a CPU ViT step (docs/benchmarks.md)."""

    # forward / setup_context split with a generated vmap rule: torch.func.vmap batches the reference (the toy study)
    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, eps: float, scale: Optional[Tensor], kernel: bool):  # type: ignore[override]
        if kernel:
            return launch.l2_normalize_forward(x, eps, scale)
        return l2_normalize_reference(x, eps, scale)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[override]  # noqa: ANN001
        x, eps, scale, kernel = inputs
        _, inv, above = output
        ctx.mark_non_differentiable(*(t for t in (inv, above) if t is not None))
        ctx.set_materialize_grads(False)  # no zeros made for the factor's (absent) gradient: one kernel less
        ctx.save_for_backward(x, inv, scale, above)
        ctx.eps, ctx.kernel = eps, kernel

    @staticmethod
    def backward(ctx, g: Optional[Tensor], *_: Optional[Tensor]):  # type: ignore[override]  # noqa: ANN001
        if g is None:
            return None, None, None, None
        x, inv, scale, above = ctx.saved_tensors
        if ctx.kernel:
            gx, dot = launch.l2_normalize_backward(g, x, inv, scale, ctx.eps)
        else:
            gx, dot = l2_normalize_backward_reference(g, x, inv, scale, above)
        gscale = None
        if scale is not None and ctx.needs_input_grad[2]:
            gscale = dot.sum_to_size(scale.shape).to(scale.dtype)
        return gx, None, gscale, None


def _ctx_form(cls: type) -> type:
    """``cls`` (a Function with ``setup_context``) as a Function with the same forward, setup and backward in the
    ``forward(ctx, ...)`` form: torch binds a setup_context Function's arguments to its signature with ``inspect`` at
    every call (about half the host time of a tiny call, docs/benchmarks.md), which this form skips. functorch
    transforms need ``cls`` itself (:func:`l2_normalize_apply`)."""
    def forward(ctx, *args):  # noqa: ANN001, ANN002, ANN202
        out = cls.forward(*args)
        cls.setup_context(ctx, args, out)
        return out
    return type(f"{cls.__name__}CtxForm", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(cls.backward), "__doc__": cls.__doc__})


_L2NormalizeCtxForm = _ctx_form(L2Normalize)


@torch.jit.unused
def l2_normalize_apply(x: Tensor, eps: float, scale: Optional[Tensor], kernel: bool) -> tuple:
    """:class:`L2Normalize` of ``x`` by the kernel (``kernel``: :func:`fused_applies` said so) or the reference:
    (y, 1 / max(||x||, eps), ||x|| >= eps or None)."""
    # vmap / grad: the generated vmap rule needs setup_context; torch.compile traces the Function as written, and
    # decides this test at trace time, without calling into functorch
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return L2Normalize.apply(x, eps, scale, kernel)
    return _L2NormalizeCtxForm.apply(x, eps, scale, kernel)


@torch.jit.unused
def l2_normalize_fused(x: Tensor, eps: float, scale: Optional[Tensor] = None) -> Tensor:
    """x * scale / max(||x||, eps) over the last dimension of a (B, H, N, d) tensor in one kernel each way;
    ``scale`` one value or one per head ((H, 1, 1) or any shape of that many elements), in x's dtype."""
    if scale is not None and scale.numel() == x.shape[1] and scale.dim() < 3:
        scale = scale.reshape(-1, 1, 1)  # the reference broadcasts: one per head lines up with dimension 1
    return l2_normalize_apply(x, eps, scale, True)[0]


# --- LayerNorm ---------------------------------------------------------------------------------------------------
class _LayerNorm(torch.autograd.Function):
    """LayerNorm over the last dimension by its kernel, forward and backward (where :func:`layer_norm_applies`: never
    under functorch, so the ``forward(ctx, ...)`` form, which torch calls without binding a signature)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, eps: float):  # type: ignore[override]  # noqa: ANN001
        out = launch.layer_norm_forward(x, weight, bias, eps)
        ctx.mark_non_differentiable(out[1], out[2])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight, out[1], out[2])
        return out

    @staticmethod
    def backward(ctx, g: Optional[Tensor], *_: Optional[Tensor]):  # type: ignore[override]  # noqa: ANN001
        if g is None:
            return None, None, None, None
        x, weight, mean, rstd = ctx.saved_tensors
        gx, gw, gb = launch.layer_norm_backward(g, x, weight, mean, rstd)
        return gx, gw.to(weight.dtype), gb.to(weight.dtype), None


@torch.jit.unused
def layer_norm_fused(x: Tensor, norm: torch.nn.LayerNorm) -> Tensor:
    """``norm`` (a LayerNorm over the last dimension, with gains and biases) of a (B, H, N, d) tensor in one kernel
    each way, computed in float32 and written in x's dtype."""
    return _LayerNorm.apply(x, norm.weight, norm.bias, float(norm.eps))[0]


@torch.jit.unused
def layer_norm_applies(x: Tensor, norm: torch.nn.Module) -> bool:
    """Whether ``norm`` of ``x`` takes :func:`layer_norm_fused`: an affine LayerNorm over d (timm's LayerNorm
    subclass computes the same), where the kernel applies."""
    # the module checks first: they are plain attributes; fused_applies refuses an fx Proxy before its shape is read
    return (isinstance(norm, torch.nn.LayerNorm) and norm.weight is not None and norm.bias is not None
            and fused_applies(x, "layer_norm") and tuple(norm.normalized_shape) == (x.shape[-1],))


# --- elliptical attention's m -------------------------------------------------------------------------------------
@torch.jit.unused
def elliptical_m_fused(v: Tensor, v_prev: Tensor, eps: float) -> Tensor:
    """Elliptical attention's m (mean estimator) in one kernel reading each value tensor once; no gradient."""
    return launch.elliptical_m(v.detach(), v_prev.detach(), eps)
