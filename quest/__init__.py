"""quest: train and evaluate timm Vision Transformers with swappable attention (standard, QNorm, QKNorm, QUEST,
Elliptical, or your own), to reproduce and extend the QUEST paper. One sub-package per concern (README, "Where things
are"): attention, models, data, train, run, evaluation, diagnostics, explain, toy, report, tools, and below them
config, store and runtime; the commands in quest.cli (entered through quest_cli)."""
from __future__ import annotations

import importlib
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from quest.runtime.versions import check_floors

# Before anything else: below the torch, torchvision and timm floors pyproject.toml declares quest refuses to start,
# in one line (quest.runtime.versions); above them it calls their APIs directly.
check_floors()

try:
    __version__ = version("quest")
except PackageNotFoundError:  # a checkout on sys.path without an install
    __version__ = "0+unknown"

__all__ = ["__version__", "register_with_timm"]

_SUBPACKAGES = frozenset({"attention", "config", "data", "diagnostics", "evaluation", "explain", "models", "report",
                          "run", "runtime", "store", "tools", "toy", "train"})


def __getattr__(name: str) -> Any:
    # quest.attention etc. as attributes after a plain `import quest`, as when they were imported eagerly
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_with_timm() -> None:
    """Teach timm quest's formulations as ``attn_layer`` names (quest.attention) and the ``quest_vit`` model that
    exported folders name (quest.models.timm_model), so that ``timm.create_model(..., attn_layer="quest")`` and
    ``timm.create_model("local-dir:DIR")`` work. Imports torch and timm; once per process (the modules register as
    they are imported)."""
    importlib.import_module("quest.attention")
    importlib.import_module("quest.models")


# `import quest` registers, as docs/interop.md and every exported model card promise. The commands (quest_cli: the
# console scripts, train.py, eval.py) defer it to the first model they build, so that --help and tab completion do
# not wait for torch and timm.
if "quest_cli" not in sys.modules:
    register_with_timm()
