"""Name -> attention class registry, and option binding for timm's ``attn_layer=``.

timm checks ``issubclass(attn_layer, ...)``, so an attention with non-default options (say a QKNorm scale
initialised for a 65-token model) cannot be a ``functools.partial``: :func:`get_attention` returns a small
subclass with the options bound as class attributes instead.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch.nn as nn

__all__ = ["register_attention", "get_attention", "list_attentions", "attention_options"]

_REGISTRY: dict[str, type[nn.Module]] = {}
A = TypeVar("A", bound=type)


def register_attention(name: str) -> Callable[[A], A]:
    """Class decorator: make ``cls`` available as ``attention=<name>`` (in code and in Hydra configs)."""

    def wrap(cls: A) -> A:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"attention {name!r} is already registered to {_REGISTRY[name].__qualname__}")
        cls.attention_name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def list_attentions() -> list[str]:
    """Registered attention names, sorted."""
    return sorted(_REGISTRY)


def attention_options(cls: type) -> dict[str, Any]:
    """The configurable options of an attention class and their current values (class attribute ``options``)."""
    return dict(getattr(cls, "options", {}))


def get_attention(name: str | type, **options: Any) -> type[nn.Module]:
    """The attention class registered as ``name``, with ``options`` (initial values of learnable scales, ...) bound.

    Raises ``ValueError`` naming the registered attentions for an unknown name, and the valid options of that
    attention for an unknown option.
    """
    if isinstance(name, type):
        cls = name
    else:
        if name not in _REGISTRY:
            raise ValueError(f"unknown attention {name!r}; registered attentions: {', '.join(list_attentions())}")
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
    bound = {**valid, **options}
    # Checkpoints store the attention name and options (plain values), never this generated class.
    return type(cls.__name__, (cls,), {"options": bound, "__module__": cls.__module__})
