"""Where a ViT looks: raw [CLS] attention, attention rollout and AG-CAM, for any model quest builds.

- :func:`cls_attention`: per layer and head, the [CLS] token's attention over the patches (softmax of the
  formulation's effective logits); as one map ("attention"), the last layer's, averaged over heads.
- :func:`attention_rollout` (Abnar & Zuidema 2020): per layer the head-mean attention mixed with the identity for
  the residual, A' = (A + I) / 2 (rows renormalised), multiplied over the layers; the [CLS] row over the patches.
- :func:`agcam` (Leem & Seo, AAAI 2024; the authors' ``Methods/AGCAM/AGCAM.py``): per layer and head, ReLU of the
  gradient of the class score with respect to the post-softmax [CLS] attention row, times the sigmoid of the
  pre-softmax [CLS] logits row, patches only, summed over heads and over layers. ``gradient="detached"`` (the
  authors' ViT, ``ViT_for_AGCAM/models/vision_transformer.py``, detaches every attention block's input, so the
  gradient reaching a layer's attention comes through the residual stream and the MLPs of the later blocks but
  not through their attention) or ``"full"`` (the gradient through the whole graph).

Each returns (B, grid_h, grid_w) maps on the patch grid; :func:`to_image` upsamples them bilinearly to the image
and min-max normalises each, as the AG-CAM authors' evaluation does. docs/explain.md.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .recorder import check_explainable, explicit_attention

__all__ = ["cls_attention", "attention_rollout", "agcam", "AGCAM_GRADIENTS", "to_image", "METHODS", "explain"]


def _grid(model: nn.Module) -> tuple[int, int]:
    grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if grid is None:
        raise ValueError(f"{type(model).__name__} has no patch grid (patch_embed.grid_size)")
    return int(grid[0]), int(grid[1])


def _on_grid(maps: torch.Tensor, model: nn.Module) -> torch.Tensor:
    h, w = _grid(model)
    return maps.reshape(maps.shape[0], h, w)


@torch.no_grad()
def _probabilities(model: nn.Module, images: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """(prefix tokens, every layer's (B, H, N, N) attention probabilities) of one eval-mode forward."""
    prefix = check_explainable(model)
    model.eval()
    with explicit_attention(model) as record:
        model(images)
    return prefix, record.probs


def cls_attention(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """(B, layers, heads, grid_h, grid_w): the [CLS] row of every layer's attention, over the patch tokens."""
    prefix, probs = _probabilities(model, images)
    rows = torch.stack([p[:, :, 0, prefix:] for p in probs], dim=1)  # (B, L, H, P)
    h, w = _grid(model)
    return rows.reshape(*rows.shape[:3], h, w)


def attention_rollout(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """(B, grid_h, grid_w): the rolled-out attention of the [CLS] token over the patches."""
    prefix, layers = _probabilities(model, images)
    n = layers[0].shape[-1]
    eye = torch.eye(n, dtype=layers[0].dtype, device=images.device)
    result = eye.expand(images.shape[0], n, n)
    for probs in layers:
        a = (probs.mean(dim=1) + eye) / 2
        a = a / a.sum(dim=-1, keepdim=True)
        result = a @ result
    return _on_grid(result[:, 0, prefix:], model)


#: AG-CAM's gradient: the authors' (each attention block's input detached) | through the whole graph
AGCAM_GRADIENTS = ("detached", "full")


def agcam(model: nn.Module, images: torch.Tensor, target: torch.Tensor | Sequence[int] | None = None,
          gradient: str = "detached") -> tuple[torch.Tensor, torch.Tensor]:
    """(maps (B, grid_h, grid_w), the classes explained): AG-CAM for ``target`` (default: each image's predicted
    class, as the authors' evaluation), with the authors' detached attention inputs or the full-graph gradient."""
    if gradient not in AGCAM_GRADIENTS:
        raise ValueError(f"AG-CAM gradient must be one of {AGCAM_GRADIENTS}, got {gradient!r}")
    prefix = check_explainable(model)
    model.eval()
    images = images.detach().requires_grad_(True)  # a graph even for a model with frozen weights
    with torch.enable_grad(), explicit_attention(model, detach_inputs=gradient == "detached") as record:
        logits = model(images)
        classes = logits.argmax(dim=1) if target is None else torch.as_tensor(target, device=logits.device)
        # samples do not interact in a ViT, so the gradient of the summed scores is every sample's own; taken with
        # respect to the attention probabilities only, so no parameter's .grad is touched
        grads = torch.autograd.grad(logits.gather(1, classes.view(-1, 1)).sum(), record.probs)
    cam = 0
    for logit, grad in zip(record.logits, grads):
        # d score / d softmax row of [CLS], and its logits row, over the patch columns
        cam = cam + (F.relu(grad[:, :, 0, prefix:]) * torch.sigmoid(logit.detach()[:, :, 0, prefix:])).sum(dim=1)
    return _on_grid(cam, model), classes.detach()


def to_image(maps: torch.Tensor, size: tuple[int, int] | int) -> torch.Tensor:
    """(B, h, w) patch-grid maps -> (B, H, W): bilinear upsampling (align_corners=False), then each map min-max
    normalised to [0, 1] (a constant map becomes 0)."""
    size = (size, size) if isinstance(size, int) else tuple(size)
    up = F.interpolate(maps[:, None].float(), size=size, mode="bilinear", align_corners=False)[:, 0]
    lo = up.amin(dim=(1, 2), keepdim=True)
    span = up.amax(dim=(1, 2), keepdim=True) - lo
    return torch.where(span > 0, (up - lo) / span.clamp_min(torch.finfo(up.dtype).tiny), torch.zeros_like(up))


def _raw(model, images, target=None):
    return cls_attention(model, images)[:, -1].mean(dim=1), None  # the last layer's [CLS] row, mean over heads


def _rollout(model, images, target=None):
    return attention_rollout(model, images), None


#: method name -> function(model, images, target) -> (maps (B, h, w), explained classes or None)
METHODS = {"attention": _raw, "rollout": _rollout, "agcam": agcam}


def explain(method: str, model: nn.Module, images: torch.Tensor, target=None, agcam_gradient: str = "detached"
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The patch-grid maps of ``method`` (attention | rollout | agcam) for ``images``; ``agcam_gradient``
    (detached | full) applies to AG-CAM only."""
    if method not in METHODS:
        raise ValueError(f"unknown explanation method {method!r}; choose from {', '.join(METHODS)}")
    if method == "agcam":
        return agcam(model, images, target, gradient=agcam_gradient)
    return METHODS[method](model, images, target)
