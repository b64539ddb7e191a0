"""Every formulation against an explicit-softmax reference written here, independently of quest.attention."""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn as nn

from quest.attention import get_attention, list_attentions

from ..reference import l2n as _l2n
from ..reference import reference_logits

PAPER_FORMULATIONS = ["standard", "quest", "qnorm", "qknorm", "qknorm_hs", "qknorm_ds"]
FORMULATIONS = list_attentions()  # every registered one: a new one fails until tests/reference.py writes it out
B, N, DIM, HEADS = 2, 7, 24, 3
D = DIM // HEADS


def test_registry_holds_the_paper_formulations():
    assert set(PAPER_FORMULATIONS) <= set(list_attentions())


def reference_masked_logits(name, layer, x, mask=None, causal=False):
    """(the logits the layer's softmax takes, masks applied; v), written out from the layer's weights."""
    qkv = x @ layer.qkv.weight.T + layer.qkv.bias
    q, k, v = (t.reshape(B, N, HEADS, D).transpose(1, 2) for t in qkv.split(DIM, dim=-1))
    z = reference_logits(name, layer, q, k)
    if causal:
        z = z.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        z = z.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else z + mask
    return z, v


def reference_forward(name, layer, x, mask=None, causal=False):
    z, v = reference_masked_logits(name, layer, x, mask, causal)
    a = torch.exp(z - z.amax(-1, keepdim=True))
    a = a / a.sum(-1, keepdim=True)
    out = (a @ v).transpose(1, 2).reshape(B, N, DIM)
    return out @ layer.proj.weight.T + layer.proj.bias


def make_layer(name, **kw):
    cls = get_attention(name)
    layer = cls(DIM, num_heads=HEADS, qkv_bias=True, norm_layer=functools.partial(nn.LayerNorm, eps=1e-6), **kw)
    layer = layer.double()
    with torch.no_grad():  # move every parameter off its init so gains, biases and scales all matter
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return layer


def masks():
    bool_mask = torch.rand(B, 1, N, N) > 0.3
    bool_mask[..., 0] = True  # every row keeps at least one key
    float_mask = torch.randn(B, HEADS, N, N, dtype=torch.float64)
    return {"none": (None, False), "bool": (bool_mask, False), "float": (float_mask, False), "causal": (None, True)}


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal"])
@pytest.mark.parametrize("name", FORMULATIONS)
def test_output_and_gradients_match_explicit_softmax(name, mask_kind):
    layer = make_layer(name)
    mask, causal = masks()[mask_kind]
    x = torch.randn(B, N, DIM, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(B, N, DIM, dtype=torch.float64)

    out = layer(x, attn_mask=mask, is_causal=causal)
    grads = torch.autograd.grad((out * weights).sum(), [x, *layer.parameters()])
    ref = reference_forward(name, layer, x, mask, causal)
    ref_grads = torch.autograd.grad((ref * weights).sum(), [x, *layer.parameters()])

    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    names = ["input", *(n for n, _ in layer.named_parameters())]
    for n, g, r in zip(names, grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-10, msg=f"gradient w.r.t. {n}")


@pytest.mark.parametrize("name", FORMULATIONS)
def test_effective_qk_gives_the_logits(name):
    layer = make_layer(name)
    x = torch.randn(B, N, DIM, dtype=torch.float64)
    q, k, scale = layer.effective_qk(x)
    qkv = x @ layer.qkv.weight.T + layer.qkv.bias
    q0, k0, _ = (t.reshape(B, N, HEADS, D).transpose(1, 2) for t in qkv.split(DIM, dim=-1))
    torch.testing.assert_close(scale * q @ k.transpose(-2, -1), reference_logits(name, layer, q0, k0), atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", FORMULATIONS)
def test_attention_dropout_is_applied_in_training_only(name):
    layer = get_attention(name)(DIM, num_heads=HEADS, attn_drop=0.5, norm_layer=nn.LayerNorm)
    x = torch.randn(B, N, DIM)
    layer.train()
    assert not torch.allclose(layer(x), layer(x))
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x), atol=0, rtol=0)


