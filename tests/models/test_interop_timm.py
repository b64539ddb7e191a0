"""quest models as timm / Hugging Face models: attn_layer names, quest-export, local-dir loading, plain timm's
refusal, and timm's own data + model API agreeing with quest's evaluation image by image."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from timm.data import create_transform, resolve_data_config
from torchvision.datasets import ImageFolder

import quest  # noqa: F401  (registers quest's attn_layer names and quest_vit with timm)
from quest.attention import link_elliptical, list_attentions
from quest.attention.timm_names import TIMM_TABLE, timm_attention_table
from quest.data import build_dataset
from quest.evaluation.config import eval_config_schema
from quest.evaluation.target import load_target
from quest.evaluation.transforms import eval_transform
from quest.models import create_model
from quest.tools.export import main as export_main
from tests.interop_helpers import CLASSES, make_image_folder, train_tiny_run


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("interop")
    data = make_image_folder(base / "data")
    run = train_tiny_run(data, base / "run")
    return data, run


def test_timm_keeps_its_attn_layer_table_where_quest_registers():
    """timm's ATTN_LAYERS is not a documented API: if a timm release moves it, this fails saying so."""
    module, attr = TIMM_TABLE
    try:
        table = timm_attention_table()
    except RuntimeError as exc:
        pytest.fail(f"timm {timm.__version__} moved {module}.{attr}; quest's attn_layer names cannot be registered: "
                    f"{exc}")
    for name in list_attentions():
        assert name in table, f"{name} not registered with timm"
    assert table["quest"].attention_name == "quest"


@pytest.mark.numerics
@pytest.mark.parametrize("attention", list_attentions())
def test_timm_attn_layer_name_builds_quests_model(attention):
    """timm.create_model(name, attn_layer=<quest name>) computes what quest.models.create_model does with the same
    weights (float64, so only the arithmetic's own order could differ: the code paths are the same)."""
    ours = create_model("vit_pico_patch4_16", attention=attention, num_classes=5).double().eval()
    theirs = timm.create_model("vit_pico_patch4_16", attn_layer=attention, num_classes=5).double().eval()
    if attention.startswith("elliptical"):
        link_elliptical(theirs)  # timm's factory cannot tell a layer its neighbours (docs/attention.md)
    assert type(theirs.blocks[0].attn) is type(ours.blocks[0].attn)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    torch.testing.assert_close(theirs(x), ours(x), rtol=0, atol=1e-12)


def test_an_import_path_attention_is_a_timm_name_once_named():
    from quest.attention import get_attention

    path = "quest.attention.formulations:QNormAttention"
    cls = get_attention(path)
    assert timm_attention_table()[path] is cls
    model = timm.create_model("vit_pico_patch4_16", attn_layer=path)
    assert isinstance(model.blocks[0].attn, cls)


def _export(run: Path, out: Path, weights: str) -> Path:
    assert export_main([str(run), "--out", str(out), "--weights", weights]) == 0
    return out


