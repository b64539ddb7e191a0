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
    python bench/gpu.py --cpu-smoke --out /tmp/gpu-smoke   # the same code paths, tiny shapes, on the CPU (CI)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

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
                     steps: int, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    model = create_model(name, attention=attention, num_classes=1000, img_size=size).to(device)
    images = torch.randn(batch, 3, size, size, device=device)
    targets = torch.randint(0, 1000, (batch,), device=device)
    flops = step_flops(model, images, targets, dtype)
    backend = sdpa_backend(model, images, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    if compiled:  # a fresh dynamo cache per model: a dozen compiled ViTs share timm's forward, and past dynamo's
        torch._dynamo.reset()  # recompile limit (8 entries per code object) the later ones would run eagerly
    forward = torch.compile(model) if compiled else model

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
    for _ in range(2):
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
            "compiled": compiled, "img_per_s": batch / median, "step_s": median, "first_step_s": first,
            "flops_per_step": flops, "mfu": (flops / median / peak) if peak else None, "sdpa_backend": backend,
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


def cli_run(args: list[str], cwd: Path, env: dict[str, str], timeout: int) -> dict[str, Any]:
    tic = time.perf_counter()
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - tic
    summary = next(cwd.rglob("summary.json"), None)
    return {"returncode": out.returncode, "seconds": seconds, "summary": json.loads(summary.read_text()) if summary else None,
            "stderr_tail": out.stderr[-1500:] if out.returncode else ""}


def toy_on_device(device: torch.device, smoke: bool, env: dict[str, str]) -> dict[str, Any]:
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
    with tempfile.TemporaryDirectory() as tmp:
        quick = ["grid.lrs=[0.01]", "grid.init_seeds=[0]", "data.train_size=64", "train.epochs=1",
                 "compile=false"] if smoke else []
        tic = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "quest.toy", "grid=quick", f"device={device.type}",
                               f"out_dir={tmp}", *quick], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=1200)
        out["quick_grid"] = {"returncode": proc.returncode, "seconds": time.perf_counter() - tic,
                             "table": proc.stdout.strip()[-600:], "stderr_tail": proc.stderr[-1500:] if proc.returncode else ""}
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU: every code path, in seconds")
    parser.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    smoke = args.cpu_smoke
    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not smoke:
        print("no GPU: run with --cpu-smoke for the CPU check of the code paths", file=sys.stderr)
        return 2
    name, size, batch = ("vit_pico_patch4_16", 16, 4) if smoke else ("vit_base_patch16_224", 224, 128)
    steps = args.steps or (2 if smoke else 10)
    formulations = list_attentions()
    dtypes = [torch.bfloat16, torch.float16]
    device_name, peak = device_peak(device)
    report: dict[str, Any] = {"device": device_name, "peak_flops": peak, "torch": torch.__version__, "model": name,
                              "img_size": size, "batch": batch, "smoke": smoke, "throughput": []}
    for attention in formulations:
        for dtype in dtypes:
            # compiled: every formulation on a GPU; in the CPU smoke only the first (compiling on CPU is slow)
            for compiled in ((False, True) if not smoke or attention == formulations[0] else (False,)):
                row = train_throughput(name, attention, size, batch, dtype, compiled, steps, device)
                report["throughput"].append(row)
                print(json.dumps(row))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        digits = ["trainer.epochs=1", "trainer.max_steps=2"] if smoke else []
        report["digits_default_run"] = cli_run([sys.executable, str(ROOT / "train.py"), *digits,
                                                f"trainer.device={device.type}"], Path(tmp), env, 1200)
    with tempfile.TemporaryDirectory() as tmp:
        short = ["trainer.epochs=1", "trainer.max_steps=5", f"trainer.device={device.type}"]
        report["torchrun_one_process"] = cli_run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_port=29511",
             str(ROOT / "train.py"), *short], Path(tmp), env, 1200)
        report["torchrun_one_process"]["backend"] = "nccl" if device.type == "cuda" else "gloo"
    report["toy"] = toy_on_device(device, smoke, env)
    print(json.dumps(report["toy"], default=str))
    report["input"] = input_on_device(device, smoke)
    print(json.dumps(report["input"]))
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    lines = [f"# GPU check: {device_name} (torch {torch.__version__}){' — CPU smoke, not a measurement' if smoke else ''}",
             "", f"{name} at {size} px, batch {batch}, median of {steps} training steps (AdamW).", "",
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
