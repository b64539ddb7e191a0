"""Name -> attention class registry, import paths, and option binding for timm's ``attn_layer=``.

An attention is named by its registered name (``quest``) or by the import path of a :class:`QKAttention` subclass
in any package (``my_package.attention:MyAttention``), so a new formulation needs no edit to quest.

timm checks ``issubclass(attn_layer, ...)``, so an attention with non-default options (say a QKNorm scale
initialised for a 65-token model) cannot be a ``functools.partial``: :func:`get_attention` returns a small
subclass with the options bound as class attributes instead.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, TypeVar

import torch.nn as nn

from quest.config.checks import is_number

from .timm_names import register_timm_name

__all__ = ["register_attention", "get_attention", "list_attentions", "attention_options", "option_problem",
           "refuse_code_named_by_file"]

_REGISTRY: dict[str, type[nn.Module]] = {}
A = TypeVar("A", bound=type)


def register_attention(name: str) -> Callable[[A], A]:
    """Class decorator: make ``cls`` available as ``attention=<name>`` (in code and in Hydra configs)."""

    def wrap(cls: A) -> A:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"attention {name!r} is already registered to {_REGISTRY[name].__qualname__}")
        cls.attention_name = name
        _REGISTRY[name] = cls
        register_timm_name(name, cls)  # timm.create_model(..., attn_layer=name) too
        return cls

    return wrap


def list_attentions() -> list[str]:
    """Registered attention names, sorted."""
    return sorted(_REGISTRY)


def attention_options(cls: type) -> dict[str, Any]:
    """The configurable options of an attention class and their current values (class attribute ``options``)."""
    return dict(getattr(cls, "options", {}))


def option_problem(cls: type, key: str, value: Any) -> str | None:
    """What ``value`` of option ``key`` should be, when it is not that: the class's own rule (``option_rules``:
    name -> (test, what is expected)), else, for an option whose default is a number, a finite number > 0 (every
    numeric option of the built-in formulations is an epsilon or a scale)."""
    rule = getattr(cls, "option_rules", {}).get(key)
    if rule is not None:
        test, expected = rule
        return None if test(value) else expected
    default = attention_options(cls).get(key)
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return None if is_number(value) and value > 0 else "a finite number > 0"
    return None


def refuse_code_named_by_file(name: Any, key: str, source: Any, trusted: bool, how: str) -> None:
    """A file is data: an import path read from it (``key`` of the file ``source``: a checkpoint's
    ``attention.name: package.module:Class``) names code that building its model would import and run. Unless
    ``trusted`` (the user named that code, or said to trust the file), a ValueError before anything is imported,
    saying ``how`` to name it."""
    if not (isinstance(name, str) and ":" in name) or trusted:
        return
    raise ValueError(f"{source} stores {key}={name!r}, an import path: building its model would import the module "
                     f"{name.partition(':')[0]!r} and run its code, and a file is data, not code. If you trust it "
                     f"and that module, {how}")


def _import_attention(path: str) -> type[nn.Module]:
    """``package.module:ClassName`` -> the class, which must subclass QKAttention."""
    from .base import QKAttention

    module_name, _, class_name = path.partition(":")
    if not module_name or not class_name or ":" in class_name:
        raise ValueError(f"attention {path!r}: an import path is 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"attention {path!r}: cannot import {module_name!r} ({exc}); is its package installed or on "
                         "PYTHONPATH?") from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, QKAttention)):
        found = "not found" if cls is None else f"a {type(cls).__name__}, not a QKAttention subclass"
        raise ValueError(f"attention {path!r}: {class_name!r} in {module_name} is {found}; an attention is a "
                         "subclass of quest.attention.QKAttention (docs/attention.md)")
    if "attention_name" not in vars(cls):  # an unregistered class goes by its import path (checkpoints, logs)
        cls.attention_name = path
    register_timm_name(path, cls)  # once named, timm.create_model(..., attn_layer=path) builds it as well
    return cls


def get_attention(name: str | type, **options: Any) -> type[nn.Module]:
    """The attention class registered as ``name`` (or at the import path ``package.module:ClassName``), with
    ``options`` (initial values of learnable scales, ...) bound.

    Raises ``ValueError`` naming the registered attentions for an unknown name, what failed for an import path, and
    the valid options of that attention for an unknown option.
    """
    if isinstance(name, type):
        cls = name
    elif ":" in name:
        cls = _import_attention(name)
    else:
        if name not in _REGISTRY:
            raise ValueError(f"unknown attention {name!r}; registered attentions: {', '.join(list_attentions())} "
                             "(or an import path package.module:ClassName)")
        cls = _REGISTRY[name]
    if not options:
        return cls
    valid = attention_options(cls)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        listed = ", ".join(f"{k}={v!r}" for k, v in valid.items()) or "none"
        raise ValueError(
            f"attention {cls.attention_name!r} has no option(s) {', '.join(unknown)}; its options are: {listed}"
        )
    for key, value in options.items():  # checked here, before any work: a bad value would fail deep in a forward
        problem = option_problem(cls, key, value)
        if problem is not None:
            raise ValueError(f"attention {cls.attention_name!r} option {key}={value!r}: expected {problem}")
    bound = {**valid, **options}
    # Checkpoints store the attention name and options (plain values), never this generated class.
    return type(cls.__name__, (cls,), {"options": bound, "__module__": cls.__module__})
