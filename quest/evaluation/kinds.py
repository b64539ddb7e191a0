"""What an evaluation is and how one registers (``eval.run`` names them): :class:`Evaluator`,
:func:`register_evaluation`, the decorator an evaluation's module applies to its function, and the table it fills.
The built-in evaluations (quest/evaluation/suites/) and a user's own import this module; finding the evaluations,
which imports them first, is quest.evaluation.registry, and the ``eval`` schema built from them is
quest.evaluation.config, both above them. No torch.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from quest.config.checks import Checks

from .settings import RESERVED_KEYS

__all__ = ["Evaluator", "register_evaluation", "unregister_evaluation", "registry_version", "registered"]

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
_STATE = {"version": 0}


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


def registered() -> dict[str, Evaluator]:
    """Every evaluation registered so far, by name, in the order registered (what their modules have registered as
    they were imported)."""
    return _REGISTRY
