"""What a data set is and how one registers (``data=<name>``): :class:`DataSet`, :func:`register_dataset`, the
decorator a data set's module applies to its builder, and the table it fills. The built-in data sets
(quest/data/sets/) and a user's own import this module; finding a data set by name, which imports them first, is
quest.data.registry, above them. No torch is imported here: builders import it when called.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from .config import DataConfig

__all__ = ["DataSet", "register_dataset", "unregister_dataset", "registered"]

B = TypeVar("B", bound=Callable[..., Any])


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


def registered() -> dict[str, DataSet]:
    """Every data set registered so far, by name (what their modules have registered as they were imported)."""
    return _REGISTRY
