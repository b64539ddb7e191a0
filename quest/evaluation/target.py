"""What is evaluated: a model rebuilt from a train.py checkpoint (its stored config gives model, attention, data and
eval transform), or a timm model with a chosen attention and optional local weights."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

from quest.attention.registry import refuse_code_named_by_file
from quest.config.checks import ConfigError
from quest.config.schema import DataConfig
from quest.data import get_dataset
from quest.models import create_model
from quest.run.checkpoint import load_record
from quest.run.outputs import wandb_group
from quest.store.files import file_sha256
from quest.store.torch_files import inspect_torch_file, state_dict_of, weights_problem
from quest.store.weights_check import check_weights
from quest.train.builders import build_model, resolve_img_size

from .directory import state_dict_sha256
from .foreign import ClassOrder, class_order, export_record, weights_num_classes
from .settings import EvalAttentionConfig, EvalModelConfig, evaluated_name

log = logging.getLogger("quest.eval")

__all__ = ["EvalTarget", "load_target", "data_was_chosen", "data_overrides", "check_stored_code", "CODE_KEYS",
           "check_stored_config", "READ_KEYS"]

#: keys of a stored config that can name code (an import path ``package.module:Class``): quest/attention/registry.py
CODE_KEYS = ("attention.name",)
#: the keys of a checkpoint's config that evaluation reads besides the model's own (model.*, attention.*): each must
#: be there (check_stored_config); its value was checked by its train.py declaration when the record was loaded
READ_KEYS = ("model.name", "attention.name", "data.name", "data.num_classes", "data.mean", "data.std",
             "recipe.crop_pct", "recipe.eval_interpolation")


@dataclass
class EvalTarget:
    model: nn.Module  # in eval mode, on the evaluation device
    num_classes: int
    img_size: int  # the model's input resolution
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_pct: float
    interpolation: str
    data: DictConfig | None  # the data set of the clean / corruptions / adversarial evaluations
    info: dict[str, Any] = field(default_factory=dict)  # what was loaded, for the report
    wandb_group: str | None = None  # the training run's wandb group, when known


def data_was_chosen(cfg: DictConfig) -> bool:
    """``data=<name>`` on the command line (the node stays at its schema default, name ???, otherwise)."""
    return not OmegaConf.is_missing(cfg.data, "name")


def data_overrides(cfg: DictConfig) -> dict[str, Any]:
    """The ``data.*`` keys whose values differ from the schema's defaults (set on the command line when no
    ``data=<name>`` was chosen), resolved; not those that change only how training reads its data (an evaluation
    reads the val split with eval.batch_size and eval.num_workers: quest.data.config.TRAINING_ONLY), which are
    never applied (quest.evaluation.runner.check_ignored_overrides refuses them on the command line)."""
    from quest.data.registry import training_only_data_keys

    default = OmegaConf.to_container(OmegaConf.structured(OmegaConf.get_type(cfg.data) or DataConfig), resolve=False)
    given = OmegaConf.to_container(cfg.data, resolve=True, throw_on_missing=False)
    skip = {"name", *training_only_data_keys()}
    return {k: v for k, v in given.items() if k not in skip and v != "???" and v != default.get(k)}


def input_size_problem(key: str, value: Any, model_size: int) -> str | None:
    """Why ``key=value`` cannot set an evaluation's input size: eval.py evaluates at the model's own size (a model at
    another size needs its position embedding resampled, which quest does not do), None when it is that size."""
    if value is None or int(value) == model_size:
        return None
    return (f"{key}={value}: the model takes {model_size} px images and eval.py evaluates at the model's input size "
            f"(another size would need its position embedding resampled, which eval.py does not do); leave {key} out")


def check_stored_code(stored: DictConfig, cfg: DictConfig, path: Path) -> None:
    """A checkpoint is data: an import path in its config (``attention.name: package.module:Class``) names code
    that is imported only when the user asked for it (``trust_code=true``, or ``attention=<that path>``); refused
    before anything is imported (quest.attention.registry.refuse_code_named_by_file, as quest-export's)."""
    for key in CODE_KEYS:
        value = OmegaConf.select(stored, key)
        named = OmegaConf.select(cfg, key) == value
        refuse_code_named_by_file(value, key, f"checkpoint={path}", cfg.trust_code or named,
                                  f"name it yourself: attention={value} (or trust_code=true)")
        if isinstance(value, str) and ":" in value:
            log.warning("checkpoint=%s: importing %s=%s (%s)", path, key, value,
                        "trust_code=true" if cfg.trust_code else "named on the command line")


def check_stored_config(stored: DictConfig, path: Path) -> None:
    """A checkpoint's config is a train.py config, read back from a file: its every value was checked against its
    train.py declaration when the record was loaded (quest.run.checkpoint_record.config_problems); here the keys
    evaluation reads are there, and the model and attention names are known, before anything is built from it; a
    ConfigError with one line per problem, each naming the file and the field."""
    from quest.data.registry import list_datasets

    problems = [f"  {key} is missing" for key in READ_KEYS if OmegaConf.select(stored, key, default="???") == "???"]
    name = OmegaConf.select(stored, "data.name")
    if name is not None and name not in list_datasets():
        problems.append(f"  data.name must be one of {', '.join(list_datasets())}, got {name!r}")
    if not problems:
        problems += _names_problems(stored)
    if problems:
        lines = [f"checkpoint={path}: config.{p.strip()}" for p in problems]
        raise ConfigError("\n".join(lines) + " (a damaged or hand-edited checkpoint: train.py would refuse this config; "
                          "use another checkpoint, e.g. checkpoints/best.pt)")


def _names_problems(stored: DictConfig) -> list[str]:
    """model.name a timm model and attention.name (with its options) a formulation, as train.py checks them
    (quest.train.checks): an import path was judged already (check_stored_code)."""
    import timm

    from quest.attention import get_attention

    problems = []
    if not timm.models.is_model(stored.model.name):
        problems.append(f"  model.name must be a timm model name, got {stored.model.name!r}")
    options = OmegaConf.select(stored, "attention.options", default=None)
    if options is not None and not OmegaConf.is_dict(options):
        return problems + [f"  attention.options must be a mapping, got {options!r}"]
    try:
        get_attention(stored.attention.name, **(OmegaConf.to_container(options, resolve=True) if options else {}))
    except (ValueError, TypeError) as exc:
        key = "attention.options" if " option" in str(exc) else "attention.name"
        problems.append(f"  {key} is invalid ({exc}), got {OmegaConf.select(stored, key)!r}")
    return problems


def _eval_transform_overrides(settings: DictConfig, crop_pct: float, interpolation: str) -> tuple[float, str]:
    return (float(settings.crop_pct) if settings.crop_pct is not None else float(crop_pct),
            str(settings.interpolation) if settings.interpolation is not None else str(interpolation))


def _set_model_keys(cfg: DictConfig) -> list[str]:
    """``model.<key>=<value>`` / ``attention.<key>=<value>`` for every key set away from eval.py's defaults other
    than the names (which the caller judges): with checkpoint= none of them would reach the model."""

    def leaves(node: Any, prefix: str) -> dict[str, Any]:
        if isinstance(node, dict) and node:
            return {k: v for key, value in node.items() for k, v in leaves(value, f"{prefix}.{key}").items()}
        return {prefix: node}

    out = []
    for group, schema in (("model", EvalModelConfig), ("attention", EvalAttentionConfig)):
        default = leaves(OmegaConf.to_container(OmegaConf.structured(schema), resolve=False), group)
        given = leaves(OmegaConf.to_container(cfg[group], resolve=True), group)
        out += [f"{key}={value}" for key, value in given.items()
                if key != f"{group}.name" and value != default.get(key, {})]
    return out


def load_target(cfg: DictConfig, device: torch.device) -> EvalTarget:
    """The model and its evaluation settings, from ``checkpoint=`` or ``model=`` / ``attention=`` / ``weights=``."""
    if cfg.checkpoint:
        given = [k for k in ("weights",) if cfg[k]] + [f"{k}=" for k in ("model", "attention") if cfg[k].name]
        if cfg.attention.name and ":" in str(cfg.attention.name) and given == ["attention="]:
            given = []  # attention=<import path>: the user names the code the checkpoint's config asks for
        given += _set_model_keys(cfg)
        if given:
            raise ValueError(f"checkpoint= rebuilds the model from the checkpoint's config; do not also pass "
                             f"{', '.join(given)}: it would not apply (use model=/attention=/weights= without "
                             "checkpoint= to build a model of your own)")
        target = _from_checkpoint(cfg)
    else:
        if not cfg.model.name:
            raise ValueError("nothing to evaluate: pass checkpoint=<run>/checkpoints/last.pt, or "
                             "model=<timm name> attention=<name> [weights=<state_dict.pt>]")
        unused = data_overrides(cfg)
        if unused and not data_was_chosen(cfg):
            raise ValueError(f"{', '.join(f'data.{k}={v}' for k, v in unused.items())} would be ignored: a timm model "
                             "has no data config to apply it to; pass data=<name> with it (e.g. data=imagefolder "
                             "data.root=... data.num_classes=...), or drop it")
        if cfg.eval.use_ema:
            raise ValueError("eval.use_ema=true needs checkpoint=<path> (a train.py checkpoint holds the EMA weights)")
        target = _from_timm(cfg)
    target.model.to(device).eval()
    return target


def _from_checkpoint(cfg: DictConfig) -> EvalTarget:
    path = Path(cfg.checkpoint).expanduser()
    if path.is_dir():
        found = sorted(str(p.relative_to(path)) for p in path.glob("**/checkpoints/*.pt"))[:4]
        raise IsADirectoryError(f"checkpoint={path} is a directory; pass a checkpoint file"
                                + (f", e.g. {path / found[0]} (found: {', '.join(found)})" if found
                                   else " such as <run>/checkpoints/last.pt"))
    ckpt = load_record(path)  # one line for a file that is not a whole quest checkpoint, saying which case it is
    stored = OmegaConf.create(ckpt.config)
    if cfg.attention.name and cfg.attention.name != stored.attention.name:
        raise ValueError(f"attention={cfg.attention.name} but checkpoint={path} was trained with attention "
                         f"{stored.attention.name!r}: checkpoint= rebuilds the model from its own config (name its "
                         "attention only to trust an import path)")
    check_stored_code(stored, cfg, path)  # before anything the stored config names is built
    check_stored_config(stored, path)  # every value train.py declares, before anything is built from them
    settings = cfg.eval
    if settings.use_ema:
        if ckpt.ema is None:
            raise ValueError(f"eval.use_ema=true but {path} holds no EMA weights (trained with recipe.ema=false)")
        weights, which = ckpt.ema, "ema"
    else:
        weights, which = ckpt.model, "model"
    model = build_model(stored)
    check_weights(weights, f"checkpoint={path}", f"{'EMA' if which == 'ema' else 'model'} weights", model.state_dict())
    model.load_state_dict(weights)
    data, applied = stored.data, {}
    if data_was_chosen(cfg):
        if int(cfg.data.num_classes) != int(stored.data.num_classes):
            raise ValueError(f"data={cfg.data.name} has {cfg.data.num_classes} classes but the checkpoint's model "
                             f"has {stored.data.num_classes}")
        data = cfg.data
    else:  # data.root=... without data=: applied to the checkpoint's own data config, never silently ignored
        applied = data_overrides(cfg)
        problem = input_size_problem("data.img_size", applied.pop("img_size", None), resolve_img_size(stored))
        if problem:  # the model's own size given again changes nothing: not recorded as applied
            raise ValueError(problem)
        if "num_classes" in applied and int(applied["num_classes"]) != int(stored.data.num_classes):
            raise ValueError(f"data.num_classes={applied['num_classes']} but the checkpoint's model has "
                             f"{stored.data.num_classes} classes")
        if "root" in applied and not get_dataset(stored.data.name).reads_root:
            raise ValueError(f"data.root={applied['root']} would be ignored: the checkpoint's data set "
                             f"{stored.data.name} is built in and reads no root; pass data=<name> data.root=... to "
                             "evaluate another data set")
        if applied:
            data = OmegaConf.merge(stored.data, applied)
            log.info("applied %s to the checkpoint's data config (data=%s)",
                     ", ".join(f"data.{k}={v}" for k, v in applied.items()), stored.data.name)
    crop_pct, interpolation = _eval_transform_overrides(settings, stored.recipe.crop_pct,
                                                        stored.recipe.eval_interpolation)
    choices = dict(ckpt.choices or {})
    group = stored.logger.get("group") or wandb_group(choices)
    info = {
        "source": "checkpoint", "checkpoint": str(path), "checkpoint_file": path.name, "weights": which,
        "evaluated": evaluated_name(path, which == "ema"),
        "model": stored.model.name, "attention": stored.attention.name,
        "attention_options": OmegaConf.to_container(stored.attention.options, resolve=True),
        "checkpoint_sha256": file_sha256(path), "data_overrides": applied,
        "choices": choices, "train_data": stored.data.name, "seed": stored.trainer.seed,
        "train_step": ckpt.state.get("step"), "train_epoch": ckpt.state.get("epoch"),
    }
    return EvalTarget(model, int(stored.data.num_classes), resolve_img_size(stored), tuple(data.mean),
                      tuple(data.std), crop_pct, interpolation, data, info, group)


def _load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The state_dict in ``path`` (plain, or wrapped as {"state_dict"|"model": ...}), loaded with weights_only."""
    if not path.is_file():
        raise FileNotFoundError(f"weights={path} does not exist" + (" (it is a directory)" if path.is_dir() else ""))
    found = inspect_torch_file(path)
    problem = weights_problem(path, found)
    if problem is not None:
        raise ValueError(problem)
    return state_dict_of(found.obj)


def _weights_state(weights: str) -> dict[str, torch.Tensor]:
    """A weights= value: a torch file (checked case by case), a .safetensors file or a local-dir:/hf-hub: folder."""
    if weights.startswith(("local-dir:", "hf-hub:")) or weights.endswith(".safetensors"):
        from quest.models.pretrained import pretrained_state_dict

        return pretrained_state_dict(weights, option="weights")
    return _load_state_dict(Path(weights).expanduser())


def _num_classes(cfg: DictConfig, state: dict[str, torch.Tensor] | None, chosen: bool) -> int:
    """The weights' class count (their head), else data.num_classes with data=, else timm's 1000."""
    if "num_classes" in cfg.model.kwargs:
        raise ValueError("model.kwargs.num_classes: the class count comes from weights= (its classifier), or from "
                         "data.num_classes with data=<name> when there are no weights; do not set it")
    found = weights_num_classes(state) if state is not None else None
    if found is not None:
        if chosen and int(cfg.data.num_classes) != found:
            raise ValueError(f"weights={cfg.weights} classify {found} classes but data={cfg.data.name} has "
                             f"data.num_classes={cfg.data.num_classes}: evaluate it on a data set with its classes")
        return found
    return int(cfg.data.num_classes) if chosen else 1000


def _from_timm(cfg: DictConfig) -> EvalTarget:
    name, attention = cfg.model.name, cfg.attention.name
    if not attention:
        raise ValueError(f"model={name} needs attention=<name> (standard for stock timm weights; "
                         "quest, qnorm, qknorm, qknorm_hs, qknorm_ds)")
    chosen = data_was_chosen(cfg)
    record = export_record(str(cfg.weights)) if cfg.weights else None
    exported = (record or {}).get("model_args") or {}
    if exported.get("attention") and exported["attention"] != attention:
        raise ValueError(f"weights={cfg.weights} were trained with {exported['attention']!r} attention, not "
                         f"attention={attention}: pass attention={exported['attention']}")
    if exported.get("model") and exported["model"] != name:
        raise ValueError(f"weights={cfg.weights} are a {exported['model']}, not model={name}")
    state = _weights_state(str(cfg.weights)) if cfg.weights else None
    num_classes = _num_classes(cfg, state, chosen)
    kwargs: dict[str, Any] = dict(cfg.model.kwargs)
    if cfg.model.img_size:
        kwargs["img_size"] = int(cfg.model.img_size)
    model = create_model(name, attention=attention, attention_options=dict(cfg.attention.options),
                         num_classes=num_classes, **kwargs)
    if state is not None:
        check_weights(state, f"weights={cfg.weights}", f"weights (for {name} with {attention} attention)",
                      model.state_dict())
        model.load_state_dict(state)
    else:
        log.warning("no weights= given: evaluating a randomly initialised %s", name)
    if chosen and record is not None:
        from quest.data import build_dataset

        classes = getattr(build_dataset(cfg.data, "val", None), "classes", None)
        order = class_order(record.get("label_names"), classes, str(cfg.weights), cfg.data.name)
        if order is not None:
            model = ClassOrder(model, order)
            model.pretrained_cfg = model.model.pretrained_cfg
    pretrained = model.pretrained_cfg
    own = (record or {}).get("pretrained_cfg") or {}
    if own:  # an exported model's own preprocessing (what timm's resolve_data_config gives), whatever the data set
        pretrained = {**pretrained, **own}
    img_size = int(cfg.model.img_size or pretrained["input_size"][-1])
    mean = tuple(cfg.data.mean) if chosen and not own else tuple(pretrained["mean"])
    std = tuple(cfg.data.std) if chosen and not own else tuple(pretrained["std"])
    crop_pct, interpolation = _eval_transform_overrides(cfg.eval, pretrained.get("crop_pct", 0.875),
                                                        pretrained.get("interpolation", "bicubic"))
    info = {"source": "timm", "model": name, "attention": attention,
            "attention_options": OmegaConf.to_container(cfg.attention.options, resolve=True),
            "weights": str(cfg.weights) if cfg.weights else "none: randomly initialised",
            "weights_sha256": state_dict_sha256(state) if state is not None else None,
            "evaluated": evaluated_name(None, False, cfg.weights)}
    return EvalTarget(model, num_classes, img_size, mean, std, crop_pct, interpolation,
                      cfg.data if chosen else None, info, cfg.logger.group)
