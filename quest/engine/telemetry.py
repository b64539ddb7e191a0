"""Where a run's time goes, per log interval: the wait for data, step time, images/s per device and for the job,
peak memory, FLOPs achieved and, on a known GPU, MFU. Measured on the host only (clocks, the allocator's counters,
/proc): nothing here adds a collective or a device-to-host read to the training step.

- data wait: the time the loop spent blocked on the loader's next batch (Run.step_batches), as a fraction of the
  interval's wall time.
- peak memory: CUDA, ``torch.cuda.max_memory_allocated`` since the last interval (then reset); CPU, the process's
  resident peak (VmHWM) since the last interval, reset through /proc/self/clear_refs where Linux allows it.
- FLOPs: the model's forward counted once by ``torch.utils.flop_counter`` on a copy without weights (the meta
  device: no memory, no collective), times 3 for forward and backward (the backward's matmuls are twice the
  forward's: the convention of PaLM's and torchtitan's MFU). Matmuls and attention only, as the peak FLOP/s of a
  GPU are; the element-wise work of every formulation is the same order and not counted.
- MFU: achieved FLOP/s per device over the dense peak of the device at the run's precision (:data:`PEAK_TFLOPS`);
  on the CPU or an unknown GPU, achieved FLOP/s only, labelled so.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

log = logging.getLogger("quest.train")

__all__ = ["PEAK_TFLOPS", "peak_tflops", "flops_per_image", "Telemetry", "resident_peak_bytes", "DATA_LEVERS"]

#: Dense (no structured sparsity) peak tensor TFLOP/s per device, from the vendors' data sheets, by precision; fp32
#: is the plain CUDA-core rate and tf32 the tensor-core rate that fp32 matmuls use when TF32 is allowed. Matched in
#: order against torch.cuda.get_device_name() (the first name contained in it wins).
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
]

#: what to try when the loader is the bottleneck (docs/data.md)
DATA_LEVERS = ("more loader workers (data.num_workers), the augmentation on the GPU (data.pipeline=split or "
               "data.pipeline=device), or data read from shards (data=shards, quest-data make-shards)")


def peak_tflops(device: torch.device, precision: str) -> float | None:
    """The dense peak TFLOP/s of ``device`` at ``precision`` (fp32 | bf16 | fp16), None when unknown (CPU included)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    key = precision
    if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        key = "tf32"
    for model, peaks in PEAK_TFLOPS:
        if model in name:
            return peaks.get(key)
    return None


def flops_per_image(build: Callable[[], torch.nn.Module], img_size: int) -> float:
    """Training FLOPs per image (3 x the forward's matmul and attention FLOPs) of the model ``build()`` makes, at
    ``img_size``; counted on the meta device (no weights, no memory, no collective)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = build().eval()
        images = torch.empty(1, 3, img_size, img_size)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(images)
    return 3.0 * counter.get_total_flops()


def resident_peak_bytes(reset: bool = False) -> int | None:
    """This process's resident peak (VmHWM, bytes) since the last reset; ``reset`` starts a new peak (Linux: writing
    5 to /proc/self/clear_refs). None where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            peak = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), None)
    except OSError:
        return None
    if reset:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass  # then the figure is the process's peak so far
    return peak


@dataclass
class Telemetry:
    """Per-interval figures (:meth:`interval`), per-epoch advice (:meth:`end_epoch`) and the run's means and peaks
    (:meth:`summary`). ``flops`` training FLOPs per image (None: not counted), ``peak`` the device's TFLOP/s."""

    device: torch.device
    world_size: int
    flops: float | None = None
    peak: float | None = None
    data_wait_warning: float = 0.10
    low_mfu_warning: float = 0.30
    _epoch: list[float] = field(default_factory=lambda: [0.0, 0.0])  # data wait, wall seconds
    _sums: dict[str, list[float]] = field(default_factory=dict)
    _active: set[str] = field(default_factory=set)  # the advice whose condition held in the last epoch

    def __post_init__(self) -> None:
        self._reset_peak()

    def _reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            resident_peak_bytes(reset=True)

    def _peak_memory(self) -> float | None:
        if self.device.type == "cuda":
            peak: float | None = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = resident_peak_bytes()
        self._reset_peak()
        return None if peak is None else peak / 2**30

    def interval(self, seconds: float, data_wait: float, images: int, steps: int) -> dict[str, float]:
        """The figures of one log interval: ``images`` over every process in ``seconds`` of wall time, ``steps``
        optimizer steps, ``data_wait`` seconds this process spent waiting for batches."""
        seconds = max(seconds, 1e-9)
        self._epoch[0] += data_wait
        self._epoch[1] += seconds
        per_device = images / self.world_size / seconds
        row = {"perf/data_wait": data_wait / seconds, "perf/step_s": seconds / max(steps, 1),
               "perf/img_per_s_per_device": per_device, "perf/img_per_s": images / seconds}
        memory = self._peak_memory()
        if memory is not None:
            row["perf/peak_mem_gib"] = memory
        if self.flops:
            row["perf/tflops_per_device"] = self.flops * per_device / 1e12
            if self.peak:
                row["perf/mfu"] = row["perf/tflops_per_device"] / self.peak
        for key, value in row.items():
            total = self._sums.setdefault(key, [0.0, 0.0, float("-inf")])
            total[0] += value * seconds  # time-weighted mean
            total[1] += seconds
            total[2] = max(total[2], value)
        return row

    def end_epoch(self, epoch: int, seconds: float, data_wait: float) -> list[str]:
        """The advice for the epoch just ended, given the wall and wait seconds since its last interval; the loop
        logs it. Each piece is said when its condition starts (not again for every epoch it lasts: the log lines
        carry the figures) and again if it comes back after an epoch without it."""
        wait, wall = self._epoch[0] + data_wait, self._epoch[1] + seconds
        self._epoch = [0.0, 0.0]
        if wall <= 0:
            return []
        said, self._active = self._active, set()
        advice = []
        if wait / wall > self.data_wait_warning:
            self._active.add("data")
            advice += [] if "data" in said else [
                f"epoch {epoch}: training waited for data {100 * wait / wall:.0f}% of the time (above "
                f"trainer.data_wait_warning={self.data_wait_warning}); the loader is the bottleneck: try {DATA_LEVERS}"]
        mfu = self._mean("perf/mfu")
        if mfu is not None and mfu < self.low_mfu_warning and wait / wall <= self.data_wait_warning:
            self._active.add("mfu")
            advice += [] if "mfu" in said else [
                f"epoch {epoch}: MFU {100 * mfu:.0f}% with little data wait ({100 * wait / wall:.0f}%): the GPU is "
                "under-used by the model itself; try trainer.compile=true, trainer.precision=bf16, or a larger "
                "data.batch_size"]
        return advice

    def _mean(self, key: str) -> float | None:
        total = self._sums.get(key)
        return total[0] / total[1] if total and total[1] else None

    def summary(self) -> dict[str, Any]:
        """The run's time-weighted means and peaks (summary.json's ``perf``)."""
        out: dict[str, Any] = {"train_flops_per_image": self.flops, "device_peak_tflops": self.peak}
        for key in self._sums:
            name = key.split("/", 1)[1]
            out[f"{name}_mean"] = self._mean(key)
            if name in ("peak_mem_gib", "step_s", "data_wait"):
                out[f"{name}_max"] = self._sums[key][2]
        return out

