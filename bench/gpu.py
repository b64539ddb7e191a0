"""The GPU check (issue: GPU readiness): one command that, the first time a GPU is lent, measures what
docs/benchmarks.md lists as "not measured" and writes it as JSON and markdown.

For every formulation: ViT-B/16 at 224 px training throughput (img/s) and MFU (the FLOPs of one training step counted
with torch.utils.flop_counter, against the peak of the device named by torch.cuda.get_device_name), in bf16 and fp16
(autocast; fp16 with a GradScaler), eager and compiled; the SDPA backend each formulation's (q', k', v) reaches
(flash / efficient / cuDNN / math, read from the profiled kernels); peak memory. Then the default digits run on the
GPU (time, accuracy), a torchrun job with one process on NCCL completing a short run, and the toy study on the GPU:
one chunk of its full grid at 4,096 samples (150 runs, 6,400 steps, all in one call) with the full grid's time
estimated from it (30 such chunks), and `python -m quest.toy grid=quick device=cuda` end to end.

    python bench/gpu.py --out docs/results/gpu             # on a GPU, about 6-8 minutes
    python bench/gpu.py --cpu-smoke --out /tmp/gpu-smoke   # the same code paths, tiny shapes, on the CPU

The test (tests/test_bench_gpu.py) calls main(..., in_process=True, compile_backend="aot_eager"): train.py, the
torchrun job and quest.toy run as calls in its process (the same overrides, through quest's Python API) instead of
child interpreters, and the compiled rows stop before inductor's code generation (30-40 s per graph on a CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from quest.attention import list_attentions  # noqa: E402
from quest.models import create_model  # noqa: E402

# dense bf16 / fp16 tensor-core peaks (FLOP/s) by device name, from the vendors' datasheets
PEAKS = {"H200": 989e12, "H100 SXM": 989e12, "H100 80GB HBM3": 989e12, "H100 PCIe": 756e12, "H100": 989e12,
         "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "V100": 125e12}
SDPA_KERNELS = {"flash": "flash", "efficient": "efficient", "cudnn": "cudnn", "math": "math"}


def device_peak(device: torch.device) -> tuple[str, float | None]:
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAKS.items():
        if key in name:
            return name, peak
    return name, None


def sdpa_backend(model: torch.nn.Module, images: torch.Tensor, dtype: torch.dtype | None) -> str:
    """Which SDPA kernel one attention layer runs, from the profiled op names."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if images.is_cuda else [])
    with profile(activities=activities) as prof, torch.no_grad(), _autocast(images.device, dtype):
        model(images[:1])
    names = " ".join(e.key for e in prof.key_averages()).lower()
    for tag in ("flash", "cudnn", "efficient", "math"):
        if f"_scaled_dot_product_{tag}" in names or f"sdpa_{tag}" in names or (tag == "efficient" and "mem_eff" in names):
            return tag
    return "math" if "scaled_dot_product" in names else "unknown"


def _autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None else nullcontext()


