"""Where a run's time goes (quest.train.telemetry): the data wait, rates, peak memory, FLOPs and MFU of each log
interval, the advice once per epoch, the run's means in summary.json; steps that compile and the loader's start timed
apart; advice that names no setting already on. References: the analytic FLOP count of a ViT written out below, a
clock the test drives, torch's own compile callbacks, and a data set made slow on purpose."""
from __future__ import annotations

import functools
import json
import logging
import re
import time
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

import quest.train.telemetry as telemetry
from quest.attention import list_attentions
from quest.data.sets.fake import FakeImages
from quest.models.factory import create_model
from quest.train import fit
from quest.train.compute import resolve_precision
from quest.train.telemetry import Levers, Telemetry, compilations, flops_per_image, peak_tflops

from ..helpers import FAST, compose_cfg


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


def test_a_runs_flop_count_is_its_own_models_whatever_the_process_counted_before(monkeypatch):
    """The count a run reports is kept per model spec for the process's later runs: each variant below, in an order
    that repeats them, gets exactly the count a fresh build of its own model gives, and each spec is counted once."""
    from types import SimpleNamespace

    from quest.train import lifecycle
    from quest.train.builders import build_model, resolve_img_size

    variants = [(), ("attention=standard",), ("model.img_size=32",), ("+model.kwargs.depth=2",),
                ("data.num_classes=7",), ("attention=qknorm", "model.img_size=32")]
    calls = []

    def counted(build, size):
        calls.append(size)
        return flops_per_image(build, size)

    monkeypatch.setattr(lifecycle, "_FLOPS", {})
    monkeypatch.setattr(lifecycle, "flops_per_image", counted)
    run = SimpleNamespace(ctx=SimpleNamespace(device=torch.device("cpu"), world_size=1), precision="fp32")
    fresh = {}
    for variant in [*variants, *reversed(variants)]:
        cfg = compose_cfg(*FAST, *variant)
        fresh.setdefault(variant, flops_per_image(lambda: build_model(cfg), resolve_img_size(cfg)))
        assert lifecycle._telemetry(cfg, run).flops == fresh[variant], variant
    assert len(calls) == len(variants) and len(set(fresh.values())) == 4  # standard, QUEST, QKNorm: the same count


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
    waited is known exactly, whatever the machine's load. The epoch's first batch is the loader's start, apart."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    getitem = FakeImages.__getitem__

    def slow(self, index):
        clock[0] += 3.0 / 16  # 16 images a batch: 3 ticks per batch
        return getitem(self, index)

    monkeypatch.setattr(FakeImages, "__getitem__", slow)
    from quest.train import trainer

    step = trainer.Run.train_step

    def timed_step(self, *args, **kwargs):
        clock[0] += 1.0  # the step: 1 tick
        return step(self, *args, **kwargs)

    monkeypatch.setattr(trainer.Run, "train_step", timed_step)
    fit(compose_cfg(*FAST, "data.num_workers=0", "trainer.epochs=1", "trainer.log_every_n_steps=2"), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    perf = [r for r in rows if "perf/data_wait" in r]
    # 2 steps each: the first interval's first batch (3 ticks) is the loader's start, then 3 of 5 ticks; 6 of 8
    assert [r["perf/data_wait"] for r in perf] == [pytest.approx(0.6), pytest.approx(0.75)]
    assert [r["perf/loader_start_s"] for r in perf] == [pytest.approx(3.0), 0.0]
    assert all(r["perf/compile_s"] == 0.0 and r["perf/compile_steps"] == 0 for r in perf)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["perf"]["data_wait_mean"] == pytest.approx(9 / 13)  # time-weighted: (3 + 6) / (5 + 8)
    assert summary["perf"]["loader_start_s"] == pytest.approx(3.0) and summary["perf"]["compile_steps"] == 0
    assert summary["perf"]["train_flops_per_image"] > 0


def test_steps_that_compile_and_the_loaders_start_are_timed_apart(tmp_path, monkeypatch, caplog):
    """A driven clock, and steps 1 and 3 compiling as torch.compile does (torch._dynamo's compile callbacks around
    10 ticks): the first batch takes 5 ticks (the loader starting), the others none, each step 1 tick. With them
    in, the first interval would show MFU 6% and a 28% data wait and both pieces of advice; apart, every steady
    interval is 1 tick a step at MFU 50%, and no advice is due."""
    from torch._dynamo.callback import CallbackTrigger

    from quest.train import lifecycle, trainer

    clock, fetched = [0.0], [0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(lifecycle, "_FLOPS", {})  # not a count an earlier test's run kept
    monkeypatch.setattr(lifecycle, "flops_per_image", lambda build, size: 1e12)
    monkeypatch.setattr(lifecycle, "peak_tflops", lambda device, precision: 32.0)  # 16 img/s: 16 of 32 TFLOP/s
    getitem = FakeImages.__getitem__

    def first_batch_slow(self, index):
        fetched[0] += 1
        clock[0] += 5.0 / 16 if fetched[0] <= 16 else 0.0
        return getitem(self, index)

    monkeypatch.setattr(FakeImages, "__getitem__", first_batch_slow)
    step, steps = trainer.Run.train_step, [0]

    def step_compiling_at_1_and_3(self, *args, **kwargs):
        steps[0] += 1
        clock[0] += 1.0
        if steps[0] in (1, 3):  # the first compilation, then a recompilation
            with torch._dynamo.callback_handler.install_callbacks(CallbackTrigger.DYNAMO, f"0/{steps[0]}"):
                clock[0] += 10.0
        return step(self, *args, **kwargs)

    monkeypatch.setattr(trainer.Run, "train_step", step_compiling_at_1_and_3)
    with caplog.at_level(logging.WARNING, logger="quest.train"):
        fit(compose_cfg(*FAST, "data.num_workers=0", "trainer.epochs=1", "trainer.log_every_n_steps=2"), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    perf = [r for r in rows if "perf/step_s" in r]
    assert [(r["perf/compile_s"], r["perf/compile_steps"]) for r in perf] == [(11.0, 1), (11.0, 1)]
    assert perf[0]["perf/loader_start_s"] == 5.0
    assert all(r["perf/step_s"] == 1.0 and r["perf/data_wait"] == 0.0 and r["perf/img_per_s"] == 16.0
               and r["perf/mfu"] == pytest.approx(0.5) for r in perf), perf
    summary = json.loads((tmp_path / "summary.json").read_text())["perf"]
    assert (summary["compile_s"], summary["compile_steps"], summary["loader_start_s"]) == (22.0, 2, 5.0)
    assert summary["mfu_mean"] == pytest.approx(0.5) and summary["step_s_mean"] == 1.0
    assert not [r.message for r in caplog.records if r.message.startswith("epoch 1:")]


def test_a_compilation_is_counted_on_the_host():
    """torch's own compiler (Dynamo, its eager backend: no code generation) against :func:`compilations`: a new
    function compiles once, the same shapes again do not, a new shape recompiles; after torch._dynamo.reset() (which
    drops every compile callback) the count goes on."""
    def double(x):
        return x * 2

    compiled = torch.compile(double, backend="eager", dynamic=False)
    before = compilations()
    compiled(torch.ones(2))
    assert compilations() == before + 1
    compiled(torch.ones(2))
    assert compilations() == before + 1
    compiled(torch.ones(3))
    assert compilations() == before + 2
    torch._dynamo.reset()
    counted = compilations()
    torch.compile(double, backend="eager")(torch.ones(2))
    assert compilations() == counted + 1


#: a setting the advice names, as on a command line: ``trainer.compile=true``, ``data=imagenet_wds``
NAMED_SETTING = re.compile(r"\b((?:[a-z_]+\.)*[a-z_]+)=([\w.-]+)")


@functools.cache
def _composed(overrides: tuple[tuple[str, str], ...]) -> DictConfig:
    return compose_cfg(*(f"{key}={value}" for key, value in overrides))


def _advice(overrides: dict[str, str], device: str = "cuda") -> list[str]:
    """Both pieces of advice (a loader-bound epoch, then an under-used GPU) for a run of these overrides on
    ``device``."""
    cfg = _composed(tuple(overrides.items()))
    precision = resolve_precision(cfg.trainer.precision, cfg.recipe.get("precision"), torch.device(device))
    levers = Levers.of(cfg, torch.device(device), precision)
    loader_bound = Telemetry(torch.device("cpu"), 1, levers=levers)
    under_used = Telemetry(torch.device("cpu"), 1, flops=1e9, peak=1e6, levers=levers)  # MFU ~0
    under_used.interval(seconds=1.0, data_wait=0.0, images=10, steps=1)
    return loader_bound.end_epoch(1, seconds=1.0, data_wait=0.5) + under_used.end_epoch(1, seconds=1.0, data_wait=0.0)


def _is_on(overrides: dict[str, str], key: str, value: str, device: str = "cuda") -> bool:
    """Whether the run of ``overrides`` already has ``key=value`` (the config group's choice for ``data``, the
    resolved precision for trainer.precision: auto on CUDA is bf16)."""
    cfg = _composed(tuple(overrides.items()))
    if key == "data":
        return cfg.data.name == value
    if key == "trainer.precision":
        return resolve_precision(cfg.trainer.precision, cfg.recipe.get("precision"), torch.device(device)) == value
    return str(OmegaConf.select(cfg, key)).lower() == value.lower()


#: a run with every lever still free: image files, decoded in the workers, fp32, eager, on a GPU
ALL_OFF = {"data": "imagefolder", "data.num_workers": "0", "data.pipeline": "timm", "trainer.precision": "fp32",
           "trainer.compile": "false"}


def test_advice_never_names_a_setting_that_is_on():
    """The class: every setting the advice names for a run with every lever free, turned on, is named no more;
    and in each of those runs nothing the advice names is already on."""
    named = {match.groups() for text in _advice(ALL_OFF) for match in NAMED_SETTING.finditer(text)}
    assert named >= {("trainer.compile", "true"), ("trainer.precision", "bf16"), ("data.pipeline", "split"),
                     ("data.pipeline", "device"), ("data", "imagenet_wds")}, named
    for key, value in sorted(named):
        run = {**ALL_OFF, key: value}
        assert _is_on(run, key, value)
        for text in _advice(run):
            for other in NAMED_SETTING.finditer(text):
                assert not _is_on(run, *other.groups()), f"with {key}={value}: {text}"
    auto = {**ALL_OFF, "trainer.precision": "auto"}  # bf16 on CUDA (the light recipe names no precision)
    assert not any("trainer.precision=bf16" in text for text in _advice(auto))
    cpu = _advice(ALL_OFF, device="cpu")  # the GPU pipelines do not help a run on the CPU
    assert cpu and not any("data.pipeline" in text for text in cpu)
    # DeiT-III's 3-Augment has no uint8 pipeline (quest.train.checks would refuse data.pipeline=split with it)
    assert not any("data.pipeline" in text for text in _advice({**ALL_OFF, "recipe": "deit3"}))
    assert "data.pipeline=split" in _advice({**ALL_OFF, "recipe": "deit"})[0]  # RandAugment: it has


def test_advice_names_more_workers_only_while_there_are_cpus_for_them(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert "(data.num_workers, now 2)" in _advice({**ALL_OFF, "data.num_workers": "2"})[0]
    # on the CPU the compute's thread and the main process come first: 4 CPUs leave room for 2 workers, 2 for none,
    # and a CPU run with no lever left is not warned about its data's share of the same cores
    cpu_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        digits = {**ALL_OFF, "data": "digits"}  # in memory: no shard copy to suggest
        assert "(data.num_workers, now 1)" in _advice({**digits, "data.num_workers": "1"}, device="cpu")[0]
        assert not any("waited for data" in a for a in _advice({**digits, "data.num_workers": "2"}, device="cpu"))
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})  # the default run's 2-core machine
        assert not any("waited for data" in a for a in _advice({**digits, "data.num_workers": "0"}, device="cpu"))
    finally:
        torch.set_num_threads(cpu_threads)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert "data.num_workers" not in _advice({**ALL_OFF, "data.num_workers": "4"})[0]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun, two ranks on this node: 2 CPUs each
    assert "data.num_workers" not in _advice({**ALL_OFF, "data.num_workers": "2"})[0]
    everything = {**ALL_OFF, "data": "imagenet_wds", "data.num_workers": "4", "data.pipeline": "device"}
    (text, _) = _advice(everything)
    assert "try" not in text and "at their fastest" in text, text


def test_a_slow_data_set_shows_in_the_log_and_the_advice(tmp_path, monkeypatch, caplog):
    """A driven clock: a data set that takes 3 ticks a batch against a step's 1. The advice comes once, at the end of
    the epoch, and names what this run (FakeData in memory, on the CPU, no loader workers) can still change: more
    workers, neither a GPU pipeline nor shards."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    getitem = FakeImages.__getitem__

    def slow(self, index):
        clock[0] += 3.0 / 16
        return getitem(self, index)

    monkeypatch.setattr(FakeImages, "__getitem__", slow)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})  # cores left over for a worker
    from quest.train import trainer

    step = trainer.Run.train_step

    def timed_step(self, *args, **kwargs):
        clock[0] += 1.0
        return step(self, *args, **kwargs)

    monkeypatch.setattr(trainer.Run, "train_step", timed_step)
    with caplog.at_level(logging.WARNING, logger="quest.train"):
        fit(compose_cfg(*FAST, "data.num_workers=0", "trainer.epochs=1", "trainer.log_every_n_steps=2"), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["perf/data_wait"] > 0.5 for r in rows if "perf/data_wait" in r)
    (advice,) = [r.message for r in caplog.records if "waited for data" in r.message]
    assert advice.startswith("epoch 1: training waited for data 69% of the time"), advice  # 9 of 13 ticks
    assert advice.endswith("try more loader workers (data.num_workers, now 0)"), advice


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
