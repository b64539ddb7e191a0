"""quest's fused q/k kernels on the device against float64 (bench/gpu.py's ``kernels`` part, before any timing).

Each public fused operator of quest.attention.fused (l2 normalisation with no, one or a per-head scale; LayerNorm
over the head dimension; elliptical attention's m) runs on (1, H, 197, d) inputs, batch 1 and ViT's 197 tokens,
over head widths :data:`WIDTHS` and two layouts: a contiguous tensor and q as a view of a qkv projection
(B, N, 3, H, d), the layout the formulations hand the kernels. The reference is the operator's formula in float64 on
the same device from the same (low-precision) values, with float64 autograd for the gradients (input, scale, gain
and bias) of a random upstream gradient. A difference is max |a - b| / max |b| per tensor; one row per (kernel,
dtype) holds the worst over widths and layouts, pass when it is within :data:`TOLERANCE` for the dtype.

Where ``quest.attention.fused.check_kernels`` exists (the kernels' own self-check), its verdict per dtype is one
more row; the rows above stand without it."""
from __future__ import annotations

import os
import traceback
from contextlib import nullcontext
from typing import Any, Callable

import torch

__all__ = ["WIDTHS", "SMOKE_WIDTHS", "TOLERANCE", "KERNELS", "kernel_rows", "check_kernels_rows"]

WIDTHS = (16, 32, 40, 64, 80, 88, 128, 256)
#: the CPU smoke's widths: a power of two and one that is not (a masked tail in the kernel's block)
SMOKE_WIDTHS = (16, 40)
HEADS, TOKENS, EPS = 3, 197, 1e-6
#: the smoke's tokens: Triton's interpreter (TRITON_INTERPRET=1, as the test suite sets) runs each program in Python
SMOKE_TOKENS = 17
#: the worst relative difference allowed per output dtype: about four units of its rounding (2^-8 bf16, 2^-11 fp16)
#: for the half types, whose outputs are rounded once from float32; float32 sums over up to 197 x 256 terms
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNELS = ("l2_normalize", "l2_normalize_scalar_scale", "l2_normalize_per_head_scale", "layer_norm", "elliptical_m")


def _input(d: int, tokens: int, layout: str, device: torch.device, dtype: torch.dtype, gen: torch.Generator
           ) -> torch.Tensor:
    if layout == "contiguous":
        x = torch.randn(1, HEADS, tokens, d, generator=gen)
    else:  # q of a qkv projection: (B, N, 3, H, d) permuted to (3, B, H, N, d), as timm's Attention splits it
        x = torch.randn(1, tokens, 3, HEADS, d, generator=gen).permute(2, 0, 3, 1, 4)[0]
    return x.to(device, dtype)


def _rel(test: torch.Tensor, ref: torch.Tensor) -> float:
    test, ref = test.detach(), ref.detach()
    top = float(ref.abs().max())
    return float((test.double() - ref).abs().max()) / (top if top > 0 else 1.0)