def step_flops(model, images, targets, dtype) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, _autocast(images.device, dtype):
        F.cross_entropy(model(images), targets).backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def train_throughput(name: str, attention: str, size: int, batch: int, dtype: torch.dtype | None, compiled: bool,
                     steps: int, device: torch.device, compile_backend: str = "inductor",
                     depth: int | None = None, warmup: int = 2) -> dict[str, Any]:
    torch.manual_seed(0)
    blocks = {"depth": depth} if depth else {}  # None: the model's own
    model = create_model(name, attention=attention, num_classes=1000, img_size=size, **blocks).to(device)
    images = torch.randn(batch, 3, size, size, device=device)
    targets = torch.randint(0, 1000, (batch,), device=device)
    flops = step_flops(model, images, targets, dtype)
    backend = sdpa_backend(model, images, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    if compiled:  # a fresh dynamo cache per model: a dozen compiled ViTs share timm's forward, and past dynamo's
        torch._dynamo.reset()  # recompile limit (8 entries per code object) the later ones would run eagerly
    forward = torch.compile(model, backend=compile_backend) if compiled else model

    def step() -> None:
        with _autocast(device, dtype):
            loss = F.cross_entropy(forward(images), targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tic = time.perf_counter()
    step()  # compiles, when compiled
    sync()
    first = time.perf_counter() - tic
    for _ in range(warmup):  # untimed: a compiled step's recompilation, the allocator's growth
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        tic = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - tic)
    median = statistics.median(times)
    _, peak = device_peak(device)
    return {"attention": attention, "dtype": str(dtype).replace("torch.", "") if dtype else "fp32",
            "compiled": compiled, "compile_backend": compile_backend if compiled else None,
            "img_per_s": batch / median, "step_s": median, "first_step_s": first,
            "flops_per_step": flops, "mfu": (flops / median / peak) if peak else None, "sdpa_backend": backend,
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


def cli_run(args: list[str], cwd: Path, env: dict[str, str], timeout: int) -> dict[str, Any]:
    tic = time.perf_counter()
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - tic
    summary = next(cwd.rglob("summary.json"), None)
    return {"returncode": out.returncode, "seconds": seconds, "summary": json.loads(summary.read_text()) if summary else None,
            "stderr_tail": out.stderr[-1500:] if out.returncode else ""}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_process(work) -> dict[str, Any]:
    """``work()`` (an exit code) as cli_run reports a child: an exception is exit 1 with its traceback as stderr."""
    tic = time.perf_counter()
    try:
        code, tail = int(work()), ""
    except Exception:
        code, tail = 1, traceback.format_exc()[-1500:]
    return {"returncode": code, "seconds": time.perf_counter() - tic, "stderr_tail": tail}


def train_run(overrides: list[str], cwd: Path, env: dict[str, str], torchrun: bool, in_process: bool) -> dict[str, Any]:
    """``python train.py *overrides`` in ``cwd`` (``torchrun``: launched by torch.distributed.run, one process). With
    ``in_process``: the config composed from the same overrides and trained by quest.engine.fit in this process, under
    the variables torchrun gives its one worker (so fit joins a one-process gloo group), instead of a child."""
    if not in_process:
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_port=29511"]
                    if torchrun else [sys.executable])
        return cli_run([*launcher, str(ROOT / "train.py"), *overrides], cwd, env, 1200)
    import torch.distributed as dist
    from hydra import compose, initialize_config_dir

    from quest.cli import config_root
    from quest.config_store import register_configs
    from quest.engine import exit_code, fit

    def work() -> int:
        register_configs()
        with initialize_config_dir(config_dir=str(config_root()), version_base="1.3"):
            cfg = compose("train", overrides=overrides)
        ranks = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())} if torchrun else {}
        with mock.patch.dict(os.environ, {**env, **ranks}):  # restored afterwards: the caller's process goes on
            try:
                return exit_code(fit(cfg, cwd / "run"))
            finally:
                if torchrun and dist.is_initialized():  # a process goes on after this run: leave no group behind
                    dist.destroy_process_group()

    out = _in_process(work)
    summary = next(cwd.rglob("summary.json"), None)
    return {**out, "summary": json.loads(summary.read_text()) if summary else None}


def toy_quick(device: torch.device, overrides: list[str], env: dict[str, str], in_process: bool) -> dict[str, Any]:
    """``python -m quest.toy grid=quick device=<device> *overrides``: its exit code, time and summary table; with
    ``in_process`` the same config composed and run by quest.toy.study.run_study in this process."""
    with tempfile.TemporaryDirectory() as tmp:
        args = ["grid=quick", f"device={device.type}", f"out_dir={tmp}", *overrides]
        if not in_process:
            tic = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "quest.toy", *args], cwd=ROOT, env=env, capture_output=True,
                                  text=True, timeout=1200)
            return {"returncode": proc.returncode, "seconds": time.perf_counter() - tic,
                    "table": proc.stdout.strip()[-600:], "stderr_tail": proc.stderr[-1500:] if proc.returncode else ""}
        from hydra import compose, initialize_config_dir
        from omegaconf import OmegaConf

        from quest.cli import config_root
        from quest.toy.config import register_toy_config
        from quest.toy.outcomes import summary_table
        from quest.toy.study import run_study

        table: list[str] = []

        def work() -> int:
            register_toy_config()
            with initialize_config_dir(config_dir=str(config_root() / "toy"), version_base="1.3"):
                cfg = compose("toy", overrides=args)
            table.append(summary_table(run_study(OmegaConf.to_container(cfg, resolve=True), tmp)["success_rates"]))
            return 0

        return {**_in_process(work), "table": "".join(table).strip()[-600:]}