def test_initial_scales_follow_their_sources():
    qk = get_attention("qknorm")(DIM, num_heads=HEADS)
    assert qk.qk_scale.item() == pytest.approx(math.log2(197**2 - 197))  # 15.24 for ViT-*/16 at 224
    assert qk.qk_scale.item() == pytest.approx(15.24, abs=0.01)
    qk65 = get_attention("qknorm", seq_len=65)(DIM, num_heads=HEADS)
    assert qk65.qk_scale.item() == pytest.approx(math.log2(65 * 64))
    hs = get_attention("qknorm_hs")(DIM, num_heads=HEADS)
    torch.testing.assert_close(hs.logit_scale.detach(), torch.full((HEADS,), math.log(10.0)))
    hs5 = get_attention("qknorm_hs", init_scale=5.0)(DIM, num_heads=HEADS)
    torch.testing.assert_close(hs5.logit_scale.detach(), torch.full((HEADS,), math.log(5.0)))
    ds = get_attention("qknorm_ds")(DIM, num_heads=HEADS, norm_layer=nn.LayerNorm)
    assert torch.all(ds.q_norm.weight == 1) and torch.all(ds.k_norm.weight == 1)


def test_qknorm_hs_scale_is_clamped_at_max():
    layer = make_layer("qknorm_hs")
    with torch.no_grad():
        layer.logit_scale.fill_(10.0)  # exp(10) >> 100
    x = torch.randn(B, N, DIM, dtype=torch.float64)
    q, k, scale = layer.effective_qk(x)
    cosine = torch.nn.functional.normalize(q, dim=-1) @ torch.nn.functional.normalize(k, dim=-1).transpose(-2, -1)
    torch.testing.assert_close(scale * q @ k.transpose(-2, -1), 100.0 * cosine)


def test_unknown_attention_lists_registered_names():
    with pytest.raises(ValueError, match="registered attentions: .*qknorm_ds.*quest.*standard"):
        get_attention("flash_quest")


def test_unknown_option_names_the_valid_ones():
    with pytest.raises(ValueError, match="seq_len"):
        get_attention("qknorm", init_scale=3.0)


def test_qk_norm_flag_is_refused_where_it_would_change_the_formulation():
    with pytest.raises(ValueError, match="qknorm_ds"):
        get_attention("quest")(DIM, num_heads=HEADS, qk_norm=True, norm_layer=nn.LayerNorm)


def test_registering_a_new_formulation_outside_the_package():
    from quest.attention import QKAttention, register_attention
    from quest.attention.registry import _REGISTRY

    @register_attention("test_cosine_t2")
    class Cosine(QKAttention):
        def transform_qk(self, q, k):
            return _l2n(q), _l2n(k), 2.0

    try:
        layer = get_attention("test_cosine_t2")(DIM, num_heads=HEADS)
        x = torch.randn(B, N, DIM)
        q, k, s = layer.effective_qk(x)
        assert s == 2.0 and layer(x).shape == x.shape
    finally:
        _REGISTRY.pop("test_cosine_t2")


def test_l2_normalize_gradient_matches_autograd_including_below_eps():
    from torch.autograd import gradcheck

    from quest.attention import l2_normalize

    x = torch.randn(3, 4, 5, 8, dtype=torch.float64)
    x[0, 0, 0] = 1e-9  # a vector shorter than eps: the norm is clamped there
    x.requires_grad_(True)
    assert gradcheck(lambda t: l2_normalize(t, 1e-3), (x,))  # eps far from the finite-difference step
    for shape in [(1,), (4, 1, 1)]:  # a per-layer and a per-head scale, with their gradient
        s = torch.rand(shape, dtype=torch.float64, requires_grad=True) + 0.5
        assert gradcheck(lambda t, s: l2_normalize(t, 1e-3, s), (x, s))
    torch.testing.assert_close(l2_normalize(x, 1e-3), torch.nn.functional.normalize(x, dim=-1, eps=1e-3))


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal"])
@pytest.mark.parametrize("name", FORMULATIONS)
def test_attention_hook_sees_the_probabilities_the_layer_applies(name, mask_kind):
    """register_attention_hook: the hook gets softmax(reference logits + mask), the output is the fused one, and
    after remove() no hook is called again."""
    layer = make_layer(name)
    mask, causal = masks()[mask_kind]
    x = torch.randn(B, N, DIM, dtype=torch.float64)
    fused = layer(x, attn_mask=mask, is_causal=causal)
    seen = []
    handle = layer.register_attention_hook(lambda module, logits, probs: seen.append((module, logits, probs)))
    hooked = layer(x, attn_mask=mask, is_causal=causal)
    handle.remove()
    layer(x, attn_mask=mask, is_causal=causal)
    assert len(seen) == 1 and seen[0][0] is layer
    z, _ = reference_masked_logits(name, layer, x, mask, causal)
    torch.testing.assert_close(seen[0][1], z, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(seen[0][2], torch.softmax(z, dim=-1), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(hooked, fused, atol=1e-10, rtol=1e-10)
