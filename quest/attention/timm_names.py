"""Quest's formulations under timm's ``attn_layer=`` names, so ``timm.create_model(name, attn_layer="quest")`` works.

timm resolves a string ``attn_layer`` through the module-level dict ``timm.models.vision_transformer.ATTN_LAYERS``
(``''``, ``'attn'``, ``'diff'`` in timm 1.0). That table is not a documented timm API: :func:`timm_attention_table`
finds it or says that this timm release moved it (tests/models/test_interop_timm.py fails then, naming the table), and
registration is skipped with a warning instead of breaking ``import quest``; passing the class
(``attn_layer=get_attention("quest")``) keeps working either way.
"""
from __future__ import annotations

import logging
import warnings

import torch.nn as nn

__all__ = ["timm_attention_table", "register_timm_name", "TIMM_TABLE"]

log = logging.getLogger("quest.attention")

#: where timm keeps its attn_layer names (module, attribute)
TIMM_TABLE = ("timm.models.vision_transformer", "ATTN_LAYERS")
_warned = False


def timm_attention_table() -> dict[str, type[nn.Module]]:
    """timm's name -> attention class table; ``RuntimeError`` naming what is missing when a timm release moved it."""
    import importlib

    module_name, attr = TIMM_TABLE
    module = importlib.import_module(module_name)
    table = getattr(module, attr, None)
    if not isinstance(table, dict):
        import timm

        raise RuntimeError(
            f"timm {timm.__version__} has no dict {module_name}.{attr} (found {type(table).__name__}): quest cannot "
            "register its formulations as timm attn_layer names; pass the class instead, "
            "attn_layer=quest.attention.get_attention(name)"
        )
    return table


def register_timm_name(name: str, cls: type[nn.Module]) -> bool:
    """Make ``attn_layer=name`` build ``cls`` in timm's VisionTransformer family; False (with one warning) when this
    timm release has no table to register in."""
    global _warned
    try:
        table = timm_attention_table()
    except RuntimeError as exc:
        if not _warned:
            warnings.warn(str(exc), RuntimeWarning, stacklevel=2)
            _warned = True
        return False
    existing = table.get(name)
    if existing is not None and existing is not cls and not getattr(existing, "attention_name", None):
        raise ValueError(f"timm already has an attn_layer named {name!r} ({existing.__qualname__}); quest will not "
                         "replace it")
    table[name] = cls
    return True
