"""The attention formulations compared by the QUEST paper. Definitions and sources: docs/attention.md.

Each is "transform q, transform k, pick a scale" on top of :class:`~quest.attention.base.QKAttention`.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from .base import LayerSite, QKAttention, l2_normalize
from .fused import layer_norm_applies, layer_norm_fused
from .registry import register_attention

__all__ = [
    "StandardAttention",
    "QuestAttention",
    "QNormAttention",
    "QKNormAttention",
    "QKNormHeadScaleAttention",
    "QKNormDimScaleAttention",
]

# Guards the l2 normalisation against an all-zero vector; far below any real q/k norm, also in bf16.
NORM_EPS = 1e-6


@register_attention("standard")
class StandardAttention(QKAttention):
    """softmax(q . k / sqrt(d)): Vaswani et al. 2017, numerically timm's ``Attention`` (``qk_norm`` honoured)."""

    supports_qk_norm = True

    def transform_qk(self, q, k):
        # the norms (qk_norm, qknorm_ds) run in the qkv projection's (B, N, H, d) layout, so their outputs keep it,
        # SDPA's output too, and the heads merge without a copy: otherwise each layer held one more (B, H, N, d)
        # tensor for backward (the projection's input), 6% of a ViT-Ti step's memory
        if not torch.jit.is_scripting():  # one kernel each way on a GPU, in q's dtype (quest.attention.fused)
            if layer_norm_applies(q, self.q_norm) and layer_norm_applies(k, self.k_norm):
                return layer_norm_fused(q, self.q_norm), layer_norm_fused(k, self.k_norm), self.head_dim**-0.5
        return (self.q_norm(q.transpose(1, 2)).transpose(1, 2), self.k_norm(k.transpose(1, 2)).transpose(1, 2),
                self.head_dim**-0.5)


@register_attention("quest")
class QuestAttention(QKAttention):
    """QUEST: softmax(q . l2n(k)), scale 1 (QUEST paper, section 2.1 and Algorithm A1).

    Only keys are normalised: the ranking inside a softmax row is the cosine similarity, and each query's norm sets
    the sharpness of its own row, so no single key with a large norm can take attention from every query.
    """

    scale_invariant_in = frozenset({"keys"})

    options = {"eps": NORM_EPS}

    def transform_qk(self, q, k):
        return q, l2_normalize(k, self.eps), 1.0


@register_attention("qnorm")
class QNormAttention(QKAttention):
    """QNorm: softmax(l2n(q) . k), scale 1; the mirror image of QUEST (QUEST paper, section 2.1)."""

    scale_invariant_in = frozenset({"queries"})

    options = {"eps": NORM_EPS}

    def transform_qk(self, q, k):
        return l2_normalize(q, self.eps), k, 1.0


@register_attention("qknorm")
class QKNormAttention(QKAttention):
    """QKNorm: softmax(g * l2n(q) . l2n(k)) with one learnable scalar g per layer (Henry et al. 2020).

    g starts at log2(L^2 - L), L the training sequence length (15.24 for the 197 tokens of a /16 model at 224 px).
    ``seq_len=None`` means "this model's token count": :meth:`bind` fills it in when the model is built; a layer
    built outside a model uses 197.
    """

    scale_invariant_in = frozenset({"queries", "keys"})

    options = {"seq_len": None, "eps": NORM_EPS}
    option_rules = {"seq_len": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0),
                                "null (the model's token count) or an integer > 0")}
    DEFAULT_SEQ_LEN = 197

    @staticmethod
    def initial_scale(seq_len: int) -> float:
        if seq_len < 2:
            raise ValueError(f"qknorm needs seq_len >= 2 to initialise log2(L^2 - L), got {seq_len}")
        return math.log2(seq_len**2 - seq_len)

    def _init_formulation(self, device=None, dtype=None) -> None:
        seq_len = self.options["seq_len"] or self.DEFAULT_SEQ_LEN
        # Shape (1,), not (): timm's optimizer factory exempts ndim <= 1 parameters from weight decay.
        self.qk_scale = nn.Parameter(torch.full((1,), self.initial_scale(seq_len), device=device, dtype=dtype))

    def reset_scale(self, seq_len: int) -> None:
        """Re-initialise g for a sequence length known only once the model exists."""
        with torch.no_grad():
            self.qk_scale.fill_(self.initial_scale(seq_len))

    def bind(self, site: LayerSite) -> None:
        if self.options["seq_len"] is None and site.num_tokens is not None:
            self.reset_scale(site.num_tokens)

    def transform_qk(self, q, k):
        # g is folded into the query normalisation (one fused pass): logits = (g l2n(q)) . l2n(k), scale 1
        return l2_normalize(q, self.eps, self.qk_scale), l2_normalize(k, self.eps), 1.0


@register_attention("qknorm_hs")
class QKNormHeadScaleAttention(QKAttention):
    """QKNorm-HS: softmax(s_h * l2n(q) . l2n(k)), one learnable scale per head (Swin Transformer V2, Liu et al. 2022).

    As in Swin-V2 the scale is stored as a log (``logit_scale``, init log(10)) and clamped at log(100) before exp.
    It is 1-d, so timm's optimizer factory keeps weight decay off it, as Swin-V2 does.
    """

    scale_invariant_in = frozenset({"queries", "keys"})

    options = {"init_scale": 10.0, "max_scale": 100.0, "eps": NORM_EPS}

    def _init_formulation(self, device=None, dtype=None) -> None:
        init = math.log(self.options["init_scale"])
        self.max_logit_scale: float = math.log(self.options["max_scale"])
        self.logit_scale = nn.Parameter(torch.full((self.num_heads,), init, device=device, dtype=dtype))

    def transform_qk(self, q, k):
        # s_h is folded into the query normalisation (one fused pass): logits = (s_h l2n(q)) . l2n(k), scale 1
        scale = self.logit_scale.clamp(max=self.max_logit_scale).exp().view(-1, 1, 1)
        return l2_normalize(q, self.eps, scale), l2_normalize(k, self.eps), 1.0


@register_attention("qknorm_ds")
class QKNormDimScaleAttention(StandardAttention):
    """QKNorm-DS: LN(q) . LN(k) / sqrt(d), LayerNorm over head_dim with per-dimension gains (ViT-22B).

    Exactly timm's ``qk_norm=True`` (gains init 1, biases 0, shared across heads), so it loads timm checkpoints
    of qk-normed ViTs. With ||LN(x)|| = sqrt(d) the logit at initialisation is sqrt(d) * cos(q, k).
    """

    scale_invariant_in = frozenset({"queries", "keys"})

    def __init__(self, dim: int, num_heads: int = 8, qk_norm: bool = True, norm_layer: Any = None, **kwargs: Any):
        if norm_layer is None:
            norm_layer = nn.LayerNorm
        super().__init__(dim, num_heads=num_heads, qk_norm=True, norm_layer=norm_layer, **kwargs)
