"""Which test tier catches a deliberate breakage: each entry below breaks one thing in quest's source, runs the fast
tier (-m "not e2e") and, if that passes, the end-to-end tier's tests of that part, each stopping at the first
failure; then puts the source back. Prints a markdown table (docs/testing.md, "What each tier catches").

    python .ci/breakages.py [--only NAME ...]

Not a test: it edits the checkout (restored in a finally, and checked with git diff at the end).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (file, text, broken text, end-to-end tests to run if the fast tier misses it)
BREAKAGES = {
    "training: gradients never zeroed": (
        "quest/train/trainer.py", "p.optimizer.zero_grad(set_to_none=True)", "pass", ["tests/run/test_runs.py"]),
    "resume: scheduler state not restored": (
        "quest/run/checkpoint.py", 'parts["scheduler"].load_state_dict(saved.scheduler)', "pass",
        ["tests/run/test_runs.py"]),
    "resume: optimizer state not restored": (
        "quest/run/checkpoint.py", 'parts["optimizer"].load_state_dict(saved.optimizer)', "pass",
        ["tests/run/test_runs.py"]),
    "resume: random state not restored": (
        "quest/run/checkpoint.py", "set_rng_state(rngs[self.ctx.rank] if len(rngs) == self.ctx.world_size else rngs[0])",
        "pass", ["tests/run/test_runs.py"]),
    "eval: top-k takes the smallest logits": (
        "quest/evaluation/context.py", "logits.float().topk(k, dim=1)", "logits.float().topk(k, dim=1, largest=False)",
        ["tests/evaluation/test_eval_cli.py"]),
    "data: the same order every epoch": (
        "quest/data/sampling.py", "manual_seed(self.seed + self.epoch)", "manual_seed(self.seed)",
        ["tests/run/test_runs.py"]),
    "DDP: every rank reads rank 0's samples": (
        "quest/data/sampling.py", "DistributedSampler(dataset, num_replicas=world_size, rank=rank,",
        "DistributedSampler(dataset, num_replicas=world_size, rank=0,",
        ["tests/train/test_distributed.py"]),
    "Slurm preemption: the job is not requeued": (
        "quest/run/signals.py", 'subprocess.run(["scontrol", "requeue", job_id], check=False)', "pass",
        ["tests/run/test_slurm.py"]),
    "interop: export names the wrong architecture": (
        "quest/tools/export.py", '"architecture": exported_architecture(stored.attention.name)',
        '"architecture": exported_architecture("standard")', ["tests/models/test_interop_docs.py"]),
    "attention: QNorm leaves q unnormalised": (
        "quest/attention/formulations.py", 'return l2_normalize(q, self.options["eps"]), k, 1.0', "return q, k, 1.0",
        ["tests/run/test_runs.py"]),
    "diagnostics: max logit over the wrong axes": (
        "quest/diagnostics/stats.py", "candidates.amax(dim=(0, 2, 3))", "candidates.amax(dim=(0, 1, 2))",
        ["tests/run/test_runs.py"]),
    "run directory: a finished run is trained again": (
        "quest/train/lifecycle.py", "already holds this finished run", "holds this finished run (ignored)",
        ["tests/run/test_runs.py"]),
}


def _pytest(*args: str) -> tuple[bool, str, float]:
    """(passed, first failing test id, seconds) of one pytest run stopping at the first failure."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-n", "auto",
                          "--durations=0", "-o", "addopts=--dist loadgroup", *args], cwd=ROOT, capture_output=True,
                         text=True)
    failed = [line.split()[1] for line in out.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return out.returncode == 0, (failed[0] if failed else ""), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    print("| breakage | caught by | first failing test | s |\n|---|---|---|---:|")
    for name, (file, text, broken, e2e) in BREAKAGES.items():
        if args.only and not any(o in name for o in args.only):
            continue
        path = ROOT / file
        source = path.read_text()
        if source.count(text) < 1:
            raise SystemExit(f"{name}: {text!r} is not in {file}: update .ci/breakages.py")
        try:
            path.write_text(source.replace(text, broken, 1))
            ok, first, seconds = _pytest("-m", "not e2e")
            tier = "fast tier"
            if ok:
                more_ok, first, more = _pytest(*e2e)
                seconds += more
                tier = "nothing" if more_ok else "e2e tier"
        finally:
            path.write_text(source)
        print(f"| {name} | {tier} | `{first}` | {seconds:.0f} |", flush=True)
    diff = subprocess.run(["git", "diff", "--stat", "--", "quest"], cwd=ROOT, capture_output=True, text=True).stdout
    if diff:
        raise SystemExit(f"the source was not restored:\n{diff}")


if __name__ == "__main__":
    main()
