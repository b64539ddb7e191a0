"""Whether the fused kernels run: the ``attention.fused`` setting, the self-check, and the record of what ran.

``attention.fused`` (quest.config.schema.AttentionConfig):

- ``auto`` (the default): the first use of each kernel on a (device, dtype, head width) runs it once on a small input
  against its PyTorch reference, values and gradients (:func:`check_kernel`). Anything that goes wrong (Triton
  missing, no C compiler or Python headers for its launcher, an unwritable cache, a GPU it does not support, a compile
  error, a wrong value) prints ONE warning line naming the cause, and from then on the PyTorch path runs on that
  device. The verdict is cached: a run pays one check per (device, dtype, head width, kernel), no sync per step.
- ``on``: :func:`configure` checks the kernels on the run's device before the run directory is made and refuses in
  one line where they cannot run; a later failing check (another dtype or head width) stops the run in one line.
- ``off``: no kernel is launched.

:func:`record` says which path ran and why (summary.json's ``attention_kernels``, shown by quest-report).
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from quest.runtime.errors import UserError
from quest.runtime.versions import installed, parse_version

from . import fused_launch as launch
from . import fused_reference as ref

__all__ = ["MODES", "KernelCheck", "KernelUnavailable", "KERNELS", "check_kernel", "check_kernels", "configure",
           "kernels_allowed", "record", "Settings", "SETTINGS", "TRITON_NEEDED", "triton_release", "triton_too_old"]

log = logging.getLogger("quest.attention")

MODES = ("auto", "on", "off")
#: (atol, rtol) per dtype of a kernel's self-check against its reference: two units in the last place of a value
#: near 1 (the kernel rounds its float32 result once; the reference may round the other way), far below what a wrong
#: kernel gives
_TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}


@dataclass(frozen=True)
class KernelCheck:
    """One kernel's self-check on one (device, dtype, head width): ``ok``, or why not (``reason``)."""

    kernel: str
    device: str
    dtype: str
    head_dim: int
    ok: bool
    reason: str
    max_abs_error: Optional[float]


#: kernel -> the oldest Triton release whose interpreter ran it equal to its PyTorch reference (docs/getting-started.md,
#: "Tested versions"): under an older Triton the kernel is not used, its check failing with that reason before any
#: launch. Triton 3.4 and 3.6 (torch 2.8, 2.11) ran elliptical_m wrong, 3.7 (torch 2.12) and 3.8 right; 3.0 (torch 2.4)
#: ran none of them.
TRITON_NEEDED: dict[str, tuple[int, int]] = {"l2_normalize": (3, 2), "layer_norm": (3, 2), "elliptical_m": (3, 7)}


def triton_release() -> Optional[tuple[int, int]]:
    """The installed Triton's (major, minor), read from its metadata without importing it; None without Triton."""
    text = installed("triton")
    return parse_version(text)[:2] if text is not None else None


def triton_too_old(kernel: str) -> Optional[str]:
    """Why ``kernel`` is not used under the installed Triton (older than :data:`TRITON_NEEDED` says), or None."""
    have, needs = triton_release(), TRITON_NEEDED[kernel]
    if have is None or have >= needs:
        return None
    return (f"the fused {kernel} kernel needs triton>={needs[0]}.{needs[1]}; this environment has triton "
            f"{have[0]}.{have[1]}")


class KernelUnavailable(UserError, RuntimeError):
    """Under ``attention.fused=on``, a kernel failed its check where the run uses it (one line, no traceback)."""


@dataclass
class Settings:
    """The process's fused-path state: the run's setting, the verdicts so far, and the overrides of
    :func:`quest.attention.fused.fused_path` (``forced``: every device, no check; ``cpu``: CPU tensors are
    checked and take the kernels as CUDA tensors do, the tests' stand-in for a GPU)."""

    mode: str = "auto"
    forced: Optional[bool] = None
    cpu: bool = False
    verdicts: dict[tuple, bool] = field(default_factory=dict)  # (device, dtype, head width, kernel) -> verdict
    checks: list[KernelCheck] = field(default_factory=list)  # every check run since configure, in order
    failed: dict[str, str] = field(default_factory=dict)  # device -> the warning said when its first check failed

    def reset(self) -> None:
        self.verdicts, self.checks, self.failed = {}, [], {}


