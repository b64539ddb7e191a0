"""The GPU check: one call of at most 8 minutes on one GPU (``--budget-s``, default 480) that measures what
docs/benchmarks.md's GPU section lists, writing every row the moment it ends.

Its parts, in priority order (``--parts`` chooses; each part, and each row within it, starts only when its estimated
time fits in what the budget leaves, else a row says it was skipped and why; a child process is ended at the
budget). The first four prove the GPU path before any timing (the first minute):

- ``environment``: torch, Triton, CUDA, the GPU, the C compiler Triton builds with, Python's headers, a writable
  Triton cache; then torch.library.opcheck on every ``torch.ops.quest.*`` operator (bench/gpu_env.py);
- ``kernels``: each fused q/k kernel against float64 over head widths x dtypes x layouts (bench/gpu_kernels.py);
- ``fused_step``: per formulation one ViT-B bf16 step with the fused operators and without (bench/gpu_fused.py);
- ``loop``: train.py's loop: host syncs between log intervals, a NaN step skipped under fp16, compile with CUDA
  graphs and accumulation, finishing batches ahead bit-equal (bench/gpu_loop.py);

then the measurements:

- ``numerics``: every formulation's logits and gradients (ViT-Ti at 64 px) on the GPU in float32 against the CPU in
  float64 (bench/gpu_numerics.py);
- ``step_bf16``: the training step of ViT-B/16 at 224 px, batch 128, eager, bf16 autocast: timm's own ViT
  (``timm.create_model("vit_base_patch16_224")``) as the anchor row, then every formulation: step time, img/s, MFU,
  SDPA kernel, peak memory, and beside it the CPU proxy of the step's cost (bench/dispatch_proxy.py);
- ``recipe``: train.py against the bare step: the recipe's parts (drop path, mixup / cutmix, EMA, its optimizer)
  built by quest's builders added one at a time, and train.py's own steady step (bench/gpu_recipe.py);
- ``fsdp``: ``torchrun --nproc_per_node=1 train.py trainer.strategy=fsdp recipe.ema=false``: exit code and time;
- ``step_compiled``: the same step compiled (bf16), as many rows as fit in 150 s (when parts follow it; alone, or
  last of those chosen, as many as the budget allows);
- ``toy``: ``python -m quest.toy grid=quick device=cuda`` end to end, then one full-grid chunk (150 runs, 4,096
  samples) with the full grid's time estimated from it;
- ``apps``: the default digits run on the GPU, a torchrun job with one process on NCCL;
- ``input``: the device's share of data.pipeline=split and =device (RandAugment, erasing, nvJPEG decode);
- ``step_fp16``, ``step_compiled_fp16``: the step tables in fp16 (GradScaler), eager then compiled.

    python bench/gpu.py --out docs/results/gpu             # on a GPU: at most 8 minutes
    python bench/gpu.py --out /tmp/gpu --parts step_compiled --budget-s 480   # the compiled rows the first left out
    python bench/gpu.py --cpu-smoke --out /tmp/gpu-smoke   # every part's code path, tiny shapes, on the CPU

It writes into ``--out``: gpu_check.jsonl (one JSON line per row, appended as each ends; a second call into the
same folder appends its rows after the first's), gpu_check.json and gpu_check.md (the report of every call's rows so
far, rebuilt after each row). Exit 0 when every part that ran passed its checks
(children exited 0, numerics within tolerance, the device's RandAugment equal to the CPU's), 1 otherwise.

The test (tests/bench/test_bench_gpu.py) calls main(..., in_process=True, compile_backend="aot_eager"): train.py, the
torchrun jobs and quest.toy run as calls in its process (the same overrides, through quest's Python API) instead of
child interpreters, and the compiled rows stop before inductor's code generation (30-40 s per graph on a CPU).
"""
from __future__ import annotations

import time

STARTED = time.perf_counter()  # run as a command, the budget counts the imports below too

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.gpu_apps import input_on_device, toy_chunk, toy_quick, train_run  # noqa: E402
from bench.gpu_env import environment_row, opcheck_rows  # noqa: E402
from bench.gpu_fused import fused_step_row  # noqa: E402
from bench.gpu_kernels import check_kernels_rows, kernel_rows  # noqa: E402
from bench.gpu_loop import compile_row, prefetch_row, sync_row  # noqa: E402
from bench.gpu_markdown import render  # noqa: E402
from bench.gpu_numerics import numerics_row  # noqa: E402
from bench.gpu_recipe import train_vs_bare  # noqa: E402
from bench.gpu_report import Budget, Part, PartRun, Report, run_parts  # noqa: E402
from bench.gpu_step import TIMM, device_peak, proxy_cost, table_order, train_throughput  # noqa: E402

