"""`grid=quick` end to end, cold and warm, under quest's inductor options and inductor's own (issue: the toy study).

Rounds alternate the settings. In each round and setting: a fresh ``TMPDIR`` (inductor's compile cache, precompiled
header and ISA probe results all live under it, so this is a machine inductor has never compiled on), the whole
``python -m quest.toy grid=quick`` command once (cold) and once more (warm: the compiled steps come from the cache).
Prints each run's wall time, the chunks' times and the success rates, then medians and the paired ratio of the
settings. Slow: about 80 s a round and setting on 2 cores.

    python bench/toy_quick.py [--rounds 5] [--settings quest probed] [-- any toy overrides, e.g. grid.lrs=[5e-4]]

Settings: ``quest`` = quest.toy.compiled.compile_options as it is; ``probed`` = its C++ wrapper with inductor's ISA
test builds and precompiled header (quest's options before they were skipped).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTING_ENV = "QUEST_BENCH_TOY_OPTIONS"
SETTINGS = {"quest": None, "probed": {"cpp_wrapper": True}}

# Applied at import, so that the toy study's spawned workers (which import this file as __mp_main__) use the
# setting too.
if os.environ.get(SETTING_ENV) in SETTINGS and SETTINGS[os.environ[SETTING_ENV]] is not None:
    sys.path.insert(0, str(ROOT))
    from quest.toy import batched as _batched

    _options = SETTINGS[os.environ[SETTING_ENV]]
    _batched.compile_options = lambda device_type: dict(_options) if device_type == "cpu" else {}


def run_once(setting: str, tmp: str, out: Path, overrides: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update({SETTING_ENV: setting, "TMPDIR": tmp})
    cmd = [sys.executable, __file__, "--child", "grid=quick", f"out_dir={out}", *overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"{setting}: the toy study failed:\n{proc.stderr[-3000:]}")
    study = json.loads((out / "study.json").read_text())
    with (out / "success_rates.csv").open() as f:
        rates = {r["attention"]: round(100 * float(r["success_rate"]), 1) for r in csv.DictReader(f) if r["lr"] == "all"}
    return {"wall_s": round(wall, 1), "study_s": round(study["wall_seconds_this_call"], 1),
            "chunks_s": {k: round(v, 1) for k, v in study["train_seconds"].items()}, "success_%": rates}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("overrides", nargs="*", help="toy config overrides")
    args = ap.parse_args()
    walls: dict[tuple[str, str], list[float]] = {}
    for r in range(1, args.rounds + 1):
        for setting in args.settings:
            with tempfile.TemporaryDirectory() as tmp:
                for mode in ("cold", "warm"):
                    out = Path(tmp) / f"out-{mode}"
                    res = run_once(setting, tmp, out, args.overrides)
                    walls.setdefault((setting, mode), []).append(res["wall_s"])
                    print(f"round {r} {setting} {mode}: {json.dumps(res)}", flush=True)
    for (setting, mode), w in walls.items():
        print(f"{setting} {mode}: median {statistics.median(w):.1f} s [{min(w):.1f}-{max(w):.1f}] over {len(w)}")
    if len(args.settings) == 2:
        a, b = args.settings
        for mode in ("cold", "warm"):
            ratios = [x / y for x, y in zip(walls[(a, mode)], walls[(b, mode)])]
            print(f"{a} / {b} {mode}: median {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")


if __name__ == "__main__":
    if "--child" in sys.argv:
        sys.argv.remove("--child")
        sys.path.insert(0, str(ROOT))
        from quest.cli import toy

        toy()
    else:
        main()
