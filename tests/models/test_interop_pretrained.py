"""model.pretrained=: weights from a quest-export folder, a state_dict file, a .safetensors file or the Hub cache,
converted to the run's attention, with the head resized for the data's class count; nothing downloaded."""
from __future__ import annotations

import math

import pytest
import timm
import torch
from safetensors.torch import save_file

from quest.config.checks import ConfigError
from quest.models import create_model
from quest.models.pretrained import load_pretrained_weights
from quest.tools.export import export_run
from quest.train.checks import check_train_config
from tests.helpers import compose_cfg
from tests.interop_helpers import make_image_folder, train_tiny_run

PICO = "vit_pico_patch4_16"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    base = tmp_path_factory.mktemp("pretrained")
    run = train_tiny_run(make_image_folder(base / "data"), base / "run")
    return export_run(run, base / "export", "ema")


def _same_except(a: dict, b: dict, skip: set[str]) -> None:
    for k in a:
        if k not in skip:
            assert torch.equal(a[k], b[k]), k


def test_a_quest_export_starts_a_qknorm_model_whose_scales_keep_their_initial_values(exported):
    from safetensors.torch import load_file

    weights = load_file(exported / "model.safetensors")
    model = create_model(PICO, attention="qknorm", num_classes=3)
    info = load_pretrained_weights(model, f"local-dir:{exported}")
    state = model.state_dict()
    scales = {k for k in state if k.endswith("qk_scale")}
    assert len(scales) == 4 and info["initial_values_kept"] == sorted(scales)
    for k in scales:  # log2(L^2 - L) for this model's 17 tokens, as built
        assert state[k].item() == pytest.approx(math.log2(17**2 - 17))
    _same_except(weights, state, scales)
    assert not info["new_head"]


def test_another_class_count_gets_a_new_head_as_timm_does(exported):
    from safetensors.torch import load_file

    weights = load_file(exported / "model.safetensors")
    torch.manual_seed(1)
    model = create_model(PICO, attention="quest", num_classes=7)
    head_before = model.head.weight.detach().clone()
    info = load_pretrained_weights(model, f"local-dir:{exported}")
    assert info["new_head"] and torch.equal(model.head.weight, head_before)
    _same_except(weights, model.state_dict(), {"head.weight", "head.bias"})


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_a_standard_timm_state_dict_file_loads_into_quest(tmp_path, suffix):
    source = timm.create_model(PICO, num_classes=10)  # standard attention
    path = tmp_path / f"weights{suffix}"
    if suffix == ".pth":
        torch.save({"state_dict": source.state_dict(), "epoch": 3}, path)
    else:
        save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(path))
    model = create_model(PICO, attention="quest", num_classes=10)
    info = load_pretrained_weights(model, str(path))
    assert info["initial_values_kept"] == [] and not info["new_head"]
    _same_except(source.state_dict(), model.state_dict(), set())


def test_weights_of_another_architecture_are_refused_by_name(tmp_path):
    other = timm.create_model("vit_nano_patch4_32", num_classes=10)
    torch.save(other.state_dict(), tmp_path / "nano.pth")
    model = create_model(PICO, attention="quest", num_classes=10)
    with pytest.raises(ValueError, match="weights do not fit the model: .*has shape"):
        load_pretrained_weights(model, str(tmp_path / "nano.pth"))


def test_nothing_is_downloaded_unless_asked(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    model = create_model("vit_tiny_patch16_224", attention="quest", num_classes=10)
    with pytest.raises(FileNotFoundError, match="pretrained_download=true"):
        load_pretrained_weights(model, "deit_tiny_patch16_224.fb_in1k")
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache|pretrained_download"):
        load_pretrained_weights(model, "hf-hub:someone/quest-model")


def test_the_config_check_names_a_bad_source_before_any_work(tmp_path):
    fast = ["data=fake", "data.img_size=16", "model=vit_pico", "recipe=light"]
    for value, expected in [(str(tmp_path / "nope.pth"), "does not exist"),
                            ("local-dir:" + str(tmp_path), "not a folder of exported weights"),
                            ("resnet_nonexistent.tag", "neither a timm model")]:
        with pytest.raises(ConfigError, match=expected):
            check_train_config(compose_cfg(*fast, f"model.pretrained={value}"))


@pytest.mark.parametrize("fault", ["int64", "bool", "nan", "inf"])
@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_weights_of_the_wrong_kind_are_refused_naming_the_tensor(tmp_path, suffix, fault):
    """Integer or bool values for a floating-point weight (load_state_dict would cast them without a word, and the
    model would score at chance) and non-finite values: refused naming the tensor, by model.pretrained= and by
    eval.py's weights= alike (one check, quest.store.weights_check.check_weights)."""
    from quest.store.weights_check import check_weights

    state = {k: v.contiguous() for k, v in timm.create_model(PICO, num_classes=10).state_dict().items()}
    key = "blocks.0.attn.qkv.weight"
    if fault in ("int64", "bool"):
        state[key] = (state[key] * 100).to(getattr(torch, fault))
    else:
        state[key] = state[key].clone()
        state[key][0, 0] = float(fault)
    path = tmp_path / f"weights{suffix}"
    save_file(state, str(path)) if suffix == ".safetensors" else torch.save(state, path)
    model = create_model(PICO, attention="quest", num_classes=10)
    with pytest.raises(ValueError, match=rf"^model.pretrained={path}: weights .*'{key}' hold"):
        load_pretrained_weights(model, str(path))
    with pytest.raises(ValueError, match=rf"^weights=w: weights .*'{key}' hold"):
        check_weights(state, "weights=w", "weights", model.state_dict())
