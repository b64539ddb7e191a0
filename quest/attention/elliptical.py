"""Elliptical attention (Nielsen et al. 2024) and Elliptical-QUEST (QUEST paper, A.5.2). Docs: docs/attention.md.

Both weight the head dimensions of the query-key product by a vector m estimated, without gradient, from how much
each value dimension changed since the previous block: per sample and head,
``m_d = mean_n |V_l[n, d] - V_{l-1}[n, d]|`` (or the median over tokens), then ``m <- m / max_d m_d``. The authors'
finite-difference step delta divides both and cancels in that normalisation, so it is not an option.

- ``elliptical``:        z_ij = (q_i * m) . k_j / sqrt(d)
- ``elliptical_quest``:  z_ij = ||q_i|| (l2n(q_i) * m) . l2n(k_j) = (q_i * m) . l2n(k_j), scale 1

The previous block's values are carried without forking timm's ``VisionTransformer``: when the model is built,
:meth:`~quest.attention.QKAttention.bind` gives every layer its index and a plain (unregistered) reference to the
previous attention layer; each layer keeps its detached ``v`` from its last forward, and a forward pre-hook on the
model drops all of them at the start of every model forward.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from quest.config_checks import is_int

from .base import CrossAttentionMixin, LayerSite, QKAttention, l2_normalize
from .recompute import attention_recomputing, recompute_applies
from .registry import register_attention

__all__ = ["EllipticalAttention", "EllipticalQuestAttention", "elliptical_weights", "link_elliptical"]

ESTIMATORS = ("mean", "median")


def elliptical_weights(
    v: torch.Tensor, v_prev: torch.Tensor, estimator: str = "mean", eps: float = 1e-6
) -> torch.Tensor:
    """m of shape (B, H, 1, d) from this and the previous block's values (B, H, N, d); never carries a gradient.

    Computed in at least float32 (a bf16 mean over a few hundred tokens loses digits) and returned in ``v``'s dtype.
    The ``eps`` floor only matters when the values did not change at all, and then m = 0 (uniform attention).
    """
    work = torch.promote_types(v.dtype, torch.float32)
    # Detached inputs, so m is a constant to autograd (the released code computes it under no_grad too).
    delta = (v.detach().to(work) - v_prev.detach().to(work)).abs()
    if estimator == "mean":
        m = delta.mean(dim=-2, keepdim=True)
    else:  # torch.median: the lower of the two middle values for an even token count
        m = delta.median(dim=-2, keepdim=True).values
    return (m / m.amax(dim=-1, keepdim=True).clamp_min(eps)).to(v.dtype)


class _Elliptical(QKAttention):
    """Shared body: option checks, linking, recording v and estimating m. Subclasses give :meth:`transform_qkm`."""

    #: layers: attention-layer indices (block indices in a ViT) that use m; None = every layer but the first.
    options = {"layers": None, "estimator": "mean", "eps": 1e-6}

    def _init_formulation(self, device: Any = None, dtype: Any = None) -> None:
        opts = self.options
        layers = opts["layers"]
        if layers is not None:
            # A YAML list arrives as an omegaconf ListConfig, which is a Sequence; a string is one too, refuse it.
            if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
                raise ValueError(
                    f"{self.attention_name} option layers={layers!r}: expected null (every layer but the first) "
                    "or a list of layer indices >= 1"
                )
            bad = [i for i in layers if not is_int(i) or i < 1]
            if bad:
                raise ValueError(
                    f"{self.attention_name} option layers={list(layers)!r}: {bad!r} are not layer indices >= 1 "
                    "(layer 0 has no previous block to estimate m from)"
                )
        if opts["estimator"] not in ESTIMATORS:
            raise ValueError(
                f"{self.attention_name} option estimator={opts['estimator']!r}: expected one of {', '.join(ESTIMATORS)}"
            )
        # eps: a finite number > 0, checked when the options were bound (quest.attention.registry.option_problem)
        self._use_layers = None if layers is None else frozenset(int(i) for i in layers)
        # Plain attributes, never parameters or buffers: state_dict and checkpoints stay those of standard / quest.
        self._index: int | None = None
        self._prev: tuple[_Elliptical, ...] = ()  # a tuple, so nn.Module does not register it as a submodule
        self._uses_m = False
        self._values: torch.Tensor | None = None

    def __prepare_scriptable__(self) -> nn.Module:
        # torch.jit.script asks every module first: refuse by name instead of failing deep inside the compiler
        raise RuntimeError(
            f"{self.attention_name} attention cannot be compiled by TorchScript: each layer reads the previous "
            "layer's values through Python references that TorchScript cannot hold; use torch.export, torch.compile, "
            "torch.fx or ONNX instead (docs/interop.md)")

    # --- linking ------------------------------------------------------------------------------------------------
    def bind(self, site: LayerSite) -> None:
        """Link to the previous attention layer of the model; the first layer also checks that the model is one
        chain of elliptical self-attention blocks and installs the model's value-clearing pre-hook (once)."""
        layers = site.layers
        if site.index == 0:
            _check_chain(layers)
            if _clear_values not in site.model._forward_pre_hooks.values():
                site.model.register_forward_pre_hook(_clear_values)
        self._link(site.index, layers[site.index - 1] if site.index else None, len(layers))

    def _link(self, index: int, prev: _Elliptical | None, depth: int) -> None:
        if self._use_layers is not None and max(self._use_layers, default=0) >= depth:
            raise ValueError(
                f"{self.attention_name} option layers={sorted(self._use_layers)}: the model has {depth} attention "
                f"layers (indices 0..{depth - 1})"
            )
        self._index, self._prev, self._values = index, (() if prev is None else (prev,)), None
        self._uses_m = index > 0 and (self._use_layers is None or index in self._use_layers)

    @property
    def uses_m(self) -> bool:
        """True when this layer weights its logits by m (linked, not the first layer, listed in ``layers``)."""
        return self._uses_m

    def metric(self, v: torch.Tensor) -> torch.Tensor | None:
        """This layer's m (B, H, 1, d) for its values ``v``, or None where it does not use m."""
        if not self._uses_m:
            return None
        prev = self._prev[0]._values
        if prev is None:
            raise RuntimeError(
                f"elliptical layer {self._index}: the previous attention layer has not run in this forward; "
                "elliptical layers must run in order inside the model's forward (see docs/attention.md)"
            )
        if not isinstance(v, torch.fx.Proxy) and prev.shape != v.shape:  # traced: shapes are known at run time only
            raise RuntimeError(
                f"elliptical layer {self._index}: values of shape {tuple(v.shape)} cannot be compared with the "
                f"previous layer's {tuple(prev.shape)}"
            )
        return elliptical_weights(v, prev, self.options["estimator"], self.options["eps"])

    # --- formulation --------------------------------------------------------------------------------------------
    def transform_qkm(
        self, q: torch.Tensor, k: torch.Tensor, m: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(q, k, m) -> (q', k', scale); ``m=None`` is the formulation without m (standard resp. quest)."""
        raise NotImplementedError

    def transform_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        # Without the values there is no m: this is the first-layer (standard / quest) transform. The logits a
        # layer actually uses, m included, come from effective_qk.
        return self.transform_qkm(q, k, None)

    def effective_qk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        q, k, v = self.project_qkv(x)
        return self.transform_qkm(q, k, self.metric(v))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        m = self.metric(v)
        if self._index is not None:  # only a linked layer has a successor that reads its values
            self._values = v.detach()
        if recompute_applies(q):  # q' = q * m recomputed in the backward, not kept (quest.attention.recompute)
            return attention_recomputing(lambda q_, k_: self._folded(*self.transform_qkm(q_, k_, m)), (q, k),
                                         lambda q2, k2, scale: self._sdpa(q2, k2, scale, v, attn_mask, is_causal))
        return self._sdpa(*self.transform_qkm(q, k, m), v, attn_mask, is_causal)


@register_attention("elliptical")
class EllipticalAttention(_Elliptical):
    """Elliptical attention: softmax((q * m) . k / sqrt(d)), m on the query side as in the authors' code."""

    def transform_qkm(self, q, k, m):
        return (q if m is None else q * m), k, self.head_dim**-0.5


@register_attention("elliptical_quest")
class EllipticalQuestAttention(_Elliptical):
    """Elliptical-QUEST: softmax(||q|| (l2n(q) * m) . l2n(k)), scale 1 (QUEST paper, A.5.2).

    ||q|| l2n(q) is q itself (for ||q|| >= eps), so q' = q * m: QUEST with the query re-weighted by m. ``eps`` is
    also QUEST's key-norm floor.
    """

    scale_invariant_in = frozenset({"keys"})  # m weights the query's dimensions, keys stay l2-normalised

    def transform_qkm(self, q, k, m):
        return (q if m is None else q * m), l2_normalize(k, self.options["eps"]), 1.0


def _clear_values(model: nn.Module, args: Any) -> None:
    # A module-level function of the model alone (no closure over layers), so copy.deepcopy(model) (EMA) and
    # pickling give a copy whose hook clears the copy's layers, not the original's.
    for module in model.modules():
        if isinstance(module, _Elliptical):
            module._values = None


def _check_chain(layers: Sequence[QKAttention]) -> None:
    if not all(isinstance(m, _Elliptical) for m in layers) or any(isinstance(m, CrossAttentionMixin) for m in layers):
        raise ValueError(
            "elliptical attention needs one chain of self-attention blocks that are all elliptical; this model mixes "
            "it with other attention layers or cross-attention (CrossViT is not supported)"
        )


def link_elliptical(model: nn.Module) -> nn.Module:
    """Link the elliptical layers of an already built ``model``, as :meth:`_Elliptical.bind` does when the model
    factory builds one (idempotent; a no-op without elliptical layers). For models assembled by hand."""
    layers = tuple(m for m in model.modules() if isinstance(m, QKAttention))
    if any(isinstance(m, _Elliptical) for m in layers):
        _check_chain(layers)
        for index, layer in enumerate(layers):
            layer.bind(LayerSite(model, layers, index, None))
    return model
