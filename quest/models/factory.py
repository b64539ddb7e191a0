"""timm models with a chosen attention: :func:`create_model` and :func:`convert_attention`."""
from __future__ import annotations

import copy
from typing import Any

import timm
import torch.nn as nn
from timm.layers import Attention as TimmAttention
from timm.models.crossvit import CrossAttention as TimmCrossAttention

from quest.attention import CrossAttentionMixin, QKAttention, bind_attention, get_attention

from . import presets  # noqa: F401  (registers the CPU presets with timm)

__all__ = ["create_model", "convert_attention", "attention_layers", "model_seq_len"]

_SELF_ATTENTION_TYPES = (TimmAttention, QKAttention)
_UNSUPPORTED = ("model.name={name!r} is not a Vision Transformer quest can give another attention ({why}): quest swaps the "
                "attention of timm's VisionTransformer family (vit_*, deit_*, deit3_*, register-token variants, the CPU "
                "presets vit_pico/nano/micro) and of CrossViT (crossvit_*)")


def attention_layers(model: nn.Module) -> list[tuple[str, QKAttention]]:
    """(qualified name, layer) of every quest attention layer, in module definition order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QKAttention)]


def model_seq_len(model: nn.Module) -> int | None:
    """Number of tokens a ViT-family model attends over at its configured input size (patches + prefix tokens)."""
    patch_embed = getattr(model, "patch_embed", None)
    if patch_embed is None or not hasattr(patch_embed, "num_patches"):
        return None
    return int(patch_embed.num_patches) + int(getattr(model, "num_prefix_tokens", 1))


def create_model(
    name: str, attention: str = "quest", attention_options: dict[str, Any] | None = None, **timm_kwargs: Any
) -> nn.Module:
    """``timm.create_model(name, **timm_kwargs)`` with every attention layer of the chosen formulation.

    VisionTransformer-family models (``vit_*``, ``deit_*``, ``deit3_*``, register-token variants, the CPU presets)
    get the class through timm's ``attn_layer=``; other models with timm attention layers (CrossViT's self- and
    cross-attention) are built stock and converted, which keeps their initialisation.
    """
    options = dict(attention_options or {})
    attn_cls = get_attention(attention, **options)
    if not timm.models.is_model(name):
        raise ValueError(f"unknown timm model {name!r}; see timm.list_models() or the configs/model group")
    if "attn_layer" in timm_kwargs:
        raise ValueError("pass the attention as attention=<name>, not attn_layer=")
    if timm.models.is_model_in_modules(name, ["crossvit"]):
        model = timm.create_model(name, **timm_kwargs)
        return convert_attention(model, attention, **options)
    try:
        model = timm.create_model(name, attn_layer=attn_cls, **timm_kwargs)
    except TypeError as exc:
        if "attn_layer" not in str(exc):
            raise
        raise ValueError(_UNSUPPORTED.format(name=name, why=exc)) from None
    if not attention_layers(model):
        raise ValueError(f"model {name!r} does not build its attention from attn_layer=; quest cannot swap it")
    return bind_attention(model, model_seq_len(model))  # each layer learns its place (token count, previous block)


def _layer_config(layer: nn.Module) -> dict[str, Any]:
    """Constructor arguments that rebuild ``layer`` (timm or quest attention, or CrossViT cross-attention)."""
    if isinstance(layer, (TimmCrossAttention, CrossAttentionMixin)):
        dim = layer.wq.in_features
        return dict(dim=dim, num_heads=layer.num_heads, qkv_bias=layer.wq.bias is not None)
    if isinstance(layer, TimmAttention) and (layer.attn_dim != layer.qkv.in_features or getattr(layer, "gate", None) is not None):
        raise ValueError("convert_attention supports attention with attn_dim == dim and no output gate")
    norm = getattr(layer, "norm", nn.Identity())
    return dict(
        dim=layer.qkv.in_features,
        num_heads=layer.num_heads,
        qkv_bias=layer.qkv.bias is not None,
        qk_norm=not isinstance(layer.q_norm, nn.Identity),
        scale_norm=not isinstance(norm, nn.Identity),
        proj_bias=layer.proj.bias is not None,
        norm_layer=type(layer.q_norm) if not isinstance(layer.q_norm, nn.Identity) else type(norm),
    )


def _converted(layer: nn.Module, attn_cls: type[QKAttention]) -> QKAttention:
    cfg = _layer_config(layer)
    is_cross = isinstance(layer, (TimmCrossAttention, CrossAttentionMixin))
    cls = type(f"{attn_cls.__name__}Cross", (CrossAttentionMixin, attn_cls), {}) if is_cross else attn_cls
    if not cls.supports_qk_norm:
        if cfg.get("qk_norm"):
            raise ValueError(
                f"cannot convert a qk-normed attention to {attn_cls.attention_name!r}: its LayerNorm gains on q and "
                "k have no place there"
            )
        cfg.pop("qk_norm", None)
    if cfg.get("norm_layer") is nn.Identity:
        cfg["norm_layer"] = None
    new = cls(**cfg, attn_drop=layer.attn_drop.p, proj_drop=layer.proj_drop.p)
    for attr in ("q_norm", "k_norm", "norm"):  # keep the norms as they were built (eps, bias), not just their type
        source_norm = getattr(layer, attr, None)
        if source_norm is not None and not isinstance(source_norm, nn.Identity):
            setattr(new, attr, copy.deepcopy(source_norm))
    source = layer.state_dict()
    target = new.state_dict()
    missing_in_target = sorted(set(source) - set(target))
    if missing_in_target:
        raise ValueError(f"converting to {attn_cls.attention_name!r} would drop weights {missing_in_target}")
    # Parameters only the new formulation has (a learnable scale) keep their initial values.
    target.update(source)
    new.load_state_dict(target)
    param = next(layer.parameters())
    return new.to(device=param.device, dtype=param.dtype).train(layer.training)


def convert_attention(model: nn.Module, attention: str, **options: Any) -> nn.Module:
    """Replace every attention layer of ``model`` in place by ``attention``, keeping all of its weights.

    Works on timm ``Attention``, CrossViT ``CrossAttention`` and quest layers (so a standard-attention checkpoint
    can be fine-tuned as QUEST). Parameters the new formulation adds start at their configured initial values.
    """
    attn_cls = get_attention(attention, **options)
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, (*_SELF_ATTENTION_TYPES, TimmCrossAttention))
    ]
    if not targets:
        raise ValueError(f"{type(model).__name__} has no timm or quest attention layers to convert")
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, _converted(module, attn_cls))
    return bind_attention(model, model_seq_len(model))
