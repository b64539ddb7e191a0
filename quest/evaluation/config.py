"""Structured config of ``eval.py``: every key and type, registered in Hydra's ConfigStore as ``eval_schema``.

configs/eval.yaml lists ``eval_schema`` first in its defaults, so the suite files in configs/eval/ merge into typed
nodes: a misspelt key or a wrong type fails at start, naming the key. The keys every suite shares are here
(:class:`EvalSettingsBase`); each registered evaluation adds its own section ``eval.<name>``, typed by the dataclass
it was registered with (quest.evaluation.registry), so ``EvalSettings`` and ``EvalConfig`` are built from the
registry (:func:`eval_settings_schema`, :func:`eval_config_schema`; the module attributes give the current ones).
Protocol numbers (PGD steps, SPSA samples, severities, ...) have their published defaults in those dataclasses and
are restated in the suite files for visibility.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from quest.config.schema import AttentionConfig, DataConfig, LoggerConfig, ModelConfig
from quest.data.registry import register_data_configs

from .registry import evaluators, load_evaluations, registry_version
from .settings import RESERVED_KEYS, EvalSettingsBase, RootsConfig

__all__ = [
    "EvalSettingsBase", "EvalConfigBase", "RootsConfig", "RESERVED_KEYS",
    "eval_settings_schema", "eval_config_schema", "register_eval_configs", "register_completion_config",
    "default_eval_dir", "evaluated_name",
]


@dataclass
class EvalModelConfig(ModelConfig):
    """The model evaluated (model mode); a checkpoint names its own."""

    # Unset in checkpoint mode (the checkpoint names its model); model=<group or timm name> sets it otherwise.
    name: Optional[str] = None


@dataclass
class EvalAttentionConfig(AttentionConfig):
    """The attention of the model evaluated (model mode); a checkpoint names its own."""

    # No default: evaluating a timm model with the wrong attention would give silently wrong numbers.
    name: Optional[str] = None


@dataclass
class EvalConfigBase:
    """Everything but ``eval``, which eval_config_schema() adds, typed by the registry."""

    checkpoint: Optional[str] = None  # a checkpoint written by train.py
    # a checkpoint is data: an attention its config names by import path (package.module:Class) is imported only
    # with trust_code=true (or attention=<that path> on the command line), as Hugging Face's trust_remote_code
    trust_code: bool = False
    weights: Optional[str] = None  # model mode: a state_dict file (loaded with weights_only=True)
    model: EvalModelConfig = field(default_factory=EvalModelConfig)
    attention: EvalAttentionConfig = field(default_factory=EvalAttentionConfig)
    # data=<name> picks the data set of the clean / corruptions / adversarial evaluations; unset in checkpoint mode:
    # the checkpoint's own data config
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


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


def _given(value: Any) -> bool:
    """A resolver argument that is set (interpolated nulls may arrive as None or as the text 'None' / 'null')."""
    return value not in (None, "None", "null", "")


def _truthy(value: Any) -> bool:
    return value is True or str(value).lower() == "true"


def evaluated_name(checkpoint: Any, use_ema: Any = False, weights: Any = None) -> str:
    """What is evaluated, as one path component: ``<checkpoint stem>-<model|ema>`` for a checkpoint (``last-ema``,
    ``best-model``), else the weights file's stem, or ``random-init`` without weights. It names the results
    directory, so evaluations of last.pt, best.pt and the EMA weights never overwrite each other."""
    if _given(checkpoint):
        return f"{Path(str(checkpoint)).stem}-{'ema' if _truthy(use_ema) else 'model'}"
    return Path(str(weights)).stem if _given(weights) else "random-init"


def default_eval_dir(checkpoint: Any, model_name: Any, attention_name: Any, suite: Any, use_ema: Any = False,
                     weights: Any = None) -> str:
    """``<training run>/eval/<suite>/<checkpoint stem>-<model|ema>`` for a checkpoint (results beside the run),
    else ``outputs/eval/<model>-<attention>/<suite>/<weights stem | random-init>``."""
    name = evaluated_name(checkpoint, use_ema, weights)
    if _given(checkpoint):
        parent = Path(str(checkpoint)).expanduser().parent
        run_dir = parent.parent if parent.name == "checkpoints" else parent
        return str(run_dir / "eval" / str(suite) / name)
    return f"outputs/eval/{model_name}-{attention_name}/{suite}/{name}"


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
    if not OmegaConf.has_resolver("quest_eval_dir"):
        OmegaConf.register_new_resolver("quest_eval_dir", default_eval_dir)
