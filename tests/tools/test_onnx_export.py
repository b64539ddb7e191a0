"""quest-export --onnx and torch.export: every registered formulation exports, and the exported program gives
PyTorch's outputs on a batch size it was not traced with (onnxruntime for ONNX, ExportedProgram.module() for
torch.export). Tolerance 1e-4 on float32 logits (quest.tools.onnx_export.ONNX_TOLERANCE; measured at most 6e-7)."""
from __future__ import annotations

import json

import onnxruntime
import pytest
import torch

import quest.tools.onnx_export as onnx_export
from quest.attention import list_attentions
from quest.models.factory import create_model
from quest.tools.export import main as export_main
from quest.tools.onnx_export import ONNX_TOLERANCE, export_onnx
from tests.tools.test_export_weights import finished_run  # noqa: F401  (the module-scoped finished run)


def _model(attention: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model("vit_tiny_patch16_224", attention, depth=2, img_size=32, patch_size=8, num_classes=5).eval()


@pytest.mark.parametrize("attention", list_attentions())
def test_every_formulation_exports_to_onnx_with_a_dynamic_batch(attention, tmp_path):
    model = _model(attention)
    info = export_onnx(model, 32, tmp_path)
    assert info["max_abs_diff_vs_pytorch"] <= ONNX_TOLERANCE and info["dynamic_axes"] == ["batch"]
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    images = torch.randn(5, 3, 32, 32)  # neither the traced batch (2) nor the export's own check (3)
    (logits,) = session.run(None, {"images": images.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(logits), model(images), atol=ONNX_TOLERANCE, rtol=0)


@pytest.mark.parametrize("attention", list_attentions())
def test_every_formulation_goes_through_torch_export(attention):
    model, images = _model(attention), torch.randn(2, 3, 32, 32)
    program = torch.export.export(model, (images,), dynamic_shapes={"x": {0: torch.export.Dim("batch")}})
    other = torch.randn(5, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(other), model(other), atol=1e-5, rtol=0)


def test_quest_export_writes_the_onnx_file_beside_the_weights(finished_run, tmp_path, capsys):  # noqa: F811
    assert export_main([str(finished_run), "--out", str(tmp_path / "out"), "--onnx"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quest"]["onnx"]["file"] == "model.onnx" and (tmp_path / "out" / "model.onnx").is_file()
    assert "- ONNX: `model.onnx`" in (tmp_path / "out" / "README.md").read_text()
    # the export is a long silent call: the command says what it does first (and, past 10 s, that it still runs)
    assert capsys.readouterr().err.startswith("quest-export: exporting model.onnx (torch.export, then checked ")


def test_a_missing_onnx_package_is_named_before_any_work(finished_run, tmp_path, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setattr(onnx_export, "ONNX_NEEDS", [*onnx_export.ONNX_NEEDS, ("no_such_onnx_xyz", "onnx", "--onnx")])
    assert export_main([str(finished_run), "--out", str(tmp_path / "out"), "--onnx"]) == 2
    err = capsys.readouterr().err
    assert "'no_such_onnx_xyz'" in err and "pip install 'quest[onnx]'" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_an_export_that_does_not_match_pytorch_is_not_written(tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_export, "ONNX_TOLERANCE", -1.0)  # no difference passes: the refusal path
    with pytest.raises(ValueError, match="differ from PyTorch's by .* model.onnx not written"):
        export_onnx(_model("quest"), 32, tmp_path)
    assert list(tmp_path.iterdir()) == []
