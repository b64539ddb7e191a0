"""``quest_vit``: the timm model entry point of an exported quest model (``quest-export``, docs/interop.md).

An exported folder's config.json names the architecture ``quest_vit.<attention>`` and keeps the timm model, the
attention and its options in ``model_args``. After ``import quest``, timm.create_model of ``"local-dir:DIR"``
(or ``hf-hub:``) with its pretrained weights reaches :func:`quest_vit`, which builds the model exactly as quest does
(:func:`quest.models.create_model`: every layer told its place, then the weights) and keeps the folder's
pretrained_cfg, so ``timm.data.resolve_data_config`` gives the run's preprocessing.

Without quest, timm stops at ``RuntimeError: Unknown model (quest_vit.<attention>)``: the attention is named, and no
model with timm's own attention is ever built from these weights (QUEST adds no parameters, so a strict load into a
standard ViT would succeed and silently compute something else).
"""
from __future__ import annotations

from typing import Any

import torch.nn as nn
from timm.models import load_pretrained, register_model
from timm.models.vision_transformer import checkpoint_filter_fn

from quest.attention import get_attention
from quest.attention.timm_names import timm_attention_table

from .factory import create_model

__all__ = ["ARCHITECTURE", "exported_architecture", "quest_vit"]

ARCHITECTURE = "quest_vit"
# timm reads a module-level default_cfgs when registering: one entry without weights of its own
default_cfgs = {ARCHITECTURE: {"url": "", "num_classes": 1000, "input_size": (3, 224, 224), "crop_pct": 0.9,
                               "interpolation": "bicubic", "first_conv": "patch_embed.proj", "classifier": "head"}}


def exported_architecture(attention: str) -> str:
    """``quest_vit.<attention>``: timm strips the tag to find :func:`quest_vit`; plain timm names the whole string
    in its "Unknown model" error."""
    return f"{ARCHITECTURE}.{attention}"


def _attention_class(attention: str, options: dict[str, Any]) -> type[nn.Module]:
    if ":" in attention:
        # an import path read from a file is never imported on that file's word: it must have been named in this
        # process already (get_attention("pkg.module:Class") or timm attn_layer=...), which registered it with timm
        try:
            known = attention in timm_attention_table()
        except RuntimeError:
            known = False
        if not known:
            raise ValueError(
                f"this model's attention is {attention!r}, an import path: name it in this process first "
                f"(quest.attention.get_attention({attention!r})) so that its code is imported on your word, "
                "not on a config file's")
    return get_attention(attention, **options)


@register_model
def quest_vit(pretrained: bool = False, model: str | None = None, attention: str | None = None,
              attention_options: dict[str, Any] | None = None, pretrained_cfg: Any = None, cache_dir: Any = None,
              pretrained_cfg_overlay: Any = None, pretrained_model_args: Any = None, **kwargs: Any) -> nn.Module:
    """A timm ``VisionTransformer`` family model (``model``) with quest attention ``attention`` (and its
    ``attention_options``); ``kwargs`` are timm model kwargs (num_classes, img_size, ...). With ``pretrained``, the
    weights named by ``pretrained_cfg`` (a ``local-dir:`` / ``hf-hub:`` folder's) load strictly."""
    if not model or not attention:
        raise ValueError(f"{ARCHITECTURE} needs model=<timm name> and attention=<quest attention> (config.json "
                         "model_args of a quest-export folder); got model={model!r}, attention={attention!r}")
    options = dict(attention_options or {})
    _attention_class(attention, options)  # checks the name and options before anything is built
    built = create_model(model, attention=attention, attention_options=options, **kwargs)
    cfg = dict(pretrained_cfg) if isinstance(pretrained_cfg, dict) else dict(built.pretrained_cfg)
    cfg.update(pretrained_cfg_overlay or {})
    cfg["architecture"] = model
    built.pretrained_cfg = built.default_cfg = cfg
    built.pretrained_model_args = dict(pretrained_model_args or {})
    if pretrained:  # after the layers were bound (QKNorm's bind initialises its scale), so the weights win
        load_pretrained(built, pretrained_cfg=cfg, num_classes=built.num_classes, filter_fn=checkpoint_filter_fn,
                        strict=True, cache_dir=cache_dir)
    return built
