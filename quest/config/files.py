"""Where the Hydra configs are: the ``quest.configs`` package of an installed wheel, else the checkout's ``configs/``.
A module of its own, below the command line: the library (quest.evaluation's override sugar) needs it too, and nothing
below the console scripts may import them."""
from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["config_root", "hydra_config_path"]


def config_root() -> Path:
    """The folder holding train.yaml, eval.yaml and the config groups."""
    spec = importlib.util.find_spec("quest.configs")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parents[2] / "configs"  # quest/config/files.py -> the checkout


def hydra_config_path(sub: str = "") -> str:
    """Hydra's ``config_path``: the package when it is importable, else the checkout's folder."""
    if importlib.util.find_spec("quest.configs") is not None:
        return "pkg://quest.configs" + (f".{sub}" if sub else "")
    return str(config_root() / sub)