#: the longest one proxy count (ViT-Ti on the CPU) may take before the table stops counting: its time is the budget's
PROXY_MAX_S = 15.0


class Check:
    """What every part shares: the device, the shapes (ViT-B/16 at 224 px, batch 128; the smoke's vit_pico at depth
    2), the step count, and how apps run (children, or calls in this process for a test)."""

    def __init__(self, smoke: bool, steps: int | None, device: torch.device, in_process: bool, compile_backend: str):
        self.smoke, self.device, self.in_process, self.compile_backend = smoke, device, in_process, compile_backend
        # the smoke's ViT: two blocks, the fewest where the elliptical formulations carry state from one block to
        # the next; its compilation takes a third of the time four blocks take
        self.name, self.size, self.batch = ("vit_pico_patch4_16", 16, 4) if smoke else ("vit_base_patch16_224", 224, 128)
        self.depth = 2 if smoke else None
        self.steps = steps or (2 if smoke else 20)  # the H200 figures: the median of 20 steps
        self.warmup = 0 if smoke else 2  # the smoke's times mean nothing
        self.env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}

    def timeout(self, run: PartRun) -> float:
        return max(run.left() - 10.0, 1.0)  # ten seconds to end a child's process group at the budget

    def steps_table(self, run: PartRun, dtype: torch.dtype, compiled: bool) -> None:
        """timm's own ViT first, then every formulation, standard first; in the smoke the compiled tables run the
        first formulation only (compiling on a CPU is slow; the compiled step is the same code for every one)."""
        names = [TIMM, *table_order()]
        if self.smoke and compiled:
            names = names[1:2]
        slow = None  # a proxy count that took too long on this machine's CPU: the rest are left to bench/gpu_proxy.py
        for attention in names:
            if not run.afford(attention):
                continue
            row = train_throughput(self.name, attention, self.size, self.batch, dtype, compiled, self.steps,
                                   self.device, self.compile_backend, self.depth, warmup=self.warmup)
            if not compiled:  # the proxy counts the eager step's kernels
                row["proxy"] = proxy_cost(attention, dtype, self.smoke) if slow is None else {
                    "launches": None, "bytes": None, "reason": f"not counted here: one count took {slow:.0f} s on "
                    "this CPU (python bench/gpu_proxy.py --model vit_tiny_patch16_224 --batch 2 counts them apart)"}
                slow = slow if (row["proxy"].get("seconds") or 0) <= PROXY_MAX_S else row["proxy"]["seconds"]
            run.row(row)
            print(json.dumps(row, default=str), flush=True)

    def environment(self, run: PartRun) -> None:
        run.row(environment_row(self.device))
        for row in opcheck_rows(self.device):
            run.row(row)

    def kernels(self, run: PartRun) -> None:
        kernel_rows(self.device, self.smoke, emit=run.row)
        for row in check_kernels_rows(self.device, self.smoke):
            run.row(row)

    def fused_step(self, run: PartRun) -> None:
        # a check, not the step tables' timing
        steps, warmup = (1, 0) if self.smoke else (5, 1)
        # the smoke's fused operators run their own PyTorch code: the kernels part ran them in Triton's interpreter,
        # which would make each step here a second or more
        interpreter = {"TRITON_INTERPRET": "0"} if self.smoke else {}
        for attention in table_order():
            if run.afford(attention):
                with mock.patch.dict(os.environ, interpreter):
                    row = fused_step_row(attention, self.name, self.size, self.batch, self.device, self.depth, steps,
                                         warmup)
                run.row(row)

    def loop(self, run: PartRun) -> None:
        loop = (8, 4) if self.smoke else (20, 10)  # steps, and a log every so many
        for label, work in (("host syncs, bf16 AdamW", lambda: sync_row(self.device, "bf16_adamw", *loop)),
                            ("host syncs, fp16 with NaN gradients",
                             lambda: sync_row(self.device, "fp16_nan_grads", *loop)),
                            ("host syncs, fp16 with a NaN loss", lambda: sync_row(self.device, "fp16_nan_loss", *loop)),
                            ("compile reduce-overhead, accum_steps=2",
                             lambda: compile_row(self.device, self.compile_backend)),
                            ("prefetch on/off", lambda: prefetch_row(self.device))):
            if run.afford(label, 5.0 if self.smoke else 20.0):
                run.row(work())

    def numerics(self, run: PartRun) -> None:
        name, size, batch = ("vit_pico_patch4_16", 16, 2) if self.smoke else ("vit_tiny_patch16_224", 64, 4)
        for attention in table_order():
            if run.afford(attention):
                run.row(numerics_row(attention, name, size, batch, self.device, self.depth))

    def recipe(self, run: PartRun) -> None:
        train_vs_bare(run, self.device, self.smoke, self.steps, self.warmup, self.in_process, self.compile_backend)

    def fsdp(self, run: PartRun) -> None:
        overrides = ["trainer.strategy=fsdp", "recipe.ema=false", "trainer.epochs=1", "trainer.max_steps=5",
                     f"trainer.device={self.device.type}"]
        with tempfile.TemporaryDirectory() as tmp:
            out = train_run(overrides, Path(tmp), self.env, torchrun=True, in_process=self.in_process,
                            timeout=self.timeout(run))
        run.row({**out, "overrides": overrides, "backend": "nccl" if self.device.type == "cuda" else "gloo",
                 "ok": out["returncode"] == 0})

    def apps(self, run: PartRun) -> None:
        short = ["trainer.epochs=1", "trainer.max_steps=2"] if self.smoke else []
        for label, overrides, torchrun, estimate in (
                ("the default digits run", [*short, f"trainer.device={self.device.type}"], False, 45.0),
                (f"torchrun, one process ({'nccl' if self.device.type == 'cuda' else 'gloo'})",
                 ["trainer.epochs=1", "trainer.max_steps=5", f"trainer.device={self.device.type}"], True, 35.0)):
            if not run.afford(label, 5.0 if self.smoke else estimate):
                continue
            with tempfile.TemporaryDirectory() as tmp:
                out = train_run(overrides, Path(tmp), self.env, torchrun=torchrun, in_process=self.in_process,
                                timeout=self.timeout(run))
            run.row({"run": label, **out, "ok": out["returncode"] == 0})

    def toy(self, run: PartRun) -> None:
        # one process, as on a GPU (quest.toy's default there): on a CPU it would spawn a worker per core
        quick = ["grid.lrs=[0.01]", "grid.init_seeds=[0]", "data.train_size=64", "data.test_size=64",
                 "probe_size=32", "train.epochs=1", "compile=false", "workers=1"] if self.smoke else []
        if run.afford("quick grid", 5.0 if self.smoke else 90.0):
            out = toy_quick(self.device, quick, self.env, self.in_process, timeout=self.timeout(run))
            run.row({"quick_grid": out, "ok": out["returncode"] == 0})
        if run.afford("full-grid chunk", 5.0 if self.smoke else 120.0):
            run.row(toy_chunk(self.device, self.smoke))

    def input(self, run: PartRun) -> None:
        run.row(input_on_device(self.device, self.smoke))

    def parts(self) -> list[Part]:
        """Every part in priority order, with its first row's estimate on the GPU (the H200's figures, rounded
        up) and in the smoke, and the compiled tables' cap."""
        step = functools.partial
        return [
            Part("environment", "versions, compiler, headers, Triton cache, opcheck", self.environment, (10.0, 5.0)),
            Part("kernels", "fused kernels against float64", self.kernels, (60.0, 10.0)),
            Part("fused_step", "one step fused and unfused per formulation", self.fused_step, (10.0, 3.0)),
            Part("loop", "host syncs, a NaN step, compile, prefetch", self.loop, (20.0, 5.0)),
            Part("numerics", "logits and gradients against float64", self.numerics, (20.0, 5.0)),
            Part("step_bf16", "training step, eager, bf16", step(self.steps_table, dtype=torch.bfloat16,
                                                                 compiled=False), (10.0, 3.0)),
            Part("recipe", "train.py against the bare step", self.recipe, (10.0, 3.0)),
            Part("fsdp", "one-process FSDP run", self.fsdp, (40.0, 5.0)),
            Part("step_compiled", "training step, compiled, bf16", step(self.steps_table, dtype=torch.bfloat16,
                                                                        compiled=True), (60.0, 10.0), cap_s=150.0),
            Part("toy", "the toy study on the device", self.toy, (90.0, 5.0)),
            Part("apps", "default run and torchrun", self.apps, (45.0, 5.0)),
            Part("input", "the training input on the device", self.input, (20.0, 5.0)),
            Part("step_fp16", "training step, eager, fp16", step(self.steps_table, dtype=torch.float16,
                                                                 compiled=False), (10.0, 3.0)),
            Part("step_compiled_fp16", "training step, compiled, fp16", step(self.steps_table, dtype=torch.float16,
                                                                             compiled=True), (60.0, 10.0)),
        ]


