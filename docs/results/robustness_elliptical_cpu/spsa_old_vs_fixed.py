"""SPSA before and after the fix (docs/evaluation.md, "SPSA: fixed directions and start, measured").

Old: quest/evaluation/attacks.py at commit 0e8c2f1 (Rademacher signs shared by the colour channels, no random start),
read with `git show`. Fixed: quest.evaluation.spsa (a sign per element, a uniform start). Both in pixel space with
true labels and the suites' settings, on the same evenly spaced val digits of a train.py checkpoint:

    python train.py hydra.run.dir=/tmp/spsa_model trainer.torch_threads=1
    python docs/results/robustness_elliptical_cpu/spsa_old_vs_fixed.py /tmp/spsa_model/checkpoints/last.pt 120 1,8 \
        > docs/results/robustness_elliptical_cpu/spsa_old_vs_fixed.json
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from quest.data import build_dataset  # noqa: E402
from quest.train.builders import build_model, resolve_img_size  # noqa: E402
from quest.run.checkpoint import load_checkpoint  # noqa: E402
from quest.evaluation import spsa as fixed  # noqa: E402
from quest.evaluation.context import evenly_spaced  # noqa: E402
from quest.evaluation.target import EvalTarget  # noqa: E402
from quest.evaluation.transforms import Normalized, pixel_transform  # noqa: E402


def _old_attacks():
    source = subprocess.run(["git", "show", "0e8c2f1:quest/evaluation/attacks.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_attacks.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_attacks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(checkpoint: str, samples: int, budgets_x255: list[float]) -> dict:
    torch.set_num_threads(1)
    old = _old_attacks()
    ckpt = load_checkpoint(checkpoint)
    cfg = OmegaConf.create(ckpt["config"])
    net = build_model(cfg)
    net.load_state_dict(ckpt["model"])
    model = Normalized(net.eval(), cfg.data.mean, cfg.data.std).eval()
    target = EvalTarget(net, int(cfg.data.num_classes), resolve_img_size(cfg), tuple(cfg.data.mean),
                        tuple(cfg.data.std), float(cfg.recipe.crop_pct), str(cfg.recipe.eval_interpolation), cfg.data)
    dataset = build_dataset(cfg.data, "val", pixel_transform(target))
    chosen = evenly_spaced(len(dataset), samples)
    x = torch.stack([dataset[i][0] for i in chosen])
    y = torch.tensor([dataset[i][1] for i in chosen])
    with torch.no_grad():
        clean = int((model(x).argmax(1) == y).sum())
    out = {"checkpoint": checkpoint, "n": len(chosen), "clean_correct": clean, "runs": {}}
    print(out, file=sys.stderr, flush=True)
    for eps_x255 in budgets_x255:
        eps = eps_x255 / 255
        for name in ("old", "fixed"):
            tic, correct, margins = time.perf_counter(), 0, []
            for start in range(0, len(chosen), 8):
                xb, yb, ib = x[start:start + 8], y[start:start + 8], chosen[start:start + 8]
                if name == "old":
                    adv = old.spsa(model, xb, yb, eps, 0.01, 0.01, 128, 40, 256, 0, ib)
                else:
                    adv = fixed.spsa(model, xb, yb, eps, 0.01, 0.01, 128, 40, 256, 0, ib, clip=(0.0, 1.0))
                with torch.no_grad():
                    logits = model(adv)
                correct += int((logits.argmax(1) == yb).sum())
                margins.append(fixed.margin(logits, yb))
            key = f"{name}@{eps_x255:g}/255"
            out["runs"][key] = {"correct": correct, "top1": 100 * correct / len(chosen),
                                "mean_margin": torch.cat(margins).mean().item(),
                                "seconds": round(time.perf_counter() - tic, 1)}
            print(key, out["runs"][key], file=sys.stderr, flush=True)
    return out


if __name__ == "__main__":
    result = main(sys.argv[1], int(sys.argv[2]), [float(e) for e in sys.argv[3].split(",")])
    print(json.dumps(result, indent=1))
