"""quest.diagnostics against a brute-force computation written out here, and its promise to change nothing."""
from __future__ import annotations

import copy
import gc
import logging
import math

import pytest
import torch
import torch.nn as nn

from quest.attention import CrossAttentionMixin, QuestAttention, StandardAttention, get_attention, list_attentions
from quest.diagnostics import AttentionDiagnostics
from quest.diagnostics.stats import HEAD_STATS, SCALAR_STATS
from quest.models import attention_layers, create_model

from ..helpers import bf16_sdpa_unavailable
from ..reference import reference_logits

FORMULATIONS = list_attentions()  # every registered one: a new one fails until tests/reference.py writes it out
# The CPU preset's shape (16 px input, width 64, 4 heads) with 2 px patches (65 tokens) at depth 2, spelt out on a
# stable timm name so these tests do not follow renames of the CPU presets.
MODEL = "vit_tiny_patch16_224"
MODEL_KW = dict(img_size=16, patch_size=2, embed_dim=64, depth=2, num_heads=4, mlp_ratio=2.0, num_classes=5)
N_TOKENS = 8 * 8 + 1  # 16 px / 2 px patches + [CLS]
DEPTH = MODEL_KW["depth"]


def tiny_model(attention: str, dtype: torch.dtype = torch.float64, **kwargs) -> nn.Module:
    if "uses_m" in dir(get_attention(attention)):
        # elliptical formulations with no layer weighted by m (layers=[]), so tests/reference.py's logits apply;
        # the m-weighted logits inside a model are written out in tests/attention/test_elliptical.py
        kwargs.setdefault("attention_options", {"layers": []})
    model = create_model(MODEL, attention=attention, in_chans=1, **MODEL_KW, **kwargs).to(dtype)
    with torch.no_grad():  # off the init, so qkv biases, LayerNorm gains and learnable scales all matter
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def images(n: int = 5, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(n, 1, 16, 16, dtype=dtype)


# --- the brute force: definitions written out, independently of quest.attention / quest.diagnostics -------------
def raw_qk(layer, x):
    B, N, C = x.shape
    H, d = layer.num_heads, C // layer.num_heads
    qkv = x @ layer.qkv.weight.T + layer.qkv.bias
    q, k, _ = (t.reshape(B, N, H, d).transpose(1, 2) for t in qkv.split(C, dim=-1))
    return q, k


def brute_force(name, layer, x):
    """Every statistic of one layer, plus the per-head mean entropies (for choosing a threshold)."""
    q, k = raw_qk(layer, x)
    z = reference_logits(name, layer, q, k)
    a = torch.exp(z - z.amax(-1, keepdim=True))
    a = a / a.sum(-1, keepdim=True)
    entropy = -(a * torch.log(a)).sum(-1)  # (B, H, N)
    b, h, i, j = (int(t) for t in torch.unravel_index(z.argmax(), z.shape))
    assert z[b, h, i, j] == z.max()
    head_entropy = entropy.mean(dim=(0, 2))
    return {
        "max_logit": z.max().item(),
        "q_norm_at_max": q[b, h, i].norm().item(),
        "k_norm_at_max": k[b, h, j].norm().item(),
        "q_norm_mean": q.norm(dim=-1).mean().item(),
        "q_norm_max": q.norm(dim=-1).max().item(),
        "k_norm_mean": k.norm(dim=-1).mean().item(),
        "k_norm_max": k.norm(dim=-1).max().item(),
        "entropy_mean": entropy.mean().item(),
        "entropy_min": entropy.min().item(),
        "head_max_logit": z.amax(dim=(0, 2, 3)).tolist(),
        "head_entropy": head_entropy.tolist(),
    }


def capture_layer_inputs(model, x):
    """Inputs of every attention layer in an eval forward, with a hook of the test's own."""
    inputs, handles = [], []
    for _, layer in attention_layers(model):
        handles.append(layer.register_forward_pre_hook(lambda m, args: inputs.append(args[0].clone())))
    try:
        with torch.no_grad():
            model.eval()(x)
    finally:
        for handle in handles:
            handle.remove()
    model.train()
    return inputs


def no_hooks_anywhere(model) -> bool:
    from torch.nn.modules import module as nn_module

    global_hooks = (nn_module._global_forward_pre_hooks, nn_module._global_forward_hooks)
    return not any(global_hooks) and all(
        not m._forward_pre_hooks and not m._forward_hooks for m in model.modules()
    )


# --- values ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FORMULATIONS)
def test_values_match_brute_force(name):
    model = tiny_model(name)
    if name == "qknorm_hs":  # one head past the clamp at log(100), so the clamp is exercised
        with torch.no_grad():
            attention_layers(model)[0][1].logit_scale[0] = 5.0
    x = images(5)
    num_samples = 3  # fewer than the batch: the statistics must see these three only
    inputs = capture_layer_inputs(model, x[:num_samples])
    layers = attention_layers(model)
    expected = [brute_force(name, layer, inp) for (_, layer), inp in zip(layers, inputs, strict=True)]
    # A threshold in the middle of the observed head entropies, so low_entropy_head_frac is neither 0 nor 1.
    all_heads = sorted(h for e in expected for h in e["head_entropy"])
    threshold = (all_heads[len(all_heads) // 2 - 1] + all_heads[len(all_heads) // 2]) / 2

    diag = AttentionDiagnostics(model, every_n_steps=1, num_samples=num_samples, per_head=True,
                                entropy_threshold=threshold)
    got = diag.collect(x)

    approx = dict(rel=1e-9, abs=1e-9)
    fracs = []
    for index, exp in enumerate(expected):
        tag = f"diag/layer{index:02d}/"
        for stat in SCALAR_STATS[:-1]:
            assert got[tag + stat] == pytest.approx(exp[stat], **approx), tag + stat
        frac = sum(h < threshold for h in exp["head_entropy"]) / len(exp["head_entropy"])
        fracs.append(frac)
        assert got[tag + "low_entropy_head_frac"] == pytest.approx(frac)
        for head, (m, e) in enumerate(zip(exp["head_max_logit"], exp["head_entropy"], strict=True)):
            assert got[f"{tag}head{head:02d}/max_logit"] == pytest.approx(m, **approx)
            assert got[f"{tag}head{head:02d}/entropy_mean"] == pytest.approx(e, **approx)
    assert 0 < sum(fracs) < len(fracs)
    assert got["diag/max_logit"] == pytest.approx(max(e["max_logit"] for e in expected), **approx)


@pytest.mark.parametrize("name", list_attentions())
def test_collect_works_for_every_registered_formulation(name):
    model = create_model(MODEL, attention=name, **MODEL_KW)
    got = AttentionDiagnostics(model, per_head=True).collect(torch.randn(3, 3, 16, 16))
    heads = model.blocks[0].attn.num_heads
    expected = {"diag/max_logit"}
    for layer in range(DEPTH):
        expected |= {f"diag/layer{layer:02d}/{s}" for s in SCALAR_STATS}
        expected |= {f"diag/layer{layer:02d}/head{h:02d}/{s}" for h in range(heads) for s in HEAD_STATS}
    assert set(got) == expected
    assert all(isinstance(v, float) and math.isfinite(v) for v in got.values())


@pytest.mark.parametrize("dtype, rel", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("name", FORMULATIONS)
def test_uniform_attention_has_entropy_log_n(name, dtype, rel):
    model = tiny_model(name, dtype=dtype)
    with torch.no_grad():
        for _, layer in attention_layers(model):
            layer.qkv.weight.zero_()
            layer.qkv.bias.zero_()  # q = k = 0: every logit of a row is the same number
    got = AttentionDiagnostics(model, per_head=True).collect(images(4, dtype))
    for layer in range(DEPTH):
        tag = f"diag/layer{layer:02d}/"
        assert got[tag + "entropy_mean"] == pytest.approx(math.log(N_TOKENS), rel=rel)
        assert got[tag + "entropy_min"] == pytest.approx(math.log(N_TOKENS), rel=rel)
        assert got[tag + "head00/entropy_mean"] == pytest.approx(math.log(N_TOKENS), rel=rel)
        assert got[tag + "low_entropy_head_frac"] == 0.0
        assert got[tag + "q_norm_max"] == 0.0 and got[tag + "k_norm_max"] == 0.0


def test_layers_are_numbered_in_forward_order_and_masks_are_honoured():
    """A module that calls its attention layers in reverse definition order, with a causal and a boolean mask."""
    dim, heads, n = 16, 2, 6

    class Reversed(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = StandardAttention(dim, num_heads=heads, qkv_bias=True)
            self.second = QuestAttention(dim, num_heads=heads, qkv_bias=True)
            self.mask = torch.rand(n, n) > 0.4
            self.mask[:, 0] = True

        def forward(self, x):
            return self.first(self.second(x, is_causal=True), attn_mask=self.mask)

    model = Reversed().double()
    x = torch.randn(2, n, dim, dtype=torch.float64)
    got = AttentionDiagnostics(model, num_samples=2).collect(x)

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for index, (name, layer, x_in, allowed) in enumerate(
        [("quest", model.second, x, causal), ("standard", model.first, model.second(x, is_causal=True), model.mask)]
    ):
        with torch.no_grad():
            q, k = raw_qk(layer, x_in)
            z = reference_logits(name, layer, q, k).masked_fill(~allowed, float("-inf"))
        a = torch.softmax(z, dim=-1)
        entropy = -torch.where(allowed, a * torch.log(a), torch.zeros(())).sum(-1)
        tag = f"diag/layer{index:02d}/"
        assert got[tag + "max_logit"] == pytest.approx(z.max().item(), rel=1e-12)
        assert got[tag + "entropy_mean"] == pytest.approx(entropy.mean().item(), rel=1e-12)
        assert got[tag + "entropy_min"] == pytest.approx(entropy.min().item(), rel=1e-12, abs=1e-12)


def test_cross_attention_layers_with_one_query():
    class Cross(CrossAttentionMixin, QuestAttention):
        pass

    model = nn.Sequential(Cross(16, num_heads=2, qkv_bias=True))
    got = AttentionDiagnostics(model, per_head=True).collect(torch.randn(2, 5, 16))
    assert got["diag/layer00/entropy_mean"] <= math.log(5) + 1e-6
    assert all(math.isfinite(v) for v in got.values())


def test_wrappers_are_looked_through():
    model = tiny_model("quest")
    x = images(3)
    plain = AttentionDiagnostics(model).collect(x)
    wrapped = AttentionDiagnostics(nn.DataParallel(model)).collect(x)
    assert wrapped == plain


def test_low_precision_runs_give_float32_statistics():
    """Under bf16 autocast or with bf16 weights the statistics still come out, close to the float32 ones."""
    if (why := bf16_sdpa_unavailable()) is not None:
        pytest.skip(why)
    model = create_model(MODEL, attention="qknorm_hs", **MODEL_KW)
    x = torch.randn(4, 3, 16, 16)
    reference = AttentionDiagnostics(model).collect(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = AttentionDiagnostics(model).collect(x)
    bf16 = AttentionDiagnostics(model.to(torch.bfloat16)).collect(x.to(torch.bfloat16))
    for got in (autocast, bf16):
        assert got.keys() == reference.keys()
        for key, value in reference.items():
            assert got[key] == pytest.approx(value, rel=0.05, abs=1e-2), key


# --- it changes nothing -------------------------------------------------------------------------------------------
def training_model():
    # Dropout, attention dropout and drop-path all draw random numbers in a training step.
    return create_model(MODEL, attention="quest", drop_rate=0.1, attn_drop_rate=0.1, drop_path_rate=0.2, **MODEL_KW)


def train_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def test_training_step_after_collect_is_bit_identical():
    x, y = torch.randn(6, 3, 16, 16), torch.randint(0, 5, (6,))
    results = []
    for with_diagnostics in (False, True):
        torch.manual_seed(1)
        model = training_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        diag = AttentionDiagnostics(model, every_n_steps=1)
        torch.manual_seed(2)
        losses = []
        for step in range(2):
            if with_diagnostics and diag.due(step):
                rng = torch.get_rng_state()
                diag.collect(x, step=step)
                assert torch.equal(torch.get_rng_state(), rng)
            losses.append(train_step(model, opt, x, y))
        results.append((losses, copy.deepcopy(model.state_dict())))
    (losses_a, state_a), (losses_b, state_b) = results
    assert all(torch.equal(a, b) for a, b in zip(losses_a, losses_b, strict=True))
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[key], state_b[key]) for key in state_a)


def test_collect_leaves_parameters_grads_buffers_and_modes_alone():
    model = training_model()
    model.register_buffer("counter", torch.zeros(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, opt, torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,)))
    model.head.eval()  # a frozen submodule must stay frozen, the rest must go back to training mode
    state = copy.deepcopy(model.state_dict())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    AttentionDiagnostics(model).collect(torch.randn(4, 3, 16, 16))

    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters())
    assert model.training and model.blocks[1].attn.training and not model.head.training


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))  # type(): no __class__ lookups


