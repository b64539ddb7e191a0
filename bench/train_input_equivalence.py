"""Does the training input pipeline change what a model learns? (data.pipeline; docs/data.md, docs/benchmarks.md)

Trains the same model with each pipeline over several seeds, with the DeiT augmentation (RandAugment
rand-m9-mstd0.5-inc1 and random erasing 0.25 on top of the light recipe's crops), on two data sets:

  digits       the built-in 8 x 8 digits (in memory, PIL images): timm vs split
  imagefolder  the same digits written as an ImageFolder of 32 x 32 JPEGs (quality 95; files decoded by each
               pipeline's own decoder): timm vs split vs device

and prints, per data set and pipeline, the final val top-1 of every seed, their mean and standard deviation, and
Welch's t-test p against timm's (scipy). Each run is `python train.py ...` in a temporary folder.

    python bench/train_input_equivalence.py [--seeds 5] [--epochs 25] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEIT_AUGMENT = ["recipe.auto_augment=rand-m9-mstd0.5-inc1", "recipe.reprob=0.25"]


def digits_folder(root: Path, size: int = 32) -> Path:
    """The digits' fixed train / val split as an ImageFolder of JPEGs, upscaled (bicubic) to ``size`` px."""
    from PIL import Image

    sys.path.insert(0, str(ROOT))
    from quest.data.digits import DigitsDataset

    for split in ("train", "val"):
        ds = DigitsDataset(split)
        for i, (img, target) in enumerate(ds):
            folder = root / split / f"{target:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            img.resize((size, size), Image.Resampling.BICUBIC).save(folder / f"{i:05d}.JPEG", quality=95)
    return root


def train(args: list[str], workdir: Path) -> float:
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    run_dir = workdir / "run"
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}"], cwd=workdir,
                          env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"train.py {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return float(summary["val/top1"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--quick", action="store_true", help="2 seeds, 2 epochs: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.epochs = 2, 2
    from scipy.stats import ttest_ind

    with tempfile.TemporaryDirectory() as tmp:
        folder = digits_folder(Path(tmp) / "folder")
        setups = {
            "digits": (["data=digits"], ["timm", "split"]),
            "imagefolder": (["data=imagefolder", f"data.root={folder}", "data.num_classes=10", "data.img_size=16",
                             "data.batch_size=64", "data.num_workers=0", "recipe.hflip=0.0"],
                            ["timm", "split", "device"]),
        }
        print(f"{args.seeds} seeds, {args.epochs} epochs, model=vit_pico recipe=light + {' '.join(DEIT_AUGMENT)}; "
              f"load average {os.getloadavg()[0]:.2f}")
        print("| data | pipeline | val top-1 per seed | mean | std | Welch p vs timm |\n|---|---|---|---|---|---|")
        for name, (data_args, pipelines) in setups.items():
            results: dict[str, list[float]] = {}
            for seed in range(args.seeds):  # pipelines interleaved per seed: load drifts hit all alike
                for pipeline in pipelines:
                    work = Path(tmp) / f"{name}-{pipeline}-{seed}"
                    work.mkdir()
                    results.setdefault(pipeline, []).append(train(
                        [*data_args, "model=vit_pico", "recipe=light", f"recipe.epochs={args.epochs}",
                         f"trainer.seed={seed}", f"data.pipeline={pipeline}",
                         *DEIT_AUGMENT], work))
            for pipeline, top1 in results.items():
                p = ("" if pipeline == "timm" or len(top1) < 2 else
                     f"{ttest_ind(top1, results['timm'], equal_var=False).pvalue:.2f}")
                spread = statistics.stdev(top1) if len(top1) > 1 else float("nan")
                print(f"| {name} | {pipeline} | {', '.join(f'{v:.2f}' for v in top1)} | {statistics.mean(top1):.2f} | "
                      f"{spread:.2f} | {p} |", flush=True)


if __name__ == "__main__":
    main()
