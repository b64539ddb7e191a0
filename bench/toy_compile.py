"""Where a cold torch.compile of the toy engine's step goes (issue: the toy study at scale).

One quick-grid chunk (16 runs, 4,096 samples, batch 32) per inductor setting, each in a fresh process on a machine
inductor has never compiled on (a fresh TMPDIR: no compile cache, no precompiled header, no ISA probe results):
the first epoch (compilation + 128 steps) against the median later epoch, the number of C++ libraries inductor
built for the step (ISA probe builds apart), and torch's own compile-phase times. Slow (about a minute per
setting on a CPU core).

    python bench/toy_compile.py [--attention quest] [--epochs 3] [--settings quest cpp_wrapper_probed ...]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name: (inductor options of the step, None = quest's (quest.toy.compiled.compile_options); environment of the child)
SETTINGS = {
    "quest": (None, {}),
    "cpp_wrapper_probed": ({"cpp_wrapper": True}, {}),  # quest's before: the ISA probes and the precompiled header
    "python_wrapper": ({}, {}),  # inductor's defaults
    "threads1": (None, {"TORCHINDUCTOR_COMPILE_THREADS": "1"}),  # no compile worker pool
    "no_simd": ("no_simd", {}),  # quest's with no vector ISA
    "grad_only": ({}, {}),  # forward + backward compiled with inductor's defaults, AdamW eager
}
PHASES = ("compile_file", "GraphLowering.codegen", "fx_codegen_and_compile")


def child(attention: str, epochs: int, setting: str) -> dict:
    import torch
    import torch.nn.functional as F
    from torch._dynamo.utils import compile_times

    from quest.toy import batched
    from quest.toy.data import ToyDataConfig, make_toy_data

    torch.set_num_threads(1)
    cfg = ToyDataConfig(train_size=4096, test_size=512)
    data = make_toy_data(cfg, 0)
    runs = [batched.RunSpec(lr, 0.0, s) for lr in (5e-4, 1e-3) for s in range(8)]  # grid=quick's chunk
    model_kwargs = {"seq_len": cfg.seq_len, "dim": cfg.dim, "num_classes": cfg.num_classes, "mlp_hidden": 20,
                    "embed_init_std": 0.02}
    options, _ = SETTINGS[setting]
    if options == "no_simd":
        options = {**batched.compile_options("cpu"), "cpp.vec_isa_ok": False}
    if options is not None:
        batched.compile_options = lambda device_type: dict(options)
    grad_only = setting == "grad_only"
    if grad_only:  # the eager program, with its loss's gradient compiled
        prog = batched._program(attention, model_kwargs, False, (0.9, 0.999), 1e-8)

        def loss(w, x, y):
            logits = prog.logits(w, x)
            return F.cross_entropy(logits.flatten(0, 1), y.repeat(logits.shape[0]), reduction="sum") / len(y)

        grad = torch.compile(torch.func.grad(loss), dynamic=False)

        def step(p, m, v, lr, wd, x, y, bc1, bc2_sqrt):  # the eager step's AdamW on compiled gradients
            g = grad(p, x, y)
            batched.foreach_adamw_(*([d[n] for n in p] for d in (p, m, v, g)), lr, wd, bc1, bc2_sqrt,
                                   (0.9, 0.999), 1e-8)

        prog.step = step
    marks: list[float] = []
    start = time.perf_counter()
    batched.train_chunk(attention, runs, data.train, data.test, 0, epochs=epochs, batch_size=32,
                        model_kwargs=model_kwargs, compile=not grad_only,
                        on_epoch=lambda e: marks.append(time.perf_counter()))
    later = sorted(b - a for a, b in zip(marks, marks[1:]))
    phases = {}
    for line in compile_times(repr="str", aggregate=True).splitlines():
        name, _, value = line.partition(",")
        if name.strip() in PHASES:
            phases[name.strip()] = round(float(value), 1)
    return {"first_epoch_s": round(marks[0] - start, 1), "later_epoch_s": round(later[len(later) // 2], 3),
            "phases_s": phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attention", default="quest")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.attention, args.epochs, args.child)))
        return
    for name in args.settings:
        with tempfile.TemporaryDirectory() as cache:  # inductor's whole state lives under TMPDIR by default
            env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
            env.update(SETTINGS[name][1], TMPDIR=cache)
            out = subprocess.run([sys.executable, __file__, "--child", name, "--attention", args.attention,
                                  "--epochs", str(args.epochs)], env=env, capture_output=True, text=True,
                                 cwd=Path(__file__).resolve().parents[1])
            if out.returncode:
                sys.exit(f"{name}: the child failed:\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            # an ISA probe's library has a .load_ok marker beside it once loaded
            result["libraries"] = sum(1 for so in Path(cache).rglob("*.so") if not Path(f"{so}.load_ok").exists())
        print(f"{name}: {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main()
