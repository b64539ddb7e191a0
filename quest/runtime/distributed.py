"""Process-group set-up from torchrun's or SLURM's environment, and the few collectives the trainer needs."""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from quest.runtime.errors import every_rank, joined_group

__all__ = ["DistContext", "init_distributed", "resolve_device", "all_reduce_max", "barrier", "gather_objects",
           "RankDataMismatch", "agree_on_sample_counts"]


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(preference: str, local_rank: int = 0) -> torch.device:
    """``auto``: the local GPU when CUDA is present, else CPU. ``cuda`` without CUDA is an error, not a silent CPU run."""
    if preference == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(preference)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            # the user's choice on this machine, not a bug: one line (a ValueError, quest.runtime.errors)
            raise ValueError(f"trainer.device={preference} but CUDA is not available; use trainer.device=auto or cpu")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    elif device.type != "cpu":
        raise ValueError(f"trainer.device must be auto, cpu, cuda or cuda:N, got {preference!r}")
    return device


def _slurm_master_addr() -> str:
    nodelist = os.environ["SLURM_JOB_NODELIST"]
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError):
        return nodelist.split(",")[0].split("[")[0]


def _env_rank() -> tuple[int, int, int] | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:  # srun, one task per GPU
        os.environ.setdefault("MASTER_ADDR", _slurm_master_addr())
        os.environ.setdefault("MASTER_PORT", str(29500 + int(os.environ.get("SLURM_JOB_ID", "0")) % 10_000))
        return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]), int(os.environ.get("SLURM_LOCALID", 0))
    return None


def init_distributed(device_preference: str = "auto") -> DistContext:
    """Join the process group described by the environment (NCCL on GPUs, gloo on CPU), or run as one process."""
    env = _env_rank()
    if env is None:
        return DistContext(device=resolve_device(device_preference))
    rank, world_size, local_rank = env
    device = resolve_device(device_preference, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size)
    joined_group()  # a user error from now on may be this process's own: printed by it (quest.runtime.errors)
    return DistContext(rank, world_size, local_rank, device)


def all_reduce_max(value: float, ctx: DistContext) -> float:
    """The maximum of a scalar over ranks, so that every rank takes the same decision (e.g. divergence)."""
    if not ctx.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    """``obj`` of every rank, in rank order (on every rank)."""
    if not ctx.distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


class RankDataMismatch(ValueError):
    """The processes of one run see data sets of different sizes (docs/data.md, "Ranks agree on sample counts")."""


def agree_on_sample_counts(counts: dict[str, int], ctx: DistContext) -> None:
    """Every rank must see the same sample count per split before the first collective of training: ranks whose
    data differ (another copy of the data set on one node, a file missing there) would run different numbers of
    steps and end in a collective mismatch (gloo) or a hang (NCCL). One all_gather of the counts; on a difference
    every rank raises the same error, naming each rank's counts."""
    everyone = gather_objects(dict(counts), ctx)
    if any(c != everyone[0] for c in everyone[1:]):
        per_rank = "; ".join(f"rank {r}: " + ", ".join(f"{k} {v}" for k, v in c.items()) for r, c in enumerate(everyone))
        raise every_rank(RankDataMismatch(  # every rank raises it: rank 0 alone prints it (quest.runtime.errors)
            f"the {ctx.world_size} processes see different data sets (sample counts {per_rank}); every process must "
            "read the same data.root content (docs/data.md)"))
