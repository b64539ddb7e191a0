"""Drop path (stochastic depth) over depth as each recipe's authors had it.

timm's VisionTransformer grows the rate linearly from 0 at the first block to ``drop_path_rate`` at the last (DeiT's
models.py uses it as is); DeiT-III's models_v2.py (facebookresearch/deit) uses the same rate in every block
(``dpr = [drop_path_rate for i in range(depth)]``), which doubles the mean rate: 0.45 for ViT-L and 0.6 for ViT-H
matter. timm has no option for it, so :func:`uniform_drop_path` sets it after the model is built.
"""
from __future__ import annotations

import torch.nn as nn
from timm.layers import DropPath

__all__ = ["uniform_drop_path", "drop_path_rates"]


def _blocks(model: nn.Module) -> list[nn.Module]:
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ValueError(f"{type(model).__name__} has no `blocks`: uniform drop path applies to ViT-family models")
    return list(blocks)


def uniform_drop_path(model: nn.Module, rate: float) -> nn.Module:
    """Every transformer block drops its attention and MLP branches with probability ``rate`` (in place)."""
    for block in _blocks(model):
        for name in ("drop_path1", "drop_path2"):
            if not hasattr(block, name):
                raise ValueError(f"{type(block).__name__} has no {name}: cannot set a uniform drop path")
            setattr(block, name, DropPath(rate) if rate > 0 else nn.Identity())
    return model


def drop_path_rates(model: nn.Module) -> list[tuple[float, float]]:
    """(attention branch, MLP branch) drop probability of every block, 0 where the branch has none."""
    rate = lambda m: float(m.drop_prob) if isinstance(m, DropPath) else 0.0  # noqa: E731
    return [(rate(b.drop_path1), rate(b.drop_path2)) for b in _blocks(model)]
