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
- timed apart (:class:`IntervalTimes`): steps that compiled or recompiled (:func:`compilations`, torch's compile
  callbacks, read on the host) and the wait for an epoch's first batches (the loader's workers starting, its queue
  filling). Each is reported (``perf/compile_s``, ``perf/compile_steps``, ``perf/loader_start_s``) and left out of
  the figures above, their means and the advice, which describe the steady state.
- advice: per epoch, naming only the settings the run has not already set (:class:`Levers`, from its config).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from quest.run.train_state import Attempt, Figure, figures

log = logging.getLogger("quest.train")

__all__ = ["PEAK_TFLOPS", "peak_tflops", "flops_per_image", "Telemetry", "resident_peak_bytes", "Levers",
           "IntervalTimes", "Apart", "compilations", "perf_text"]

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

#: the pipelines that move the augmentation onto the GPU, in the order that moves more of it (docs/data.md)
GPU_PIPELINES = ("split", "device")
#: the data config that reads WebDataset shards (quest/data/sets/shards.py; python -m quest.tools.make_shards convert)
SHARD_DATA = "imagenet_wds"


@dataclass(frozen=True)
class Levers:
    """What the advice may suggest: only settings the run has not already set. Built from the run's config by
    :meth:`of`; the default (no config known, e.g. bench/telemetry.py) has every lever.

    ``compile``: trainer.compile is off. ``bf16``: the run computes in fp32. ``pipelines``: the data.pipeline values
    that would move more of the augmentation onto the GPU than the run's does. ``workers``: data.num_workers when
    fewer than this process's share of the CPUs, less, on the CPU, the compute's threads and the main process (more
    cannot help beyond that; None: no more). ``shards``: the data
    set reads image files one by one (a shard copy reads them in sequence). ``batch_size``: data.batch_size.
    ``cpu``: the run computes on the CPU, where a wait for data with no lever left is the data's share of the same
    cores, not a fault to report."""

    compile: bool = True
    bf16: bool = True
    pipelines: tuple[str, ...] = GPU_PIPELINES
    workers: int | None = 0
    shards: bool = True
    batch_size: int | None = None
    cpu: bool = False  # the run computes on the CPU: its data's preparation shares the compute's cores

    @classmethod
    def of(cls, cfg: Any, device: torch.device, precision: str) -> Levers:
        """The levers of a run of ``cfg`` on ``device`` at its resolved ``precision`` (fp32 | bf16 | fp16)."""
        from quest.data.registry import get_dataset

        try:
            dataset = get_dataset(cfg.data.name)
            reads_files, streamed = dataset.reads_files, dataset.streamed
        except ValueError:  # a data set this process does not know: no lever that depends on it
            reads_files, streamed = False, True
        pipelines: tuple[str, ...] = ()
        current = cfg.data.get("pipeline", "timm")
        if device.type == "cuda":  # on the CPU the "device's" share runs on the same cores as the workers
            later = GPU_PIPELINES[GPU_PIPELINES.index(current) + 1:] if current in GPU_PIPELINES else GPU_PIPELINES
            pipelines = tuple(p for p in later if _pipeline_fits(cfg, p, reads_files))
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cpus = os.cpu_count() or 1
        cpus //= max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), 1)  # torchrun: the node's ranks share them
        if device.type == "cpu":  # the compute's threads and the main process take their cores before any worker
            cpus -= torch.get_num_threads() + 1
        workers = int(cfg.data.num_workers)
        return cls(compile=not cfg.trainer.compile, bf16=precision == "fp32", pipelines=pipelines,
                   workers=workers if workers < cpus else None, shards=reads_files and not streamed,
                   batch_size=int(cfg.data.batch_size), cpu=device.type == "cpu")

    def for_data(self) -> list[str]:
        """What to try when the loader is the bottleneck (docs/data.md), in words."""
        out = [] if self.workers is None else [f"more loader workers (data.num_workers, now {self.workers})"]
        if self.pipelines:
            out.append("the augmentation on the GPU (" + " or ".join(f"data.pipeline={p}" for p in self.pipelines)
                       + ")")
        if self.shards:
            out.append(f"data read from shards (data={SHARD_DATA}, made by python -m quest.tools.make_shards convert)")
        return out

    def for_model(self) -> list[str]:
        """What to try when the GPU is under-used with little data wait, in words."""
        out = ["trainer.compile=true"] if self.compile else []
        out += ["trainer.precision=bf16"] if self.bf16 else []
        size = f" (now {self.batch_size})" if self.batch_size else ""
        return out + [f"a larger data.batch_size{size}"]


