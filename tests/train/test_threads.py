"""Intra-op threads of CPU runs: one for the CPU presets (measured in docs/benchmarks.md), torch's default for other
models, the user's choice (trainer.torch_threads, OMP_NUM_THREADS) always first."""
from __future__ import annotations

import torch

from quest.train import fit
from quest.train.compute import busy_hint, default_cpu_threads, free_cores

from ..helpers import FAST, compose_cfg


def test_presets_take_one_thread_unless_the_environment_says_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [default_cpu_threads(n) for n in ("vit_pico_patch4_16", "vit_nano_patch4_32", "vit_micro_patch4_32")] == [1] * 3
    assert default_cpu_threads("vit_base_patch16_224") is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert default_cpu_threads("vit_pico_patch4_16") is None


def test_free_cores_and_the_busy_machine_hint():
    assert free_cores(2, 6.8) == 1 and free_cores(16, 0.2) == 16 and free_cores(16, 3.6) == 12 and free_cores(4, 1.5) == 2
    assert busy_hint(2, cores=2, load=0.3) is None
    hint = busy_hint(2, cores=2, load=6.8)
    assert "only 1 core(s) are free" in hint and "trainer.torch_threads=1" in hint


def test_a_cpu_run_of_a_preset_trains_with_one_thread(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        fit(compose_cfg(*FAST, "trainer.max_steps=1", "trainer.device=cpu"), tmp_path / "a")
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        fit(compose_cfg(*FAST, "trainer.max_steps=1", "trainer.device=cpu", "trainer.torch_threads=2"), tmp_path / "b")
        assert torch.get_num_threads() == 2  # the user's setting stands
    finally:
        torch.set_num_threads(saved)


def _ran(run) -> list[int | None]:
    import json

    return [h.get("ran", {}).get("torch_threads") for h in json.loads((run / "run.json").read_text())["history"]]


def test_the_same_command_gives_the_same_numbers_whatever_threads_the_process_had(monkeypatch, tmp_path):
    """The default run's threads come from its config, not from the process or the machine's load at its start: two
    processes left at 1 and 2 threads train the preset alike, bit for bit, and run.json says what ran."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    held = torch.get_num_threads()
    try:
        summaries = []
        for threads in (1, 2):
            torch.set_num_threads(threads)  # what another job beside it, or another machine, would leave
            summaries.append(fit(compose_cfg(*FAST, "trainer.max_steps=3", "trainer.device=cpu"), tmp_path / f"t{threads}"))
            assert _ran(tmp_path / f"t{threads}") == [1]
        assert summaries[0]["val/top1"] == summaries[1]["val/top1"] and summaries[0]["val/loss"] == summaries[1]["val/loss"]
    finally:
        torch.set_num_threads(held)


def test_a_resume_computes_with_the_threads_its_run_started_with(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    held = torch.get_num_threads()
    try:
        fit(compose_cfg(*FAST, "trainer.max_steps=2", "trainer.device=cpu", "trainer.torch_threads=2"), tmp_path)
        torch.set_num_threads(1)
        fit(compose_cfg(*FAST, "trainer.max_steps=3", "trainer.device=cpu", "trainer.torch_threads=null"), tmp_path)
        assert _ran(tmp_path) == [2, 2] and torch.get_num_threads() == 2  # the start's 2, not the preset's 1
    finally:
        torch.set_num_threads(held)
