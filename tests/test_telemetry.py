"""Where a run's time goes (quest.engine.telemetry): the data wait, rates, peak memory, FLOPs and MFU of each log
interval, the advice once per epoch, the run's means in summary.json. References: the analytic FLOP count of a ViT
written out below, a clock the test drives, and a data set made slow on purpose."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import torch
import torchvision.datasets as tvd

import quest.engine.telemetry as telemetry
from quest.attention import list_attentions
from quest.engine import fit
from quest.engine.telemetry import Telemetry, flops_per_image, peak_tflops
from quest.models.factory import create_model

from .helpers import FAST, compose_cfg


def analytic_vit_flops(depth: int, dim: int, img: int = 224, patch: int = 16, classes: int = 1000) -> int:
    """Forward matmul FLOPs (2 per multiply-add) of a ViT with a class token and MLP ratio 4: patch embedding, per
    block the qkv, q k^T, attention @ v, output projection and the two MLP layers, and the head."""
    patches = (img // patch) ** 2
    tokens = patches + 1
    block = (2 * tokens * dim * 3 * dim + 2 * tokens * tokens * dim * 2 + 2 * tokens * dim * dim
             + 2 * tokens * dim * 4 * dim * 2)
    return depth * block + 2 * patches * 3 * patch * patch * dim + 2 * dim * classes


@pytest.mark.parametrize("attention", list_attentions())
@pytest.mark.parametrize("model,depth,dim", [("vit_tiny_patch16_224", 12, 192), ("vit_small_patch16_224", 12, 384),
                                             ("vit_base_patch16_224", 12, 768)])
def test_counted_flops_are_the_analytic_count(model, depth, dim, attention):
    counted = flops_per_image(lambda: create_model(model, attention), 224)
    assert counted == pytest.approx(3 * analytic_vit_flops(depth, dim), rel=0.02)  # training: 3 x the forward


def test_mfu_is_achieved_over_the_devices_dense_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_tflops(torch.device("cuda"), "bf16") == 989.4
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak_tflops(torch.device("cuda"), "bf16") == 756.0  # PCIe, not the SXM entry
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert peak_tflops(torch.device("cuda"), "bf16") is None
    assert peak_tflops(torch.device("cpu"), "fp32") is None
    t = Telemetry(torch.device("cpu"), world_size=4, flops=1e9, peak=100.0)
    row = t.interval(seconds=2.0, data_wait=0.5, images=8000, steps=10)
    assert row["perf/img_per_s"] == 4000 and row["perf/img_per_s_per_device"] == 1000
    assert row["perf/tflops_per_device"] == pytest.approx(1e9 * 1000 / 1e12)
    assert row["perf/mfu"] == pytest.approx(1.0 / 100.0) and row["perf/data_wait"] == 0.25
    assert row["perf/step_s"] == 0.2


def test_the_advice_is_given_once_per_epoch_with_its_levers():
    t = Telemetry(torch.device("cpu"), world_size=1, flops=1e9, peak=100.0, data_wait_warning=0.1)
    t.interval(seconds=1.0, data_wait=0.3, images=10, steps=1)
    (advice,) = t.end_epoch(1, seconds=1.0, data_wait=0.0)
    assert "waited for data 15%" in advice and "data.num_workers" in advice and "data.pipeline=split" in advice
    assert t.end_epoch(2, seconds=1.0, data_wait=0.0)[0].startswith("epoch 2: MFU")  # a new epoch, little wait
    assert Telemetry(torch.device("cpu"), 1).end_epoch(3, seconds=1.0, data_wait=0.01) == []  # no peak: no MFU


def test_advice_is_said_when_its_condition_starts_not_every_epoch_it_lasts():
    t = Telemetry(torch.device("cpu"), world_size=1, data_wait_warning=0.1)
    waits = [0.5, 0.5, 0.5, 0.0, 0.4, 0.4]  # loader-bound for 3 epochs, fine for 1, bound again for 2
    said = [bool(t.end_epoch(epoch, seconds=1.0, data_wait=w)) for epoch, w in enumerate(waits, 1)]
    assert said == [True, False, False, False, True, False]


def test_the_wait_is_the_time_blocked_on_the_loader(tmp_path, monkeypatch):
    """A driven clock: each batch takes 3 ticks to arrive and every other moment 1 tick, so the fraction the loop
    waited is known exactly, whatever the machine's load."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    getitem = tvd.FakeData.__getitem__

    def slow(self, index):
        clock[0] += 3.0 / 16  # 16 images a batch: 3 ticks per batch
        return getitem(self, index)

    monkeypatch.setattr(tvd.FakeData, "__getitem__", slow)
    from quest.engine import trainer

    step = trainer.Run.train_step

    def timed_step(self, *args, **kwargs):
        clock[0] += 1.0  # the step: 1 tick
        return step(self, *args, **kwargs)

    monkeypatch.setattr(trainer.Run, "train_step", timed_step)
    fit(compose_cfg(*FAST, "data.num_workers=0", "trainer.epochs=1", "trainer.log_every_n_steps=2"), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    waits = [r["perf/data_wait"] for r in rows if "perf/data_wait" in r]
    assert waits == [pytest.approx(0.75)] * 2  # 2 steps: 6 ticks waiting of 8
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["perf"]["data_wait_mean"] == pytest.approx(0.75)
    assert summary["perf"]["train_flops_per_image"] > 0


def test_a_slow_data_set_shows_in_the_log_and_the_advice(tmp_path, monkeypatch, caplog):
    getitem = tvd.FakeData.__getitem__

    def slow(self, index):  # a data set that reads slowly: 25 ms an image, 0.4 s a batch against a ~10 ms step
        time.sleep(0.025)
        return getitem(self, index)

    monkeypatch.setattr(tvd.FakeData, "__getitem__", slow)
    with caplog.at_level(logging.WARNING, logger="quest.train"):
        fit(compose_cfg(*FAST, "data.num_workers=0", "trainer.epochs=1", "trainer.log_every_n_steps=2"), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["perf/data_wait"] > 0.5 for r in rows if "perf/data_wait" in r)
    advice = [r.message for r in caplog.records if "waited for data" in r.message]
    assert len(advice) == 1 and "epoch 1:" in advice[0], advice


def test_the_resident_peak_is_read_and_reset():
    before = telemetry.resident_peak_bytes(reset=True)
    assert before is None or before > 0
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    after = telemetry.resident_peak_bytes()
    del block
    if before is not None and Path("/proc/self/clear_refs").exists():
        assert after >= 64 * 2**20


def test_the_report_and_the_figure_show_where_the_time_went(tmp_path, monkeypatch):
    from quest.report.perf_plot import plot_perf
    from quest.report.plot import PlotInputError
    from quest.report.render import perf_markdown
    from quest.report.runs import load_runs
    from quest.report.tables import build_report

    for attention in ("standard", "quest"):
        fit(compose_cfg(*FAST, f"attention={attention}", "trainer.epochs=1", "trainer.log_every_n_steps=2"),
            tmp_path / "sweep" / attention)
    table = perf_markdown(build_report(load_runs([tmp_path / "sweep"])))
    assert "| run | attention | val/top1 | img/s per device | data wait | peak memory | MFU |" in table, table
    summary = json.loads((tmp_path / "sweep" / "quest" / "summary.json").read_text())
    perf = summary["perf"]
    assert (f"| quest | quest | {summary['val/top1']:.2f} | {perf['img_per_s_per_device_mean']:.0f} | "
            f"{perf['data_wait_mean']:.0%} | {perf['peak_mem_gib_max']:.2f} GiB | — |") in table, table
    out = plot_perf([tmp_path / "sweep" / "standard", tmp_path / "sweep" / "quest"], tmp_path / "perf.png")
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text('{"step": 1, "train/loss": 2.0}\n')
    with pytest.raises(PlotInputError, match="has no perf/ rows"):
        plot_perf([tmp_path / "old"], tmp_path / "old.png")
