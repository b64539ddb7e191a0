"""The shared body of every attention formulation: project q, k, v; transform q and k; fused SDPA; project out.

A formulation only says how it turns (q, k) into the (q', k', scale) whose product ``scale * q' k'^T`` is its
logits (:meth:`QKAttention.transform_qk`). The forward pass hands exactly those to
``F.scaled_dot_product_attention``, so every formulation runs on the fused kernels, and diagnostics and tests read
the logits from the same definition instead of re-deriving each formula.

Explanations that need the attention probabilities (which the fused kernel never materialises) register an
attention hook (:meth:`QKAttention.register_attention_hook`): while one is registered, the layer computes
``softmax(logits + mask)`` explicitly and hands the logits and probabilities to the hook before applying them.

Parameter names follow timm's ``Attention`` (``qkv``, ``q_norm``, ``k_norm``, ``norm``, ``proj``) so timm's
initialisation, ``no_weight_decay`` handling and checkpoints apply unchanged.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.hooks import RemovableHandle

from .fused import fused_applies, l2_normalize_apply
from .fused_reference import times_inverse
from .recompute import attention_recomputing, recalled_factor, recompute_applies, remember_factor

__all__ = ["QKAttention", "CrossAttentionMixin", "l2_normalize", "AttentionHook"]

#: ``hook(layer, logits, probs)``, both (B, H, N, M): the pre-softmax logits (mask added) and the probabilities the
#: layer applies to v (before attention dropout); ``probs`` keeps its autograd graph
AttentionHook = Callable[[nn.Module, torch.Tensor, torch.Tensor], None]


def l2_normalize(x: torch.Tensor, eps: float, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x / max(||x||_2, eps) along the head dimension, times ``scale`` (broadcast) when given, in one pass each way
    (quest.attention.fused.L2Normalize: its Triton kernel where it applies, its PyTorch reference elsewhere).

    TorchScript and torch.fx (and so torchvision's create_feature_extractor) record the same formula in plain
    operators, whose backward autograd derives: neither can enter the autograd.Function. Eager code, torch.compile
    and torch.export run the hand-written backward."""
    if scale is not None:
        scale = scale.to(x.dtype)  # an fp32 parameter must not promote bf16 activations under autocast
    if torch.jit.is_scripting():
        return _l2_normalize_ops(x, eps, scale)
    return _l2_normalize_python(x, eps, scale)


def _l2_normalize_ops(x: torch.Tensor, eps: float, scale: Optional[torch.Tensor]) -> torch.Tensor:
    inv = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(eps).reciprocal()
    return times_inverse(x, inv, scale)


@torch.jit.unused
def _l2_normalize_python(x: torch.Tensor, eps: float, scale: Optional[torch.Tensor]) -> torch.Tensor:
    if isinstance(x, torch.fx.Proxy):  # symbolic tracing: record the operators
        return _l2_normalize_ops(x, eps, scale)
    if fused_applies(x):  # one kernel each way on a GPU; the backward's recompute reruns it
        return l2_normalize_apply(x, eps, scale, True)[0]
    inv = recalled_factor(x, eps)  # the backward recomputing this layer's q', k': the forward's 1/max(||x||, eps)
    if inv is not None:
        return times_inverse(x, inv, scale)
    out, inv, _ = l2_normalize_apply(x, eps, scale, False)
    remember_factor(x, eps, inv)
    return out


@dataclass(frozen=True)
class LayerSite:
    """Where an attention layer sits in the model it was built into (see :meth:`QKAttention.bind`)."""

    model: nn.Module
    layers: tuple["QKAttention", ...]  # every quest attention layer of the model, in module definition order
    index: int  # this layer's position in ``layers`` (its block index in a ViT)
    num_tokens: int | None  # tokens attended over at the model's input size (patches + prefix tokens), if known


