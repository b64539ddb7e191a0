"""Intra-op threads for CPU training on a busy machine (issue: newcomer pass, item 1).

Trains the default preset (vit_pico_patch4_16, QUEST, 16 px digits-sized batches of 64, AdamW) for a few seconds in a
fresh process per measurement, under each threading option:

- ``1 thread``: ``torch.set_num_threads(1)``;
- ``free cores``: ``torch.set_num_threads(max(1, cores - round(1-min load average)))``;
- ``default``: torch's default (one thread per core), OpenMP's default (active, spinning) wait policy;
- ``default, passive``: the same with ``OMP_WAIT_POLICY=PASSIVE`` (threads sleep instead of spinning).

each with the machine as found and with a competing load added (one busy-looping process per core). Options and
conditions are interleaved round by round (every round runs every pair once, in a shuffled order), and medians over
rounds are printed, so a load that changes over the minutes hits every option alike. Figures: docs/benchmarks.md.

    python bench/cpu_threads.py [--rounds 5] [--seconds 4]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = {  # name: (threads: int | "free" | None for torch's default, extra environment)
    "1 thread": (1, {}),
    "free cores": ("free", {}),
    "default": (None, {}),
    "default, passive": (None, {"OMP_WAIT_POLICY": "PASSIVE"}),
}


def worker(threads: str, seconds: float) -> None:
    """One measurement: images per second of training steps for ``seconds`` (after 3 warm-up steps)."""
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.nn.functional as F

    from quest.models import create_model

    if threads == "free":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - round(os.getloadavg()[0])))
    elif threads != "None":
        torch.set_num_threads(int(threads))
    torch.manual_seed(0)
    model = create_model("vit_pico_patch4_16", "quest", num_classes=10, img_size=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 3, 16, 16), torch.randint(0, 10, (64,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or steps < 3:
        step()
        steps += 1
    elapsed = time.perf_counter() - start
    print(json.dumps({"img_per_s": steps * 64 / elapsed, "threads": torch.get_num_threads()}))


def _spin() -> None:
    while True:
        pass


def measure(option: str, seconds: float) -> dict:
    threads, extra = OPTIONS[option]
    env = {**os.environ, **extra}
    env.pop("OMP_NUM_THREADS", None)  # the options decide, not the caller's environment
    if "OMP_WAIT_POLICY" not in extra:
        env.pop("OMP_WAIT_POLICY", None)
    out = subprocess.run([sys.executable, __file__, "--worker", str(threads), "--seconds", str(seconds)],
                         env=env, capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--worker")
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.seconds)
        return
    cores = os.cpu_count() or 1
    print(f"{cores} cores; 1-min load average at start {os.getloadavg()[0]:.1f}", flush=True)
    results: dict[tuple[str, str], list[float]] = {}
    threads_used: dict[tuple[str, str], int] = {}
    rng = random.Random(0)
    for r in range(args.rounds):
        pairs = [(o, c) for o in OPTIONS for c in ("as found", f"+{cores} busy processes")]
        rng.shuffle(pairs)
        for option, condition in pairs:
            spinners = [mp.Process(target=_spin, daemon=True) for _ in range(cores if condition != "as found" else 0)]
            for p in spinners:
                p.start()
            try:
                got = measure(option, args.seconds)
            finally:
                for p in spinners:
                    p.terminate()
                    p.join()
            results.setdefault((option, condition), []).append(got["img_per_s"])
            threads_used[option, condition] = got["threads"]
        print(f"round {r + 1}/{args.rounds} done; load average {os.getloadavg()[0]:.1f}", flush=True)
    print("\n| option | condition | threads | median img/s | min | max |\n|---|---|---|---|---|---|")
    for (option, condition), values in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"| {option} | {condition} | {threads_used[option, condition]} | {statistics.median(values):.0f} | "
              f"{min(values):.0f} | {max(values):.0f} |")


if __name__ == "__main__":
    main()