def _pipeline_fits(cfg: Any, name: str, reads_files: bool) -> bool:
    """Whether the run's config with ``data.pipeline=name`` passes that pipeline's checks (a data set that reads
    image files for ``device``; the recipe steps a uint8 pipeline reproduces): advice suggests no refused setting."""
    from omegaconf import OmegaConf

    from quest.config.checks import Checks
    from quest.data.pipelines.train_input import get_train_input

    kind = get_train_input(name)
    if kind.reads_files and not reads_files:
        return False
    checks = Checks(OmegaConf.merge(cfg, {"data": {"pipeline": name}}))
    if kind.check is not None:
        kind.check(checks)
    return not checks.problems


def _count_compile(*_: Any) -> None:
    _compiled[0] += 1


_compiled = [0]


def compilations() -> int:
    """The compilations torch has finished in this process (torch._dynamo's end-of-compile callback: a Dynamo frame
    compiled or recompiled, a backward compiled lazily, a CUDA graph recorded). A host counter: reading it before
    and after a step says whether the step compiled, with no device synchronisation. torch._dynamo.reset() clears
    the callbacks; the next call registers this one again."""
    handler = torch._dynamo.callback_handler
    if _count_compile not in handler.end_callbacks:
        handler.register_end_callback(_count_compile)
    return _compiled[0]


@dataclass
class Apart:
    """The time left out of an interval's figures: steps that compiled, and the wait for an epoch's first batches
    (its workers starting, its prefetch queue filling: not the loader's steady speed)."""

    compile_s: float = 0.0
    compile_steps: int = 0
    loader_start_s: float = 0.0
    loader_starts: int = 0

    def add(self, other: Apart) -> None:
        self.compile_s += other.compile_s
        self.compile_steps += other.compile_steps
        self.loader_start_s += other.loader_start_s
        self.loader_starts += other.loader_starts


