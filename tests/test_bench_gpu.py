"""bench/gpu.py, the prepared GPU check, runs its code paths on the CPU with tiny shapes (--cpu-smoke), so that the
first time a GPU is lent it runs as one command (docs/benchmarks.md). Here in this process: the apps it runs (train.py,
a one-process torchrun job, quest.toy) as calls through quest's Python API rather than child interpreters, one timed
step per row, and the compiled rows traced by dynamo and AOTAutograd without inductor's code generation (inductor
compiles every formulation in tests/test_models.py and tests/test_elliptical.py)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from bench import gpu
from quest.attention import list_attentions


@pytest.mark.slow
def test_gpu_check_cpu_smoke_covers_every_formulation_and_both_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # as the command ran in tmp_path: nothing it writes lands in the checkout
    threads = torch.get_num_threads()
    code = gpu.main(["--cpu-smoke", "--out", str(tmp_path), "--steps", "1"], in_process=True,
                    compile_backend="aot_eager")
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    runs = (report["digits_default_run"], report["torchrun_one_process"], report["toy"]["quick_grid"])
    assert code == 0, [r["stderr_tail"] for r in runs]
    # the caller's process as it was: its thread count, and no process group left by the torchrun run
    assert torch.get_num_threads() == threads and not dist.is_initialized()
    rows = report["throughput"]
    assert {(r["attention"], r["dtype"]) for r in rows} == {(a, d) for a in list_attentions()
                                                            for d in ("bfloat16", "float16")}
    # the compiled path ran in both dtypes (fp16 adds the GradScaler)
    assert {r["dtype"] for r in rows if r["compiled"]} == {r["dtype"] for r in rows}
    assert all(r["img_per_s"] > 0 and r["flops_per_step"] > 0 and r["sdpa_backend"] != "unknown" for r in rows)
    assert report["digits_default_run"]["returncode"] == 0 and report["torchrun_one_process"]["returncode"] == 0
    assert report["digits_default_run"]["summary"]["status"] == "stopped"  # trainer.max_steps=2 ended it
    assert report["torchrun_one_process"]["summary"]["status"] == "stopped"
    toy = report["toy"]  # one full-grid chunk of the toy study (150 runs) and the quick grid, on the device
    assert toy["chunk_runs"] == 150 and toy["run_steps_per_s"] > 0 and toy["quick_grid"]["returncode"] == 0
    assert "| standard |" in toy["quick_grid"]["table"] and "| quest |" in toy["quick_grid"]["table"]
    inputs = report["input"]  # the device's share of data.pipeline=split and =device
    assert inputs["rand_augment_equals_cpu"] is True
    assert sum(isinstance(v, float) and v > 0 for v in inputs.values()) == 2
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| attention | dtype | compiled | img/s | MFU |" in md and "Toy study, one full-grid chunk" in md
