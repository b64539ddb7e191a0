"""The one-layer, one-head Transformer of the toy study (QUEST paper, A.3 and Algorithm A2).

Pre-norm block (LayerNorm -> attention -> residual, LayerNorm -> MLP -> residual), learnable positional embedding,
a [CLS] token, a final LayerNorm and a linear head on the [CLS] output; width = token width (20), MLP width 20, one
head. The attention is any registered formulation: its module holds the parameters (``attn.qkv``, ``attn.proj`` and
the formulation's own scales) and its ``transform_qk`` defines the logits.

Only the [CLS] output reaches the loss, so the forward computes the [CLS] row of the attention and the [CLS] MLP
only; the other rows could not change the output of a one-layer model. The [CLS] query depends on the parameters
alone (its input is cls_token + pos_embed[0]), so it is computed once per model rather than once per sample. The
softmax is written out instead of calling SDPA because ``torch.func.vmap`` has no batching rule for the fused CPU
kernel (it would fall back to a Python loop over models).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Mlp, trunc_normal_

from quest.attention import LayerSite, get_attention

__all__ = ["ToyTransformer"]


class ToyTransformer(nn.Module):
    def __init__(self, attention: str, seq_len: int, dim: int, num_classes: int, mlp_hidden: int = 20,
                 embed_init_std: float = 0.02) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, dim))
        self.pos_embed = nn.Parameter(trunc_normal_(torch.empty(seq_len + 1, dim), std=embed_init_std))
        self.norm1 = nn.LayerNorm(dim)
        self.attn = get_attention(attention)(dim, num_heads=1, qkv_bias=True)
        # its place, as the model factory tells every layer: QKNorm's scale starts from the token count ([CLS] too)
        self.attn.bind(LayerSite(self, (self.attn,), 0, seq_len + 1))
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, mlp_hidden)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        self.dim = dim

    def _cls_qkv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        cls = self.cls_token + self.pos_embed[:1]  # (1, dim): the same for every sample
        q, k, v = F.linear(self.norm1(cls), self.attn.qkv.weight, self.attn.qkv.bias).split(self.dim, -1)
        return cls, q, k, v

    def keys(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw keys and values of the data tokens, (B, N, dim) each, before any normalisation."""
        w, b = self.attn.qkv.weight[self.dim:], self.attn.qkv.bias[self.dim:]
        return F.linear(self.norm1(x + self.pos_embed[1:]), w, b).split(self.dim, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (B, N, dim) -> class logits (B, num_classes)."""
        B, D = x.shape[0], self.dim
        cls, q_cls, k_cls, v_cls = self._cls_qkv()
        k, v = self.keys(x)
        k = torch.cat([k_cls.expand(B, 1, D), k], 1).unsqueeze(1)  # (B, 1 head, N + 1, D)
        v = torch.cat([v_cls.expand(B, 1, D), v], 1).unsqueeze(1)
        q, k, scale = self.attn.transform_qk(q_cls.expand(B, 1, D).unsqueeze(1), k)
        attn = (scale * q @ k.transpose(-2, -1)).softmax(-1)  # (B, 1, 1, N + 1): the [CLS] row
        out = cls + self.attn.proj((attn @ v).reshape(B, D))
        out = out + self.mlp(self.norm2(out))
        return self.head(self.norm(out))