SETTINGS = Settings()


def _inputs(device: torch.device, dtype: torch.dtype, d: int) -> tuple[Tensor, Tensor]:
    # a strided view of a (B, N, 3, H, d) projection, as the model's q, k, v are; a fixed seed of its own
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 5, 3, 3, d, generator=gen).to(device, dtype)
    return qkv.permute(2, 0, 3, 1, 4)[1], torch.randn(2, 3, 5, d, generator=gen).to(device, dtype)


def _l2(x: Tensor, g: Tensor) -> list[tuple[Tensor, Tensor]]:
    pairs = []
    for scale in (None, torch.linspace(0.5, 2.0, x.shape[1], device=x.device, dtype=x.dtype).view(-1, 1, 1)):
        y, inv, _ = launch.l2_normalize_forward(x, 1e-6, scale)
        gx, dot = launch.l2_normalize_backward(g, x, inv, scale, 1e-6)
        # the reference in float64: the formula's value, which the kernel's float32 arithmetic must come close to
        xd, gd, sd = x.double(), g.double(), None if scale is None else scale.double()
        y_ref, inv_ref, above = ref.l2_normalize_reference(xd, 1e-6, sd)
        gx_ref, dot_ref = ref.l2_normalize_backward_reference(gd, xd, inv_ref, sd, above)
        pairs += [(y, y_ref), (inv, inv_ref), (gx, gx_ref), (dot, dot_ref)]
    return pairs


def _layer_norm(x: Tensor, g: Tensor) -> list[tuple[Tensor, Tensor]]:
    d = x.shape[-1]
    weight = torch.linspace(0.5, 1.5, d, device=x.device)
    bias = torch.linspace(-0.2, 0.2, d, device=x.device)
    y, mean, rstd = launch.layer_norm_forward(x, weight, bias, 1e-5)
    grads = launch.layer_norm_backward(g, x, weight, mean, rstd)
    y_ref, mean_ref, rstd_ref = ref.layer_norm_reference(x, weight, bias, 1e-5)
    grads_ref = ref.layer_norm_backward_reference(g, x, weight, mean_ref, rstd_ref)
    return [(y, y_ref), (mean, mean_ref), (rstd, rstd_ref), *zip(grads, grads_ref)]


def _elliptical_m(x: Tensor, g: Tensor) -> list[tuple[Tensor, Tensor]]:
    return [(launch.elliptical_m(x, g, 1e-6), ref.elliptical_m_reference(x, g, 1e-6))]


#: kernel name -> its check: (kernel's results, reference's) on the same small input and output gradient
KERNELS: dict[str, Callable[[Tensor, Tensor], list[tuple[Tensor, Tensor]]]] = {
    "l2_normalize": _l2, "layer_norm": _layer_norm, "elliptical_m": _elliptical_m}


