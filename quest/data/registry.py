"""The data sets ``data=<name>`` can name, each registered where it is defined (quest/data/sets/, docs/data.md).

A data set is one module and one yaml: the module holds its settings (a dataclass extending
:class:`quest.data.config.DataConfig` with its own options), its value checks and its builder, registered with
:func:`register_dataset`; ``configs/data/<name>.yaml`` sets its values and lists ``<name>_schema`` (the settings,
stored in Hydra's ConfigStore by :func:`register_data_configs`) first in its defaults, so a misspelt option fails
when the command is composed, naming the key.

Where data sets come from, all imported on first use (:func:`load_datasets`): the modules of ``quest/data/sets/``
(the built-in ones), the modules named in ``QUEST_DATA_MODULES`` (comma-separated import names) and the
``quest.datasets`` entry points of installed packages. No torch is imported here: builders import it when called.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from quest.runtime.plugins import import_plugins
from quest.store.compat import FLAT_DATA_KEYS
from quest.store.compat import upgrade_data_config as compat_upgrade_data_config

from .config import DataConfig, training_only_keys

__all__ = ["DataSet", "register_dataset", "unregister_dataset", "get_dataset", "list_datasets", "load_datasets",
           "register_data_configs", "schema_name", "any_data_settings", "upgrade_data_config", "data_set_keys",
           "SCHEMA_SUFFIX", "training_only_data_keys", "ANY_DATA_SCHEMA", "FLAT_KEYS", "MODULES_ENV", "ENTRY_POINT_GROUP"]

MODULES_ENV = "QUEST_DATA_MODULES"
SCHEMA_SUFFIX = "_schema"  # data/<name>_schema in Hydra's ConfigStore: the data set's settings
#: data/_any_schema: eval.py's data node when no data=<name> is chosen (data.<key>=... then changes the checkpoint's
#: own data config, whichever data set it names): every registered data set's keys
ANY_DATA_SCHEMA = "_any" + SCHEMA_SUFFIX
ENTRY_POINT_GROUP = "quest.datasets"
B = TypeVar("B", bound=Callable[..., Any])

#: the keys of the flat DataConfig of earlier quest (quest.store.compat.FLAT_DATA_KEYS), kept here by their former name
FLAT_KEYS = FLAT_DATA_KEYS


@dataclass(frozen=True)
class DataSet:
    """One data set: ``build(data, split, transform)`` and the settings dataclass of its ``data`` node."""

    name: str
    build: Callable[[Any, str, Callable | None], Any]  # (data config, 'train' | 'val', transform) -> a Dataset
    settings: type  # a dataclass extending DataConfig: the keys and types of data.* for this data set
    # value checks of its own options, given quest.config.checks.Checks (keys named 'data.<option>'); run with every
    # other config check before anything is built
    check: Callable[[Any], None] | None = None
    # the class count the data set has (it may list directories or read an index), or None when it cannot say
    num_classes: Callable[[Any], int | None] | None = None
    # checks of the data itself that list directories only (image folders: both splits have the same classes)
    check_data: Callable[[Any], None] | None = None
    streamed: bool = False  # read in order (tar shards): no class-balanced subset, no repeated augmentation
    reads_root: bool = True  # False: built in, data.root is not read
    where_classes: Callable[[Any], str] | None = None  # where num_classes was read, for the error message
    # the folder of the val split when the data set reads one (an evaluation checks it is readable first)
    val_folder: Callable[[Any], Path | None] | None = None
    # True: reads image files, and its builder takes ``read_file=`` (a training input's way to read one:
    # data.pipeline=split decodes with torchvision, data.pipeline=device passes the bytes on; build_dataset)
    reads_files: bool = False
    module: str = ""


_REGISTRY: dict[str, DataSet] = {}
_STATE = {"loaded": False}


def schema_name(name: str) -> str:
    """The ConfigStore name of a data set's settings in group ``data`` (its yaml's first default)."""
    return f"{name}{SCHEMA_SUFFIX}"


def register_dataset(name: str, settings: type = DataConfig, *, check: Callable[[Any], None] | None = None,
                     num_classes: Callable[[Any], int | None] | int | None = None,
                     check_data: Callable[[Any], None] | None = None, streamed: bool = False,
                     reads_root: bool = True, where_classes: Callable[[Any], str] | None = None,
                     val_folder: Callable[[Any], Path | None] | None = None,
                     reads_files: bool = False) -> Callable[[B], B]:
    """Decorator: ``build(data, split, transform)`` becomes the data set ``name``, its ``data`` node typed by
    ``settings`` (a dataclass extending :class:`DataConfig`). ``check(checks)`` adds value checks of its options
    (:class:`quest.config.checks.Checks`, keys ``data.<option>``); ``num_classes`` (an int or a function of the data
    config) is compared with ``data.num_classes`` at start. Returns ``build`` unchanged."""
    if not name.isidentifier():
        raise ValueError(f"data set name {name!r} must be an identifier")
    if not (dataclasses.is_dataclass(settings) and issubclass(settings, DataConfig)):
        raise TypeError(f"data set {name!r}: settings must be a dataclass extending quest.data.config.DataConfig, "
                        f"got {settings!r}")
    classes = (lambda data, n=num_classes: n) if isinstance(num_classes, int) else num_classes

    def decorate(build: B) -> B:
        module = getattr(build, "__module__", "") or ""
        old = _REGISTRY.get(name)
        if old is not None and old.module != module:
            raise ValueError(f"data set {name!r} is registered twice: by {old.module} and by {module}")
        _REGISTRY[name] = DataSet(name, build, settings, check, classes, check_data, streamed, reads_root,
                                  where_classes, val_folder, reads_files, module)
        return build

    return decorate


def unregister_dataset(name: str) -> None:
    """Forget ``name`` (tests that register data sets of their own)."""
    _REGISTRY.pop(name, None)


def load_datasets() -> None:
    """Import the built-in data sets, the modules of ``QUEST_DATA_MODULES`` and the ``quest.datasets`` entry points
    (once); each registers its data sets as it is imported."""
    if _STATE["loaded"]:
        return
    _STATE["loaded"] = True  # before importing: a module that asks for the registry does not recurse
    try:
        import_plugins("quest.data.sets", MODULES_ENV, ENTRY_POINT_GROUP, "data set")
    except BaseException:
        _STATE["loaded"] = False
        raise


def list_datasets() -> list[str]:
    """Registered data set names, sorted (after :func:`load_datasets`)."""
    load_datasets()
    return sorted(_REGISTRY)


def get_dataset(name: str) -> DataSet:
    """The data set registered as ``name``; a ValueError naming the registered ones otherwise."""
    load_datasets()
    if name not in _REGISTRY:
        raise ValueError(f"unknown data set {name!r}; registered data sets: {', '.join(sorted(_REGISTRY))} (a data "
                         f"set of your own: docs/data.md, \"Adding a data set\"; its module in {MODULES_ENV})")
    return _REGISTRY[name]


def training_only_data_keys() -> frozenset[str]:
    """The data.* keys that any registered data set marks training-only (quest.data.config.TRAINING_ONLY): the union,
    so that a stored config holding other data sets' keys (the flat node of earlier quest) is read the same way."""
    load_datasets()
    return frozenset().union(*(training_only_keys(ds.settings) for ds in _REGISTRY.values()))


