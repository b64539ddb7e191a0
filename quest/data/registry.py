"""The data sets ``data=<name>`` can name, each registered where it is defined (quest/data/sets/, docs/data.md).

A data set is one module and one yaml: the module holds its settings (a dataclass extending
:class:`quest.data.config.DataConfig` with its own options), its value checks and its builder, registered with
:func:`register_dataset` (quest/data/kinds.py, importable from here too); ``configs/data/<name>.yaml`` sets its
values and lists ``<name>_schema`` (the settings, stored in Hydra's ConfigStore by :func:`register_data_configs`)
first in its defaults, so a misspelt option fails when the command is composed, naming the key.

Where data sets come from, all imported on first use (:func:`load_datasets`): the modules of ``quest/data/sets/``
(the built-in ones), the modules named in ``QUEST_DATA_MODULES`` (comma-separated import names) and the
``quest.datasets`` entry points of installed packages. This module finds a data set by name and lists them: it
imports the modules that fill the table first, and they register in quest.data.kinds and never import this module
back. No torch is imported here: builders import it when called.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

from quest.runtime.plugins import import_plugins
from quest.store.compat import FLAT_DATA_KEYS
from quest.store.compat import upgrade_data_config as compat_upgrade_data_config

from .config import DataConfig, training_only_keys
from .kinds import DataSet, register_dataset, registered, unregister_dataset

__all__ = ["DataSet", "register_dataset", "unregister_dataset", "get_dataset", "list_datasets", "load_datasets",
           "register_data_configs", "schema_name", "any_data_settings", "upgrade_data_config", "data_set_keys",
           "SCHEMA_SUFFIX", "training_only_data_keys", "ANY_DATA_SCHEMA", "FLAT_KEYS", "MODULES_ENV", "ENTRY_POINT_GROUP"]

MODULES_ENV = "QUEST_DATA_MODULES"
SCHEMA_SUFFIX = "_schema"  # data/<name>_schema in Hydra's ConfigStore: the data set's settings
#: data/_any_schema: eval.py's data node when no data=<name> is chosen (data.<key>=... then changes the checkpoint's
#: own data config, whichever data set it names): every registered data set's keys
ANY_DATA_SCHEMA = "_any" + SCHEMA_SUFFIX
ENTRY_POINT_GROUP = "quest.datasets"

#: the keys of the flat DataConfig of earlier quest (quest.store.compat.FLAT_DATA_KEYS), kept here by their former name
FLAT_KEYS = FLAT_DATA_KEYS


def schema_name(name: str) -> str:
    """The ConfigStore name of a data set's settings in group ``data`` (its yaml's first default)."""
    return f"{name}{SCHEMA_SUFFIX}"


def load_datasets() -> None:
    """Import the built-in data sets, the modules of ``QUEST_DATA_MODULES`` and the ``quest.datasets`` entry points
    (once); each registers its data sets as it is imported (quest.data.kinds), and none imports this module back."""
    import_plugins("quest.data.sets", MODULES_ENV, ENTRY_POINT_GROUP, "data set")


def list_datasets() -> list[str]:
    """Registered data set names, sorted (after :func:`load_datasets`)."""
    load_datasets()
    return sorted(registered())


def get_dataset(name: str) -> DataSet:
    """The data set registered as ``name``; a ValueError naming the registered ones otherwise."""
    load_datasets()
    if name not in registered():
        raise ValueError(f"unknown data set {name!r}; registered data sets: {', '.join(sorted(registered()))} "
                         f"(a data set of your own: docs/data.md, \"Adding a data set\"; its module in {MODULES_ENV})")
    return registered()[name]


def training_only_data_keys() -> frozenset[str]:
    """The data.* keys that any registered data set marks training-only (quest.data.config.TRAINING_ONLY): the union,
    so that a stored config holding other data sets' keys (the flat node of earlier quest) is read the same way."""
    load_datasets()
    return frozenset().union(*(training_only_keys(ds.settings) for ds in registered().values()))


def register_data_configs() -> None:
    """Every registered data set's settings in Hydra's ConfigStore as ``data/<name>_schema`` (its yaml's first
    default), so ``data=<name> data.<option>=...`` is typed by them."""
    from hydra.core.config_store import ConfigStore

    load_datasets()
    store = ConfigStore.instance()
    for name, entry in registered().items():
        store.store(group="data", name=schema_name(name), node=entry.settings)
    store.store(group="data", name=ANY_DATA_SCHEMA, node=any_data_settings())


def any_data_settings() -> type:
    """A dataclass extending :class:`DataConfig` with the own keys of every registered data set (the first one to
    define a key gives its type and default): what ``data.<key>=...`` may set on a checkpoint's data config."""
    load_datasets()
    shared = {f.name for f in dataclasses.fields(DataConfig)}
    fields: dict[str, tuple] = {}
    for entry in registered().values():
        hints = typing.get_type_hints(entry.settings)
        for f in dataclasses.fields(entry.settings):
            if f.name not in shared and f.name not in fields:
                default = (dataclasses.field(default_factory=f.default_factory)
                           if f.default_factory is not dataclasses.MISSING else dataclasses.field(default=f.default))
                fields[f.name] = (f.name, hints[f.name], default)
    return dataclasses.make_dataclass("AnyDataConfig", list(fields.values()), bases=(DataConfig,))


def data_set_keys(name: Any) -> frozenset[str] | None:
    """The keys of data set ``name``'s settings; None when no data set of that name is registered."""
    if name not in registered():
        load_datasets()
    entry = registered().get(name)
    return None if entry is None else frozenset(f.name for f in dataclasses.fields(entry.settings))


def upgrade_data_config(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored ``data`` config of any quest in today's form (quest.store.compat.upgrade_data_config): the flat node of
    earlier quest narrowed to the keys of its data set's settings, ``pipeline`` added where it predates the key."""
    return compat_upgrade_data_config(stored, data_set_keys(stored.get("name")))
