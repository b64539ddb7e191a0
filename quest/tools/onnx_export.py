"""``quest-export ... --onnx``: the exported model as ``model.onnx`` too, with a dynamic batch axis, checked against
PyTorch with onnxruntime before it is kept.

torch's dynamo exporter (``torch.onnx.export(..., dynamo=True)``) goes through torch.export, so every formulation
exports, the elliptical ones included, and quest's l2 normalisation is recorded as the operators of its forward.
The packages are the ``onnx`` extra; a missing one is named before any work.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from quest.runtime.extras import Need, require_all
from quest.store.files import atomic_write

__all__ = ["ONNX_FILE", "ONNX_NEEDS", "ONNX_TOLERANCE", "require_onnx", "export_onnx", "checked_onnx"]

ONNX_FILE = "model.onnx"
#: what the exporter and the check import (onnxscript translates torch.export's graph; onnxruntime runs the check)
ONNX_NEEDS: list[Need] = [("onnx", "onnx", "--onnx"), ("onnxscript", "onnx", "--onnx"),
                          ("onnxruntime", "onnx", "--onnx")]
#: the largest |onnxruntime - PyTorch| accepted on the check's float32 outputs (logits). Measured on every
#: formulation (ViT-Ti blocks, batch 5, CPU): at most 6.1e-7; 1e-4 leaves room for other CPUs' kernels while any
#: wrong operator (a missing normalisation changes logits by > 1e-2) still fails.
ONNX_TOLERANCE = 1e-4


def require_onnx() -> None:
    """MissingExtra naming ``pip install 'quest[onnx]'`` when a package of the extra is missing (cheap: no import)."""
    require_all(ONNX_NEEDS, "quest-export --onnx")


def export_onnx(model: torch.nn.Module, img_size: int, out: Path, opset: int | None = None) -> dict[str, Any]:
    """Write ``out/model.onnx`` (batch axis dynamic) for ``model`` at ``img_size``; returns what config.json records
    about it. Written (atomically, quest.store.files) only once onnxruntime's outputs on a batch of another size than the
    traced one equal PyTorch's within :data:`ONNX_TOLERANCE`; ValueError otherwise, and nothing is written."""
    serialized, info = checked_onnx(model, img_size, opset)
    atomic_write(out / ONNX_FILE, lambda f: f.write(serialized))
    return info


def checked_onnx(model: torch.nn.Module, img_size: int, opset: int | None = None) -> tuple[bytes, dict[str, Any]]:
    """:func:`export_onnx`'s model.onnx as bytes, checked, and what config.json records about it; nothing written
    (quest-export writes it once the folder's earlier export is kept aside)."""
    import onnxruntime

    model = model.eval()
    traced = torch.randn(2, 3, img_size, img_size, generator=torch.Generator().manual_seed(0))
    checked = torch.randn(3, 3, img_size, img_size, generator=torch.Generator().manual_seed(1))
    program = torch.onnx.export(model, (traced,), dynamo=True, opset_version=opset, verbose=False,
                                input_names=["images"], output_names=["logits"],
                                dynamic_shapes={"x": {0: torch.export.Dim("batch")}})
    proto = program.model_proto
    serialized = proto.SerializeToString()
    session = onnxruntime.InferenceSession(serialized, providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"images": checked.numpy()})
    with torch.no_grad():
        reference = model(checked)
    diff = float((torch.from_numpy(logits) - reference).abs().max())
    if not diff <= ONNX_TOLERANCE:
        raise ValueError(f"the ONNX export's logits differ from PyTorch's by {diff:.3g} (more than {ONNX_TOLERANCE}) "
                         f"on a batch of {len(checked)}: {ONNX_FILE} not written")
    opset_used = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    return serialized, {"file": ONNX_FILE, "opset": opset_used, "input": "images (N, 3, H, W)", "dynamic_axes": ["batch"],
            "max_abs_diff_vs_pytorch": diff, "tolerance": ONNX_TOLERANCE, "onnxruntime": onnxruntime.__version__}
