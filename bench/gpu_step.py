"""The training-step rows of bench/gpu.py: one step of a ViT (quest's formulations, and timm's own ViT as the anchor)
timed on the device, its FLOPs (torch.utils.flop_counter) and MFU, the SDPA kernel it reaches, its peak memory, and
beside it the CPU-side proxy of the step's cost (bench/dispatch_proxy.py, when present)."""
from __future__ import annotations

import gc
import statistics
import time
from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.nn.functional as F

from quest.attention import list_attentions
from quest.models import create_model
from quest.train.telemetry import peak_tflops

__all__ = ["TIMM", "device_peak", "sdpa_backend", "step_flops", "time_steps", "train_throughput", "proxy_cost",
           "table_order", "autocast"]

#: the attention name of timm's own ViT (``timm.create_model(name)``, timm's Attention): the tables' anchor row
TIMM = "timm"
# the H200 run's row order; a formulation added later comes after these
_ORDER = ("standard", "quest", "qnorm", "qknorm", "qknorm_hs", "qknorm_ds", "elliptical", "elliptical_quest")


def table_order() -> list[str]:
    """Every formulation, standard first (the ratios' denominator), then as the H200 table ordered them."""
    names = list_attentions()
    return [a for a in _ORDER if a in names] + [a for a in names if a not in _ORDER]


def device_peak(device: torch.device) -> tuple[str, float | None]:
    """The device's name and dense bf16 peak FLOP/s (quest's telemetry table; fp16's is the same), None if unknown."""
    if device.type != "cuda":
        return "cpu", None
    peak = peak_tflops(device, "bf16")
    return torch.cuda.get_device_name(device), peak * 1e12 if peak else None


def autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None else nullcontext()


def sdpa_backend(model: torch.nn.Module, images: torch.Tensor, dtype: torch.dtype | None) -> str:
    """Which SDPA kernel one attention layer runs, from the profiled op names."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if images.is_cuda else [])
    with profile(activities=activities) as prof, torch.no_grad(), autocast(images.device, dtype):
        model(images[:1])
    names = " ".join(e.key for e in prof.key_averages()).lower()
    for tag in ("flash", "cudnn", "efficient", "math"):
        if f"_scaled_dot_product_{tag}" in names or f"sdpa_{tag}" in names or (tag == "efficient" and "mem_eff" in names):
            return tag
    return "math" if "scaled_dot_product" in names else "unknown"


def step_flops(model, images, targets, dtype) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, autocast(images.device, dtype):
        F.cross_entropy(model(images), targets).backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def time_steps(step: Callable[[], None], steps: int, warmup: int, device: torch.device) -> dict[str, Any]:
    """``step()`` once (it compiles, when compiled), ``warmup`` more untimed (a compiled step's recompilation, the
    allocator's growth), then ``steps`` timed one by one: the median, the first step's time and the peak memory of
    the timed steps."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tic = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - tic
    for _ in range(warmup):
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
    return {"step_s": statistics.median(times), "first_step_s": first,
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


def free(device: torch.device) -> None:
    """Drop what the last row left (its model, optimizer state, compiled graphs' buffers) before the next one."""
    if device.type == "cuda":  # (on the CPU the allocator returns memory itself, and a collection costs 0.1-0.3 s)
        gc.collect()
        torch.cuda.empty_cache()


def _model(name: str, attention: str, size: int, depth: int | None) -> torch.nn.Module:
    import timm

    blocks = {"depth": depth} if depth else {}  # None: the model's own
    if attention == TIMM:
        return timm.create_model(name, num_classes=1000, img_size=size, **blocks)
    return create_model(name, attention=attention, num_classes=1000, img_size=size, **blocks)


def train_throughput(name: str, attention: str, size: int, batch: int, dtype: torch.dtype | None, compiled: bool,
                     steps: int, device: torch.device, compile_backend: str = "inductor",
                     depth: int | None = None, warmup: int = 2) -> dict[str, Any]:
    """The bare training step (AdamW, fused on CUDA; cross-entropy; a GradScaler in fp16) of ``name`` with
    ``attention`` (:data:`TIMM`: timm's own model), timed as :func:`time_steps` says."""
    row = _train_throughput(name, attention, size, batch, dtype, compiled, steps, device, compile_backend, depth, warmup)
    free(device)  # the row's model, optimizer and graphs are gone with its frame
    return row


def _train_throughput(name, attention, size, batch, dtype, compiled, steps, device, compile_backend, depth, warmup):
    torch.manual_seed(0)
    model = _model(name, attention, size, depth).to(device)
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
        with autocast(device, dtype):
            loss = F.cross_entropy(forward(images), targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    timed = time_steps(step, steps, warmup, device)
    _, peak = device_peak(device)
    return {"attention": attention, "dtype": str(dtype).replace("torch.", "") if dtype else "fp32",
            "compiled": compiled, "compile_backend": compile_backend if compiled else None,
            "img_per_s": batch / timed["step_s"], **timed, "flops_per_step": flops,
            "mfu": (flops / timed["step_s"] / peak) if peak else None, "sdpa_backend": backend}


_PROXY_CACHE: dict[tuple[str, str, str], dict[str, Any]] = {}


def proxy_cost(attention: str, dtype: torch.dtype, smoke: bool) -> dict[str, Any]:
    """bench.dispatch_proxy.step_cost(attention): the kernels one training step launches on the GPU path and the
    bytes its non-matmul operations move, counted on the CPU under CUDA's autocast rules (ViT-Ti at 224 px, batch 2;
    the CPU smoke: vit_pico at 16 px). Imported here, not at the top: where that module is missing (or fails) the
    figures are None and ``reason`` says why, and the check goes on."""
    if attention == TIMM:
        return {"launches": None, "bytes": None, "reason": "not a quest formulation"}
    model, size = ("vit_pico_patch4_16", 16) if smoke else ("vit_tiny_patch16_224", 224)
    key = (attention, str(dtype), model)
    if key in _PROXY_CACHE:
        return _PROXY_CACHE[key]
    try:
        from bench.dispatch_proxy import step_cost
    except Exception as exc:  # ImportError where it is missing; anything it raises on import
        return {"launches": None, "bytes": None, "reason": f"bench.dispatch_proxy: {type(exc).__name__}: {exc}"}
    tic = time.perf_counter()
    try:
        cost = step_cost(attention, model=model, batch=2, img_size=size, dtype=dtype)
        out = {"launches": int(cost["launches"]), "bytes": int(cost["bytes"]), "model": model,
               "seconds": time.perf_counter() - tic}
    except Exception as exc:
        out = {"launches": None, "bytes": None, "reason": f"step_cost({attention!r}): {type(exc).__name__}: {exc}"}
    _PROXY_CACHE[key] = out
    return out
