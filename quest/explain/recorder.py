"""Attention probabilities, computed explicitly so that explanations can read them (and their gradients).

The fused SDPA kernel never materialises softmax(logits). :func:`explicit_attention` registers, for the duration
of a ``with`` block, an attention hook on every quest attention layer (``QKAttention.register_attention_hook``, the
public seam of the one call every formulation's ``attend`` ends in: standard, QUEST, QKNorm, Elliptical with its m,
and out-of-tree formulations); while it is registered the layer writes its softmax out and hands the hook its
logits = scale * q' k'^T (+ mask) and probs = softmax(logits), the ones it applies to v. Nothing of it runs unless
an explanation asks.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn as nn

from quest.attention import CrossAttentionMixin, QKAttention

__all__ = ["AttentionRecord", "explicit_attention", "check_explainable"]


@dataclass
class AttentionRecord:
    """What the layers computed in one forward, in forward order: per layer (B, H, N, N) logits and probabilities
    (the probabilities keep their autograd graph, so a gradient with respect to them can be taken)."""

    logits: list[torch.Tensor] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


def _layers(model: nn.Module) -> list[QKAttention]:
    return [m for m in model.modules() if isinstance(m, QKAttention)]


def check_explainable(model: nn.Module) -> int:
    """The number of prefix tokens ([CLS] first) of a ViT whose [CLS] token makes the prediction; a clear error for
    models where the [CLS]-row methods do not apply."""
    layers = _layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no quest attention layers; build it with quest.models.create_model")
    if any(isinstance(m, CrossAttentionMixin) for m in layers):
        raise ValueError("attention maps, rollout and AG-CAM follow one chain of self-attention blocks read through "
                         "the [CLS] row; CrossViT's two branches and cross-attention have no such chain")
    if getattr(model, "global_pool", "token") != "token" or getattr(model, "cls_token", None) is None:
        raise ValueError(f"{type(model).__name__} does not classify from a [CLS] token (global_pool="
                         f"{getattr(model, 'global_pool', None)!r}); the [CLS]-row explanations do not apply")
    return int(getattr(model, "num_prefix_tokens", 1))


def _detached_input(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # a fresh leaf: the layer's probabilities keep a graph (even with frozen weights) that ends at its own input
    def leaf(x: torch.Tensor) -> torch.Tensor:
        return x.detach().requires_grad_(torch.is_grad_enabled())

    if args:
        return (leaf(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "x": leaf(kwargs["x"])}


@contextmanager
def explicit_attention(model: nn.Module, detach_inputs: bool = False) -> Iterator[AttentionRecord]:
    """Inside the block every attention layer of ``model`` computes (and records) its probabilities explicitly.
    ``detach_inputs``: every attention layer's input tokens are detached first, as in the AG-CAM authors' ViT
    (``x = x.detach()`` at the top of their ``Attention.forward``), so no gradient flows back through an attention
    layer into the blocks before it; the forward values are unchanged."""
    record = AttentionRecord()

    def keep(layer: nn.Module, logits: torch.Tensor, probs: torch.Tensor) -> None:
        record.logits.append(logits)
        record.probs.append(probs)

    handles = []
    try:
        for layer in _layers(model):
            handles.append(layer.register_attention_hook(keep))
            if detach_inputs:
                handles.append(layer.register_forward_pre_hook(_detached_input, with_kwargs=True))
        yield record
    finally:
        for handle in handles:
            handle.remove()  # the fused kernel again
