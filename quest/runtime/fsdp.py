"""``trainer.strategy=fsdp``: PyTorch FSDP2 (``fully_shard``) with distributed (sharded) checkpoints.

For models that do not fit in one device's memory next to their optimizer state (the paper's 2B-parameter ViT).
Each transformer block is a shard unit, then the root. Checkpoints: the model and optimizer shards go to
``checkpoints/<name>.dcp/`` through ``torch.distributed.checkpoint`` (every rank writes its own shard); the small
``<name>.pt`` beside it holds the full model weights (for eval.py), the training state and every rank's RNG.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.optim import Optimizer

from .distributed import DistContext, barrier
from .phase import may_change

__all__ = ["shard_model", "save_sharded", "load_sharded", "full_model_state_dict"]


def shard_model(model: nn.Module, ctx: DistContext) -> nn.Module:
    # one process is a group too when torchrun started it (`--nproc_per_node=1`: FSDP's code path on one GPU)
    if not (ctx.distributed or dist.is_initialized()):
        raise ValueError("trainer.strategy=fsdp needs a process group: launch with torchrun (one process or more) "
                         "or srun")
    for block in getattr(model, "blocks", []):
        fully_shard(block)
    fully_shard(model)
    return model


def save_sharded(path: Path, model: nn.Module, optimizer: Optimizer, ctx: DistContext) -> None:
    """Every rank writes its shard into a temporary directory; rank 0 swaps it in once all are done."""
    may_change(path)  # torch's distributed checkpoint writes the shards, not quest.store: the same rule
    tmp = path.with_name(path.name + ".tmp")
    if ctx.is_main and tmp.exists():
        shutil.rmtree(tmp)
    barrier(ctx)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp))
    barrier(ctx)
    if ctx.is_main:
        old = path.with_name(path.name + ".old")
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    barrier(ctx)


def load_sharded(path: Path, model: nn.Module, optimizer: Optimizer) -> None:
    if not path.is_dir():
        raise FileNotFoundError(f"sharded checkpoint {path} is missing (written by trainer.strategy=fsdp)")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def full_model_state_dict(model: nn.Module) -> dict:
    """The unsharded weights, gathered on CPU (a collective: every rank calls it; rank 0 gets the tensors)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