def _l2_ref(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    out = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(EPS)
    return out if scale is None else out * scale.reshape(-1, 1, 1)


def _ln_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    var, mean = torch.var_mean(x, dim=-1, keepdim=True, correction=0)
    return (x - mean) / torch.sqrt(var + EPS) * weight + bias


def _m_ref(v: torch.Tensor, v_prev: torch.Tensor) -> torch.Tensor:
    m = (v - v_prev).abs().mean(dim=-2, keepdim=True)
    return m / m.amax(dim=-1, keepdim=True).clamp_min(EPS)


def _differentiable(kernel: str, fused: Any, x: torch.Tensor, gen: torch.Generator
                    ) -> tuple[Callable, Callable, dict[str, torch.Tensor]]:
    """The fused call, its float64 formula and the extra leaves by name (scale, or gain and bias) for ``kernel``."""
    device, dtype, d = x.device, x.dtype, x.shape[-1]
    if kernel == "layer_norm":
        norm = torch.nn.LayerNorm(d, eps=EPS).to(device, dtype)
        with torch.no_grad():  # not the initial 1 and 0: a gain or bias mix-up would pass with those
            norm.weight.copy_(torch.rand(d, generator=gen).add(0.5))
            norm.bias.copy_(torch.randn(d, generator=gen))
        leaves = {"weight": norm.weight, "bias": norm.bias}
        return (lambda t: fused.layer_norm_fused(t, norm)), _ln_ref, leaves
    shape = {"l2_normalize": None, "l2_normalize_scalar_scale": (1,), "l2_normalize_per_head_scale": (HEADS, 1, 1)}
    if shape[kernel] is None:
        return (lambda t: fused.l2_normalize_fused(t, EPS)), (lambda t: _l2_ref(t, None)), {}
    scale = torch.rand(shape[kernel], generator=gen).add(0.5).to(device, dtype).requires_grad_()
    return (lambda t: fused.l2_normalize_fused(t, EPS, scale)), (lambda t, s: _l2_ref(t, s)), {"scale": scale}


def _one(kernel: str, fused: Any, d: int, tokens: int, layout: str, device: torch.device, dtype: torch.dtype
         ) -> dict[str, float]:
    """The relative differences of one (width, layout): the values, and each gradient."""
    gen = torch.Generator().manual_seed(d)
    x = _input(d, tokens, layout, device, dtype, gen)
    if kernel == "elliptical_m":
        v_prev = _input(d, tokens, layout, device, dtype, gen)
        out = fused.elliptical_m_fused(x, v_prev, EPS)
        return {"values": _rel(out, _m_ref(x.double(), v_prev.double()))}
    x.requires_grad_()
    call, formula, leaves = _differentiable(kernel, fused, x, gen)
    out = call(x)
    upstream = torch.randn(out.shape, generator=gen).to(device, dtype)
    out.backward(upstream)
    tested = {"x": x, **leaves}
    refs = {name: t.detach().double().requires_grad_() for name, t in tested.items()}
    ref_out = formula(*refs.values())
    ref_out.backward(upstream.double())
    diffs = {"values": _rel(out, ref_out)}
    for name, t in tested.items():
        diffs[f"grad_{name}"] = _rel(t.grad, refs[name].grad)
    return diffs


def _fused_module() -> tuple[Any, str | None]:
    try:
        from quest.attention import fused
    except Exception as exc:
        return None, f"quest.attention.fused: {type(exc).__name__}: {exc}"
    missing = [n for n in ("l2_normalize_fused", "layer_norm_fused", "elliptical_m_fused") if not hasattr(fused, n)]
    return fused, (f"quest.attention.fused has no {', '.join(missing)}" if missing else None)


def triton_runs() -> Callable[[torch.Tensor], bool] | None:
    """quest's test of whether a fused operator on a tensor runs its Triton kernel (a CUDA tensor, or Triton's
    interpreter) rather than the PyTorch code that stands in for it (``quest.attention.fused_launch.triton_runs``);
    None where quest cannot be imported."""
    try:
        from quest.attention.fused_launch import triton_runs as runs
    except ImportError:
        return None
    return runs


def what_ran(x: torch.Tensor) -> str:
    """What a fused operator on ``x`` runs here (:func:`triton_runs`)."""
    runs = triton_runs()
    if runs is None:
        return "unknown (quest names no test of it)"
    return "triton kernel" if runs(x) else "operator's PyTorch code"


def kernel_rows(device: torch.device, smoke: bool, dtypes: tuple[torch.dtype, ...] = DTYPES,
                emit: Callable[[dict[str, Any]], None] | None = None,
                kernels: tuple[str, ...] = KERNELS) -> list[dict[str, Any]]:
    """One row per (kernel, dtype) of ``kernels``, each handed to ``emit`` as it ends (the part writes it then). The
    smoke runs :data:`SMOKE_WIDTHS` and :data:`SMOKE_TOKENS` only (its rows say so); on the CPU the operators run
    forced onto the fused path (their Triton kernels under ``TRITON_INTERPRET=1``, else the operators' own
    reference code)."""
    fused, missing = _fused_module()
    widths, tokens = (SMOKE_WIDTHS, SMOKE_TOKENS) if smoke else (WIDTHS, TOKENS)
    rows: list[dict[str, Any]] = []
    for kernel in kernels:
        for dtype in dtypes:
            row: dict[str, Any] = {"check": "kernel", "kernel": kernel, "dtype": str(dtype).replace("torch.", ""),
                                   "widths": list(widths), "layouts": ["contiguous", "qkv-view"],
                                   "tolerance": TOLERANCE[dtype], "batch": 1, "tokens": tokens, "heads": HEADS,
                                   "reference": f"float64 on {device.type}"}
            if smoke:
                row["note"] = (f"CPU smoke: widths {', '.join(map(str, widths))} of {', '.join(map(str, WIDTHS))}, "
                                f"{tokens} tokens")
            if missing:
                rows.append({**row, "ok": False, "error": f"not available: {missing}"})
            else:
                rows.append({**row, **_kernel_row(kernel, fused, widths, tokens, device, dtype)})
            if emit is not None:
                emit(rows[-1])
    return rows


def _kernel_row(kernel: str, fused: Any, widths: tuple[int, ...], tokens: int, device: torch.device,
                dtype: torch.dtype) -> dict[str, Any]:
    worst: dict[str, tuple[float, int, str]] = {}
    # the kernel path on every device, unchecked (on CUDA too: quest's own choice may first check, or fall back)
    forced = fused.fused_path(True) if hasattr(fused, "fused_path") else nullcontext()
    try:
        with forced:
            for d in widths:
                for layout in ("contiguous", "qkv-view"):
                    for name, diff in _one(kernel, fused, d, tokens, layout, device, dtype).items():
                        if name not in worst or not diff <= worst[name][0]:  # NaN counts as worst
                            worst[name] = (diff, d, layout)
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500], "traceback": traceback.format_exc()[-1200:]}
    tol = TOLERANCE[dtype]
    return {"max_rel": {k: v[0] for k, v in worst.items()},
            "worst_at": {k: f"d={v[1]} {v[2]}" for k, v in worst.items()},
            "ran": what_ran(torch.empty(1, 1, 1, 1, device=device, dtype=dtype)),
            "ok": all(v[0] <= tol for v in worst.values())}


