"""The first rows of bench/gpu.py, before any timing: the environment the GPU path needs (what Triton compiles
with, where it caches, which versions and device), and torch.library.opcheck on quest's custom operators.

Why first: a missing C compiler, Python header or writable Triton cache makes the first fused kernel fail minutes
into the call, after the budget is spent; these rows say so in the first seconds."""
from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

__all__ = ["environment_row", "opcheck_rows", "quest_ops"]


def _c_compiler() -> dict[str, Any]:
    """The compiler Triton would build its launcher with: ``CC`` when set, else the first of cc / gcc / clang on
    PATH (Triton's own order)."""
    chosen = os.environ.get("CC")
    if chosen:
        return {"cc": chosen, "from": "CC", "found": shutil.which(chosen) is not None or Path(chosen).is_file()}
    for name in ("cc", "gcc", "clang"):
        if path := shutil.which(name):
            return {"cc": path, "from": "PATH", "found": True}
    return {"cc": None, "from": "PATH", "found": False}


def _python_headers() -> dict[str, Any]:
    include = sysconfig.get_paths().get("include") or ""
    return {"include": include, "found": (Path(include) / "Python.h").is_file()}


def _triton_cache() -> dict[str, Any]:
    """TRITON_CACHE_DIR, else ~/.triton/cache (made if missing, as Triton does): writable when a temporary file can
    be written there."""
    where = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=where, prefix=".quest-probe-"):
            pass
        return {"dir": str(where), "writable": True}
    except OSError as exc:
        return {"dir": str(where), "writable": False, "error": f"{type(exc).__name__}: {exc}"}


def _triton_version() -> str | None:
    try:
        import triton
    except Exception:  # absent, or broken on import: the row says which
        return None
    return getattr(triton, "__version__", "unknown")


def environment_row(device: torch.device) -> dict[str, Any]:
    """Versions, compute capability, GPU name and memory, C compiler, Python headers, the Triton cache. ``ok``: all
    that the fused kernels need is there (on the CPU smoke: the compiler, headers and cache only)."""
    row: dict[str, Any] = {"check": "environment", "python": sys.version.split()[0], "torch": torch.__version__,
                           "cuda": torch.version.cuda, "triton": _triton_version(), "c_compiler": _c_compiler(),
                           "python_headers": _python_headers(), "triton_cache": _triton_cache(),
                           "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1"}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        row.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30,
                   compute_capability=f"{props.major}.{props.minor}", cudnn=torch.backends.cudnn.version())
    else:
        row.update(gpu=None, gpu_memory_gib=None, compute_capability=None, cudnn=None)
    needs = [row["c_compiler"]["found"], row["python_headers"]["found"], row["triton_cache"]["writable"]]
    if device.type == "cuda":
        needs.append(row["triton"] is not None)
    row["ok"] = all(needs)
    return row


def quest_ops() -> list[str]:
    """The names of quest's custom operators registered now (``torch.ops.quest.*``), with quest's attention imported
    (which registers them); none when the fused operators are gone."""
    import quest.attention  # noqa: F401  (registers the formulations and their operators)

    try:
        import quest.attention.fused  # noqa: F401
    except ImportError:
        pass
    names = []
    for name in dir(torch.ops.quest):
        packet = getattr(torch.ops.quest, name, None)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            names.append(name)
    return sorted(names)


def _op_inputs(name: str, device: torch.device, dtype: torch.dtype) -> list[tuple[Any, ...]] | None:
    """Sample arguments for each quest operator known here: (B, H, N, d) = (1, 2, 5, 16) in the qkv layout."""
    def qk(grad: bool = True) -> torch.Tensor:
        x = torch.randn(1, 5, 2, 16, device=device, dtype=dtype).transpose(1, 2)
        return x.requires_grad_(grad)

    if name == "l2_normalize":
        return [(qk(), 1e-6, None), (qk(), 1e-6, torch.rand(1, device=device, dtype=dtype).add(0.5).requires_grad_()),
                (qk(), 1e-6, torch.rand(2, 1, 1, device=device, dtype=dtype).add(0.5).requires_grad_())]
    if name == "layer_norm":
        return [(qk(), torch.rand(16, device=device, dtype=dtype).requires_grad_(),
                 torch.randn(16, device=device, dtype=dtype).requires_grad_(), 1e-6)]
    if name == "elliptical_m":
        return [(qk(False), qk(False), 1e-6)]
    return None


def opcheck_rows(device: torch.device) -> list[dict[str, Any]]:
    """torch.library.opcheck (schema, fake tensor, autograd registration, AOT dispatch) on ``device``'s tensors for
    every registered ``torch.ops.quest.*`` operator with sample inputs here (the backward operators are checked
    through their forward's autograd); one row per operator, or one row saying none is registered."""
    names = quest_ops()
    if not names:
        return [{"check": "opcheck", "op": None, "ok": True,
                 "note": "no torch.ops.quest.* operator is registered: nothing to check"}]
    rows = []
    dtype = torch.float32
    for name in names:
        samples = _op_inputs(name, device, dtype)
        if samples is None:
            rows.append({"check": "opcheck", "op": f"quest::{name}", "ok": None,
                         "note": "no sample inputs here (a backward operator, checked through its forward, or new)"})
            continue
        op = getattr(torch.ops.quest, name).default
        failures = []
        for args in samples:
            try:
                results = torch.library.opcheck(op, args)
            except Exception:
                failures.append(traceback.format_exc(limit=2)[-600:])
                continue
            failures += [f"{test}: {result}" for test, result in results.items() if result != "SUCCESS"]
        rows.append({"check": "opcheck", "op": f"quest::{name}", "samples": len(samples), "device": device.type,
                     "ok": not failures, **({"failures": failures[:3]} if failures else {})})
    return rows
