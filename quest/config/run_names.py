"""The name of a run directory: ``runs/<data>/<model>-<attention>-<recipe>-seed<seed>`` for the choices alone, plus
every other override that changes what is trained in words (``-bs32-lr0.05``; operational keys such as
``trainer.device`` do not count), with a short hash only for values the words cannot show exactly, so two different
command lines land in different directories and the same command line resumes its own run.

A sweep (``-m``) lays out each job by the same rule, so a job of a sweep and the single run of the same command line
share one directory; the sweep's own record (Hydra's ``multirun.yaml``, submitit's logs) goes to
``runs/.sweeps/<command>[-<experiment>]-<digest of the command line>`` (:func:`sweep_record_name`).

Torch-free: Hydra resolves these names (``${quest_run_suffix:}``, ``${quest_safe_name:...}`` in ``hydra.run.dir``)
before anything is trained, also for ``--help`` and tab completion.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from omegaconf import DictConfig, OmegaConf

from quest.config.schema import OPERATIONAL_KEYS, matches_key

__all__ = ["run_name_suffix", "safe_name", "sweep_record_name", "register_resolvers"]

#: Overrides already spelt out in the readable part of the name.
_NAMED = ("model", "attention", "recipe", "data", "trainer.seed", "attention.name", "recipe.name", "data.name")
#: Short words for the keys most often changed on a command line (``-lr0.05-bs32``); any other key is spelt out
#: (``-trainer.max_loss5``). Each word must stay distinct from every key and from the other words.
_SHORT = {"recipe.lr": "lr", "recipe.base_lr": "base_lr", "data.batch_size": "bs", "trainer.epochs": "ep",
          "recipe.weight_decay": "wd", "recipe.warmup_epochs": "warmup", "model.img_size": "img",
          "data.img_size": "data_img", "recipe.drop_path": "dp", "trainer.accum_steps": "accum",
          "trainer.precision": "prec", "data.subset_seed": "subset_seed",
          "data.pipeline": "pipeline", "data.root": "root", "trainer.init_from": "init"}
#: the characters a run directory's name keeps; any other becomes '_' (and the name then gets a hash)
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._+-")
_MAX_WORD = 32  # longer values (lists, paths) are shown by a hash


def safe_name(text: Any) -> str:
    """``text`` with every character outside ``[A-Za-z0-9._+-]`` replaced by ``_`` (an import-path attention's
    ``pkg.mod:Cls`` -> ``pkg.mod_Cls``): a path component that needs no quoting in a shell or a Hydra override.
    Also the OmegaConf resolver ``${quest_safe_name:...}`` of ``hydra.run.dir``."""
    return "".join(c if c in _SAFE else "_" for c in str(text)) or "_"


def _named(value: Any) -> Any:
    """A path as the name of what it holds (its last part: ``/datasets/imagenet`` -> ``imagenet``), never the path: a
    data set moved to another folder is the same run, named the same (its data is compared by content when the run
    resumes, quest.run.directory.check_data), and no file-system path ends up in a directory name. The whole path
    is in run.json."""
    if isinstance(value, str) and "/" in value.rstrip("/"):
        return value.rstrip("/").rsplit("/", 1)[-1] or value
    return value


def _word(key: str, value: Any) -> tuple[str, bool]:
    """(the override in words, whether the words say it exactly): ``lr0.05`` for a number, ``diagnostics_default``
    for a group option or a text; ``exact`` is False when a character was replaced or the value is too long."""
    name = _SHORT.get(key, key)
    if value == "<deleted>":
        return f"no_{name}", True
    shown = json.dumps(value) if isinstance(value, (dict, list, bool)) or value is None else str(value)
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    word = f"{name}{shown}" if numeric else f"{name}_{shown}"
    safe = safe_name(word)
    if len(safe) > _MAX_WORD:
        return name, False
    return safe, safe == word


def _names_the_run(key: str) -> bool:
    """Whether an override of ``key`` changes what is trained (not Hydra's own, not an operational key)."""
    return not (key.startswith("hydra") or matches_key(key, OPERATIONAL_KEYS))


def run_name_suffix(*replaced: str, _root_: DictConfig) -> str:
    """OmegaConf resolver ``${quest_run_suffix:}`` for ``hydra.run.dir``: ``""`` when the command line chooses only
    what the readable name shows, else every other override in words, sorted by key (``-bs32-lr0.05``,
    ``-diagnostics_default``); when a value cannot be shown exactly (a long list, a path, a character outside
    ``[A-Za-z0-9._+-]``) the words are followed by 6 hex digits of a hash of every such override's resolved value,
    so two different command lines never share a directory and the same command line resumes its own run.

    ``replaced`` (``${quest_run_suffix:'experiment=table2_deit3'}``): group choices taken as if the command line had
    chosen them instead, to name another run of the same command line (a fine-tune's first phase)."""
    overrides = OmegaConf.select(_root_, "hydra.overrides.task", default=None) or []
    choices = OmegaConf.select(_root_, "hydra.runtime.choices", default=None) or {}
    identity: dict[str, Any] = {}
    for override in overrides:
        text = str(override)
        deleted = text.startswith("~")
        key = text.lstrip("+~").split("=", 1)[0]
        if key in _NAMED or not _names_the_run(key):
            continue
        if deleted:
            identity[key] = "<deleted>"
        elif key in choices:  # a config group (diagnostics=default, experiment=...)
            identity[key] = str(choices[key])
        else:
            value = OmegaConf.select(_root_, key, default=None)
            value = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
            identity[key] = _named(value)
    for choice in replaced:
        key, _, value = str(choice).partition("=")
        identity[key] = value
    if not identity:
        return ""
    words, inexact = [], {}
    for key in sorted(identity):
        word, exact = _word(key, identity[key])
        words.append(word)
        if not exact:
            inexact[key] = identity[key]
    if inexact:
        digest = hashlib.sha256(json.dumps(inexact, sort_keys=True, default=str).encode()).hexdigest()
        words.append(digest[:6])
    return "-" + "-".join(words)


def sweep_record_name(*, _root_: DictConfig) -> str:
    """OmegaConf resolver ``${quest_sweep_name:}`` for ``hydra.sweep.dir``, the folder of a sweep's own record (its
    jobs are laid out as single runs): ``<command>[-<experiment>]-<digest>``, the digest 6 hex digits of the sweep's
    command line as written (its overrides sorted, the operational ones and Hydra's own left out, a path by its last
    part as in a run's name). So the same sweep run again, from another machine or launcher, writes its record in
    the same folder, and two different sweeps never share one (``train-table1_ablation_cpu-3f2a9c``)."""
    overrides = OmegaConf.select(_root_, "hydra.overrides.task", default=None) or []
    lines = []
    for override in map(str, overrides):
        key, _, value = override.partition("=")
        if _names_the_run(key.lstrip("+~")):
            lines.append(f"{key}={_named(value) if ',' not in value else value}")
    digest = hashlib.sha256(json.dumps(sorted(lines)).encode()).hexdigest()[:6]
    command = safe_name(OmegaConf.select(_root_, "hydra.job.name", default="sweep"))
    experiment = OmegaConf.select(_root_, "hydra.runtime.choices.experiment", default=None)
    return "-".join([command, *([safe_name(experiment)] if experiment else []), digest])


def register_resolvers() -> None:
    """The OmegaConf resolvers ``${quest_run_suffix:}`` and ``${quest_safe_name:...}`` of ``hydra.run.dir``, and
    ``${quest_sweep_name:}`` of ``hydra.sweep.dir``."""
    if not OmegaConf.has_resolver("quest_run_suffix"):
        OmegaConf.register_new_resolver("quest_run_suffix", run_name_suffix)
    if not OmegaConf.has_resolver("quest_safe_name"):
        OmegaConf.register_new_resolver("quest_safe_name", safe_name)
    if not OmegaConf.has_resolver("quest_sweep_name"):
        OmegaConf.register_new_resolver("quest_sweep_name", sweep_record_name)
