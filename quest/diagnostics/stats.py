"""Attention statistics of one layer from its raw and effective queries and keys. Pure tensor code, no hooks.

Definitions (docs/diagnostics.md): logits z = scale * q' k'^T as the formulation defines them
(:meth:`quest.attention.QKAttention.effective_qk`); A = softmax_j(z); H_i = -sum_j A_ij log A_ij in nats.
Norms are of the *raw* projections q = W_q x, k = W_k x (:meth:`~quest.attention.QKAttention.project_qkv`): those
are what grow when training destabilises (QUEST paper, Figure A6), and after an l2 normalisation the transformed
norms would be constant and say nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LayerStats", "layer_statistics", "SCALAR_STATS", "HEAD_STATS"]

#: Per-layer scalar statistics, in the order they are reported.
SCALAR_STATS = (
    "max_logit",
    "q_norm_at_max",
    "k_norm_at_max",
    "q_norm_mean",
    "q_norm_max",
    "k_norm_mean",
    "k_norm_max",
    "entropy_mean",
    "entropy_min",
    "low_entropy_head_frac",
)
#: Per-head statistics (reported with ``per_head=True``).
HEAD_STATS = ("max_logit", "entropy_mean")


@dataclass
class LayerStats:
    """0-d tensors for :data:`SCALAR_STATS` and (H,) tensors for :data:`HEAD_STATS`, all on the layer's device.

    Kept as tensors so the collector moves every layer's numbers to the host in one transfer (one GPU sync).
    """

    scalars: dict[str, torch.Tensor]
    heads: dict[str, torch.Tensor]


def _upcast(t: torch.Tensor) -> torch.Tensor:
    # bf16/fp16 logits lose the digits that matter for a max-logit curve; float64 stays float64 (tests).
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _masks(
    shape: torch.Size, device: torch.device, attn_mask: torch.Tensor | None, is_causal: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(allowed, additive bias) as SDPA reads ``attn_mask`` / ``is_causal``; None where there is none."""
    n_q, n_k = shape[-2], shape[-1]
    allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril() if is_causal else None
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = attn_mask if allowed is None else allowed & attn_mask
        else:
            bias = _upcast(attn_mask)
            # An additive -inf is a masked position too: it must not win the max-logit.
            finite = bias > float("-inf")
            allowed = finite if allowed is None else allowed & finite
    return allowed, bias


def layer_statistics(
    q_raw: torch.Tensor,
    k_raw: torch.Tensor,
    q_eff: torch.Tensor,
    k_eff: torch.Tensor,
    scale: float | torch.Tensor,
    entropy_threshold: float,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> LayerStats:
    """Statistics of one attention layer; q tensors are (B, H, Nq, d), k tensors (B, H, Nk, d).

    ``scale`` is a float or a tensor broadcastable to (B, H, Nq, Nk). With a mask, the max logit is taken over the
    allowed pairs only, and the softmax (hence the entropy) sees the mask exactly as SDPA does; the reported max
    logit is the formulation's logit, without an additive mask.
    """
    scale = _upcast(scale) if isinstance(scale, torch.Tensor) else scale
    logits = scale * (_upcast(q_eff) @ _upcast(k_eff).transpose(-2, -1))  # (B, H, Nq, Nk)
    allowed, bias = _masks(logits.shape, logits.device, attn_mask, is_causal)
    candidates = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))

    q_norm = _upcast(q_raw).norm(dim=-1)  # (B, H, Nq)
    k_norm = _upcast(k_raw).norm(dim=-1)  # (B, H, Nk)
    b, h, i, j = torch.unravel_index(candidates.argmax(), candidates.shape)

    z = candidates if bias is None else (logits + bias).masked_fill(~allowed, float("-inf"))
    log_a = torch.log_softmax(z, dim=-1)
    a = log_a.exp()
    # 0 * log 0 = 0: masked keys (and underflowed probabilities) add nothing to the entropy.
    entropy = -torch.where(a > 0, a * log_a, torch.zeros_like(a)).sum(dim=-1)  # (B, H, Nq), nats
    head_entropy = entropy.mean(dim=(0, 2))  # (H,)

    scalars = {
        "max_logit": candidates[b, h, i, j],
        "q_norm_at_max": q_norm[b, h, i],
        "k_norm_at_max": k_norm[b, h, j],
        "q_norm_mean": q_norm.mean(),
        "q_norm_max": q_norm.max(),
        "k_norm_mean": k_norm.mean(),
        "k_norm_max": k_norm.max(),
        "entropy_mean": entropy.mean(),
        "entropy_min": entropy.min(),
        "low_entropy_head_frac": (head_entropy < entropy_threshold).to(entropy.dtype).mean(),
    }
    heads = {"max_logit": candidates.amax(dim=(0, 2, 3)), "entropy_mean": head_entropy}
    return LayerStats(scalars=scalars, heads=heads)