def _holds_tensor(obj, depth: int = 0) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if depth > 4 or isinstance(obj, nn.Module):
        return False  # the model's own parameters are the model's, not the collector's
    if isinstance(obj, dict):
        return any(_holds_tensor(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple, set)):
        return any(_holds_tensor(v, depth + 1) for v in obj)
    return hasattr(obj, "__dict__") and _holds_tensor(vars(obj), depth + 1)


def test_nothing_is_registered_or_kept_between_diagnostic_steps():
    model = training_model()
    x = torch.randn(4, 3, 16, 16)
    diag = AttentionDiagnostics(model, every_n_steps=2, per_head=True)
    assert no_hooks_anywhere(model)
    diag.collect(x)  # warm-up: lazily created caches of torch itself are not ours
    before = _live_tensors()
    metrics = diag.collect(x)
    assert _live_tensors() <= before  # none kept (fewer: torch freed a cache of an earlier test in this process)
    assert no_hooks_anywhere(model)
    assert not _holds_tensor(diag)
    assert all(type(v) is float for v in metrics.values())


def test_hooks_are_removed_when_the_forward_fails():
    model = training_model()

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    model.blocks[1].mlp.forward = fail  # after the first attention layer's hook has fired
    with pytest.raises(RuntimeError, match="boom"):
        AttentionDiagnostics(model).collect(torch.randn(2, 3, 16, 16))
    assert no_hooks_anywhere(model)
    assert model.training


