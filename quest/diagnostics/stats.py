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

__all__ = ["LayerStats", "layer_statistics", "stacked_statistics", "SCALAR_STATS", "HEAD_STATS"]

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
    return stacked_statistics(q_raw[None], k_raw[None], q_eff[None], k_eff[None], scale, entropy_threshold,
                              attn_mask, is_causal)[0]


def stacked_statistics(
    q_raw: torch.Tensor,
    k_raw: torch.Tensor,
    q_eff: torch.Tensor,
    k_eff: torch.Tensor,
    scale: float | torch.Tensor,
    entropy_threshold: float,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> list[LayerStats]:
    """:func:`layer_statistics` of L layers at once, their tensors stacked on a leading dimension ((L, B, H, N, d),
    one scale and mask for all): the same numbers in a fixed number of batched operations whatever the depth, so a
    diagnostics step launches a few dozen kernels on a GPU rather than a few dozen per layer."""
    scale = _upcast(scale) if isinstance(scale, torch.Tensor) else scale
    logits = scale * (_upcast(q_eff) @ _upcast(k_eff).transpose(-2, -1))  # (L, B, H, Nq, Nk)
    allowed, bias = _masks(logits.shape, logits.device, attn_mask, is_causal)
    candidates = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))

    q_norm = _upcast(q_raw).norm(dim=-1)  # (L, B, H, Nq)
    k_norm = _upcast(k_raw).norm(dim=-1)  # (L, B, H, Nk)
    depth = logits.shape[0]
    where = torch.unravel_index(candidates.reshape(depth, -1).argmax(dim=1), candidates.shape[1:])  # each (L,)
    layer = torch.arange(depth, device=logits.device)
    b, h, i, j = where

    z = candidates if bias is None else (logits + bias).masked_fill(~allowed, float("-inf"))
    log_a = torch.log_softmax(z, dim=-1)
    a = log_a.exp()
    # 0 * log 0 = 0: masked keys (and underflowed probabilities) add nothing to the entropy.
    entropy = -torch.where(a > 0, a * log_a, torch.zeros_like(a)).sum(dim=-1)  # (L, B, H, Nq), nats
    head_entropy = entropy.mean(dim=(1, 3))  # (L, H)
    per_layer = (1, 2, 3)

    scalars = {
        "max_logit": candidates[layer, b, h, i, j],
        "q_norm_at_max": q_norm[layer, b, h, i],
        "k_norm_at_max": k_norm[layer, b, h, j],
        "q_norm_mean": q_norm.mean(dim=per_layer),
        "q_norm_max": q_norm.amax(dim=per_layer),
        "k_norm_mean": k_norm.mean(dim=per_layer),
        "k_norm_max": k_norm.amax(dim=per_layer),
        "entropy_mean": entropy.mean(dim=per_layer),
        "entropy_min": entropy.amin(dim=per_layer),
        "low_entropy_head_frac": (head_entropy < entropy_threshold).to(entropy.dtype).mean(dim=1),
    }
    heads = {"max_logit": candidates.amax(dim=(1, 3, 4)), "entropy_mean": head_entropy}
    return [LayerStats(scalars={k: v[n] for k, v in scalars.items()}, heads={k: v[n] for k, v in heads.items()})
            for n in range(depth)]
