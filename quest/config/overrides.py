"""Command-line overrides checked before Hydra composes anything: a misspelt key or config group is answered with the
nearest valid one, in one line, on the first try.

Hydra answers ``atention=standard`` with "To append to your config use +atention=standard", which then fails again
(quest refuses keys the schema does not define, quest.config.checks); ``trainer.epoch=3`` likewise. Here every override
``[+|++|~]key[@package]=value`` is read with Hydra's own parser and its key walked down the app's schema
dataclasses: a key that names neither a config group of the app nor a schema field is refused with the closest
spelling, and a group option that does not exist with the closest option. Anything this cannot judge (Hydra's own
``hydra.*`` keys, free-form ``Dict`` fields, sweeps, interpolations) is left to Hydra and the later checks.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import typing
from pathlib import Path
from typing import Any

from quest.config.checks import dataclass_of
from quest.config.flags import flag_problems
from quest.data.registry import SCHEMA_SUFFIX
from quest.runtime.errors import control_character_problems, print_error
from quest.store.made_dirs import output_dir_problem

__all__ = ["override_problems", "exit_on_bad_overrides", "app_groups", "default_options", "not_utf8_problems"]


def app_groups(config_dir: Path, primary: str) -> dict[str, list[str]]:
    """Config group -> its options, for the groups the primary config's defaults list names (``model``,
    ``attention``, ...): the YAML files of configs/<group>/ plus the options stored in Hydra's ConfigStore."""
    from omegaconf import OmegaConf

    groups: dict[str, list[str]] = {}
    defaults = OmegaConf.to_container(OmegaConf.load(config_dir / f"{primary}.yaml")).get("defaults", [])
    for entry in defaults:
        if not isinstance(entry, dict):
            continue
        for key in entry:
            group = str(key).split()[-1].split("@")[0]  # "override hydra/x" -> hydra/x; "group@pkg" -> group
            if not group.startswith("hydra") and (config_dir / group).is_dir():
                groups[group] = _options(config_dir, group)
    return groups


def _options(config_dir: Path, group: str) -> list[str]:
    from hydra.core.config_store import ConfigStore

    options = {p.stem for p in (config_dir / group).glob("*.yaml")}
    try:
        stored = ConfigStore.instance().list(group)
    except (OSError, KeyError, ValueError):
        stored = []
    # <option>_schema: an option's typed settings (data=<name>, quest/data/registry.py), not an option itself
    options.update(n for n in (name.removesuffix(".yaml") for name in stored) if not n.endswith(SCHEMA_SUFFIX))
    return sorted(options)


def _option_schema(group: str, option: Any) -> type | None:
    """The dataclass an option of ``group`` is typed by (``<group>/<option>_schema`` in Hydra's ConfigStore), if any."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    try:
        node = ConfigStore.instance().load(f"{group}/{option}{SCHEMA_SUFFIX}.yaml").node
    except Exception:  # noqa: BLE001 -- not stored: the option has no schema of its own
        return None
    found = OmegaConf.get_type(node)
    return found if dataclasses.is_dataclass(found) else None


def _option_schemas(group: str) -> list[type]:
    """The schemas of every option of ``group`` that has one."""
    from hydra.core.config_store import ConfigStore

    names = [n.removesuffix(".yaml") for n in ConfigStore.instance().list(group)]
    found = (_option_schema(group, n.removesuffix(SCHEMA_SUFFIX)) for n in names if n.endswith(SCHEMA_SUFFIX))
    return [t for t in found if t is not None]


def _typed_groups(args: list[str], groups: dict[str, list[str]], parser: Any,
                  defaults: dict[str, str]) -> dict[str, type | None]:
    """Groups whose options bring their own schema (data): the schema of the option the command line chooses, else of
    the primary config's default (``defaults``); None when neither is known: keys under it are then left to Hydra's
    typed composition."""
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException

    typed: dict[str, type | None] = {}
    for group in groups:
        try:
            names = ConfigStore.instance().list(group)
        except (OSError, KeyError, ValueError):
            continue
        if any(n.removesuffix(".yaml").endswith(SCHEMA_SUFFIX) for n in names):
            typed[group] = _option_schema(group, defaults[group]) if group in defaults else None
    for arg in args:
        try:
            override = parser.parse_override(arg) if "=" in arg and not arg.startswith("-") else None
        except HydraException:
            continue
        if override is not None and override.key_or_group in typed and _simple(override.value()):
            typed[override.key_or_group] = _option_schema(override.key_or_group, override.value())
    return typed


def _closest(word: str, candidates: typing.Iterable[str]) -> str | None:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return close[0] if close else None


def _simple(value: Any) -> bool:
    """A plain option name (not a sweep, a list, an interpolation or null)."""
    return isinstance(value, str) and value.replace("_", "").replace("-", "").replace(".", "").isalnum()


def default_options(config_dir: Path, primary: str) -> dict[str, str]:
    """Config group -> the option the primary config's defaults list chooses (``data: digits``)."""
    from omegaconf import OmegaConf

    defaults = OmegaConf.to_container(OmegaConf.load(config_dir / f"{primary}.yaml")).get("defaults", [])
    return {str(k): str(v) for entry in defaults if isinstance(entry, dict) for k, v in entry.items()
            if isinstance(v, str) and " " not in str(k)}


#: the overrides that name the directory Hydra makes before quest's code runs (so quest checks them first)
_OUTPUT_DIRS = ("hydra.run.dir", "hydra.sweep.dir")