@pytest.mark.parametrize("every_n_steps", [0, -5])
def test_disabled_collector_is_never_due_and_registers_nothing(every_n_steps):
    model = training_model()
    diag = AttentionDiagnostics(model, every_n_steps=every_n_steps)
    assert not diag.enabled
    assert not any(diag.due(step) for step in range(1000))
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 3, 16, 16), torch.tensor([0, 1]))
    assert no_hooks_anywhere(model)


def test_due_every_n_steps():
    diag = AttentionDiagnostics(training_model(), every_n_steps=3)
    assert [s for s in range(10) if diag.due(s)] == [0, 3, 6, 9]


def test_max_logit_warning_fires_exactly_once(caplog):
    model = tiny_model("standard")
    diag = AttentionDiagnostics(model, max_logit_warning=1e-3)
    quiet = AttentionDiagnostics(model, max_logit_warning=1e9)
    with caplog.at_level(logging.WARNING, logger="quest.diagnostics"):
        for step in (10, 20, 30):
            value = diag.collect(images(2), step=step)["diag/max_logit"]
            quiet.collect(images(2), step=step)
    records = [r for r in caplog.records if r.name == "quest.diagnostics"]
    assert len(records) == 1
    message = records[0].getMessage()
    assert "step 10" in message and "layer0" in message and "blocks." in message
    assert value > 1e-3


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError, match="num_samples"):
        AttentionDiagnostics(training_model(), num_samples=0)
    with pytest.raises(ValueError, match="no quest attention layers"):
        AttentionDiagnostics(nn.Linear(2, 2))
    AttentionDiagnostics(nn.Linear(2, 2), every_n_steps=0)  # disabled: fine on any model
