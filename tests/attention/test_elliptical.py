"""Elliptical attention and Elliptical-QUEST against an explicit float64 reference written here, and their plumbing:
the previous block's values, no gradient through m, torch.compile, state_dict, options."""
from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch
import torch.nn as nn

import quest.attention.elliptical as elliptical_module
from quest.attention import get_attention
from quest.models import attention_layers, convert_attention, create_model

from ..helpers import compose_cfg

MODEL = "vit_pico_patch4_16"  # width 64, 4 heads (d = 16), 16 px / 4 px patches + [CLS] = 17 tokens
DEPTH = 3
ELLIPTICAL = {"elliptical": "standard", "elliptical_quest": "quest"}  # formulation -> the same without m


def make_model(attention: str, dtype: torch.dtype = torch.float64, depth: int = DEPTH, **options) -> nn.Module:
    model = create_model(MODEL, attention=attention, attention_options=options, depth=depth, num_classes=5)
    model = model.to(dtype).eval()
    with torch.no_grad():  # off the init, so the qkv biases matter and the values differ visibly between blocks
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def images(n: int = 3, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, dtype=dtype)


# --- the reference: definitions written out, independently of quest.attention -----------------------------------
def split_heads(layer, x):
    B, N, C = x.shape
    H, d = layer.num_heads, C // layer.num_heads
    qkv = x @ layer.qkv.weight.T + layer.qkv.bias
    return [t.reshape(B, N, H, d).transpose(1, 2) for t in qkv.split(C, dim=-1)]


