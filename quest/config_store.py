"""What Hydra needs before quest's training configs compose: the schema in its ConfigStore and the resolvers that
name run directories. A module of its own so that the schema (quest.schema) stays free of what it is used for."""
from __future__ import annotations

from hydra.core.config_store import ConfigStore

from quest.run_names import register_resolvers
from quest.schema import TrainConfig

__all__ = ["register_configs"]


def register_configs() -> None:
    """``train_schema`` in Hydra's ConfigStore, and the ``${quest_run_suffix:}`` / ``${quest_safe_name:...}``
    resolvers of ``hydra.run.dir``."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    register_resolvers()