class QKAttention(nn.Module):
    """Multi-head self-attention with a pluggable (q, k) transform; a drop-in for timm's ``Attention``.

    Subclasses override :meth:`transform_qk` (and :meth:`_init_formulation` for learnable parameters) and declare
    their configurable initial values in the class attribute ``options``. A formulation that needs to know its
    model (the token count, the previous block) overrides :meth:`bind`.
    """

    # TorchScript cannot hold Python callables; scripted code never reads them (the guard in _sdpa)
    __jit_ignored_attributes__ = ["_attention_hooks"]

    attention_name: ClassVar[str] = "base"
    options: ClassVar[dict[str, Any]] = {}
    #: what an option must be, checked when the class is bound (quest.attention.registry.option_problem): name ->
    #: (test, what is expected). Without a rule, an option whose default is a number must be a finite number > 0.
    option_rules: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {}
    #: True when the constructor's ``qk_norm`` flag is honoured (timm's per-head LayerNorm on q and k).
    supports_qk_norm: ClassVar[bool] = False
    #: which inputs of :meth:`attend` may be scaled by a positive constant per token ("queries", "keys") without
    #: changing its output, in exact arithmetic (docs/attention.md); tests/attention/test_invariances.py checks each declared
    #: one and that every other scaling changes the output
    scale_invariant_in: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        scale_norm: bool = False,
        proj_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        norm_layer: type[nn.Module] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **unused: Any,
    ) -> None:
        super().__init__()
        if unused:
            raise TypeError(
                f"{type(self).__name__} does not support timm attention arguments {sorted(unused)}; "
                "it accepts dim, num_heads, qkv_bias, qk_norm, scale_norm, proj_bias, attn_drop, proj_drop, norm_layer"
            )
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        if qk_norm and not self.supports_qk_norm:
            raise ValueError(
                f"attention {self.attention_name!r} does not take qk_norm=True (that is LayerNorm on q and k, "
                "the 'qknorm_ds' formulation); build the model without qk_norm or choose attention='qknorm_ds'"
            )
        if (qk_norm or scale_norm) and norm_layer is None:
            raise ValueError("norm_layer must be given when qk_norm or scale_norm is True")
        dd = {"device": device, "dtype": dtype}
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self._make_projections(dim, qkv_bias, **dd)
        self.q_norm = norm_layer(self.head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim, **dd) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = norm_layer(dim, **dd) if scale_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self._attention_hooks: OrderedDict[int, AttentionHook] = OrderedDict()
        # the norm floor as a plain float attribute: scripted code reads instance attributes, not the class's options
        self.eps: float = float(self.options.get("eps", 0.0))
        self._init_formulation(**dd)

    # --- what a formulation overrides -------------------------------------------------------------------------
    def _init_formulation(self, device: Any = None, dtype: Any = None) -> None:
        """Create the formulation's learnable parameters (none by default)."""

    def bind(self, site: LayerSite) -> None:
        """Told once, when the model is built and before any weights are loaded, where this layer sits
        (:func:`bind_attention`). Nothing to do by default; QKNorm initialises its scale from the token count,
        Elliptical links to the previous layer."""

    def transform_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float | torch.Tensor]:
        """(q, k) of shape (B, H, N, d) -> (q', k', scale) with logits = scale * q' @ k'^T."""
        raise NotImplementedError

    # --- shared machinery ---------------------------------------------------------------------------------------
    def _make_projections(self, dim: int, qkv_bias: bool, **dd: Any) -> None:
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias, **dd)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens (B, N, C) -> q, k, v of shape (B, H, N, d), before any formulation-specific transform."""
        B, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return q, k, v

    def effective_qk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float | torch.Tensor]:
        """The (q', k', scale) this layer's logits are made of, for input tokens ``x`` (diagnostics, tests)."""
        q, k, _ = self.project_qkv(x)
        return self.transform_qk(q, k)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """softmax(logits + mask) @ v with this formulation's logits, through the fused SDPA kernels. While training,
        the transformed q' and k' are recomputed in the backward instead of being kept (quest.attention.recompute)."""
        if not torch.jit.is_scripting():
            out = self._recomputing(self.transform_qk, q, k, v, attn_mask, is_causal)
            if out is not None:
                return out
        return self._sdpa(*self.transform_qk(q, k), v, attn_mask, is_causal)

    @torch.jit.unused
    def _recomputing(self, transform: Callable[[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor, Any]],
                     q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                     is_causal: bool) -> Optional[torch.Tensor]:
        """SDPA of ``transform(q, k)`` with q', k' recomputed in the backward, or None where that does not apply."""
        if not recompute_applies(q):
            return None
        return attention_recomputing(lambda q_, k_: self._folded(*transform(q_, k_)), (q, k),
                                     lambda q2, k2, scale: self._sdpa(q2, k2, scale, v, attn_mask, is_causal))

    def register_attention_hook(self, hook: AttentionHook) -> RemovableHandle:
        """Call ``hook(layer, logits, probs)`` at every forward (see :data:`AttentionHook`) until the returned
        handle's ``remove()``. While any hook is registered the layer computes its softmax explicitly instead of
        through the fused kernel (the same values; slower, and the (N, M) matrices are held): the seam through which
        explanations read attention (quest.explain)."""
        handle = RemovableHandle(self._attention_hooks)
        self._attention_hooks[handle.id] = hook
        return handle

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        scale: float | torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
    ) -> torch.Tensor:
        """softmax(scale * q k^T + mask) @ v for transformed q, k: through the fused SDPA kernels, or written out
        when an attention hook asks for the probabilities."""
        q, k, scale = self._folded(q, k, scale)
        if not torch.jit.is_scripting():  # hooks are Python callables: a scripted model has none
            if self._attention_hooks:
                return self._explicit_attention(q, k, scale, v, attn_mask, is_causal)
        return F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=attn_mask,
            dropout_p=self.attn_drop.p if self.training else 0.0,
            is_causal=is_causal,
            scale=scale,
        )

    def _folded(self, q: torch.Tensor, k: torch.Tensor,
                scale: Union[float, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, float]:
        """(q, k, scale) with a tensor scale folded into q: SDPA takes a Python float scale; a learnable (per-layer or
        per-head) scale is folded into q instead, which is exact and keeps the gradient w.r.t. the scale. Cast to
        q's dtype so that under bf16 autocast the fp32 parameter does not promote q to fp32 (and SDPA cast it
        back)."""
        if isinstance(scale, torch.Tensor):
            return q * scale.to(q.dtype), k, 1.0
        return q, k, scale

    def _explicit_attention(self, q, k, scale: float, v, attn_mask, is_causal: bool) -> torch.Tensor:
        """What SDPA computes, written out so that the attention hooks see the logits and probabilities."""
        logits = scale * (q @ k.transpose(-2, -1))
        if is_causal:
            n, m = logits.shape[-2:]
            keep = torch.ones(n, m, dtype=torch.bool, device=logits.device).tril()
            logits = logits.masked_fill(~keep, float("-inf"))
        if attn_mask is not None:
            logits = logits.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else logits + attn_mask
        probs = logits.softmax(dim=-1)
        for hook in tuple(self._attention_hooks.values()):
            hook(self, logits, probs)
        return self.attn_drop(probs) @ v

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        B = x.shape[0]
        out = self.attend(*self.project_qkv(x), attn_mask=attn_mask, is_causal=is_causal)
        out = out.transpose(1, 2).reshape(B, out.shape[2], self.dim)
        return self.proj_drop(self.proj(self.norm(out)))

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return f"attention={self.attention_name!r}, num_heads={self.num_heads}" + (f", {opts}" if opts else "")


def bind_attention(model: nn.Module, num_tokens: int | None) -> nn.Module:
    """Tell every quest attention layer of ``model`` its :class:`LayerSite` (the model factory calls this once)."""
    layers = tuple(m for m in model.modules() if isinstance(m, QKAttention))
    for index, layer in enumerate(layers):
        layer.bind(LayerSite(model, layers, index, num_tokens))
    return model


class CrossAttentionMixin:
    """Turns a formulation into CrossViT's class-token cross-attention (timm ``crossvit.CrossAttention`` layout).

    The query is the first (class) token only; keys and values are all tokens. Parameter names ``wq``, ``wk``,
    ``wv``, ``proj`` match timm's, so CrossViT weights load unchanged.
    """

    def _make_projections(self, dim: int, qkv_bias: bool, **dd: Any) -> None:
        self.wq = nn.Linear(dim, dim, bias=qkv_bias, **dd)
        self.wk = nn.Linear(dim, dim, bias=qkv_bias, **dd)
        self.wv = nn.Linear(dim, dim, bias=qkv_bias, **dd)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, N, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(B, t.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

        return heads(self.wq(x[:, :1])), heads(self.wk(x)), heads(self.wv(x))
