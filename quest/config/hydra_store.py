"""What Hydra needs before quest's training configs compose: the schema in its ConfigStore and the resolvers that
name run directories. A module of its own so that the schema (quest.config.schema) stays free of what it is used for."""
from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from quest.config.run_names import register_resolvers
from quest.config.schema import TrainConfig, model_size_value
from quest.data.registry import register_data_configs

__all__ = ["register_configs"]


def register_configs() -> None:
    """``train_schema`` in Hydra's ConfigStore with each registered data set's settings (``data/<name>_schema``),
    the ``${quest_run_suffix:}`` / ``${quest_safe_name:...}`` resolvers of ``hydra.run.dir``, and
    ``${quest_model_size:KEY}``, the row of a recipe's per-model-size table."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    register_data_configs()  # data/<name>_schema: each data set's own settings (quest/data/registry.py)
    register_resolvers()
    if not OmegaConf.has_resolver("quest_model_size"):
        OmegaConf.register_new_resolver("quest_model_size", model_size_value)
