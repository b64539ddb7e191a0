"""The device's numerics per formulation (bench/gpu.py's ``numerics`` part): the logits and the gradients of every
parameter of a small ViT, one training step's forward and backward, on the device in float32 against the same model
on the CPU in float64; the CPU smoke compares the CPU's float32 with its float64, so that the code path runs.

A difference is relative per tensor: max |a - b| over max |b| (b: float64). A parameter whose float64 gradient is
zero up to rounding (a key bias under a LayerNorm whose shift every softmax row cancels, as QKNorm-DS's) has no
relative difference; it is listed apart with its absolute one."""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from quest.models import create_model

__all__ = ["relative_differences", "numerics_row", "TOLERANCE"]

#: what counts as agreement: about 10x the H200's worst (logits 1e-6, gradients 2.2e-5 relative)
TOLERANCE = {"logits": 1e-5, "grads": 2e-4}
# a float64 gradient this small beside the model's largest is zero in exact arithmetic, not a figure to divide by
_ZERO = 1e-10


def relative_differences(test: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Per tensor name: max |test - reference| / max |reference|, the largest of them and its name, and apart the
    names (with their absolute difference) whose reference is zero up to :data:`_ZERO` x the largest reference."""
    scale = max(float(r.abs().max()) for r in reference.values())
    rel: dict[str, float] = {}
    zero: dict[str, float] = {}
    for name, ref in reference.items():
        diff = float((test[name].detach().to("cpu", torch.float64) - ref).abs().max())
        top = float(ref.abs().max())
        if top <= _ZERO * scale:
            zero[name] = diff
        else:
            rel[name] = diff / top
    worst = max(rel, key=rel.__getitem__)
    return {"max": rel[worst], "worst": worst, "zero_in_exact_arithmetic": zero}


def _forward_backward(model: torch.nn.Module, images: torch.Tensor, targets: torch.Tensor
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits = model(images)
    F.cross_entropy(logits, targets).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def numerics_row(attention: str, name: str, size: int, batch: int, device: torch.device,
                 depth: int | None = None) -> dict[str, Any]:
    """One formulation: the same initial weights and inputs in float32 on ``device`` and in float64 on the CPU.
    TF32 is off for the float32 side (cuDNN's convolutions use it by default: the patch embedding would differ by
    about 1e-3 for that alone)."""
    torch.manual_seed(0)
    blocks = {"depth": depth} if depth else {}
    model = create_model(name, attention=attention, num_classes=10, img_size=size, **blocks).train()
    reference = copy.deepcopy(model).double()
    images = torch.randn(batch, 3, size, size)  # float32 values: the float64 side sees exactly the same inputs
    targets = torch.randint(0, 10, (batch,))
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        logits, grads = _forward_backward(model.to(device), images.to(device), targets.to(device))
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    ref_logits, ref_grads = _forward_backward(reference, images.double(), targets)
    logit_diff = relative_differences({"logits": logits}, {"logits": ref_logits})["max"]
    grad = relative_differences(grads, ref_grads)
    return {"attention": attention, "device": f"{device.type} float32", "reference": "cpu float64",
            "model": name, "depth": depth, "img_size": size, "batch": batch,
            "logits_max_rel": logit_diff, "grads_max_rel": grad["max"], "grads_worst": grad["worst"],
            "grads_zero_in_exact_arithmetic": grad["zero_in_exact_arithmetic"],
            "ok": logit_diff <= TOLERANCE["logits"] and grad["max"] <= TOLERANCE["grads"]}
