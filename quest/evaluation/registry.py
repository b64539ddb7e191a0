"""The evaluations ``eval.run`` can name, each registered where it is defined.

An evaluation is a function ``(run: EvalRun, section) -> dict`` (its numbers, and text saying how they were
obtained) and the dataclass of its config section ``eval.<name>``. :func:`register_evaluation` records both, with
an optional value check; quest.evaluation.config builds the typed ``eval`` node from what is registered, so a new
evaluation brings its own settings and nothing central is edited: one module and one suite file
(docs/evaluation.md, "Adding an evaluation").

Where evaluations come from, all imported on first use (:func:`load_evaluations`): the modules of
``quest/evaluation/suites/`` (the built-in ones), the modules named in ``QUEST_EVAL_MODULES`` (comma-separated
import names), the ``quest.evaluations`` entry points of installed packages, and any module imported before
``register_eval_configs()`` stores the schema.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from quest.config.checks import Checks
from quest.runtime.plugins import import_named, import_plugins

from .settings import RESERVED_KEYS

__all__ = ["Evaluator", "register_evaluation", "unregister_evaluation", "evaluators", "load_evaluations",
           "registry_version", "EVALUATIONS", "MODULES_ENV", "ENTRY_POINT_GROUP"]

MODULES_ENV = "QUEST_EVAL_MODULES"
ENTRY_POINT_GROUP = "quest.evaluations"
F = TypeVar("F", bound=Callable[..., dict])


@dataclass(frozen=True)
class Evaluator:
    """One evaluation: ``run(eval_run, section)`` and the schema of ``eval.<name>``."""

    name: str
    run: Callable[[Any, Any], dict[str, Any]]
    settings: type  # a dataclass: the keys and types of eval.<name>
    default: Callable[[], Any]  # the section's defaults (an instance of ``settings``)
    check: Callable[[Checks, str], None] | None  # value checks, given the section's key ('eval.<name>')
    module: str  # where it was registered
    # the optional modules it imports, given its section: [(module, extra, what)] (quest.runtime.extras.require_all), checked
    # for every evaluation of eval.run before any of them starts
    needs: Callable[[Any], Iterable[tuple[str, str, str]]] = lambda section: ()
    # the data roots it reads (quest.evaluation.inputs.Input), each checked before the suite's first evaluation
    inputs: Callable[[Any, Any], list] | None = None


_REGISTRY: dict[str, Evaluator] = {}
_STATE = {"version": 0, "loaded": False}


def registry_version() -> int:
    """Changes whenever an evaluation is registered or removed (the schema is rebuilt then)."""
    return _STATE["version"]


def register_evaluation(name: str, settings: type | None = None, *, default: Callable[[], Any] | None = None,
                        check: Callable[[Checks, str], None] | None = None,
                        needs: Callable[[Any], Iterable[tuple[str, str, str]]] | Iterable[tuple[str, str, str]] = (),
                        inputs: Callable[[Any, Any], list] | None = None) -> Callable[[F], F]:
    """Decorator: ``fn(run, section) -> dict`` becomes the evaluation ``name``, its section ``eval.<name>`` typed by
    the dataclass ``settings`` (None: a section without keys) with the defaults ``default()`` (default:
    ``settings()``); ``check(checks, 'eval.<name>')`` adds its value checks (:class:`quest.config.checks.Checks`), run
    at start with every other check. ``needs``: the optional modules it imports as ``(module, extra, what)``, or a
    function of its section that lists them; a missing one is named before any evaluation runs. ``inputs(run,
    section)`` lists the data roots it reads (:class:`quest.evaluation.inputs.Input`), checked before the suite's
    first evaluation runs and recorded in eval_results.json. Returns ``fn`` unchanged."""
    if not name.isidentifier() or name in RESERVED_KEYS:
        raise ValueError(f"evaluation name {name!r} must be an identifier and not one of eval's own keys "
                         f"{sorted(RESERVED_KEYS)}")
    if settings is None:
        settings = dataclasses.make_dataclass(f"{name}_settings", [])
    if not dataclasses.is_dataclass(settings):
        raise TypeError(f"evaluation {name!r}: settings must be a dataclass, got {settings!r}")

    def decorate(fn: F) -> F:
        module = getattr(fn, "__module__", None) or type(fn).__module__
        old = _REGISTRY.get(name)
        if old is not None and old.module != module:
            raise ValueError(f"evaluation {name!r} is registered twice: by {old.module} and by {module}")
        wanted = needs if callable(needs) else (lambda section, fixed=tuple(needs): fixed)
        _REGISTRY[name] = Evaluator(name, fn, settings, default or settings, check, module, wanted, inputs)
        _STATE["version"] += 1
        return fn

    return decorate


def unregister_evaluation(name: str) -> None:
    """Forget ``name`` (tests that register evaluations of their own)."""
    if _REGISTRY.pop(name, None) is not None:
        _STATE["version"] += 1


def load_evaluations(modules: tuple[str, ...] | list[str] = ()) -> None:
    """Import the built-in suites, the modules of ``QUEST_EVAL_MODULES`` and the ``quest.evaluations`` entry points
    (once), and ``modules``; each registers its evaluations as it is imported."""
    if not _STATE["loaded"]:
        _STATE["loaded"] = True  # before importing: a suite module that asks for the registry does not recurse
        try:
            import_plugins("quest.evaluation.suites", MODULES_ENV, ENTRY_POINT_GROUP, "evaluation")
        except BaseException:
            _STATE["loaded"] = False
            raise
    for module in modules:
        import_named(module, "load_evaluations", "evaluation")


def evaluators() -> dict[str, Evaluator]:
    """Every registered evaluation by name, in the order registered (after :func:`load_evaluations`)."""
    load_evaluations()
    return dict(_REGISTRY)


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
