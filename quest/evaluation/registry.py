"""The evaluations ``eval.run`` can name, each registered where it is defined.

An evaluation is a function ``(run: EvalRun, section) -> dict`` (its numbers, and text saying how they were
obtained) and the dataclass of its config section ``eval.<name>``. :func:`register_evaluation`
(quest/evaluation/kinds.py, importable from here too) records both, with an optional value check;
quest.evaluation.config builds the typed ``eval`` node from what is registered, so a new
evaluation brings its own settings and nothing central is edited: one module and one suite file
(docs/evaluation.md, "Adding an evaluation").

Where evaluations come from, all imported on first use (:func:`load_evaluations`): the modules of
``quest/evaluation/suites/`` (the built-in ones), the modules named in ``QUEST_EVAL_MODULES`` (comma-separated
import names), the ``quest.evaluations`` entry points of installed packages, and any module imported before
``register_eval_configs()`` stores the schema. This module finds them: it imports the modules that fill the table
first, and they register in quest.evaluation.kinds and never import this module back.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Callable

from quest.runtime.plugins import import_named, import_plugins

from .kinds import Evaluator, register_evaluation, registered, registry_version, unregister_evaluation

__all__ = ["Evaluator", "register_evaluation", "unregister_evaluation", "evaluators", "load_evaluations",
           "registry_version", "EVALUATIONS", "MODULES_ENV", "ENTRY_POINT_GROUP"]

MODULES_ENV = "QUEST_EVAL_MODULES"
ENTRY_POINT_GROUP = "quest.evaluations"


def load_evaluations(modules: tuple[str, ...] | list[str] = ()) -> None:
    """Import the built-in suites, the modules of ``QUEST_EVAL_MODULES`` and the ``quest.evaluations`` entry points
    (once), and ``modules``; each registers its evaluations as it is imported (quest.evaluation.kinds), and none
    imports this module back."""
    import_plugins("quest.evaluation.suites", MODULES_ENV, ENTRY_POINT_GROUP, "evaluation")
    for module in modules:
        import_named(module, "load_evaluations", "evaluation")


def evaluators() -> dict[str, Evaluator]:
    """Every registered evaluation by name, in the order registered (after :func:`load_evaluations`)."""
    load_evaluations()
    return dict(registered())


class _Evaluations(Mapping):
    """Evaluation name -> ``fn(run, section) -> dict``: a read-only view of the registry (the former
    ``runner.EVALUATIONS`` dict)."""

    def __getitem__(self, name: str) -> Callable[[Any, Any], dict[str, Any]]:
        return evaluators()[name].run

    def __iter__(self) -> Iterator[str]:
        return iter(evaluators())

    def __len__(self) -> int:
        return len(evaluators())

    def __repr__(self) -> str:
        return f"EVALUATIONS({', '.join(self)})"


EVALUATIONS: Mapping[str, Callable[[Any, Any], dict[str, Any]]] = _Evaluations()
