"""The commands' entry points: the console scripts (quest-train, quest-eval, quest-toy, quest-report, quest-plot,
quest-export, quest-data) and train.py / eval.py start here, then run quest.cli's function of the same name.

Why a module outside the quest package: ``import quest`` registers quest's formulations and the quest_vit model with
timm, which imports torch and timm (about 5 s on a laptop). A command must answer ``--help`` and tab completion at
once, so it loads quest from here: while this module is loaded, ``import quest`` leaves the registration to the
first import of quest.attention or quest.models, which every command that builds a model makes. That is the only
difference; what each command does is quest.cli's.
"""
from __future__ import annotations

from importlib import import_module
from typing import Callable

__all__ = ["train", "evaluate", "toy", "report", "plot", "export", "data"]


def _command(name: str) -> Callable[[], None]:
    def command() -> None:
        getattr(import_module("quest.cli"), name)()  # imported when the command runs, not when this module loads

    command.__name__ = command.__qualname__ = name
    command.__doc__ = f"quest.cli.{name}: the console script's command."
    return command


train, evaluate, toy, report, plot, export, data = map(_command, __all__)
