"""Overhead of quest's training step against a minimal hand-written loop (issue: training).

Both run the same model, batch, optimizer (timm AdamW with the same parameter groups) and loss, in one process,
interleaved round by round; the framework step adds what it always does (finiteness check of the loss agreed
across ranks, grad-norm computation and check, per-step schedule). EMA and mixup are off on both sides so the two
do the same arithmetic. Prints median step times and the ratio.

    python bench/train_loop.py [--rounds 7] [--steps 10]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hydra import compose, initialize_config_dir  # noqa: E402

from quest.config.hydra_store import register_configs  # noqa: E402
from quest.runtime.distributed import DistContext  # noqa: E402
from quest.train.trainer import Run  # noqa: E402

CASES = {
    # name: (overrides, batch)
    "vit_tiny_patch16_224, batch 8": (["model=vit_tiny", "data.img_size=224"], 8),
    "vit_pico_patch4_16 (digits default), batch 64": (["model=vit_pico", "data.img_size=16"], 64),
}


def framework_run(overrides: list[str], batch: int, tmp: Path) -> Run:
    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=["data=fake", f"data.batch_size={batch}", f"data.fake_train_size={batch * 4}",
                                          "recipe=light", "recipe.ema=false", "recipe.smoothing=0", *overrides])
    return Run(cfg, tmp, {}, DistContext())


def time_steps(step, steps: int) -> float:
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t) / steps


def count_reads(step, steps: int) -> float:
    """Device-to-host reads (Tensor.item / tolist / bool / float / int) made from quest's own modules per step:
    what stalls a GPU's queue (torch's own, e.g. inside the optimizer on CPU step counters, are not counted)."""
    names = ("item", "tolist", "__bool__", "__float__", "__int__")
    originals = {n: getattr(torch.Tensor, n) for n in names}
    count = [0]

    def wrap(original):
        def wrapper(self, *a, **k):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("quest."):
                count[0] += 1
            return original(self, *a, **k)
        return wrapper

    try:
        for n in names:
            setattr(torch.Tensor, n, wrap(originals[n]))
        for _ in range(steps):
            step()
    finally:
        for n, original in originals.items():
            setattr(torch.Tensor, n, original)
    return count[0] / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, (overrides, batch) in CASES.items():
        run = framework_run(overrides, batch, Path("/tmp/quest-bench-train-loop"))
        images = torch.randn(batch, 3, run.cfg.data.img_size, run.cfg.data.img_size)
        targets = torch.randint(0, run.cfg.data.num_classes, (batch,))

        # the hand-written loop trains an identical copy with an identical optimizer
        model = copy.deepcopy(run.model)
        opt = type(run.parts.optimizer)(
            [{**{k: v for k, v in g.items() if k != "params"}, "params": [dict(model.named_parameters())[n]
             for n, p0 in run.model.named_parameters() for q in g["params"] if q is p0]}
             for g in run.parts.optimizer.param_groups])
        model.train()

        def minimal() -> None:
            loss = F.cross_entropy(model(images), targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        def framework() -> None:
            run.train_step([(images, targets)])

        for fn in (minimal, framework):  # warm-up
            time_steps(fn, 2)
        t_min, t_fw = [], []
        for _ in range(args.rounds):
            t_min.append(time_steps(minimal, args.steps))
            t_fw.append(time_steps(framework, args.steps))
        m, f = statistics.median(t_min), statistics.median(t_fw)
        ratios = sorted(b / a for a, b in zip(t_min, t_fw))
        reads = count_reads(framework, steps=4)
        print(f"{name}: minimal {m * 1e3:.1f} ms/step, framework {f * 1e3:.1f} ms/step, "
              f"ratio of medians {f / m:.3f} (per-round ratios {ratios[0]:.3f}..{ratios[-1]:.3f}); "
              f"device-to-host reads from quest's code per step: {reads}")


if __name__ == "__main__":
    main()