PART_NAMES = [p.name for p in Check(True, None, torch.device("cpu"), True, "eager").parts()]


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _meta(check: Check, budget_s: float, argv: list[str]) -> dict[str, Any]:
    import timm

    device_name, peak = device_peak(check.device)
    return {"device": device_name, "device_type": check.device.type, "peak_flops": peak, "torch": torch.__version__,
            "cuda": torch.version.cuda, "timm": timm.__version__, "model": check.name, "depth": check.depth,
            "img_size": check.size, "batch": check.batch, "steps": check.steps, "smoke": check.smoke,
            "budget_s": budget_s, "command": " ".join(["python bench/gpu.py", *argv]), "commit": _commit(),
            "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def failures(report: Report) -> list[str]:
    """The parts of this call that raised or whose rows failed a check (a row with ``ok`` False); an earlier call's
    into the same folder are its own."""
    return [name for name, entry in report.parts.items() if entry.get("call") == report.call
            and (entry["status"] == "failed" or any(r.get("ok") is False for r in report.rows(name)))]


def main(argv: list[str] | None = None, *, in_process: bool = False, compile_backend: str = "inductor",
         started: float | None = None) -> int:
    """The command (``argv``: default sys.argv[1:]). ``in_process`` and ``compile_backend``: what a test sets (the
    module's docstring says why); the command line runs the apps as child interpreters and compiles with inductor.
    ``started``: when the budget began on time.perf_counter's clock (the command line: before its imports; None:
    now, as a caller in a longer process wants)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU: every code path, in seconds")
    parser.add_argument("--out", required=True, help="folder for gpu_check.jsonl, gpu_check.json and gpu_check.md")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row (default 20; smoke 2)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="the whole call's seconds (default 480)")
    parser.add_argument("--parts", default=",".join(PART_NAMES),
                        help=f"comma-separated, run in this priority order whatever the order given: {', '.join(PART_NAMES)}")
    args = parser.parse_args(argv)
    chosen = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in PART_NAMES]
    if unknown or not chosen:
        parser.error(f"--parts: unknown part(s) {', '.join(unknown) or '(none given)'}; expected a comma-separated "
                     f"choice of {', '.join(PART_NAMES)}")
    if Path(args.out).exists() and not Path(args.out).is_dir():  # before any work: nothing written, nothing run
        print(f"bench/gpu.py: error: --out {args.out} is a file; expected a folder (new, or one an earlier call "
              "wrote into: its rows are kept)", file=sys.stderr)
        return 2
    smoke = args.cpu_smoke
    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not smoke:
        print("no GPU: run with --cpu-smoke for the CPU check of the code paths", file=sys.stderr)
        return 2
    budget = Budget(args.budget_s, time.perf_counter, start=started)
    check = Check(smoke, args.steps, device, in_process, compile_backend)
    report = Report(Path(args.out), _meta(check, args.budget_s, argv), render)
    threads = torch.get_num_threads()
    if smoke:  # tiny shapes gain nothing from a second thread, and on shared cores threads waiting for each other at
        torch.set_num_threads(1)  # every op made an eager row 30x slower (4 s instead of 0.1 s)
    try:
        run_parts([p for p in check.parts() if p.name in chosen], report, budget, smoke)
    finally:  # a caller in this process (a test) keeps its own setting; fit sets one thread on a CPU too
        torch.set_num_threads(threads)
        ending = {"elapsed_s": budget.elapsed(), "failed": failures(report)}
        report.meta.update(ending)
        report.write()
        report.close(ending)
    print((Path(args.out) / "gpu_check.md").read_text())
    return 1 if report.meta["failed"] else 0


def _stopped(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)  # the part running is marked interrupted, its child ended


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stopped)  # a time limit's SIGTERM (timeout, a job's end): the rows so far stay
    sys.exit(main(started=STARTED))
