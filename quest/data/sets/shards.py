"""data=imagenet_wds / data=wds: WebDataset tar shards read in order (quest/data/shards.py; docs/distributed.md,
"Sharded input"), every shard header and label checked before the first step (docs/data.md)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from quest.store.records import bounded

from ..config import TRAINING_ONLY, DataConfig, need_root
from ..kinds import register_dataset

__all__ = ["ShardData"]


@dataclass
class ShardData(DataConfig):
    """data=imagenet_wds | wds: train_split / val_split name a split of ${root}/_info.json or a shard pattern such
    as imagenet1k-train-{0000..1023}.tar."""

    # no _info.json: the training samples, checked; the shards are counted at start
    num_samples: Optional[int] = field(default=None, metadata={**TRAINING_ONLY, **bounded(1)})
    # training samples are permuted within windows of this many (held in memory)
    shuffle_window: int = field(default=8192, metadata={**TRAINING_ONLY, **bounded(1)})


def _num_classes(data: Any) -> int | None:
    from ..shard_index import shard_num_classes

    return shard_num_classes(need_root(data))  # what _info.json states, if it does


def _where(data: Any) -> str:
    return f"{data.root}/_info.json"


def _build(data: Any, split: str, transform: Callable | None) -> Any:
    """An IterableDataset that splits itself by rank and worker (quest/data/shards.py)."""
    from ..shard_preflight import apply_shard_preflight
    from ..shards import build_shards

    if data.get("preflight", True):  # every shard header and label checked before the first step
        apply_shard_preflight(data, split)
    return build_shards(data, split, transform)


for _name in ("imagenet_wds", "wds"):
    register_dataset(_name, ShardData, num_classes=_num_classes, streamed=True,
                     where_classes=_where)(_build)