@dataclass
class IntervalTimes:
    """One log interval's host time, step by step: steady steps (``seconds``, ``data_wait``, ``images``, ``steps``:
    the interval's figures) and the time :class:`Apart`."""

    seconds: float = 0.0
    data_wait: float = 0.0
    images: int = 0
    steps: int = 0
    apart: Apart = field(default_factory=Apart)

    def add_step(self, seconds: float, data_wait: float, images: int, compiled: bool, loader_start: bool) -> None:
        """One optimizer step: ``seconds`` since the last one ended, ``data_wait`` of it spent waiting for batches;
        ``compiled``: torch compiled during it; ``loader_start``: its batches were the epoch's first."""
        if loader_start:
            self.apart.loader_start_s += data_wait
            self.apart.loader_starts += 1
            seconds, data_wait = seconds - data_wait, 0.0
        if compiled:  # its host time is the compilation's, the step itself a small part of it
            self.apart.compile_s += seconds
            self.apart.compile_steps += 1
            return
        self.seconds += seconds
        self.data_wait += data_wait
        self.images += images
        self.steps += 1


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
    levers: Levers = field(default_factory=Levers)  # what the advice may suggest (StepLog sets the run's)
    _epoch: list[float] = field(default_factory=lambda: [0.0, 0.0])  # steady data wait, wall seconds
    _apart: Apart = field(default_factory=Apart)  # the run's time left out of the figures
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

    def interval(self, seconds: float, data_wait: float, images: int, steps: int,
                 apart: Apart | None = None) -> dict[str, float]:
        """The figures of one log interval's steady steps: ``images`` over every process in ``seconds`` of wall
        time, ``steps`` optimizer steps, ``data_wait`` seconds this process spent waiting for batches; the time
        ``apart`` reported beside them (an interval of compiling steps only has no other figure)."""
        row = self._apart_row(apart)
        figures: dict[str, float] = {}
        memory = self._peak_memory()  # the interval's peak, compiling steps included: memory is not a rate
        if memory is not None:
            figures["perf/peak_mem_gib"] = memory
        seconds = max(seconds, 1e-9) if steps else 0.0  # no steady step: the peak counts in the maximum only
        if steps:
            self._epoch[0] += data_wait
            self._epoch[1] += seconds
            per_device = images / self.world_size / seconds
            figures.update({"perf/data_wait": data_wait / seconds, "perf/step_s": seconds / steps,
                            "perf/img_per_s_per_device": per_device, "perf/img_per_s": images / seconds})
            if self.flops:
                figures["perf/tflops_per_device"] = self.flops * per_device / 1e12
                if self.peak:
                    figures["perf/mfu"] = figures["perf/tflops_per_device"] / self.peak
        for key, value in figures.items():
            total = self._sums.setdefault(key, [0.0, 0.0, float("-inf")])
            total[0] += value * seconds  # time-weighted mean
            total[1] += seconds
            total[2] = max(total[2], value)
        return {**figures, **row}

    def _apart_row(self, apart: Apart | None) -> dict[str, float]:
        if apart is None:
            return {}
        self._apart.add(apart)
        # in every row, 0 when nothing was apart: a row's keys do not depend on where a compile or a resume fell
        return {"perf/compile_s": apart.compile_s, "perf/compile_steps": apart.compile_steps,
                "perf/loader_start_s": apart.loader_start_s}

    def end_epoch(self, epoch: int, seconds: float, data_wait: float, apart: Apart | None = None) -> list[str]:
        """The advice for the epoch just ended, given the steady wall and wait seconds since its last interval (and
        the time ``apart`` in them, counted in the summary); the loop logs it. Each piece is said when its condition
        starts (not again for every epoch it lasts: the log lines carry the figures) and again if it comes back
        after an epoch without it. It names only :attr:`levers`, the settings the run has not set."""
        if apart is not None:
            self._apart.add(apart)
        wait, wall = self._epoch[0] + data_wait, self._epoch[1] + seconds
        self._epoch = [0.0, 0.0]
        if wall <= 0:
            return []
        said, self._active = self._active, set()
        advice = []
        levers = self.levers.for_data()
        # on the CPU the data's preparation shares the cores with the compute: a share of the time, not a fault,
        # unless a setting could move it onto cores the run leaves idle (Levers.of)
        if wait / wall > self.data_wait_warning and (levers or not self.levers.cpu):
            self._active.add("data")
            advice += [] if "data" in said else [
                f"epoch {epoch}: training waited for data {100 * wait / wall:.0f}% of the time (above "
                f"trainer.data_wait_warning, {self.data_wait_warning}); the loader is the bottleneck: "
                + (f"try {_either(levers)}" if levers else "quest's data settings are at their fastest here "
                   "(the CPUs or the storage are the limit)")]
        mfu = self._mean("perf/mfu")
        if mfu is not None and mfu < self.low_mfu_warning and wait / wall <= self.data_wait_warning:
            self._active.add("mfu")
            advice += [] if "mfu" in said else [
                f"epoch {epoch}: MFU {100 * mfu:.0f}% with little data wait ({100 * wait / wall:.0f}%): the GPU is "
                f"under-used by the model itself; try {_either(self.levers.for_model())}"]
        return advice

    def _mean(self, key: str) -> float | None:
        total = self._sums.get(key)
        return total[0] / total[1] if total and total[1] else None

    def totals(self) -> dict[str, Any]:
        """What :meth:`summary` is computed from, as an attempt's record holds it (quest.run.train_state.Attempt):
        the time apart and each figure's time-weighted sum, seconds and largest value."""
        apart = self._apart
        # clock noise could make a difference of host times a hair below 0; a record's times are >= 0
        return {"compile_s": max(apart.compile_s, 0.0), "compile_steps": apart.compile_steps,
                "loader_start_s": max(apart.loader_start_s, 0.0),
                "figures": {key.split("/", 1)[1]: Figure(max(weighted, 0.0), max(seconds, 0.0), max(largest, 0.0))
                            for key, (weighted, seconds, largest) in self._sums.items()}}

    def summary(self) -> dict[str, Any]:
        """The time-weighted means and peaks over the steady steps so far, and the time left out of them: the steps
        that compiled and the loaders' starts, in all (a run's summary.json covers its every attempt:
        quest.run.train_state.run_perf)."""
        return {"train_flops_per_image": self.flops, "device_peak_tflops": self.peak,
                **figures([Attempt(**self.totals())])}


def _either(levers: list[str]) -> str:
    return levers[0] if len(levers) == 1 else ", ".join(levers[:-1]) + ", or " + levers[-1]


def perf_text(perf: dict[str, float]) -> str:
    """The telemetry part of a log line: data wait, per-device rate, step time, peak memory, FLOP/s and MFU of the
    steady steps, then the time apart (compiling steps, the loader's start)."""
    parts = []
    if "perf/step_s" in perf:
        parts += [f"data {100 * perf['perf/data_wait']:.0f}%",
                  f"{perf['perf/img_per_s_per_device']:.0f} img/s/device", f"step {perf['perf/step_s']:.3g}s"]
    if "perf/peak_mem_gib" in perf:
        parts.append(f"peak {perf['perf/peak_mem_gib']:.2f} GiB")
    if "perf/tflops_per_device" in perf:
        parts.append(f"{perf['perf/tflops_per_device']:.3g} TFLOP/s/device"
                     + (f" MFU {100 * perf['perf/mfu']:.0f}%" if "perf/mfu" in perf else " (no MFU: peak unknown)"))
    if perf.get("perf/compile_steps"):
        steps = int(perf["perf/compile_steps"])
        parts.append(f"compiling {perf['perf/compile_s']:.3g}s ({steps} step{'s' if steps > 1 else ''}, "
                     "not in the figures)")
    if perf.get("perf/loader_start_s"):
        parts.append(f"loader start {perf['perf/loader_start_s']:.3g}s")
    return " ".join(parts)