def register_data_configs() -> None:
    """Every registered data set's settings in Hydra's ConfigStore as ``data/<name>_schema`` (its yaml's first
    default), so ``data=<name> data.<option>=...`` is typed by them."""
    from hydra.core.config_store import ConfigStore

    load_datasets()
    store = ConfigStore.instance()
    for name, entry in _REGISTRY.items():
        store.store(group="data", name=schema_name(name), node=entry.settings)
    store.store(group="data", name=ANY_DATA_SCHEMA, node=any_data_settings())


def any_data_settings() -> type:
    """A dataclass extending :class:`DataConfig` with the own keys of every registered data set (the first one to
    define a key gives its type and default): what ``data.<key>=...`` may set on a checkpoint's data config."""
    load_datasets()
    shared = {f.name for f in dataclasses.fields(DataConfig)}
    fields: dict[str, tuple] = {}
    for entry in _REGISTRY.values():
        hints = typing.get_type_hints(entry.settings)
        for f in dataclasses.fields(entry.settings):
            if f.name not in shared and f.name not in fields:
                default = (dataclasses.field(default_factory=f.default_factory)
                           if f.default_factory is not dataclasses.MISSING else dataclasses.field(default=f.default))
                fields[f.name] = (f.name, hints[f.name], default)
    return dataclasses.make_dataclass("AnyDataConfig", list(fields.values()), bases=(DataConfig,))


def data_set_keys(name: Any) -> frozenset[str] | None:
    """The keys of data set ``name``'s settings; None when no data set of that name is registered."""
    if name not in _REGISTRY:
        load_datasets()
    entry = _REGISTRY.get(name)
    return None if entry is None else frozenset(f.name for f in dataclasses.fields(entry.settings))


def upgrade_data_config(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored ``data`` config of any quest in today's form (quest.store.compat.upgrade_data_config): the flat node of
    earlier quest narrowed to the keys of its data set's settings, ``pipeline`` added where it predates the key."""
    return compat_upgrade_data_config(stored, data_set_keys(stored.get("name")))
