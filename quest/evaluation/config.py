"""Structured config of ``eval.py``: every key and type, registered in Hydra's ConfigStore as ``eval_schema``.

configs/eval.yaml lists ``eval_schema`` first in its defaults, so the suite files in configs/eval/ merge into typed
nodes: a misspelt key or a wrong type fails at start, naming the key. The keys every suite shares and the nodes
beside ``eval`` (:class:`EvalSettingsBase`, :class:`EvalConfigBase`, quest/evaluation/settings.py, importable from
here too) are below every evaluation; each registered evaluation adds its own section ``eval.<name>``, typed by the
dataclass it was registered with (quest.evaluation.kinds), so ``EvalSettings`` and ``EvalConfig`` are built from the
registry (:func:`eval_settings_schema`, :func:`eval_config_schema`; the module attributes give the current ones).
Protocol numbers (PGD steps, SPSA samples, severities, ...) have their published defaults in those dataclasses and
are restated in the suite files for visibility.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import field
from typing import Any, Dict

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from quest.config.run_names import register_resolvers
from quest.data.registry import register_data_configs

from .registry import evaluators, load_evaluations, registry_version
from .settings import (
    RESERVED_KEYS,
    EvalAttentionConfig,
    EvalConfigBase,
    EvalModelConfig,
    EvalSettingsBase,
    RootsConfig,
    default_eval_dir,
    evaluated_name,
)

__all__ = [
    "EvalSettingsBase", "EvalConfigBase", "EvalModelConfig", "EvalAttentionConfig", "RootsConfig", "RESERVED_KEYS",
    "eval_settings_schema", "eval_config_schema", "register_eval_configs", "register_completion_config",
    "default_eval_dir", "evaluated_name",
]


_SCHEMAS: dict[str, Any] = {"version": None}


def _named(cls: type, name: str) -> type:
    # importable by this name (module __getattr__ below), so that configs typed by it pickle by reference
    cls.__module__, cls.__qualname__ = __name__, name
    return cls


def _build() -> None:
    load_evaluations()
    version = registry_version()
    if _SCHEMAS["version"] == version:
        return
    sections = [(name, ev.settings, field(default_factory=ev.default, metadata={"doc": _section_doc(name, ev)}))
                for name, ev in evaluators().items()]
    settings = _named(dataclasses.make_dataclass("EvalSettings", sections, bases=(EvalSettingsBase,)), "EvalSettings")
    suite_doc = {"doc": "the suite (eval=<option>, configs/eval/*.yaml): what runs, and each evaluation's settings"}
    config = _named(dataclasses.make_dataclass(
        "EvalConfig", [("eval", settings, field(default_factory=settings, metadata=suite_doc))],
        bases=(EvalConfigBase,)), "EvalConfig")
    _SCHEMAS.update(version=version, EvalSettings=settings, EvalConfig=config)


def _section_doc(name: str, evaluator: Any) -> str:
    """eval.<name>'s description in --help: the first paragraph of its settings class's docstring, else of its run
    function's."""
    for obj in (evaluator.settings, evaluator.run):
        doc = inspect.getdoc(obj) if inspect.isclass(obj) or inspect.isfunction(obj) else None
        if doc and not doc.startswith(f"{getattr(obj, '__name__', '')}("):  # not a dataclass's generated signature
            return " ".join(doc.split("\n\n")[0].split())
    return f"settings of the {name} evaluation ({evaluator.module})"


def eval_settings_schema() -> type:
    """The ``eval`` node's dataclass: :class:`EvalSettingsBase` and one section per registered evaluation."""
    _build()
    return _SCHEMAS["EvalSettings"]


def eval_config_schema() -> type:
    """eval.py's whole config: :class:`EvalConfigBase` and ``eval`` typed by :func:`eval_settings_schema`."""
    _build()
    return _SCHEMAS["EvalConfig"]


def __getattr__(name: str) -> Any:
    if name == "EvalSettings":
        return eval_settings_schema()
    if name == "EvalConfig":
        return eval_config_schema()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def completion_config_schema() -> type:
    """eval.py's config for tab completion only: :class:`EvalConfigBase` with an untyped ``eval`` node holding the
    keys of :class:`EvalSettingsBase`, so that no evaluation module (each imports torch) is imported to answer a TAB;
    the suite files' sections (eval.<evaluation>) compose into it, and complete with the keys they set."""
    if "completion" not in _SCHEMAS:
        shared = OmegaConf.to_container(OmegaConf.structured(EvalSettingsBase))
        _SCHEMAS["completion"] = dataclasses.make_dataclass(
            "EvalCompletionConfig", [("eval", Dict[str, Any], field(default_factory=lambda: dict(shared)))],
            bases=(EvalConfigBase,))
    return _SCHEMAS["completion"]


def register_eval_configs(modules: tuple[str, ...] | list[str] = ()) -> None:
    """Store ``eval_schema`` (the current :func:`eval_config_schema`) in Hydra's ConfigStore, after importing the
    evaluation modules (the built-in suites, ``QUEST_EVAL_MODULES``, entry points, ``modules``). Call it again after
    registering an evaluation later."""
    load_evaluations(modules)
    ConfigStore.instance().store(name="eval_schema", node=eval_config_schema())
    register_data_configs()  # data=<name>: each data set's settings (quest/data/registry.py)
    _register_eval_dir_resolver()


def register_completion_config() -> None:
    """Store :func:`completion_config_schema` as ``eval_schema``: for a completion query (quest.cli)."""
    ConfigStore.instance().store(name="eval_schema", node=completion_config_schema())
    register_data_configs()
    _register_eval_dir_resolver()


def _register_eval_dir_resolver() -> None:
    register_resolvers()  # ${quest_sweep_name:} of hydra.sweep.dir
    if not OmegaConf.has_resolver("quest_eval_dir"):
        OmegaConf.register_new_resolver("quest_eval_dir", default_eval_dir)