def check_kernels_rows(device: torch.device, smoke: bool, dtypes: tuple[torch.dtype, ...] = DTYPES) -> list[dict]:
    """``quest.attention.fused.check_kernels(device, dtype, head_dim)`` per dtype over the widths, where it exists:
    its results as it gives them, a failure when it raises or returns False; one row saying so where it does not."""
    fused, _ = _fused_module()
    check = getattr(fused, "check_kernels", None)
    if check is None:
        return [{"check": "check_kernels", "ok": None,
                 "note": "not available: quest.attention.fused has no check_kernels (the rows above stand alone)"}]
    rows = []
    for dtype in dtypes:
        results, errors = {}, []
        for d in SMOKE_WIDTHS if smoke else WIDTHS:
            try:
                out = check(device, dtype, d)
            except Exception as exc:
                errors.append(f"d={d}: {type(exc).__name__}: {exc}"[:300])
                continue
            # a list of per-kernel verdicts (objects with ok / kernel / reason), or one value
            verdicts = out if isinstance(out, (list, tuple)) else [out]
            for v in verdicts:
                ok = getattr(v, "ok", v)
                name = getattr(v, "kernel", "all")
                results[f"{name} d={d}"] = ok if isinstance(ok, (bool, type(None))) else repr(ok)[:200]
                if ok is False:
                    errors.append(f"{name} d={d}: {getattr(v, 'reason', 'False')}"[:300])
        rows.append({"check": "check_kernels", "dtype": str(dtype).replace("torch.", ""), "results": results,
                     "ok": not errors, **({"errors": errors[:4]} if errors else {}),
                     "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1"})
    return rows
