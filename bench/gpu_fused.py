"""One training step per formulation with the fused q/k operators and without (bench/gpu.py's ``fused`` part).

The same ViT (ViT-B/16 at 224 px, batch 128 on the GPU; the smoke's ViT-pico) and the same images, bf16 autocast,
once under ``fused_path(True)`` and once under ``fused_path(False)`` (quest.attention.fused): the logits and every
parameter's gradient of the first step compared, each path's step time (the bare step: fused AdamW, cross-entropy),
peak memory and the SDPA kernel it reached. Both bf16 paths are also compared with the same step in float32 without
autocast (TF32 off), so that "the fused path differs" can be told from "the fused path is worse": the fused path
passes when its difference from float32 is at most :data:`WORSE` times the PyTorch path's (plus a floor for
differences at float32's own rounding).

A difference is max |a - b| / max |b| per tensor, b the float64 copy of the reference side on the host."""
from __future__ import annotations

import copy
import traceback
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from bench.gpu_kernels import what_ran
from bench.gpu_step import _model, autocast, free, sdpa_backend, time_steps

__all__ = ["fused_step_row", "WORSE"]

#: how much further from float32 the fused path may be than the PyTorch path (both bf16), and the floor under which
#: a difference is float32's rounding whatever the ratio
WORSE, FLOOR = 2.0, 1e-4
#: a tensor whose largest reference value is below this fraction of the largest tensor's is zero up to rounding (a
#: key bias every softmax row cancels, QKNorm-DS's): its relative difference means nothing, so it is listed apart
_ZERO = 1e-6


def zero_up_to_rounding(exact: dict[str, torch.Tensor]) -> set[str]:
    """The tensors of ``exact`` (float32 gradients) whose largest value is below :data:`_ZERO` x the largest's."""
    scale = max(float(r.abs().max()) for r in exact.values())
    return {name for name, r in exact.items() if float(r.abs().max()) <= _ZERO * scale}


def relative_differences(test: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                         zero: set[str] = frozenset()) -> dict[str, Any]:
    """max |test - reference| / max |reference| per tensor: the largest and its name, and apart the tensors named in
    ``zero`` (zero up to rounding in float32: their absolute difference)."""
    rel, zero_diffs = {}, {}
    for name, ref in reference.items():
        diff, top = float((test[name] - ref).abs().max()), float(ref.abs().max())
        if name in zero:
            zero_diffs[name] = diff
        else:
            rel[name] = diff / (top if top > 0 else 1.0)
    worst = max(rel, key=rel.__getitem__)
    return {"max": rel[worst], "worst": worst, "zero": zero_diffs}


@contextmanager
def _path(enabled: bool) -> Iterator[str]:
    """quest's fused operators on (``enabled``) or off, and the name of how that was set."""
    try:
        from quest.attention.fused import fused_path
    except ImportError:
        yield "not available: quest.attention.fused has no fused_path"
        return
    with fused_path(enabled):
        yield f"fused_path({enabled})"


def _first_step(model: torch.nn.Module, images: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype | None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with autocast(images.device, dtype):
        logits = model(images)
    F.cross_entropy(logits.float(), targets).backward()
    # on the host in float64: relative_differences compares there
    grads = {n: p.grad.detach().to("cpu", torch.float64) for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach().to("cpu", torch.float64), grads


def _timed(model: torch.nn.Module, images: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype, steps: int,
           warmup: int) -> dict[str, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=images.is_cuda)

    def step() -> None:
        with autocast(images.device, dtype):
            loss = F.cross_entropy(model(images), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return time_steps(step, steps, warmup, images.device)


def _float32_step(model: torch.nn.Module, images: torch.Tensor, targets: torch.Tensor
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with _path(False):
            return _first_step(model, images, targets, None)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def fused_step_row(attention: str, name: str, size: int, batch: int, device: torch.device, depth: int | None,
                   steps: int, warmup: int) -> dict[str, Any]:
    """The row of one formulation (the module's docstring says what it holds)."""
    row: dict[str, Any] = {"check": "fused step", "attention": attention, "model": name, "depth": depth,
                           "img_size": size, "batch": batch, "dtype": "bfloat16", "steps": steps}
    try:
        row.update(_fused_step(attention, name, size, batch, device, depth, steps, warmup))
    except Exception as exc:
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500], traceback=traceback.format_exc()[-1500:])
    free(device)
    return row


def _fused_step(attention, name, size, batch, device, depth, steps, warmup) -> dict[str, Any]:  # noqa: ANN001
    torch.manual_seed(0)
    model = _model(name, attention, size, depth).to(device).train()
    images = torch.randn(batch, 3, size, size, device=device)
    targets = torch.randint(0, 1000, (batch,), device=device)
    exact_logits, exact_grads = _float32_step(model, images, targets)
    ran = what_ran(images)
    zero = zero_up_to_rounding(exact_grads)
    out: dict[str, Any] = {"fused_ops_ran": ran}
    results = {}
    for enabled in (True, False):
        key = "fused" if enabled else "pytorch"
        with _path(enabled) as how:
            if how.startswith("not available"):
                return {"ok": None, "note": how}
            logits, grads = _first_step(model, images, targets, torch.bfloat16)
            backend = sdpa_backend(model, images, torch.bfloat16) if device.type == "cuda" else "cpu"
            timed = _timed(copy.deepcopy(model), images, targets, torch.bfloat16, steps, warmup)
        results[key] = (logits, grads)
        out[key] = {"set_by": how, "sdpa_backend": backend, "step_s": timed["step_s"],
                    "first_step_s": timed["first_step_s"], "peak_memory_gib": timed["peak_memory_gib"],
                    "logits_vs_fp32": relative_differences({"logits": logits}, {"logits": exact_logits})["max"],
                    "grads_vs_fp32": relative_differences(grads, exact_grads, zero)["max"]}
    (fl, fg), (pl, pg) = results["fused"], results["pytorch"]
    grads = relative_differences(fg, pg, zero)
    out.update(logits_fused_vs_pytorch=relative_differences({"logits": fl}, {"logits": pl})["max"],
               grads_fused_vs_pytorch=grads["max"], grads_worst=grads["worst"], grads_zero_up_to_rounding=grads["zero"],
               step_ratio=out["fused"]["step_s"] / out["pytorch"]["step_s"])
    if device.type == "cuda":
        out["memory_ratio"] = out["fused"]["peak_memory_gib"] / out["pytorch"]["peak_memory_gib"]
    out["ok"] = all(out["fused"][k] <= WORSE * out["pytorch"][k] + FLOOR for k in ("logits_vs_fp32", "grads_vs_fp32"))
    return out