def override_problems(args: list[str], schema: type, groups: dict[str, list[str]],
                      defaults: dict[str, str] | None = None) -> list[str]:
    """One line per override of ``args`` that names no config group of ``groups`` and no key of the ``schema``
    dataclass tree, or an option its group does not have (a group with no options listed: not checked); each with
    the closest valid spelling when there is one."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    typed = _typed_groups(args, groups, parser, defaults or {})
    problems = []
    for arg in args:
        if arg.startswith("-") or "=" not in arg.lstrip("~"):
            continue
        try:
            override = parser.parse_override(arg)
        except HydraException:
            continue  # a syntax error: Hydra's own message says where
        key = override.key_or_group
        if key == "hydra.sweep.subdir":  # said, not ignored: a user who sets it expects the jobs there
            problems.append(f"{arg}: not used: each job of a sweep runs in the directory its single run uses "
                            "(hydra.run.dir; docs/training.md, \"Sweeps\"); leave it out")
            continue
        if key in _OUTPUT_DIRS and isinstance(override.value(), str):
            problem = output_dir_problem(override.value())
            if problem:
                problems.append(f"{arg}: {problem}")
            continue
        if key.startswith("hydra") or (override.is_delete() and key in groups):
            continue
        value = override.value()
        rest = arg.split("=", 1)[1]
        if key in groups:
            options = groups[key]
            if options and _simple(value) and value not in options and value != "null":
                near = _closest(str(value), options)
                hint = f"did you mean {key}={near}? " if near else ""
                problems.append(f"{arg}: config group {key} has no option {value!r}; {hint}(options: {', '.join(options)})")
            continue
        problem = _key_problem(key, schema, groups, typed)
        if problem:
            where, near, known = problem
            hint = f"did you mean {near}={rest}? " if near else ""
            problems.append(f"{arg}: {where}; {hint}(known there: {', '.join(known)})")
    return problems


def _key_problem(key: str, schema: type, groups: dict[str, list[str]],
                 typed: dict[str, type | None] | None = None) -> tuple[str, str | None, list[str]] | None:
    """(what is wrong, the closest valid key, the keys known there) for a dotted key the schema does not define;
    under a group of ``typed`` (see :func:`_typed_groups`), by its chosen option's schema."""
    if "/" in key:  # a nested group (toy/grid): the first part must be a group or a key
        key = key.split("/")[0]
    node: type | None = schema
    parts = key.split(".")
    lenient = False  # under a group whose option's schema is not known here: an unknown key is left to Hydra
    for depth, part in enumerate(parts):
        if node is None:
            return None  # below a free-form field: checked where it is used
        fields = {f.name for f in dataclasses.fields(node)}
        if part in fields:
            node = dataclass_of(typing.get_type_hints(node).get(part))
            if depth == 0 and typed and part in typed:
                lenient = typed[part] is None
                node = typed[part] or node
            continue
        if lenient and any(part in {f.name for f in dataclasses.fields(t)} for t in _option_schemas(parts[0])):
            return None  # a key of some option's schema: Hydra's composition judges it against the chosen one
        prefix = ".".join(parts[:depth])
        known = sorted(fields | (set(groups) if depth == 0 else set()))
        near = _closest(part, known)
        full_near = f"{prefix}.{near}" if prefix and near else near
        if near and depth + 1 < len(parts):
            full_near += "." + ".".join(parts[depth + 1:])
        where = f"no config group or key {part!r}" if depth == 0 else f"{prefix} has no key {part!r}"
        return where, full_near, known
    return None


def not_utf8_problems(args: list[str]) -> list[str]:
    """One line per argument holding a name that is not UTF-8 (a folder an old zip archive extracted in Latin-1, which
    Python reads as escaped bytes): Hydra's override grammar reads UTF-8 text only, and would answer with its lexer's
    error naming no byte. The byte is shown as the file system holds it (``caf\\xe9``)."""
    problems = []
    for arg in args:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            shown = os.fsencode(arg).decode("utf-8", "backslashreplace")
            problems.append(f"{shown}: holds a name that is not UTF-8 text (bytes of another encoding, as an old "
                            "archive extracts them); quest's overrides are UTF-8 text: rename it (convmv -f latin1 "
                            "-t utf8), or give a link to it under a UTF-8 name")
    return problems


# flags after which the primary config or the search path is another one (or Hydra answers without composing)
_UNCHECKED_FLAGS = ("--config-name", "-cn", "--config-dir", "-cd", "--config-path", "-cp", "--shell-completion", "-sc",
                    "--help", "-h", "--hydra-help", "--version", "--experimental-rerun")


def exit_on_bad_overrides(app: str, args: list[str], schema: type, config_dir: Path, primary: str) -> None:
    """Print each problem of :func:`override_problems` as one line on stderr and exit 1, or return. Skipped when a
    flag selects another primary config or search path."""
    # --epochs 3 from a timm or DeiT habit: the quest key; a name not UTF-8; a line break from a shell's $(...)
    flags = flag_problems(args, app) + not_utf8_problems(args) + control_character_problems(args)
    if flags:
        for line in flags:
            print_error(app, line)
        sys.exit(1)
    if any(a.split("=", 1)[0] in _UNCHECKED_FLAGS for a in args):
        return
    groups = app_groups(config_dir, primary)
    if any(a.lstrip("+").startswith("hydra.searchpath") for a in args):
        groups = {group: [] for group in groups}  # more options may come from the added search path
    problems = override_problems(args, schema, groups, default_options(config_dir, primary))
    if problems:
        for line in problems:  # the command line's: every process of a torchrun group finds them, rank 0 says them
            print_error(app, line)
        sys.exit(1)