def test_export_writes_timm_and_hugging_face_layout(tiny_run, tmp_path):
    data, run = tiny_run
    out = _export(run, tmp_path / "export", "ema")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == "quest_vit.quest"
    assert config["num_classes"] == 3
    assert config["model_args"]["model"] == "vit_pico_patch4_16"
    assert config["model_args"]["attention"] == "quest"
    assert config["model_args"]["attention_options"] == {"eps": 1e-6}
    cfg = config["pretrained_cfg"]
    assert cfg["input_size"] == [3, 16, 16] and cfg["mean"] == [0.5] * 3 and cfg["std"] == [0.5] * 3
    assert cfg["crop_pct"] == 0.875 and cfg["interpolation"] == "bilinear"
    assert config["label_names"] == list(CLASSES)
    ckpt = torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    saved = load_file(out / "model.safetensors")
    assert saved.keys() == ckpt["ema"].keys()
    assert all(torch.equal(saved[k], ckpt["ema"][k]) for k in saved)
    card = (out / "README.md").read_text()
    assert "library_name: timm" in card and "quest_vit.quest" in card and "val/top1" in card
    assert "sha256" in card and "attention:" in card  # provenance and the run's config
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_the_model_card_s_example_runs_as_written_offline(tiny_run, tmp_path, monkeypatch):
    """The card's Python block, with this folder's path in place of its placeholder, loads the exported weights
    with the run's preprocessing, and reads nothing from the network (HF_HUB_OFFLINE: a download would raise)."""
    from quest.tools.export import CARD_FOLDER

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = _export(tiny_run[1], tmp_path / "export", "model")
    card = (out / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", card, flags=re.S)
    assert len(blocks) == 1 and CARD_FOLDER in blocks[0] and "hf-hub:" not in blocks[0]
    scope: dict = {}
    exec(blocks[0].replace(CARD_FOLDER, str(out)), scope)  # noqa: S102 - the card this test just wrote
    saved = load_file(out / "model.safetensors")
    assert all(torch.equal(scope["model"].state_dict()[k], v) for k, v in saved.items())
    assert tuple(scope["config"]["input_size"]) == (3, 16, 16) and scope["transform"] is not None


def test_export_refusals_name_the_problem(tiny_run, tmp_path, capsys):
    _, run = tiny_run
    assert export_main([str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "without checkpoints/last.pt" in capsys.readouterr().err
    ckpt = torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    ckpt["ema"] = None
    torch.save(ckpt, tmp_path / "no_ema.pt")
    assert export_main([str(tmp_path / "no_ema.pt"), "--out", str(tmp_path / "y"), "--weights", "ema"]) == 2
    err = capsys.readouterr().err  # both of its problems in the one message: no EMA, no summary.json beside it
    assert "holds no EMA weights" in err and "there is no summary.json beside" in err and err.count("\n") == 1, err
    assert not (tmp_path / "y").exists()


def _quest_eval(run: Path, use_ema: bool) -> tuple[torch.Tensor, list[int], float]:
    """quest's evaluation of the run's checkpoint: per-image logits (in data-set order), labels, and top-1."""
    cfg = OmegaConf.merge(OmegaConf.structured(eval_config_schema()),
                          {"checkpoint": str(run / "checkpoints" / "last.pt"), "eval": {"use_ema": use_ema}})
    target = load_target(cfg, torch.device("cpu"))
    dataset = build_dataset(target.data, "val", eval_transform(target))
    images = torch.stack([dataset[i][0] for i in range(len(dataset))])
    labels = [dataset[i][1] for i in range(len(dataset))]
    with torch.no_grad():
        logits = target.model.double()(images.double())
    top1 = (logits.argmax(1) == torch.tensor(labels)).double().mean().item()
    return logits, labels, top1


@pytest.mark.numerics
@pytest.mark.parametrize("weights", ["model", "ema"])
def test_timm_data_and_model_api_give_quests_eval_image_by_image(tiny_run, tmp_path, weights):
    """An exported QUEST model evaluated with nothing but timm and torchvision (create_model('local-dir:...'),
    resolve_data_config, create_transform, ImageFolder) gives quest's evaluation image by image. Both sides run in
    float64 with the same kernels, so the logits agree to rounding (1e-10)."""
    data, run = tiny_run
    out = _export(run, tmp_path / weights, weights)
    model = timm.create_model(f"local-dir:{out}", pretrained=True).eval().double()
    assert type(model.blocks[0].attn).attention_name == "quest"
    config = resolve_data_config({}, model=model)
    assert tuple(config["input_size"]) == (3, 16, 16) and tuple(config["mean"]) == tuple(config["std"]) == (0.5,) * 3
    assert config["crop_pct"] == 0.875 and config["interpolation"] == "bilinear"
    dataset = ImageFolder(str(data / "val"), transform=create_transform(**config))
    images = torch.stack([dataset[i][0] for i in range(len(dataset))])
    with torch.no_grad():
        timm_logits = model(images.double())
    ours, labels, top1 = _quest_eval(run, use_ema=weights == "ema")
    assert [dataset[i][1] for i in range(len(dataset))] == labels
    torch.testing.assert_close(timm_logits, ours, rtol=0, atol=1e-10)
    assert (timm_logits.argmax(1) == torch.tensor(labels)).double().mean().item() == top1
    # the model and the EMA weights really are different models (the test would not notice a mix-up otherwise)
    other, _, _ = _quest_eval(run, use_ema=weights != "ema")
    assert (other - ours).abs().max() > 1e-4


@pytest.mark.process  # a process that never imported quest: neither this one nor the warm zygote is that
def test_timm_without_quest_refuses_naming_the_attention(tiny_run, tmp_path):
    """A process that never imported quest gets an error naming the attention, never a standard-attention model."""
    _, run = tiny_run
    out = _export(run, tmp_path / "export", "model")
    code = ("import sys, timm\n"
            f"timm.create_model('local-dir:{out}', pretrained=True)\n"
            "assert 'quest' not in sys.modules\n")
    env = {**os.environ, "PYTHONPATH": ""}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=300)
    assert result.returncode != 0
    assert "Unknown model (quest_vit.quest)" in result.stderr, result.stderr[-2000:]
