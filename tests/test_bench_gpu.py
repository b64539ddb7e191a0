"""bench/gpu.py, the prepared GPU check, runs its code paths on the CPU with tiny shapes (--cpu-smoke), so that the
first time a GPU is lent it runs as one command (docs/benchmarks.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from quest.attention import list_attentions

from .helpers import ROOT


@pytest.mark.slow
def test_gpu_check_cpu_smoke_covers_every_formulation_and_both_runs(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--cpu-smoke", "--out", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = report["throughput"]
    assert {(r["attention"], r["dtype"]) for r in rows} == {(a, d) for a in list_attentions()
                                                            for d in ("bfloat16", "float16")}
    assert any(r["compiled"] for r in rows)  # the compiled path ran
    assert all(r["img_per_s"] > 0 and r["flops_per_step"] > 0 and r["sdpa_backend"] != "unknown" for r in rows)
    assert report["digits_default_run"]["returncode"] == 0 and report["torchrun_one_process"]["returncode"] == 0
    assert report["torchrun_one_process"]["summary"]["status"] == "stopped"
    toy = report["toy"]  # one full-grid chunk of the toy study (150 runs) and the quick grid, on the device
    assert toy["chunk_runs"] == 150 and toy["run_steps_per_s"] > 0 and toy["quick_grid"]["returncode"] == 0
    assert "| standard |" in toy["quick_grid"]["table"] and "| quest |" in toy["quick_grid"]["table"]
    inputs = report["input"]  # the device's share of data.pipeline=split and =device
    assert inputs["rand_augment_equals_cpu"] is True
    assert sum(isinstance(v, float) and v > 0 for v in inputs.values()) == 2
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| attention | dtype | compiled | img/s | MFU |" in md and "Toy study, one full-grid chunk" in md
