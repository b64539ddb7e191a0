"""Elliptical attention (Nielsen et al. 2024) and Elliptical-QUEST (QUEST paper, A.5.2). Docs: docs/attention.md.

Both weight the head dimensions of the query-key product by a vector m estimated, without gradient, from how much
each value dimension changed since the previous block: per sample and head,
``m_d = mean_n |V_l[n, d] - V_{l-1}[n, d]|`` (or the median over tokens), then ``m <- m / max_d m_d``. The authors'
finite-difference step delta divides both and cancels in that normalisation, so it is not an option.

- ``elliptical``:        z_ij = (q_i * m) . k_j / sqrt(d)
- ``elliptical_quest``:  z_ij = ||q_i|| (l2n(q_i) * m) . l2n(k_j) = (q_i * m) . l2n(k_j), scale 1

The previous block's values are carried without forking timm's ``VisionTransformer``: when the model is built,
:meth:`~quest.attention.QKAttention.bind` gives every layer its index and one :class:`ValueChain` shared by all of
them; a layer whose successor uses m puts its detached ``v`` there, and the first layer empties it when a forward
starts.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from quest.config.checks import is_int

from .base import CrossAttentionMixin, LayerSite, QKAttention, l2_normalize
from .fused import elliptical_m_fused, fused_applies
from .registry import register_attention

__all__ = ["EllipticalAttention", "EllipticalQuestAttention", "ValueChain", "elliptical_weights", "link_elliptical"]

ESTIMATORS = ("mean", "median")


def elliptical_weights(
    v: torch.Tensor, v_prev: torch.Tensor, estimator: str = "mean", eps: float = 1e-6
) -> torch.Tensor:
    """m of shape (B, H, 1, d) from this and the previous block's values (B, H, N, d); never carries a gradient.

    Computed in at least float32 (a bf16 mean over a few hundred tokens loses digits) and returned in ``v``'s dtype.
    The ``eps`` floor only matters when the values did not change at all, and then m = 0 (uniform attention).
    """
    if not torch.jit.is_scripting():
        if estimator == "mean" and fused_applies(v, "elliptical_m"):  # one kernel reading each value tensor once, on a GPU
            return elliptical_m_fused(v, v_prev, eps)
    work = torch.promote_types(v.dtype, torch.float32)
    # Detached inputs, so m is a constant to autograd (the released code computes it under no_grad too).
    delta = (v.detach().to(work) - v_prev.detach().to(work)).abs()
    if estimator == "mean":
        m = delta.mean(dim=-2, keepdim=True)
    else:  # torch.median: the lower of the two middle values for an even token count
        m = delta.median(dim=-2, keepdim=True).values
    return (m / m.amax(dim=-1, keepdim=True).clamp_min(eps)).to(v.dtype)


class ValueChain(nn.Module):
    """The detached values of a model's elliptical layers, kept for the next layer's m.

    One instance is shared by every linked layer of a model and registered in each, so ``copy.deepcopy`` (an EMA
    copy) and pickling keep the sharing and a copy has its own; it holds no parameters or buffers, so ``state_dict``
    and checkpoints are those of the plain model. Slot i holds layer i's values while layer i + 1 uses m. The first
    layer empties every slot when it starts, so a forward never reads values of an earlier one; otherwise they stay
    until the next forward, for the backward's recomputation under gradient checkpointing.

    TorchScript does not share submodules: it gives every layer its own copy of this module and of its lists. The
    tensors in a list stay shared, though, so scripted code keeps the values in ``slots``, tensors whose data it
    swaps (``Tensor.set_data``), and a scripted layer empties its predecessor's slot once read (a scripted model
    never checkpoints): after a scripted forward nothing is held, and ``torch.jit.save`` writes no activations.
    """

    # TorchScript reads attribute types from the class's annotations, unevaluated: under this module's
    # ``from __future__ import annotations`` a plain ``values: List[...]`` would reach it as a string it cannot parse
    __annotations__ = {"values": List[Optional[Tensor]], "slots": List[Tensor]}

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.values = [None] * depth
        self.slots = [torch.empty(0) for _ in range(depth)]  # empty: 1-D; values are (B, H, N, d)

    @torch.jit.export
    def start(self) -> None:
        """Forget every layer's values (the first layer calls this when a forward starts)."""
        for i in range(len(self.values)):
            self.values[i] = None
            if torch.jit.is_scripting():
                self.slots[i].set_data(torch.empty(0))

    @torch.jit.export
    def put(self, index: int, values: Tensor) -> None:
        if torch.jit.is_scripting():
            self.slots[index].set_data(values)
        else:
            self.values[index] = values

    @torch.jit.export
    def take(self, index: int) -> Optional[Tensor]:
        """Layer ``index``'s values of this forward, or None where it has not run."""
        if torch.jit.is_scripting():
            slot = self.slots[index]
            if slot.dim() != 4:
                return None
            values = slot.detach()  # a tensor of its own over the same storage, kept when the slot is emptied
            slot.set_data(torch.empty(0))
            return values
        return self.values[index]

    def extra_repr(self) -> str:
        return f"layers={len(self.values)}"


