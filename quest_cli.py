"""The commands' entry points: the console scripts (quest-train, quest-eval, quest-toy, quest-report, quest-plot,
quest-export, quest-data) and train.py / eval.py start here, then run quest.cli's function of the same name.

Why a module outside the quest package: ``import quest`` registers quest's formulations and the quest_vit model with
timm, which imports torch and timm (about 5 s on a laptop). A command must answer ``--help`` and tab completion at
once, so it loads quest from here: while this module is loaded, ``import quest`` leaves the registration to the
first import of quest.attention or quest.models, which every command that builds a model makes. That is the only
difference; what each command does is quest.cli's.
"""
from __future__ import annotations

__all__ = ["train", "evaluate", "toy", "report", "plot", "export", "data"]


def train() -> None:
    from quest.cli import train as command

    command()


def evaluate() -> None:
    from quest.cli import evaluate as command

    command()


def toy() -> None:
    from quest.cli import toy as command

    command()


def report() -> None:
    from quest.cli import report as command

    command()


def plot() -> None:
    from quest.cli import plot as command

    command()


def export() -> None:
    from quest.cli import export as command

    command()


def data() -> None:
    from quest.cli import data as command

    command()