def reference_m(v, v_prev, estimator):
    delta = (v - v_prev).abs()  # (B, H, N, d); delta's 1/step cancels in the normalisation below
    n = v.shape[-2]
    if estimator == "mean":
        m = delta.sum(-2) / n
    else:
        m = delta.sort(dim=-2).values[..., (n - 1) // 2, :]  # the (lower) middle value over tokens
    return (m / m.max(dim=-1, keepdim=True).values)[..., None, :]  # (B, H, 1, d)


def reference_logits(name, q, k, m):
    d = q.shape[-1]
    if m is None:
        m = torch.ones_like(q[..., :1, :])
    if name == "elliptical":
        return (q * m) @ k.transpose(-2, -1) / math.sqrt(d)
    l2n = lambda t: t / t.norm(dim=-1, keepdim=True)  # noqa: E731
    return q.norm(dim=-1, keepdim=True) * ((l2n(q) * m) @ l2n(k).transpose(-2, -1))  # ||q|| (l2n(q) M) l2n(k)^T


def reference_output(name, layer, x, m):
    q, k, v = split_heads(layer, x)
    z = reference_logits(name, q, k, m)
    a = torch.exp(z - z.amax(-1, keepdim=True))
    a = a / a.sum(-1, keepdim=True)
    out = (a @ v).transpose(1, 2).reshape(x.shape)
    return out @ layer.proj.weight.T + layer.proj.bias


def run_capturing(model, x):
    """Forward; per attention layer its input, its output, and the logits effective_qk gives right before it runs."""
    captured = []

    def pre(layer, args):
        q, k, scale = layer.effective_qk(args[0])  # as the diagnostics call it: in a pre-hook of the model forward
        captured.append({"x": args[0], "logits": scale * q @ k.transpose(-2, -1)})

    def post(layer, args, out):
        captured[-1]["out"] = out

    handles = [h for _, layer in attention_layers(model)
               for h in (layer.register_forward_pre_hook(pre), layer.register_forward_hook(post))]
    try:
        out = model(x)
    finally:
        for h in handles:
            h.remove()
    return out, captured


# --- (a), (d): against the reference, and which layers use m ----------------------------------------------------
@pytest.mark.parametrize("estimator", ["mean", "median"])
@pytest.mark.parametrize("layers", [None, [2], [1, 2]])
@pytest.mark.parametrize("name", list(ELLIPTICAL))
def test_every_layer_matches_explicit_softmax_with_m_from_the_previous_block(name, layers, estimator):
    model = make_model(name, layers=layers, estimator=estimator)
    _, captured = run_capturing(model, images())
    attn = [layer for _, layer in attention_layers(model)]
    expected_use = [False, True, True] if layers is None else [i in layers for i in range(DEPTH)]
    assert [layer.uses_m for layer in attn] == expected_use
    assert not expected_use[0]  # the first layer never has an m
    for index, (layer, cap) in enumerate(zip(attn, captured, strict=True)):
        m = None
        if expected_use[index]:
            v = split_heads(layer, cap["x"])[2]
            v_prev = split_heads(attn[index - 1], captured[index - 1]["x"])[2]
            m = reference_m(v, v_prev, estimator)
            assert not torch.allclose(m, torch.ones_like(m))  # m really weights the dimensions
        torch.testing.assert_close(cap["out"], reference_output(name, layer, cap["x"], m), atol=1e-10, rtol=1e-10)
        q, k, _ = split_heads(layer, cap["x"])
        torch.testing.assert_close(cap["logits"], reference_logits(name, q, k, m), atol=1e-10, rtol=1e-10)


def test_median_of_an_even_token_count_is_the_lower_middle_value():
    v_prev = torch.zeros(1, 1, 4, 2, dtype=torch.float64)
    v = torch.tensor([[[[1.0, 4.0], [2.0, 8.0], [3.0, 1.0], [9.0, 2.0]]]], dtype=torch.float64)
    m = elliptical_module.elliptical_weights(v, v_prev, "median")
    torch.testing.assert_close(m, torch.tensor([[[[2.0 / 2.0, 2.0 / 2.0]]]], dtype=torch.float64))  # medians 2, 2
    m = elliptical_module.elliptical_weights(v, v_prev, "mean")
    torch.testing.assert_close(m, torch.tensor([[[[15.0 / 15.0, 15.0 / 15.0]]]], dtype=torch.float64))
    torch.testing.assert_close(elliptical_module.elliptical_weights(v_prev, v_prev), torch.zeros_like(v[..., :1, :]))


# --- (b): m = 1 is standard resp. quest --------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(ELLIPTICAL))
def test_with_m_fixed_to_ones_it_is_the_formulation_without_m(name, monkeypatch):
    monkeypatch.setattr(elliptical_module, "elliptical_weights", lambda v, *args: torch.ones_like(v[..., :1, :]))
    model = make_model(name)
    plain = create_model(MODEL, attention=ELLIPTICAL[name], depth=DEPTH, num_classes=5).double().eval()
    plain.load_state_dict(model.state_dict())
    x = images().requires_grad_(True)
    out, plain_out = model(x), plain(x)
    torch.testing.assert_close(out, plain_out, atol=1e-12, rtol=1e-12)
    g, g_plain = (torch.autograd.grad(o.sum(), x)[0] for o in (out, plain_out))
    torch.testing.assert_close(g, g_plain, atol=1e-12, rtol=1e-12)
    assert all(layer.uses_m for _, layer in attention_layers(model)[1:])  # m was used, it just was 1


# --- (c): no gradient through m -----------------------------------------------------------------------------------
def _param_grads(model, x):
    return torch.autograd.grad((model(x) * torch.linspace(-1, 1, 5, dtype=x.dtype)).sum(), list(model.parameters()))


@pytest.mark.parametrize("name", list(ELLIPTICAL))
def test_no_gradient_flows_through_m(name, monkeypatch):
    model = make_model(name)
    x = images()
    real = elliptical_module.elliptical_weights
    recorded = []

    def recording(*args):
        m = real(*args)
        assert not m.requires_grad
        recorded.append(m.clone())
        return m

    monkeypatch.setattr(elliptical_module, "elliptical_weights", recording)
    grads = _param_grads(model, x)
    assert len(recorded) == DEPTH - 1
    kept = attention_layers(model)[0][1].chain.values
    assert sum(v is not None for v in kept) == DEPTH - 1 and not any(v.requires_grad for v in kept if v is not None)

    # The same forward with m a constant (the recorded values) gives the same gradients ...
    constants = iter(recorded)
    monkeypatch.setattr(elliptical_module, "elliptical_weights", lambda *args: next(constants))
    for g, r in zip(grads, _param_grads(model, x), strict=True):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=1e-12)

    # ... and an m that did carry a gradient (through this layer's v) would not: the comparison above can fail.
    def leaky(v, v_prev, estimator, eps):
        delta = (v - v_prev).abs().mean(-2, keepdim=True)
        return delta / delta.amax(-1, keepdim=True)

    monkeypatch.setattr(elliptical_module, "elliptical_weights", leaky)
    leaky_grads = _param_grads(model, x)
    assert any(not torch.allclose(g, r) for g, r in zip(grads, leaky_grads, strict=True))