class _Elliptical(QKAttention):
    """Shared body: option checks, linking, recording v and estimating m. Subclasses give :meth:`transform_qkm`."""

    #: layers: attention-layer indices (block indices in a ViT) that use m; None = every layer but the first.
    options = {"layers": None, "estimator": "mean", "eps": 1e-6}
    # the layer selection is read while linking only; TorchScript has no frozenset
    __jit_ignored_attributes__ = QKAttention.__jit_ignored_attributes__ + ["_use_layers"]

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
        #: "mean" or "median"; an instance attribute, so that an evaluation can change it (quest.evaluation.estimator)
        self.estimator: str = str(opts["estimator"])
        # Unlinked, a layer is a first layer with a chain of its own: no m, and it keeps no values.
        self.chain = ValueChain(1)
        self._index = 0
        self._uses_m = False
        self._keeps_values = False  # True while the next layer uses m

    # --- linking ------------------------------------------------------------------------------------------------
    def bind(self, site: LayerSite) -> None:
        """Link into the model's chain: the first layer checks that the model is one chain of elliptical
        self-attention blocks and makes the shared :class:`ValueChain`; each later one joins it and tells its
        predecessor whether to keep its values."""
        layers = site.layers
        if site.index == 0:
            _check_chain(layers)
        chain = layers[site.index - 1].chain if site.index else ValueChain(len(layers))
        self._link(site.index, chain, len(layers))
        if site.index:
            layers[site.index - 1]._keeps_values = self._uses_m

    def _link(self, index: int, chain: ValueChain, depth: int) -> None:
        if self._use_layers is not None and max(self._use_layers, default=0) >= depth:
            raise ValueError(
                f"{self.attention_name} option layers={sorted(self._use_layers)}: the model has {depth} attention "
                f"layers (indices 0..{depth - 1})"
            )
        self.chain, self._index, self._keeps_values = chain, index, False
        self._uses_m = index > 0 and (self._use_layers is None or index in self._use_layers)

    @property
    def uses_m(self) -> bool:
        """True when this layer weights its logits by m (linked, not the first layer, listed in ``layers``)."""
        return self._uses_m

    def metric(self, v: torch.Tensor) -> Optional[torch.Tensor]:
        """This layer's m (B, H, 1, d) for its values ``v``, or None where it does not use m."""
        if not self._uses_m:
            return None
        prev = self.chain.take(self._index - 1)
        if prev is None:
            raise RuntimeError(
                f"elliptical layer {self._index}: the previous attention layer has not run in this forward; "
                "elliptical layers must run in order inside the model's forward (see docs/attention.md)"
            )
        if not torch.jit.is_scripting():
            if isinstance(v, torch.fx.Proxy):  # traced: shapes are known at run time only
                return elliptical_weights(v, prev, self.estimator, self.eps)
        if prev.shape != v.shape:
            raise RuntimeError(
                f"elliptical layer {self._index}: values of shape {v.shape} cannot be compared with the "
                f"previous layer's {prev.shape}"
            )
        return elliptical_weights(v, prev, self.estimator, self.eps)

    # --- formulation --------------------------------------------------------------------------------------------
    def transform_qkm(self, q: torch.Tensor, k: torch.Tensor,
                      m: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, float]:
        """(q, k, m) -> (q', k', scale); ``m=None`` is the formulation without m (standard resp. quest)."""
        raise NotImplementedError

    def transform_qk(self, q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, float]:
        # Without the values there is no m: this is the first-layer (standard / quest) transform. The logits a
        # layer actually uses, m included, come from effective_qk.
        return self.transform_qkm(q, k, None)

    def effective_qk(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, float]:
        q, k, v = self.project_qkv(x)
        return self.transform_qkm(q, k, self.metric(v))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        if self._index == 0:
            self.chain.start()
        m = self.metric(v)
        if self._keeps_values:
            self.chain.put(self._index, v.detach())
        if not torch.jit.is_scripting():  # q' = q * m recomputed in the backward, not kept (quest.attention.recompute)
            out = self._recomputing(functools.partial(self.transform_qkm, m=m), q, k, v, attn_mask, is_causal)
            if out is not None:
                return out
        q2, k2, scale = self.transform_qkm(q, k, m)
        return self._sdpa(q2, k2, scale, v, attn_mask, is_causal)


@register_attention("elliptical")
class EllipticalAttention(_Elliptical):
    """Elliptical attention: softmax((q * m) . k / sqrt(d)), m on the query side as in the authors' code."""

    def transform_qkm(self, q: torch.Tensor, k: torch.Tensor,
                      m: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, float]:
        return (q if m is None else q * m), k, self.head_dim**-0.5


@register_attention("elliptical_quest")
class EllipticalQuestAttention(_Elliptical):
    """Elliptical-QUEST: softmax(||q|| (l2n(q) * m) . l2n(k)), scale 1 (QUEST paper, A.5.2).

    ||q|| l2n(q) is q itself (for ||q|| >= eps), so q' = q * m: QUEST with the query re-weighted by m. ``eps`` is
    also QUEST's key-norm floor.
    """

    scale_invariant_in = frozenset({"keys"})  # m weights the query's dimensions, keys stay l2-normalised

    def transform_qkm(self, q: torch.Tensor, k: torch.Tensor,
                      m: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, float]:
        return (q if m is None else q * m), l2_normalize(k, self.eps), 1.0


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
