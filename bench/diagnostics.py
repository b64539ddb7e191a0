"""Training throughput with attention diagnostics every 100 steps against diagnostics off (issue: diagnostics).

Two identical runs (same model, data, optimizer) in one process; each round trains 100 optimizer steps on each,
alternating, exactly as the trainer does it (``due(step)`` then ``collect`` on ``num_samples`` images of the batch
before the step). Prints median seconds per 100 steps, the ratio, and the cost of one collect.

    python bench/diagnostics.py [--rounds 5] [--model vit_pico]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hydra import compose, initialize_config_dir  # noqa: E402

from quest.config.hydra_store import register_configs  # noqa: E402
from quest.runtime.distributed import DistContext  # noqa: E402
from quest.train.builders import resolve_img_size  # noqa: E402
from quest.train.trainer import Run  # noqa: E402

STEPS = 100


def make_run(model: str, diagnostics: str, batch: int) -> Run:
    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={model}", "data=fake", f"data.batch_size={batch}",
                                          f"data.fake_train_size={batch * 2}", f"diagnostics={diagnostics}"])
    torch.manual_seed(0)
    return Run(cfg, Path("/tmp/quest-bench-diagnostics"), {}, DistContext())


def hundred_steps(run: Run, images: torch.Tensor, targets: torch.Tensor) -> float:
    t = time.perf_counter()
    for _ in range(STEPS):
        if run.diagnostics is not None and run.diagnostics.due(run.state.step):
            run.diagnostics.collect(images[: run.cfg.diagnostics.num_samples], step=run.state.step)
        run.train_step([(images, targets)])
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default="vit_pico")
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    off, on = make_run(args.model, "disabled", args.batch), make_run(args.model, "default", args.batch)
    assert on.diagnostics is not None and on.diagnostics.every_n_steps == STEPS and off.diagnostics is None
    size = resolve_img_size(off.cfg)
    images, targets = torch.randn(args.batch, 3, size, size), torch.randint(0, 10, (args.batch,))
    hundred_steps(off, images, targets), hundred_steps(on, images, targets)  # warm-up (on: one collect)
    t_off, t_on = [], []
    for _ in range(args.rounds):
        on.state.step = 0  # make every round start on a diagnostic step
        t_off.append(hundred_steps(off, images, targets))
        t_on.append(hundred_steps(on, images, targets))
    collect = statistics.median(
        [(lambda t: (on.diagnostics.collect(images[:8]), time.perf_counter() - t)[1])(time.perf_counter())
         for _ in range(5)])
    m_off, m_on = statistics.median(t_off), statistics.median(t_on)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, model {off.cfg.model.name}, batch {args.batch}")
    print(f"diagnostics off: {m_off:.2f} s / {STEPS} steps; every {STEPS} steps: {m_on:.2f} s / {STEPS} steps; "
          f"ratio {m_on / m_off:.4f}; one collect {collect * 1e3:.1f} ms "
          f"= {collect / (m_off / STEPS) * 100:.1f}% of a step = {collect / m_off * 100:.2f}% per {STEPS} steps")


if __name__ == "__main__":
    main()