# --- linking, standalone layers, stale values --------------------------------------------------------------------
@pytest.mark.parametrize("name", list(ELLIPTICAL))
def test_a_standalone_layer_is_a_first_layer(name):
    dim, heads = 24, 3
    layer = get_attention(name)(dim, num_heads=heads, qkv_bias=True).double()
    plain = get_attention(ELLIPTICAL[name])(dim, num_heads=heads, qkv_bias=True).double()
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(2, 7, dim, dtype=torch.float64)
    torch.testing.assert_close(layer(x), plain(x), atol=0, rtol=0)
    assert not layer.uses_m and layer.chain.values == [None]  # keeps nothing: no successor reads it


def test_values_are_dropped_at_every_model_forward_and_a_skipped_layer_is_refused():
    model = make_model("elliptical")
    model(images())
    layers = [layer for _, layer in attention_layers(model)]
    chain = layers[0].chain
    assert all(layer.chain is chain for layer in layers)
    # layers 0 and 1 keep their values for the next layer; the last one's are read by nobody
    assert [v is not None for v in chain.values] == [True, True, False]

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    layers[0].proj.forward = fail  # this forward stops inside the first layer, after it started
    with pytest.raises(RuntimeError, match="boom"):
        model(images())
    assert [v is not None for v in chain.values] == [True, False, False]  # only this forward's first values
    with pytest.raises(RuntimeError, match="previous attention layer has not run"):
        layers[2](torch.randn(2, 17, 64, dtype=torch.float64))


def test_a_deep_copy_carries_its_own_values():
    model = make_model("elliptical_quest")
    model(images())
    chain = attention_layers(model)[0][1].chain
    before = list(chain.values)
    twin = copy.deepcopy(model)  # as an EMA copy is made
    twin_chain = attention_layers(twin)[0][1].chain
    assert twin_chain is not chain and all(layer.chain is twin_chain for _, layer in attention_layers(twin))
    twin(images(2))
    assert all(a is b for a, b in zip(before, chain.values, strict=True))
    x = images(2)
    torch.testing.assert_close(twin(x), model(x), atol=0, rtol=0)


def test_relinking_keeps_one_chain_and_other_models_have_none():
    model = make_model("elliptical")
    before = dict(model.state_dict())
    elliptical_module.link_elliptical(model)
    chains = {id(layer.chain) for _, layer in attention_layers(model)}
    assert len(chains) == 1 and model.state_dict().keys() == before.keys()
    standard = create_model(MODEL, attention="standard", depth=DEPTH)
    assert not any(isinstance(m, elliptical_module.ValueChain) for m in standard.modules())


@pytest.mark.parametrize("name", list(ELLIPTICAL))
def test_torchscript_uses_m_as_the_eager_model_does(name):
    model = make_model(name)
    x = images()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.script is deprecated
        scripted = torch.jit.script(model)
    eager = model(x)
    torch.testing.assert_close(scripted(x), eager, atol=1e-12, rtol=0)
    plain = create_model(MODEL, attention=ELLIPTICAL[name], depth=DEPTH, num_classes=5).double().eval()
    plain.load_state_dict(model.state_dict())
    assert not torch.allclose(plain(x), eager)  # m changes the output here, so the comparison above can fail
    x2 = images(2)  # another batch size: nothing of the first call is read
    torch.testing.assert_close(scripted(x2), model(x2), atol=1e-12, rtol=0)
    assert all(slot.numel() == 0 for block in scripted.blocks for slot in block.attn.chain.slots)  # none kept
    buf = io.BytesIO()
    torch.jit.save(scripted, buf)
    buf.seek(0)
    torch.testing.assert_close(torch.jit.load(buf)(x), eager, atol=1e-12, rtol=0)  # the layers still share slots


