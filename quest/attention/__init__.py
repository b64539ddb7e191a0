"""Attention formulations and their registry.

>>> from quest.attention import get_attention
>>> timm.create_model("vit_tiny_patch16_224", attn_layer=get_attention("quest"))

Register your own with ``@register_attention("name")`` on a :class:`QKAttention` subclass that overrides
``transform_qk``.
"""
from .base import CrossAttentionMixin, LayerSite, QKAttention, bind_attention, l2_normalize
from .elliptical import EllipticalAttention, EllipticalQuestAttention, link_elliptical
from .formulations import (
    QKNormAttention,
    QKNormDimScaleAttention,
    QKNormHeadScaleAttention,
    QNormAttention,
    QuestAttention,
    StandardAttention,
)
from .registry import attention_options, get_attention, list_attentions, register_attention

__all__ = [
    "QKAttention",
    "LayerSite",
    "bind_attention",
    "CrossAttentionMixin",
    "l2_normalize",
    "StandardAttention",
    "QuestAttention",
    "QNormAttention",
    "QKNormAttention",
    "QKNormHeadScaleAttention",
    "QKNormDimScaleAttention",
    "EllipticalAttention",
    "EllipticalQuestAttention",
    "link_elliptical",
    "register_attention",
    "get_attention",
    "list_attentions",
    "attention_options",
]
