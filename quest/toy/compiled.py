"""How the toy study's compiled step is built and called: the step itself, the device ``auto`` picks, inductor's
options on a CPU and the runs per call (measured in docs/benchmarks.md, "Toy study")."""
from __future__ import annotations

import functools
import os
import platform
import re
import subprocess
from collections.abc import Callable, Collection, Mapping

import torch

from quest.runtime.versions import TORCH_VERSION

__all__ = ["UPDATES_IN_PLACE", "compiled_adamw_step", "resolve_toy_device", "compile_options", "default_runs_per_call",
           "call_tiles"]

#: Whether the compiled step writes the new weights into the tensors it differentiates, in its graph (no new buffers).
#: Inductor before torch 2.12 computed that graph wrong with two or more runs a call (on 2.8: about 1 element in 10 of
#: the first AdamW update had the wrong sign, where dynamo with aot_eager, and the same graph without the write, were
#: right; docs/versions.md): there the step returns the new weights, and they replace the old ones outside the graph.
UPDATES_IN_PLACE = TORCH_VERSION >= (2, 12, 0)


def compiled_adamw_step(grad: Callable, frozen: Collection[str], betas: tuple[float, float], eps: float,
                        options: Mapping[str, bool], in_place: bool | None = None) -> Callable[..., None]:
    """The study's training step, compiled: ``grad(p, x, y)``'s gradients, then torch.optim.AdamW's single-tensor
    arithmetic, in its order, with a per-run lr and weight decay. The step's ``p``, ``exp_avg`` and ``exp_avg_sq``
    (name -> (R, *shape) tensors; separate tensors, since views into one flat matrix make inductor assemble the
    gradient element by element, a slow kernel on a CPU) hold the updated values when it returns; ``lr``, ``wd``:
    (R,); ``bc1``, ``bc2_sqrt``: the bias corrections, 0-d tensors. A ``frozen`` parameter gets no step and no decay.
    ``in_place``: :data:`UPDATES_IN_PLACE` unless given."""
    b1, b2 = betas
    in_place = UPDATES_IN_PLACE if in_place is None else in_place

    def updated(p, exp_avg, exp_avg_sq, lr, wd, x, y, bc1, bc2_sqrt) -> dict[str, torch.Tensor]:
        grads, new = grad(p, x, y), {}
        for name, g in grads.items():
            if name in frozen:
                continue
            shape = (-1,) + (1,) * (g.dim() - 1)
            lr_, wd_ = lr.view(shape), wd.view(shape)
            m = exp_avg[name].lerp_(g, 1 - b1)
            v = exp_avg_sq[name].mul_(b2).addcmul_(g, g, value=1 - b2)
            if in_place:
                p[name].mul_(1 - lr_ * wd_).sub_(m / ((v.sqrt() / bc2_sqrt) + eps) * (lr_ / bc1))
            else:
                new[name] = p[name] * (1 - lr_ * wd_) - m / ((v.sqrt() / bc2_sqrt) + eps) * (lr_ / bc1)
        return new

    compiled = torch.compile(updated, dynamic=False, options=dict(options))

    def step(p, exp_avg, exp_avg_sq, lr, wd, x, y, bc1, bc2_sqrt) -> None:
        p.update(compiled(p, exp_avg, exp_avg_sq, lr, wd, x, y, bc1, bc2_sqrt))

    return step


def resolve_toy_device(device: str | None) -> str:
    """The device ``device=auto`` (the default) trains on: the CPU, also on a machine with a GPU.

    The study's models are tiny (21 tokens of width 20, one block): a compiled step of a chunk's runs is a few dozen
    kernels of microseconds each, so on a GPU the time goes to launching them from one Python process, to compiling
    each formulation's step into GPU kernels, and to training the chunks one after another (one process, which owns
    the GPU), where a CPU trains one chunk per core side by side. Measured once (docs/experiments.md, "The toy
    study"): ``grid=quick`` took 76 s with ``device=cuda`` on an H200 against 25-47 s on 2 CPU cores. ``cpu``,
    ``cuda`` and ``cuda:N`` are used as given."""
    return "cpu" if device in (None, "auto") else device


def compile_options(device_type: str) -> dict[str, bool]:
    """Inductor options of the compiled step (measurements: docs/benchmarks.md, "Toy study"). On a CPU:

    - its C++ wrapper: the step's kernels are called from C++ instead of Python (one shared library instead of 20),
      a step 1.09x faster at 24 runs and 1.04x at tiles of 50 (bench/toy.py --python-wrapper);
    - no precompiled header, and the vector ISA read from the CPU's flags instead of found by test builds when the
      compiler is g++ 11 or newer (which has the flags of every x86 ISA inductor picks, AVX2 to AMX). Both are costs
      of the first compile on a machine, about 10 s of a cold start (bench/toy_compile.py, bench/toy_quick.py); the
      header would then save 1.7 s of each new graph's 11 s build.
    """
    if device_type != "cpu":
        return {}
    options = {"cpp_wrapper": True, "cpp_cache_precompile_headers": False}
    # ATEN_CPU_CAPABILITY caps the kernels ATen dispatches to (and what inductor may target): the CPU's flags say
    # nothing then, so inductor picks and probes as it does
    if _gcc_has_every_x86_isa() and not os.environ.get("ATEN_CPU_CAPABILITY"):
        options["cpp.vec_isa_ok"] = True
    return options


@functools.cache
def _gcc_has_every_x86_isa() -> bool:
    """True on x86 with inductor's C++ compiler being g++ 11 or newer; False (inductor probes) for anything else."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        compiler = get_cpp_compiler()
        banner = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        version = subprocess.run([compiler, "-dumpfullversion", "-dumpversion"], capture_output=True, text=True,
                                 timeout=30).stdout
    except Exception:  # noqa: BLE001 - no compiler found, or another torch: let inductor probe as it does
        return False
    first = banner.splitlines()[0].lower() if banner else ""
    is_gcc = ("g++" in first or "gcc" in first) and "clang" not in banner.lower()
    major = re.match(r"\d+", version.strip())
    return bool(is_gcc and major and int(major.group()) >= 11)


def default_runs_per_call(device: torch.device | str) -> int:
    """Runs per compiled call: a tile that stays in a CPU core's L2 cache; on a GPU, every run of the chunk."""
    return 50 if torch.device(device).type == "cpu" else 1 << 30


def call_tiles(n: int, per_call: int) -> list[slice]:
    """``n`` runs in ceil(n / per_call) tiles of near-equal size (at most two sizes, so at most two compilations)."""
    count = -(-n // max(1, per_call))
    bounds = [round(i * n / count) for i in range(count + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]
