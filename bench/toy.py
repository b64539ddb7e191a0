"""Toy study: training many runs as one batched computation against a Python loop over runs (issue: paper studies).

Per optimizer step of every run (batch 32, the toy task's shapes), for R runs of one formulation:
- loop: R separate ToyTransformer models, each with torch.optim.AdamW, stepped one after the other (eager);
- batched: the R runs stacked and vmapped (quest.toy.batched.train_chunk's step), eager and torch.compile'd.
Rounds are interleaved in one process; prints medians of the time per step of all R runs and per run-step.

    python bench/toy.py [--runs 150] [--steps 24] [--rounds 5] [--attention quest]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call, stack_module_state, vmap

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quest.toy import ToyDataConfig, ToyTransformer, make_toy_data  # noqa: E402
from quest.toy.batched import BatchedAdamW  # noqa: E402


def loop_case(attention: str, runs: int, kwargs: dict):
    models = [ToyTransformer(attention, **kwargs) for _ in range(runs)]
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.05) for m in models]

    def step(x, y):
        for m, o in zip(models, optims):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    return step


def batched_case(attention: str, runs: int, kwargs: dict, compile: bool):
    stacked, _ = stack_module_state([ToyTransformer(attention, **kwargs) for _ in range(runs)])
    params = {k: v.detach().clone().requires_grad_() for k, v in stacked.items()}
    base = ToyTransformer(attention, **kwargs).to("meta")
    logits = vmap(lambda p, x: functional_call(base, p, (x,)), in_dims=(0, None))

    def loss_fn(p, x, y):
        return F.cross_entropy(logits(p, x).flatten(0, 1), y.repeat(runs), reduction="sum") / len(y)

    loss_fn = torch.compile(loss_fn) if compile else loss_fn
    opt = BatchedAdamW(params.values(), torch.full((runs,), 1e-3), torch.full((runs,), 0.05), compile=compile)

    def step(x, y):
        loss_fn(params, x, y).backward()
        opt.step()
    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=150)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--attention", default="quest")
    args = ap.parse_args()
    cfg = ToyDataConfig(train_size=32 * args.steps, test_size=1)
    data = make_toy_data(cfg, 0).train
    kwargs = dict(seq_len=cfg.seq_len, dim=cfg.dim, num_classes=cfg.num_classes)
    cases = {
        "loop (eager, torch.optim.AdamW)": loop_case(args.attention, args.runs, kwargs),
        "batched vmap (eager)": batched_case(args.attention, args.runs, kwargs, compile=False),
        "batched vmap (torch.compile)": batched_case(args.attention, args.runs, kwargs, compile=True),
    }
    batches = [(data.x[i:i + 32], data.y[i:i + 32]) for i in range(0, 32 * args.steps, 32)]
    for step in cases.values():  # warm-up (and compilation)
        for x, y in batches[:3]:
            step(x, y)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, step in cases.items():
            start = time.perf_counter()
            for x, y in batches:
                step(x, y)
            times[name].append((time.perf_counter() - start) / len(batches))
    base = statistics.median(times["loop (eager, torch.optim.AdamW)"])
    print(f"{args.attention}, {args.runs} runs, batch 32, {torch.get_num_threads()} threads, median of {args.rounds}")
    print("| case | ms per step of all runs | us per run-step | speed-up vs loop |\n|---|---|---|---|")
    for name, t in times.items():
        med = statistics.median(t)
        print(f"| {name} | {1e3 * med:.1f} | {1e6 * med / args.runs:.0f} | {base / med:.1f}x |")


if __name__ == "__main__":
    main()