def toy_on_device(device: torch.device, smoke: bool, env: dict[str, str], in_process: bool = False) -> dict[str, Any]:
    """One full-grid chunk of the toy study (QUEST, 150 runs: every lr x weight decay x 5 initialisations) timed
    end to end, compilation included, and the quick grid as a user runs it."""
    from bench.toy import grid_specs  # the full grid's chunk: every lr x weight decay cell x 5 initialisations
    from quest.toy import ToyDataConfig, make_toy_data, train_chunk

    specs = grid_specs(150)
    cfg = ToyDataConfig(train_size=64 if smoke else 4096, test_size=64 if smoke else 1024)
    data = make_toy_data(cfg, 0)
    epochs = 1 if smoke else 50
    kwargs = {"seq_len": cfg.seq_len, "dim": cfg.dim, "num_classes": cfg.num_classes}
    tic = time.perf_counter()
    res = train_chunk("quest", specs, data.train, data.test, 0, epochs, 32, kwargs, compile=not smoke, device=device)
    seconds = time.perf_counter() - tic
    run_steps = len(specs) * epochs * -(-cfg.train_size // 32)
    out: dict[str, Any] = {"chunk_runs": len(specs), "train_size": cfg.train_size, "epochs": epochs,
                           "chunk_seconds": seconds, "phases": res.seconds, "run_steps_per_s": run_steps / seconds,
                           "full_grid_estimate_s": 30 * seconds}  # 6 formulations x 5 data realisations
    # one process, as on a GPU (quest.toy's default there): on a CPU it would spawn a worker per core
    quick = ["grid.lrs=[0.01]", "grid.init_seeds=[0]", "data.train_size=64", "data.test_size=64", "probe_size=32",
             "train.epochs=1", "compile=false", "workers=1"] if smoke else []
    out["quick_grid"] = toy_quick(device, quick, env, in_process)
    return out


def input_on_device(device: torch.device, smoke: bool) -> dict[str, Any]:
    """The device's share of data.pipeline=split and =device (docs/data.md): img/s of the DeiT augmentation on
    batches (RandAugment rand-m9-mstd0.5-inc1, normalise, random erasing 0.25) from uint8 crops, and of the whole
    input from JPEG bytes (decode with nvJPEG, crop, flip, then the same); and whether the device's RandAugment
    gives the CPU's pixels for the same draws."""
    import random

    from omegaconf import OmegaConf

    from bench.data import make_jpegs
    from quest.data.device_augment import DeviceRandAugment
    from quest.data.tensor_input import CropFlip, DeviceFinish, decode_rgb

    size, batch, rounds = (32, 8, 2) if smoke else (224, 128, 10)
    recipe = OmegaConf.create({"auto_augment": "rand-m9-mstd0.5-inc1", "reprob": 0.25, "remode": "pixel",
                               "recount": 1, "train_interpolation": "bicubic"})
    data = OmegaConf.create({"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]})
    crop = CropFlip(size, (0.08, 1.0), (3 / 4, 4 / 3), "bicubic", 0.5)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    random.seed(0), torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        encoded = [torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8)
                   for p in make_jpegs(Path(tmp), batch)]
    crops = torch.stack([crop(decode_rgb(e)) for e in encoded]).to(device)
    stages = {"split: RA + normalise + erase from uint8 crops": (DeviceFinish(recipe, data, size), crops),
              "device: decode + crop + flip + RA + normalise + erase from JPEG bytes":
                  (DeviceFinish(recipe, data, size, crop=crop), encoded)}
    out: dict[str, Any] = {"batch": batch, "img_size": size}
    for name, (finish, images) in stages.items():
        finish(images, device)  # warm-up
        sync()
        times = []
        for _ in range(rounds):
            tic = time.perf_counter()
            finish(images, device)
            sync()
            times.append(time.perf_counter() - tic)
        out[name] = batch / statistics.median(times)
    augment = DeviceRandAugment("rand-m9-mstd0.5-inc1", size, data.mean)
    draws = augment.draw(batch)
    out["rand_augment_equals_cpu"] = torch.equal(augment.apply(crops, draws).cpu(), augment.apply(crops.cpu(), draws))
    return out


def measure(smoke: bool, steps: int | None, device: torch.device, in_process: bool = False,
            compile_backend: str = "inductor") -> dict[str, Any]:
    """Every figure of the check, as the report's dict (main writes it as JSON and markdown)."""
    name, size, batch = ("vit_pico_patch4_16", 16, 4) if smoke else ("vit_base_patch16_224", 224, 128)
    # the smoke's ViT: two blocks, the fewest where the elliptical formulations carry state from one block to the
    # next; its compilation takes a third of the time four blocks take
    depth = 2 if smoke else None
    steps = steps or (2 if smoke else 10)
    formulations = list_attentions()
    dtypes = [torch.bfloat16, torch.float16]
    device_name, peak = device_peak(device)
    report: dict[str, Any] = {"device": device_name, "peak_flops": peak, "torch": torch.__version__, "model": name,
                              "depth": depth, "img_size": size, "batch": batch, "steps": steps, "smoke": smoke,
                              "throughput": []}
    for attention in formulations:
        for dtype in dtypes:
            # compiled: every row on a GPU; in the CPU smoke the first formulation in each dtype (compiling on CPU
            # is slow; the compiled step is the same code for every formulation, but fp16's adds the GradScaler)
            first = attention == formulations[0]
            for compiled in ((False, True) if not smoke or first else (False,)):
                row = train_throughput(name, attention, size, batch, dtype, compiled, steps, device, compile_backend,
                                       depth, warmup=0 if smoke else 2)  # the smoke's times mean nothing
                report["throughput"].append(row)
                print(json.dumps(row))
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        digits = ["trainer.epochs=1", "trainer.max_steps=2"] if smoke else []
        report["digits_default_run"] = train_run([*digits, f"trainer.device={device.type}"], Path(tmp), env,
                                                 torchrun=False, in_process=in_process)
    with tempfile.TemporaryDirectory() as tmp:
        short = ["trainer.epochs=1", "trainer.max_steps=5", f"trainer.device={device.type}"]
        report["torchrun_one_process"] = train_run(short, Path(tmp), env, torchrun=True, in_process=in_process)
        report["torchrun_one_process"]["backend"] = "nccl" if device.type == "cuda" else "gloo"
    report["toy"] = toy_on_device(device, smoke, env, in_process)
    print(json.dumps(report["toy"], default=str))
    report["input"] = input_on_device(device, smoke)
    print(json.dumps(report["input"]))
    return report


def main(argv: list[str] | None = None, *, in_process: bool = False, compile_backend: str = "inductor") -> int:
    """The command (``argv``: default sys.argv[1:]). ``in_process`` and ``compile_backend``: what a test sets (the
    module's docstring says why); the command line runs the apps as child interpreters and compiles with inductor."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU: every code path, in seconds")
    parser.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not smoke:
        print("no GPU: run with --cpu-smoke for the CPU check of the code paths", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    if smoke:  # tiny shapes gain nothing from a second thread, and on shared cores threads waiting for each other at
        torch.set_num_threads(1)  # every op made an eager row 30x slower (4 s instead of 0.1 s)
    try:
        report = measure(smoke, args.steps, device, in_process, compile_backend)
    finally:  # a caller in this process (a test) keeps its own setting; fit sets one thread on a CPU too
        torch.set_num_threads(threads)
    device_name, name, depth, size, batch, steps = (report[k] for k in ("device", "model", "depth", "img_size", "batch",
                                                                        "steps"))
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    lines = [f"# GPU check: {device_name} (torch {torch.__version__}){' — CPU smoke, not a measurement' if smoke else ''}",
             "", f"{name}{f' at depth {depth}' if depth else ''} at {size} px, batch {batch}, median of {steps} "
             "training steps (AdamW).", "",
             "| attention | dtype | compiled | img/s | MFU | SDPA backend | peak memory (GiB) |", "|---|---|---|---|---|---|---|"]
    for r in report["throughput"]:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        mem = f"{r['peak_memory_gib']:.2f}" if r["peak_memory_gib"] is not None else "n/a"
        lines.append(f"| {r['attention']} | {r['dtype']} | {r['compiled']} | {r['img_per_s']:.1f} | {mfu} | "
                     f"{r['sdpa_backend']} | {mem} |")
    d, t = report["digits_default_run"], report["torchrun_one_process"]
    lines += ["", f"Default digits run: exit {d['returncode']}, {d['seconds']:.1f} s, val top-1 "
              f"{(d['summary'] or {}).get('val/top1')}",
              f"torchrun, one process ({t['backend']}): exit {t['returncode']}, {t['seconds']:.1f} s, status "
              f"{(t['summary'] or {}).get('status')}"]
    y = report["toy"]
    lines += ["", f"Toy study, one full-grid chunk (QUEST, {y['chunk_runs']} runs, {y['train_size']} samples, "
              f"{y['epochs']} epochs, compilation included): {y['chunk_seconds']:.1f} s, "
              f"{y['run_steps_per_s']:.0f} run-steps/s; the full grid (30 such chunks) estimated at "
              f"{y['full_grid_estimate_s'] / 60:.1f} min",
              f"`python -m quest.toy grid=quick device={device.type}`: exit {y['quick_grid']['returncode']}, "
              f"{y['quick_grid']['seconds']:.1f} s", "", y["quick_grid"]["table"]]
    i = report["input"]
    lines += ["", f"Training input on the device (data.pipeline, batch {i['batch']} at {i['img_size']} px; "
              f"RandAugment equals the CPU's pixels for the same draws: {i['rand_augment_equals_cpu']}):", "",
              "| stage | img/s |", "|---|---|"]
    lines += [f"| {k} | {v:.0f} |" for k, v in i.items() if isinstance(v, float)]
    (out_dir / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    ok = d["returncode"] == 0 and t["returncode"] == 0 and y["quick_grid"]["returncode"] == 0
    return 0 if ok and i["rand_augment_equals_cpu"] else 1


if __name__ == "__main__":
    sys.exit(main())
