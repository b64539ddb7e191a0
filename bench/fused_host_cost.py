"""Host cost of one fused operator call, forward and backward, on the CPU: what quest.attention.fused adds per call
in Python and the dispatcher, besides its kernel (docs/benchmarks.md, "Host cost of a fused operator").

    python bench/fused_host_cost.py                                   # the current operators
    git show <commit>:quest/attention/fused.py > /tmp/fused_before.py
    python bench/fused_host_cost.py --before /tmp/fused_before.py     # interleaved with an earlier fused.py

Each call: the predicate (:func:`fused_applies` / ``layer_norm_applies``) and the operator's forward and backward on
a tiny (1, 2, 8, 16) view, so that the computation (the PyTorch reference standing in for the kernel: no Triton,
``TRITON_INTERPRET=0``) is small next to the overhead. The current operators run under ``attention.fused=auto``
with the verdict cached, as on a GPU after the first call. Printed: the median microseconds per call over
``--rounds`` rounds of ``--calls`` calls, the two versions alternating round by round.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from quest.attention import fused  # noqa: E402


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.nn.LayerNorm]:
    qkv = torch.randn(1, 8, 3, 2, 16)
    x = qkv.permute(2, 0, 3, 1, 4)[1].detach().requires_grad_(True)
    scale = torch.full((2, 1, 1), 2.0, requires_grad=True)
    return x, scale, torch.nn.LayerNorm(16)


def _calls(module: Any) -> dict[str, Callable[[], None]]:
    x, scale, norm = _inputs()
    g = torch.randn(1, 2, 8, 16)

    def l2() -> None:
        assert module.fused_applies(x)
        module.l2_normalize_fused(x, 1e-6, scale).backward(g)

    def layer_norm() -> None:
        assert module.layer_norm_applies(x, norm)
        module.layer_norm_fused(x, norm).backward(g)

    return {"l2_normalize": l2, "layer_norm": layer_norm}


def _per_call_us(fn: Callable[[], None], calls: int) -> float:
    tic = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - tic) / calls * 1e6


def _load(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("fused_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="an earlier quest/attention/fused.py to time beside the current one")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    versions: dict[str, tuple[Any, Any]] = {}
    with fused.fused_path("auto"):
        versions["current"] = (fused, _calls(fused))
        if args.before:
            before = _load(args.before)
            versions["before"] = (before, _calls(before))
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for version, (module, calls) in versions.items():
                context = module.fused_path(True) if version == "before" else fused.fused_path("auto")
                with context:
                    for op, fn in calls.items():
                        fn()  # the first call of a round: its check (current) or nothing, outside the timing
                        times.setdefault((version, op), []).append(_per_call_us(fn, args.calls))
    for (version, op), values in sorted(times.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{op:14s} {version:8s} median {statistics.median(values):7.1f} us per call "
              f"(min {min(values):.1f}, max {max(values):.1f}, {args.rounds} rounds of {args.calls})")


if __name__ == "__main__":
    main()
