"""summary.json's ``perf``: the telemetry's figures over a run's attempts (quest.run.train_state.Attempt), the
whole run's first and then each attempt's own (docs/training.md, "Where the time goes").

A figure's mean over several attempts is the time-weighted mean over all their log intervals (the sum of value x
seconds over the sum of seconds), as within one attempt; a maximum is the largest of any; counts and times add up.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .train_state import Attempt

__all__ = ["figures", "run_perf"]

#: the figures whose largest interval value is reported beside the mean (``<name>_max``)
MAXIMA = ("peak_mem_gib", "step_s", "data_wait")


def figures(attempts: Sequence[Attempt]) -> dict[str, Any]:
    """The time apart in all (compiling steps, the loaders' starts) and each figure's ``<name>_mean`` (None without
    a steady step) and, for :data:`MAXIMA`, ``<name>_max``, over ``attempts`` together."""
    out: dict[str, Any] = {"compile_s": sum(a.compile_s for a in attempts),
                           "compile_steps": sum(a.compile_steps for a in attempts),
                           "loader_start_s": sum(a.loader_start_s for a in attempts)}
    names = dict.fromkeys(name for a in attempts for name in a.figures)  # first seen first, as logged
    for name in names:
        parts = [a.figures[name] for a in attempts if name in a.figures]
        seconds = sum(p.seconds for p in parts)
        out[f"{name}_mean"] = sum(p.weighted for p in parts) / seconds if seconds else None
        if name in MAXIMA:
            out[f"{name}_max"] = max(p.largest for p in parts)
    return out


def _counts(attempts: Sequence[Attempt]) -> dict[str, Any]:
    train_s = sum(a.train_s for a in attempts)
    images = sum(a.images for a in attempts)
    return {"steps": sum(a.steps for a in attempts), "images": images, "train_s": train_s,
            "wall_s": sum(a.wall_s for a in attempts), "img_per_s": images / train_s if train_s else None}


def run_perf(attempts: Sequence[Attempt], flops: float | None, peak: float | None) -> dict[str, Any]:
    """summary.json's ``perf``: the run's FLOPs per image and device peak, its counts and times over every attempt
    (``steps``, ``images``, ``train_s``, ``wall_s``, ``img_per_s`` = images / training time) and the figures over
    all of them, then ``attempts``: each attempt's own (``first_step`` and the same counts and figures)."""
    return {"train_flops_per_image": flops, "device_peak_tflops": peak, **_counts(attempts), **figures(attempts),
            "attempts": [{"first_step": a.first_step, **_counts([a]), **figures([a])} for a in attempts]}
