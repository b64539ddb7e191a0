"""The telemetry's own cost (docs/training.md, "Where the time goes"): a ViT-Ti training step over a loader with and
without what quest adds to measure it, interleaved in one process.

What the telemetry adds to the training path: a host clock read around each loader ``next()`` (Run._timed); per step
what StepLog.record does (a clock read, torch's compile counter, the step's time into ``IntervalTimes``); and per
log interval (20 steps) one ``Telemetry.interval`` call (a /proc read and write on the CPU, the allocator's peak on
CUDA). Both variants run the same model, data and optimizer; rounds alternate which goes first.

Usage: ``python bench/telemetry.py [--rounds 7] [--steps 20] [--batch 8] [--cpu-smoke]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quest.models.factory import create_model  # noqa: E402
from quest.train.telemetry import IntervalTimes, Telemetry, compilations  # noqa: E402


def timed(loader, wait: list[float]):
    """Run._timed's measurement, on a plain iterable."""
    tic = time.perf_counter()
    for batch in loader:
        wait[0] += time.perf_counter() - tic
        yield batch
        tic = time.perf_counter()


def run_steps(model, optimizer, batches, telemetry: Telemetry | None, log_every: int) -> float:
    start = time.perf_counter()
    wait, interval, last, compiles = [0.0], IntervalTimes(), time.perf_counter(), compilations()
    for images, targets in (timed(batches, wait) if telemetry else batches):
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), targets).backward()
        optimizer.step()
        if telemetry:  # StepLog.record's work for every step, then the interval's at its end
            now, count = time.perf_counter(), compilations()
            interval.add_step(now - last, wait[0], len(targets), count != compiles, loader_start=False)
            wait[0], last, compiles = 0.0, now, count
            if interval.steps + interval.apart.compile_steps == log_every:
                telemetry.interval(interval.seconds, interval.data_wait, interval.images, interval.steps,
                                   interval.apart)
                interval, last = IntervalTimes(), time.perf_counter()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20, help="steps per round and variant (one log interval)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cpu-smoke", action="store_true", help="a few tiny steps: checks the script runs")
    args = parser.parse_args()
    name, size = ("vit_pico_patch4_16", 16) if args.cpu_smoke else ("vit_tiny_patch16_224", 224)
    if args.cpu_smoke:
        args.rounds, args.steps, args.batch = 2, 2, 2
    torch.manual_seed(0)
    model = create_model(name, "quest", num_classes=10).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [(torch.randn(args.batch, 3, size, size), torch.randint(0, 10, (args.batch,)))
               for _ in range(args.steps)]
    telemetry = Telemetry(torch.device("cpu"), 1, flops=1e9)
    run_steps(model, optimizer, batches, telemetry, args.steps)  # warm-up
    times: dict[str, list[float]] = {"without": [], "with telemetry": []}
    for r in range(args.rounds):
        order = ["without", "with telemetry"][:: 1 if r % 2 == 0 else -1]
        for variant in order:
            times[variant].append(run_steps(model, optimizer, batches, telemetry if variant != "without" else None,
                                            args.steps) / args.steps)
    ratios = [w / b for w, b in zip(times["with telemetry"], times["without"])]
    print(f"# telemetry cost: {name}, batch {args.batch}, {args.steps} steps a round, {args.rounds} rounds, "
          f"{torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.2f}\n")
    print("| variant | median step ms | min ms |\n|---|---|---|")
    for variant, ts in times.items():
        print(f"| {variant} | {1e3 * statistics.median(ts):.1f} | {1e3 * min(ts):.1f} |")
    print(f"\nwith / without, paired per round: median {statistics.median(ratios):.4f} (min {min(ratios):.4f}, "
          f"max {max(ratios):.4f})")


if __name__ == "__main__":
    main()
