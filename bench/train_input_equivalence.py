"""Does the training input pipeline change what a model learns? (data.pipeline; docs/data.md, docs/benchmarks.md)

Trains the same model with each pipeline over several seeds, with the DeiT augmentation (RandAugment
rand-m9-mstd0.5-inc1 and random erasing 0.25 on top of the light recipe's crops), on two data sets:

  digits       the built-in 8 x 8 digits (in memory, PIL images): timm vs split
  imagefolder  the same digits written as an ImageFolder of 32 x 32 JPEGs (quality 95; files decoded by each
               pipeline's own decoder): timm vs split vs device

and prints, per data set and pipeline, the final val top-1 of every seed, their mean and standard deviation, and
Welch's t-test p against timm's (scipy). Each run is `python train.py ...` in a temporary folder; called as
main(..., in_process=True) (the test, tests/bench/test_bench_data.py), the same overrides composed and trained by
quest.train.fit in this process instead.

    python bench/train_input_equivalence.py [--seeds 5] [--epochs 25] [--max-steps N] [--per-class N] [--quick]
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


def digits_folder(root: Path, size: int = 32, per_class: int | None = None) -> Path:
    """The digits' fixed train / val split as an ImageFolder of JPEGs, upscaled (bicubic) to ``size`` px; with
    ``per_class``, the first that many images of each class in each split."""
    from PIL import Image

    sys.path.insert(0, str(ROOT))
    from quest.data.sets.digits import DigitsDataset

    for split in ("train", "val"):
        ds, written = DigitsDataset(split), [0] * 10
        for i, (img, target) in enumerate(ds):
            if per_class is not None and written[target] >= per_class:
                continue
            written[target] += 1
            folder = root / split / f"{target:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            img.resize((size, size), Image.Resampling.BICUBIC).save(folder / f"{i:05d}.JPEG", quality=95)
    return root


def train(args: list[str], workdir: Path, in_process: bool = False) -> float:
    """``python train.py *args`` in ``workdir`` (``in_process``: the same config through quest.train.fit, here);
    the run's final val top-1."""
    run_dir = workdir / "run"
    if in_process:
        return _train_in_process(args, run_dir)
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}"], cwd=workdir,
                          env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"train.py {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return float(summary["val/top1"])


def _train_in_process(args: list[str], run_dir: Path) -> float:
    if str(ROOT) not in sys.path:  # the checkout's quest, as train.py imports it
        sys.path.insert(0, str(ROOT))
    import torch
    from hydra import compose, initialize_config_dir

    from quest.cli import config_root
    from quest.config.hydra_store import register_configs
    from quest.train import exit_code, fit

    register_configs()
    with initialize_config_dir(config_dir=str(config_root()), version_base="1.3"):
        cfg = compose("train", overrides=args)
    threads = torch.get_num_threads()
    try:
        summary = fit(cfg, run_dir)
    finally:  # fit sets one thread on a CPU; the caller's process goes on with its own
        torch.set_num_threads(threads)
    if exit_code(summary):
        raise SystemExit(f"train.py {' '.join(args)} ended {summary['status']}")
    return float(summary["val/top1"])


def main(argv: list[str] | None = None, *, in_process: bool = False) -> None:
    """The command (``argv``: default sys.argv[1:]); ``in_process``: every run as a call in this process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--max-steps", type=int, default=None,
                        help="trainer.max_steps of every run: a smoke run's cap (the schedule still spans --epochs)")
    parser.add_argument("--per-class", type=int, default=None,
                        help="the ImageFolder's images per class and split (a smoke run's; default: every digit; "
                        "at least 7, so that a training batch of 64 fills)")
    parser.add_argument("--quick", action="store_true", help="2 seeds, 2 epochs: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.epochs = 2, 2
    from scipy.stats import ttest_ind

    steps = [] if args.max_steps is None else [f"trainer.max_steps={args.max_steps}"]

    with tempfile.TemporaryDirectory() as tmp:
        folder = digits_folder(Path(tmp) / "folder", per_class=args.per_class)
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
                         f"trainer.seed={seed}", f"data.pipeline={pipeline}", *DEIT_AUGMENT, *steps], work,
                        in_process))
            for pipeline, top1 in results.items():
                p = ("" if pipeline == "timm" or len(top1) < 2 else
                     f"{ttest_ind(top1, results['timm'], equal_var=False).pvalue:.2f}")
                spread = statistics.stdev(top1) if len(top1) > 1 else float("nan")
                print(f"| {name} | {pipeline} | {', '.join(f'{v:.2f}' for v in top1)} | {statistics.mean(top1):.2f} | "
                      f"{spread:.2f} | {p} |", flush=True)


if __name__ == "__main__":
    main()
