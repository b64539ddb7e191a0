"""Toy study: the training engine against the engine it replaced, in one process (issue: the toy study at scale).

One optimizer step of R runs (default 150, one chunk of the full grid: batch 32, 20 tokens of width 20), per case:

- ``loop`` (with --loop; slow): R ToyTransformer models, each with ``torch.optim.AdamW``, stepped one after the other;
- ``previous engine``: the engine this one replaced (commit 74a4ed4): the R runs' weights stacked, the model's forward
  ``vmap``-ed over them, ``loss.backward()``, a batched AdamW over the parameter tensors, forward and update each
  ``torch.compile``-d;
- ``engine, N runs per call``: quest.toy.batched as ``python -m quest.toy`` runs it, one compiled call (forward,
  ``torch.func.grad`` backward, AdamW) per tile of N runs; with --returned also the step that returns the new weights
  instead of writing them in its graph (what runs on torch before 2.12), with --eager the engine uncompiled
  (``compile=false``).

Rounds are interleaved in one process; it prints medians of wall time and process CPU time per step of all R runs,
and run-steps per second. ``--chunk N`` then trains one whole chunk (N training samples, 50 epochs, key norms after
every epoch, final evaluation) through ``train_chunk`` and reports its run-steps per second end to end and where its
time went (training steps, key-norm probes, evaluation). ``--profile`` runs ``torch.profiler`` over the engine's
steps and splits one step into the compiled graph's matrix products (extern ATen calls), its fused element-wise C++
kernels (the rest of the graph's time) and what runs outside the graph (Python, dispatch, guards).

    python bench/toy.py [--runs 150] [--steps 24] [--rounds 5] [--attention quest] [--threads 2] [--loop]
                        [--per-call 16 150] [--chunk 4096] [--profile] [--device cpu]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call, stack_module_state, vmap

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quest.toy import RunSpec, ToyDataConfig, ToyTransformer, make_toy_data, train_chunk  # noqa: E402
from quest.toy.batched import _Program, _program  # noqa: E402
from quest.toy.compiled import call_tiles  # noqa: E402

GRID_LRS = [5e-4, 1e-3, 2.5e-3, 5e-3, 7.5e-3, 1e-2]
GRID_WDS = [0.0, 0.01, 0.02, 0.05, 0.1]


def grid_specs(runs: int) -> list[RunSpec]:
    """``runs`` runs cycling through the paper's lr x weight decay cells, 5 initialisations each."""
    cells = [(lr, wd) for lr in GRID_LRS for wd in GRID_WDS]
    return [RunSpec(*cells[(i // 5) % len(cells)], i % 5) for i in range(runs)]


# --- the previous engine (quest/toy/batched.py at commit 74a4ed4), kept here as the baseline --------------------
def _previous_adamw_update(params, grads, exp_avgs, exp_avg_sqs, lrs, decays, bc1, bc2_sqrt, b1, b2, eps):
    for p, g, m, v, lr, wd in zip(params, grads, exp_avgs, exp_avg_sqs, lrs, decays):
        p.mul_(1 - lr * wd)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        p.sub_(m / ((v.sqrt() / bc2_sqrt) + eps) * (lr / bc1))


def previous_engine(attention: str, specs: list[RunSpec], kwargs: dict, device: str):
    models = []
    for s in specs:
        torch.manual_seed(s.init_seed)
        models.append(ToyTransformer(attention, **kwargs))
    stacked, _ = stack_module_state(models)
    params = {k: v.detach().clone().to(device).requires_grad_() for k, v in stacked.items()}
    base = ToyTransformer(attention, **kwargs).to("meta")
    logits = vmap(lambda p, x: functional_call(base, p, (x,)), in_dims=(0, None))
    n = len(specs)

    def loss_fn(p, x, y):
        return F.cross_entropy(logits(p, x).flatten(0, 1), y.repeat(n), reduction="sum") / len(y)

    loss_fn = torch.compile(loss_fn)
    update = torch.compile(_previous_adamw_update)
    plist = list(params.values())
    shapes = [(-1,) + (1,) * (p.dim() - 1) for p in plist]
    lr = torch.tensor([s.lr for s in specs], device=device)
    wd = torch.tensor([s.weight_decay for s in specs], device=device)
    lrs, wds = [lr.view(s) for s in shapes], [wd.view(s) for s in shapes]
    m, v = [torch.zeros_like(p) for p in plist], [torch.zeros_like(p) for p in plist]
    state = {"t": 0}

    def step(x, y):
        loss_fn(params, x, y).backward()
        state["t"] += 1
        with torch.no_grad():
            update(plist, [p.grad for p in plist], m, v, lrs, wds, torch.tensor(1 - 0.9 ** state["t"]),
                   torch.tensor(math.sqrt(1 - 0.999 ** state["t"])), 0.9, 0.999, 1e-8)
        for p in plist:
            p.grad = None
    return step


def loop_case(attention: str, specs: list[RunSpec], kwargs: dict, device: str):
    models = [ToyTransformer(attention, **kwargs).to(device) for _ in specs]
    optims = [torch.optim.AdamW(m.parameters(), lr=s.lr, weight_decay=s.weight_decay) for m, s in zip(models, specs)]

    def step(x, y):
        for m, o in zip(models, optims):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    return step


def engine(attention: str, specs: list[RunSpec], kwargs: dict, per_call: int, device: str,
           options: dict | None = None, in_place: bool | None = None, compile: bool = True):
    """The engine's compiled step; ``options``: inductor options instead of quest's (compile_options); ``in_place``:
    whether the graph writes the new weights or returns them, instead of what this torch gets (UPDATES_IN_PLACE)."""
    device_type = torch.device(device).type
    prog = (_program(attention, kwargs, compile, (0.9, 0.999), 1e-8, device_type=device_type)
            if options is None and in_place is None else
            _Program(attention, kwargs, compile, (0.9, 0.999), 1e-8, device_type=device_type, options=options,
                     in_place=in_place))
    models = []
    for s in specs:
        torch.manual_seed(s.init_seed)
        models.append(ToyTransformer(attention, **kwargs))
    params = {k: v.to(device) for k, v in prog.layout.stack(models).items()}
    lr = torch.tensor([s.lr for s in specs], device=device)
    wd = torch.tensor([s.weight_decay for s in specs], device=device)
    tiles = []
    for t in call_tiles(len(specs), per_call):
        p = {k: v[t].clone() for k, v in params.items()}
        tiles.append((p, {k: torch.zeros_like(v) for k, v in p.items()}, {k: torch.zeros_like(v) for k, v in p.items()},
                      lr[t], wd[t]))
    state = {"t": 0}

    def step(x, y):
        state["t"] += 1
        bc1 = torch.tensor(1 - 0.9 ** state["t"], device=device)
        bc2 = torch.tensor(math.sqrt(1 - 0.999 ** state["t"]), device=device)
        for p, m, v, lr_, wd_ in tiles:
            prog.step(p, m, v, lr_, wd_, x, y, bc1, bc2)
    return step


MATMULS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::_weight_int8pack_mm")


def profile_engine(step, batches: list, runs: int) -> None:
    """Where one step's time goes: matmuls inside the compiled graph, the graph's fused kernels, and the rest."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        w0 = time.perf_counter()
        for x, y in batches:
            step(x, y)
        wall = (time.perf_counter() - w0) / len(batches)
    events = prof.key_averages()
    per_step = lambda keep: sum(e.self_cpu_time_total for e in events if keep(e.key)) / len(batches) / 1e6
    mm = per_step(lambda k: k in MATMULS)
    fused = per_step(lambda k: "CompiledFxGraph" in k)
    guards = per_step(lambda k: any(s in k for s in ("Cache Lookup", "Compiled Region", "AOTDispatcher", "Pregraph")))
    rest = max(wall - mm - fused - guards, 0.0)
    share = lambda t: f"{1e3 * t:.2f} ms ({100 * t / wall:.0f}%)"
    print(f"profile of one step of {runs} runs (under the profiler: {1e3 * wall:.2f} ms):")
    print("| part | time per step |\n|---|---|")
    print(f"| matrix products (extern ATen bmm / baddbmm, inside the graph) | {share(mm)} |")
    print(f"| fused element-wise kernels and reductions (the graph's own C++) | {share(fused)} |")
    print(f"| dynamo guards and wrappers | {share(guards)} |")
    print(f"| Python outside the graph (loop, batch slicing, bias corrections) | {share(rest)} |")
    print(events.table(sort_by="self_cpu_time_total", row_limit=12))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=150)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--attention", default="quest")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--per-call", type=int, nargs="+", default=[16])
    ap.add_argument("--loop", action="store_true", help="also time a Python loop over torch.optim.AdamW models")
    ap.add_argument("--no-previous", action="store_true", help="skip the previous engine")
    ap.add_argument("--chunk", type=int, default=0, help="then train one chunk of this many samples end to end")
    ap.add_argument("--profile", action="store_true", help="profile the engine's steps (first --per-call)")
    ap.add_argument("--python-wrapper", action="store_true",
                    help="also time the step compiled with inductor's default Python wrapper (quest: C++ on a CPU)")
    ap.add_argument("--returned", action="store_true",
                    help="also time the step that returns the new weights (where torch is before 2.12) against the one "
                         "that writes them in its graph")
    ap.add_argument("--eager", action="store_true", help="also time the engine uncompiled (compile=false)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ToyDataConfig(train_size=32 * args.steps, test_size=1)
    data = make_toy_data(cfg, 0).train
    kwargs = dict(seq_len=cfg.seq_len, dim=cfg.dim, num_classes=cfg.num_classes)
    specs = grid_specs(args.runs)
    cases = {}
    if args.loop:
        cases["loop (eager, torch.optim.AdamW each)"] = loop_case(args.attention, specs, kwargs, args.device)
    if not args.no_previous:
        cases["previous engine (vmap + torch.compile)"] = previous_engine(args.attention, specs, kwargs, args.device)
    for n in args.per_call:
        cases[f"engine, {min(n, args.runs)} runs per call"] = engine(args.attention, specs, kwargs, n, args.device)
        if args.python_wrapper:
            cases[f"engine, {min(n, args.runs)} runs per call, inductor's Python wrapper"] = engine(
                args.attention, specs, kwargs, n, args.device, options={})
        if args.eager:
            cases[f"engine, {min(n, args.runs)} runs per call, eager"] = engine(
                args.attention, specs, kwargs, n, args.device, compile=False)
        if args.returned:
            cases[f"engine, {min(n, args.runs)} runs per call, weights returned"] = engine(
                args.attention, specs, kwargs, n, args.device, in_place=False)
    batches = [(data.x[i:i + 32].to(args.device), data.y[i:i + 32].to(args.device))
               for i in range(0, 32 * args.steps, 32)]
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for step in cases.values():  # warm-up (and compilation)
        for x, y in batches[:3]:
            step(x, y)
    sync()
    wall: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, step in cases.items():
            w0, c0 = time.perf_counter(), time.process_time()
            for x, y in batches:
                step(x, y)
            sync()
            wall[name].append((time.perf_counter() - w0) / len(batches))
            cpu[name].append((time.process_time() - c0) / len(batches))
    load = os.getloadavg()
    print(f"{args.attention}, {args.runs} runs, batch 32, {torch.get_num_threads()} threads, {args.device}, median of "
          f"{args.rounds} rounds of {args.steps} steps; load average before/after: {load[0]:.2f} (1 min)")
    ref = next(iter(wall))
    print("| case | ms per step of all runs (wall) | CPU ms per step | run-steps / s (wall) | speed-up (wall) |")
    print("|---|---|---|---|---|")
    for name in cases:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(f"| {name} | {1e3 * w:.1f} | {1e3 * c:.1f} | {args.runs / w:,.0f} | "
              f"{statistics.median(wall[ref]) / w:.2f}x |")
    if args.profile:
        name = f"engine, {min(args.per_call[0], args.runs)} runs per call"
        profile_engine(cases[name], batches, args.runs)
    if args.chunk:
        full = make_toy_data(ToyDataConfig(train_size=args.chunk, test_size=1024), 0)
        epochs = 50
        start = time.perf_counter()
        result = train_chunk(args.attention, specs, full.train, full.test, 0, epochs=epochs, batch_size=32,
                             model_kwargs=kwargs, compile=True, device=args.device, runs_per_call=args.per_call[0])
        took = time.perf_counter() - start
        run_steps = args.runs * epochs * math.ceil(args.chunk / 32)
        print(f"one chunk end to end ({args.runs} runs, {args.chunk} samples, {epochs} epochs, "
              f"{args.per_call[0]} runs per call, compilation included): {took:.1f} s, {run_steps / took:,.0f} "
              f"run-steps / s; load average {os.getloadavg()[0]:.2f}")
        parts = ", ".join(f"{k} {v:.1f} s ({100 * v / took:.0f}%)" for k, v in result.seconds.items())
        print(f"  of which {parts}; setup {took - sum(result.seconds.values()):.1f} s")


if __name__ == "__main__":
    main()
