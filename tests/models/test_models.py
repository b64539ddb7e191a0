"""quest.models against timm's own models, conversion, serialisation and torch.compile."""
from __future__ import annotations

import io

import pytest
import timm
import torch

from quest.attention import QKAttention, list_attentions
from quest.models import CPU_PRESETS, attention_layers, convert_attention, create_model

from ..attention.test_elliptical import ELLIPTICAL

FORMULATIONS = list_attentions()


@pytest.mark.parametrize(
    "name, kwargs, size",
    [
        ("vit_tiny_patch16_224", dict(img_size=64), 64),
        ("deit3_small_patch16_224", dict(img_size=48, depth=4), 48),  # LayerScale, no_embed_class
        ("vit_little_patch16_reg4_gap_256", dict(img_size=48, depth=2), 48),  # register tokens
        ("crossvit_tiny_240", dict(), 240),  # self- and cross-attention
    ],
)
def test_standard_attention_reproduces_timm(name, kwargs, size):
    reference = timm.create_model(name, **kwargs).eval()
    ours = create_model(name, attention="standard", **kwargs).eval()
    ours.load_state_dict(reference.state_dict())  # strict: same parameter names and shapes
    n_attn = sum(1 for m in reference.modules() if type(m).__name__ in ("Attention", "CrossAttention"))
    assert len(attention_layers(ours)) == n_attn > 0
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), reference(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", FORMULATIONS)
def test_every_preset_builds_with_every_formulation(attention):
    for name, cfg in CPU_PRESETS.items():
        model = create_model(name, attention=attention, num_classes=7)
        layers = attention_layers(model)
        assert len(layers) == cfg["depth"]
        assert all(layer.attention_name == attention for _, layer in layers)
        out = model(torch.randn(2, 3, cfg["img_size"], cfg["img_size"]))
        assert out.shape == (2, 7) and torch.isfinite(out).all()


def test_qknorm_scale_initialised_from_the_models_token_count():
    model = create_model("vit_pico_patch4_16", attention="qknorm")
    seq_len = 4 * 4 + 1
    for _, layer in attention_layers(model):
        assert layer.qk_scale.item() == pytest.approx(torch.log2(torch.tensor(seq_len**2 - seq_len)).item())


@pytest.mark.parametrize("attention", FORMULATIONS)
def test_convert_attention_keeps_every_weight(attention):
    source = timm.create_model("deit3_small_patch16_224", img_size=32, depth=3, drop_path_rate=0.1)
    before = {k: v.clone() for k, v in source.state_dict().items()}
    if attention == "qknorm_ds":
        source.blocks[0].attn.qkv.weight.data.mul_(1.0)  # conversion to qknorm_ds adds LN gains, keeps the rest
    model = convert_attention(source, attention)
    after = model.state_dict()
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, atol=0, rtol=0, msg=key)
    assert all(isinstance(m, QKAttention) and m.attention_name == attention for _, m in attention_layers(model))
    assert len(attention_layers(model)) == 3


def test_convert_standard_checkpoint_to_quest_for_finetuning():
    standard = create_model("vit_pico_patch4_16", attention="standard")
    quest = convert_attention(standard, "quest")
    x = torch.randn(2, 3, 16, 16)
    fresh = create_model("vit_pico_patch4_16", attention="quest")
    fresh.load_state_dict(quest.state_dict())
    torch.testing.assert_close(fresh(x), quest(x))


def test_convert_refuses_to_drop_qk_norm_weights():
    source = create_model("vit_pico_patch4_16", attention="qknorm_ds")
    with pytest.raises(ValueError, match="qk-normed"):
        convert_attention(source, "quest")


@pytest.mark.parametrize("attention", FORMULATIONS)
def test_state_dict_round_trip(attention):
    model = create_model("vit_pico_patch4_16", attention=attention, num_classes=5).eval()
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    clone = create_model("vit_pico_patch4_16", attention=attention, num_classes=5).eval()
    clone.load_state_dict(torch.load(buf, weights_only=True))
    x = torch.randn(3, 3, 16, 16)
    torch.testing.assert_close(clone(x), model(x), atol=0, rtol=0)


# the elliptical formulations carry state from one block to the next: compiled at depth 2 in tests/attention/test_elliptical.py
@pytest.mark.parametrize("attention", [name for name in FORMULATIONS if name not in ELLIPTICAL])
def test_torch_compile_matches_eager(attention):
    # one block: every block runs the same layer, and a second one only doubles the graph inductor lowers
    model = create_model("vit_pico_patch4_16", attention=attention, num_classes=5, depth=1).eval()
    x = torch.randn(2, 3, 16, 16, requires_grad=True)
    eager = model(x)
    (g_eager,) = torch.autograd.grad(eager.sum(), x)
    compiled = torch.compile(model)(x)
    (g_compiled,) = torch.autograd.grad(compiled.sum(), x)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_compiled, g_eager, atol=1e-5, rtol=1e-5)


def test_unknown_model_and_attention_are_named():
    with pytest.raises(ValueError, match="unknown timm model 'vit_gigantic_patch99'"):
        create_model("vit_gigantic_patch99", attention="quest")
    with pytest.raises(ValueError, match="registered attentions"):
        create_model("vit_pico_patch4_16", attention="sparse")


def test_convert_keeps_the_norm_layers_as_built():
    import functools

    from timm.models.vision_transformer import VisionTransformer

    norm = functools.partial(torch.nn.LayerNorm, eps=1e-3)
    source = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, qk_norm=True,
                               norm_layer=norm)
    converted = convert_attention(source, "qknorm_ds")
    assert converted.blocks[0].attn.q_norm.eps == 1e-3 and converted.blocks[0].attn.k_norm.eps == 1e-3
