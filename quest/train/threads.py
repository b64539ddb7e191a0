"""Intra-op threads of a CPU run when ``trainer.torch_threads`` is not set.

torch's default is one thread per core, and its OpenMP threads spin while they wait for each other. On a machine
whose cores are busy with other jobs (a login node, a shared workstation), two spinning threads on two busy cores
trained the default preset (vit_pico_patch4_16, batches of 64) at 18-43 img/s, against 209-646 img/s with one
thread, 283-362 with OMP_WAIT_POLICY=PASSIVE, and up to 2,406 img/s with one thread in the quietest moments
(bench/cpu_threads.py, docs/benchmarks.md). The CPU presets' matrices are too small for a second thread to pay for
its synchronisation, so they train with one thread. Larger models keep torch's default: a count that followed the
load would make an interrupted run resume with another thread count, and so with other float rounding, where quest
promises bit-identical resumes; :func:`busy_hint` says how to set it on a busy machine.
"""
from __future__ import annotations

import os

__all__ = ["default_cpu_threads", "run_threads", "free_cores", "busy_hint"]


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
