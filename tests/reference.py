"""Each formulation's logits written out from its definition (docs/attention.md), independently of quest.attention.

Shared by the attention and diagnostics tests, which both compare the library against these formulas.
"""
from __future__ import annotations

import math

import torch


def l2n(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)


def layer_norm(x: torch.Tensor, ln: torch.nn.LayerNorm) -> torch.Tensor:
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias


def reference_logits(name: str, layer, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """z_ij for raw per-head queries and keys (B, H, N, d); learnable scales are read from ``layer``."""
    d = q.shape[-1]
    if name == "standard":
        return q @ k.transpose(-2, -1) / math.sqrt(d)
    if name == "quest":
        return q @ l2n(k).transpose(-2, -1)
    if name == "qnorm":
        return l2n(q) @ k.transpose(-2, -1)
    if name == "qknorm":
        return layer.qk_scale * (l2n(q) @ l2n(k).transpose(-2, -1))
    if name == "qknorm_hs":
        s = torch.exp(torch.clamp(layer.logit_scale, max=math.log(100.0)))[None, :, None, None]
        return s * (l2n(q) @ l2n(k).transpose(-2, -1))
    if name == "qknorm_ds":
        return layer_norm(q, layer.q_norm) @ layer_norm(k, layer.k_norm).transpose(-2, -1) / math.sqrt(d)
    if name in ("elliptical", "elliptical_quest"):
        # a layer outside a model (no previous block) has no m: the formulation without it (docs/attention.md);
        # the weighted logits are written out in tests/attention/test_elliptical.py
        assert not layer.uses_m, ("a linked elliptical layer needs the previous block's values "
                                  "(tests/attention/test_elliptical.py)")
        return reference_logits("standard" if name == "elliptical" else "quest", layer, q, k)
    raise AssertionError(f"no reference for {name}: write its logits out here")