def test_gradient_checkpointing_recomputes_with_the_same_values():
    model = make_model("elliptical").train()  # no dropout or drop path in the preset, so train mode is deterministic
    x = images()
    grads = _param_grads(model, x)
    model.set_grad_checkpointing(True)  # the blocks' forward is rerun in backward, reading the stored values
    for g, r in zip(grads, _param_grads(model, x), strict=True):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=1e-12)


def test_crossvit_is_refused():
    with pytest.raises(ValueError, match="CrossViT is not supported"):
        create_model("crossvit_tiny_240", attention="elliptical")


# --- (e): torch.compile ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(ELLIPTICAL))
def test_torch_compile_matches_eager(name):
    model = make_model(name, dtype=torch.float32, depth=2)
    x = images(2, torch.float32).requires_grad_(True)
    eager = model(x)
    (g_eager,) = torch.autograd.grad(eager.sum(), x)
    compiled = torch.compile(model)
    out = compiled(x)
    (g_compiled,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_compiled, g_eager, atol=1e-5, rtol=1e-5)
    x2 = images(2, torch.float32)  # a second call: the values stored by the first must not leak into it
    torch.testing.assert_close(compiled(x2), model(x2), atol=1e-5, rtol=1e-5)


# --- (f): weights and state_dict ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(ELLIPTICAL))
def test_state_dict_is_that_of_the_plain_model_and_round_trips(name):
    standard = create_model(MODEL, attention="standard", depth=DEPTH, num_classes=5).eval()
    before = {k: v.clone() for k, v in standard.state_dict().items()}
    converted = convert_attention(standard, name)
    assert all(layer.attention_name == name for _, layer in attention_layers(converted))
    x = images(2, torch.float32)
    out = converted(x)  # after a forward the layers hold values; none of them is in the state_dict
    state = converted.state_dict()
    assert state.keys() == before.keys()
    assert all(torch.equal(state[k], v) for k, v in before.items())

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    fresh = create_model(MODEL, attention=name, depth=DEPTH, num_classes=5).eval()
    fresh.load_state_dict(torch.load(buf, weights_only=True))  # strict
    torch.testing.assert_close(fresh(x), out, atol=0, rtol=0)


# --- (g): options ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options, match",
    [
        (dict(estimator="mode"), r"estimator='mode': expected one of mean, median"),
        (dict(eps=0.0), r"eps=0.0: expected a finite number > 0"),
        (dict(eps="small"), r"eps='small': expected a finite number > 0"),
        (dict(layers=[0, 1]), r"layers=\[0, 1\]: \[0\] are not layer indices >= 1"),
        (dict(layers=[1.5]), r"\[1.5\] are not layer indices >= 1"),
        (dict(layers="all"), r"layers='all': expected null"),
        (dict(layers=2), r"layers=2: expected null"),
        (dict(layers=[1, 3]), r"layers=\[1, 3\]: the model has 3 attention layers \(indices 0..2\)"),
    ],
)
@pytest.mark.parametrize("name", list(ELLIPTICAL))
def test_bad_options_are_refused(name, options, match):
    with pytest.raises(ValueError, match=match):
        create_model(MODEL, attention=name, attention_options=options, depth=DEPTH)


@pytest.mark.parametrize("name", list(ELLIPTICAL))
def test_config_options_from_yaml_build_the_model(name):
    cfg = compose_cfg(f"attention={name}", "attention.options.layers=[1,3]", "attention.options.estimator=median")
    model = create_model("vit_nano_patch4_32", attention=cfg.attention.name, attention_options=cfg.attention.options)
    assert [layer.uses_m for _, layer in attention_layers(model)] == [False, True, False, True, False, False]
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 1000)
    default = compose_cfg(f"attention={name}")
    assert default.attention.options.layers is None and default.attention.options.estimator == "mean"


def test_tiny_vit_builds_with_every_block_but_the_first_using_m():
    model = create_model("vit_tiny_patch16_224", attention="elliptical", img_size=32, depth=3)
    assert [layer.uses_m for _, layer in attention_layers(model)] == [False, True, True]
    assert torch.isfinite(model(torch.randn(1, 3, 32, 32))).all()
