"""How a run computes: its precision (autocast for training and evaluation, float32 matmuls) and a CPU run's
intra-op threads. Both decide the rounding of every sum, so a run records them and a resume computes as its start did.

The threads of a CPU run when ``trainer.torch_threads`` is not set: torch's default is one thread per core, and its
OpenMP threads spin while they wait for each other. On a machine whose cores are busy with other jobs (a login node,
a shared workstation), two spinning threads on two busy cores trained the default preset (vit_pico_patch4_16, batches
of 64) at 18-43 img/s, against 209-646 img/s with one thread, 283-362 with OMP_WAIT_POLICY=PASSIVE, and up to 2,406
img/s with one thread in the quietest moments (bench/cpu_threads.py, docs/benchmarks.md). The CPU presets' matrices
are too small for a second thread to pay for its synchronisation, so they train with one thread. Larger models keep
torch's default: a count that followed the load would make an interrupted run resume with another thread count, and
so with other float rounding, where quest promises bit-identical resumes; :func:`busy_hint` says how to set it on a
busy machine.
"""
from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from functools import partial
from typing import Any, Callable

import torch

from quest.config.checks import MATMUL_PRECISIONS, PRECISIONS

__all__ = ["AUTOCAST_DTYPES", "autocast_for", "resolve_precision", "set_matmul_precision", "set_compute",
           "default_cpu_threads", "run_threads", "free_cores", "busy_hint"]

log = logging.getLogger("quest.train")

#: precision -> autocast dtype (None: no autocast, float32 throughout)
AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
assert tuple(AUTOCAST_DTYPES) == PRECISIONS


def autocast_for(precision: str, device: torch.device) -> Callable[[], Any]:
    """A factory of the context that runs forward passes at ``precision`` (fp32 | bf16 | fp16) on ``device``."""
    if precision not in AUTOCAST_DTYPES:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    dtype = AUTOCAST_DTYPES[precision]
    return partial(torch.autocast, device_type=device.type, dtype=dtype) if dtype else nullcontext


def resolve_precision(trainer_precision: str, recipe_precision: str | None, device: torch.device) -> str:
    """``auto``: on CUDA what the recipe's authors trained with (DeiT / DeiT-III: fp16 with a loss scaler), else
    bf16; fp32 on CPU. An explicit trainer.precision wins (fp16 on CPU works, slowly: for tests of the scaler path)."""
    if trainer_precision != "auto":
        return trainer_precision
    if device.type != "cuda":
        return "fp32"
    return recipe_precision or "bf16"


def set_matmul_precision(level: str) -> dict[str, Any]:
    """Run float32 matmuls and convolutions at ``level`` (trainer.matmul_precision) and return what is now in force,
    as torch reports it, for the run's records.

    One setting for both kinds of kernel: torch's own defaults differ (matmuls IEEE float32, cuDNN convolutions TF32),
    so a "float32" ViT's patch embedding would otherwise run TF32 while its attention and MLPs do not. ``highest``
    (quest's default) keeps float32 what its name says; ``high`` lets Ampere and later GPUs use TF32 tensor cores
    (10-bit mantissa, several times the float32 rate); ``medium`` also allows bfloat16 passes. Only float32 work is
    affected: under bf16 / fp16 autocast the matmuls already run in the autocast dtype. The legacy setters are used
    on purpose: torch refuses a mix of them and the newer ``fp32_precision`` attributes, and the MFU peak
    (quest.train.telemetry) reads the legacy ``allow_tf32``."""
    if level not in MATMUL_PRECISIONS:
        raise ValueError(f"trainer.matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)}, got {level!r}")
    torch.set_float32_matmul_precision(level)
    torch.backends.cudnn.allow_tf32 = level != "highest"
    return {"float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32)}

def set_compute(matmul_precision: str, torch_threads: int | None, model_name: str, device: torch.device,
                saved_threads: int | None) -> dict[str, Any]:
    """Set how this process computes for a run and return what is in force, for the run's records: the matmul
    precision (every start sets it: a process's earlier run left its own) and, on the CPU, the intra-op threads
    (:func:`run_threads`; ``saved_threads``: the run's own from its checkpoint), with a hint on a busy machine when
    torch's default is kept."""
    ran = set_matmul_precision(matmul_precision)
    if device.type != "cpu":
        return ran
    threads = run_threads(torch_threads, model_name, saved_threads)
    if threads:
        torch.set_num_threads(threads)
    elif hint := busy_hint(torch.get_num_threads()):
        log.warning(hint)
    ran["torch_threads"] = torch.get_num_threads()  # as torch says: the same count gives the same numbers
    return ran


def default_cpu_threads(model_name: str) -> int | None:
    """1 for the CPU presets (quest.models.presets), None (torch's default) for any other model, and None when the
    user's environment sets OMP_NUM_THREADS (their choice stands)."""
    from quest.models.presets import CPU_PRESETS

    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return 1 if model_name in CPU_PRESETS else None


def run_threads(asked: int | None, model_name: str, saved: int | None) -> int | None:
    """The intra-op threads a CPU run computes with: ``trainer.torch_threads`` when set (``asked``), else those the
    run started with (``saved`` in its checkpoint: a resume rounds its sums as the start did, whatever the machine
    or its load now), else :func:`default_cpu_threads`; None: torch's default, one per core of the machine."""
    return asked or saved or default_cpu_threads(model_name)


def free_cores(cores: int | None = None, load: float | None = None) -> int:
    """Cores minus the 1-minute load average (rounded), at least 1. ``cores``: the CPUs this process may run on."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # not available on this platform: assume a quiet machine
            load = 0.0
    return max(1, cores - round(load))


def busy_hint(threads: int, cores: int | None = None, load: float | None = None) -> str | None:
    """A line for the log when ``threads`` intra-op threads exceed the free cores, else None."""
    free = free_cores(cores, load)
    if threads <= free:
        return None
    return (f"{threads} intra-op threads, but only {free} core(s) are free (1-min load average): spinning threads slow "
            f"each other down; trainer.torch_threads={free} trains faster on a busy machine (docs/benchmarks.md)")
