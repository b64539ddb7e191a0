"""Checkpoints: tensors and plain containers only, written atomically, loaded with ``weights_only=True``."""
from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["FORMAT", "save_checkpoint", "load_checkpoint", "check_compatible", "rng_state", "set_rng_state"]

FORMAT = "quest-checkpoint-v1"


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write to a temporary file in the same directory, fsync, then rename: a crash never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format": FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        raise ValueError(f"cannot load checkpoint {path}: {exc}") from exc
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"{path} is not a quest checkpoint (expected format {FORMAT!r})")
    return ckpt


def check_compatible(ckpt: dict[str, Any], expected: dict[str, Any], path: str | Path) -> None:
    """Fail with both descriptions when a checkpoint was written for another model, attention or class count."""
    found = ckpt.get("meta", {})
    diffs = [k for k in expected if found.get(k) != expected[k]]
    if diffs:
        have = ", ".join(f"{k}={found.get(k)!r}" for k in diffs)
        want = ", ".join(f"{k}={expected[k]!r}" for k in diffs)
        raise ValueError(f"checkpoint {path} was written for {have}, but this run is {want}")


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from (augmentation, mixup, drop path), as tensors and plain values."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(_plain, np_state[2:])],
        "python": _plain(random.getstate()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value