def check_kernel(kernel: str, device: torch.device | str, dtype: torch.dtype, head_dim: int) -> KernelCheck:
    """Run ``kernel`` (forward and backward) once on a small input on ``device`` against its PyTorch reference.
    Never raises: an exception (Triton missing, a compile error, ...) is the check's ``reason``."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    where = dict(kernel=kernel, device=str(device), dtype=str(dtype).removeprefix("torch."), head_dim=head_dim)
    too_old = triton_too_old(kernel)
    if too_old:
        return KernelCheck(**where, ok=False, reason=too_old, max_abs_error=None)
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            pairs = KERNELS[kernel](*_inputs(device, dtype, head_dim))
            atol, rtol = _TOLERANCE.get(dtype, (1e-6, 1e-6))
            error, wrong = 0.0, None
            for i, (got, want) in enumerate(pairs):
                got, want = got.double(), want.double()
                if got.shape != want.shape:
                    wrong = wrong or f"result {i} has shape {tuple(got.shape)}, its reference {tuple(want.shape)}"
                    continue
                error = max(error, (got - want).abs().max().item())
                if not torch.allclose(got, want, atol=atol, rtol=rtol):  # a NaN is a disagreement too
                    wrong = wrong or f"result {i} differs from its PyTorch reference"
    except Exception as exc:  # anything: the point is to keep the run going on the PyTorch path
        cause = str(exc).strip().splitlines()[-1:] or [""]
        return KernelCheck(**where, ok=False, reason=f"{type(exc).__name__}: {cause[0][:300]}", max_abs_error=None)
    if wrong:
        return KernelCheck(**where, ok=False, reason=f"{wrong} (max abs error {error:.3g})", max_abs_error=error)
    return KernelCheck(**where, ok=True, reason="matches its PyTorch reference", max_abs_error=error)


def check_kernels(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> list[KernelCheck]:
    """Every fused kernel's self-check on ``device`` for ``dtype`` and ``head_dim`` (bench/gpu.py, the ``on``
    pre-flight)."""
    return [check_kernel(kernel, device, dtype, head_dim) for kernel in KERNELS]


def configure(mode: str, device: torch.device | str) -> None:
    """Set the process's ``attention.fused`` for a run on ``device`` and forget the verdicts of an earlier run.
    ``on`` checks every kernel there first (float32, head width 64) and refuses in one line where one fails."""
    if mode not in MODES:
        raise ValueError(f"attention.fused={mode!r}: expected one of {', '.join(MODES)}")
    device = torch.device(device)
    if mode == "on":
        if device.type != "cuda":
            raise ValueError(f"attention.fused=on: the fused kernels run on CUDA devices only, and this run's device "
                             f"is {device} (attention.fused=auto uses them where they pass their check)")
        for check in check_kernels(device, torch.float32, 64):
            if not check.ok:
                raise ValueError(f"attention.fused=on: the fused {check.kernel} kernel cannot run on {device}: "
                                 f"{check.reason} (attention.fused=auto runs the PyTorch path instead)")
    SETTINGS.mode = mode
    SETTINGS.reset()


def kernels_allowed(x: Tensor, kernel: str) -> bool:
    """Whether ``kernel`` runs on ``x``'s device, dtype and head width under the current setting: its verdict,
    from one self-check the first time (module docstring)."""
    forced = SETTINGS.forced
    if forced is not None:
        return forced
    if SETTINGS.mode == "off" or not (x.is_cuda or (SETTINGS.cpu and x.device.type == "cpu")):
        return False
    key = (x.device, x.dtype, x.shape[-1], kernel)
    verdict = SETTINGS.verdicts.get(key)
    if verdict is None:
        verdict = SETTINGS.verdicts[key] = _verdict(x.device, x.dtype, x.shape[-1], kernel)
    return verdict


def _verdict(device: torch.device, dtype: torch.dtype, d: int, kernel: str) -> bool:
    if str(device) in SETTINGS.failed:  # said once: the PyTorch path already runs there
        return False
    check = check_kernel(kernel, device, dtype, d)
    SETTINGS.checks.append(check)
    if check.ok:
        return True
    where = f"{check.kernel} kernel on {check.device} ({check.dtype}, head width {d})"
    if SETTINGS.mode == "on":
        raise KernelUnavailable(f"attention.fused=on: the fused {where} failed its check: {check.reason}")
    for key in SETTINGS.verdicts:  # kernels that passed on this device stop too: one path per device from here
        if key[0] == device:
            SETTINGS.verdicts[key] = False
    SETTINGS.failed[check.device] = message = (
        f"attention.fused=auto: the fused {where} failed its check ({check.reason}); the PyTorch path runs instead "
        f"on {check.device}")
    log.warning("%s", message)
    return False


def record() -> dict[str, Any]:
    """Which path the formulations' q/k transforms took since :func:`configure`, and why: ``path`` is ``fused``
    (every kernel used passed its check), ``pytorch`` or ``fused until a check failed``; ``checks`` lists them."""
    checks = [asdict(c) for c in SETTINGS.checks]
    if SETTINGS.forced is not None:
        path, why = ("fused" if SETTINGS.forced else "pytorch"), f"forced by fused_path({SETTINGS.forced})"
    elif SETTINGS.mode == "off":
        path, why = "pytorch", "attention.fused=off"
    elif SETTINGS.failed:
        path = "fused until a check failed" if any(c["ok"] for c in checks) else "pytorch"
        why = next(iter(SETTINGS.failed.values()))
    elif checks:
        path, why = "fused", "every kernel used passed its check against its PyTorch reference"
    else:
        path, why = "pytorch", "no kernel was used (they run on CUDA tensors of float32, bfloat16 or float16)"
    return {"setting": SETTINGS.mode, "path": path, "reason": why, "checks": checks}
