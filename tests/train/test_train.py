"""End-to-end training on CPU: outputs, exact resume, divergence, bad input."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from PIL import Image

from quest.data import CorruptImageError
from quest.run.checkpoint import load_checkpoint
from quest.train import EXIT_DIVERGED, fit, summary_line

from ..helpers import FAST, compose_cfg
from ..warm import run_app


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_epoch_run_writes_metrics_summary_and_checkpoints(tmp_path):
    summary = fit(compose_cfg(*FAST), tmp_path)
    assert summary["status"] == "completed" and summary["epoch"] == 2 and summary["step"] == 8
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["status"] == "completed"
    for key in ("val/top1", "val/top5", "val/loss", "val_ema/top1", "best/val/top1", "num_params", "wall_time_s",
                "train_img_per_s", "seed", "lr", "global_batch"):
        assert saved[key] is not None, key
    assert saved["choices"] == {"model": "vit_pico_patch4_16", "attention": "quest", "recipe": "light", "data": "fake"}
    rows = _rows(tmp_path)
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert all({"train/lr", "train/grad_norm", "train/img_per_s"} <= r.keys() for r in steps)
    assert sum("val/top1" in r for r in rows) == 2
    last = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert last["state"]["epoch"] == 2 and last["ema"] is not None and last["meta"]["attention"] == "quest"
    assert (tmp_path / "checkpoints" / "best.pt").is_file()
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))  # atomic writes leave no temporaries


def _final_weights(run_dir: Path) -> dict:
    return load_checkpoint(run_dir / "checkpoints" / "last.pt")


@pytest.mark.parametrize("stop_at", [3, 4])  # mid-epoch, and exactly at the epoch boundary
def test_interrupted_and_resumed_run_ends_with_the_same_weights(tmp_path, stop_at):
    # real augmentation randomness (crops, mixup, drop path) included: every RNG is checkpointed
    overrides = [*FAST, "recipe.mixup=0.8", "recipe.cutmix=1.0", "recipe.drop_path=0.1", "trainer.epochs=3"]
    fit(compose_cfg(*overrides), tmp_path / "straight")
    first = fit(compose_cfg(*overrides, f"trainer.max_steps={stop_at}"), tmp_path / "resumed")
    assert first["status"] == "stopped" and first["step"] == stop_at
    second = fit(compose_cfg(*overrides), tmp_path / "resumed")
    assert second["resumed"] and second["status"] == "completed"
    a, b = _final_weights(tmp_path / "straight"), _final_weights(tmp_path / "resumed")
    for part in ("model", "ema"):
        for key, value in a[part].items():
            torch.testing.assert_close(b[part][key], value, atol=0, rtol=0, msg=f"{part}.{key}")
    assert a["state"]["step"] == b["state"]["step"] == 12


def test_finished_run_is_not_trained_again(tmp_path):
    fit(compose_cfg(*FAST), tmp_path)
    again = fit(compose_cfg(*FAST), tmp_path)
    assert again["status"] == "completed" and again["step"] == 8 and again["resumed"]


def test_divergence_is_reported_and_keeps_the_last_good_checkpoint(tmp_path):
    summary = fit(compose_cfg(*FAST, "recipe.lr=1e6", "recipe.warmup_epochs=0", "trainer.epochs=4",
                              "trainer.checkpoint_every_n_steps=1", "attention=standard"), tmp_path)
    assert summary["status"] == "diverged" and summary["diverged_at_step"] is not None
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["status"] == "diverged"
    good = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert good["state"]["step"] == summary["diverged_at_step"] - 1 == summary["step"]
    assert all(torch.isfinite(v).all() for v in good["model"].values())


def test_loss_bound_counts_as_divergence(tmp_path):
    summary = fit(compose_cfg(*FAST, "trainer.max_loss=0.01"), tmp_path)
    assert summary["status"] == "diverged" and summary["diverged_at_step"] == 1


def test_resume_from_another_attention_names_both(tmp_path):
    stopped = fit(compose_cfg(*FAST, "trainer.max_steps=1"), tmp_path)
    # stopped inside its first epoch: validated, but no epoch ended, so there is no best epoch (not epoch -1)
    assert stopped["best/val/top1"] is None and stopped["best_epoch"] is None
    assert "no best yet" in summary_line(stopped) and "epoch -1" not in summary_line(stopped)
    with pytest.raises(ValueError, match=r"attention='quest'.*attention='standard'"):
        fit(compose_cfg(*FAST, "attention=standard"), tmp_path)


@pytest.mark.parametrize("bad, match", [("data.batch_size=0", "batch_size must be a positive integer"),
                                        ("trainer.precision=fp8", "precision")])
def test_bad_values_fail_clearly(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        fit(compose_cfg(*FAST, bad), tmp_path)


def test_missing_data_root_names_path_and_layout(tmp_path):
    missing = tmp_path / "imagenet"
    with pytest.raises(FileNotFoundError, match=rf"{missing}/train.*<class>/<image>"):
        fit(compose_cfg("data=imagenet", f"data.root={missing}", "model=vit_pico"), tmp_path / "run")


def _image_folder(root: Path, corrupt: bool) -> Path:
    for split in ("train", "val"):
        for c in range(3):
            d = root / split / f"n0000000{c}"
            d.mkdir(parents=True)
            for i in range(8):
                Image.new("RGB", (20, 20), (40 * c, 10 * i, 90)).save(d / f"img{i}.JPEG")
    bad = root / "train" / "n00000001" / "broken.JPEG"
    if corrupt:
        bad.write_bytes(b"not a jpeg at all")
    return bad


def test_corrupt_image_is_named_or_skipped_and_counted(tmp_path):
    bad = _image_folder(tmp_path / "data", corrupt=True)
    base = ["data=imagefolder", f"data.root={tmp_path / 'data'}", "data.num_classes=3", "data.img_size=16",
            "data.batch_size=5", "data.num_workers=1", "model=vit_pico", "trainer.epochs=1", "trainer.log_every_n_steps=1"]
    with pytest.raises(CorruptImageError, match=str(bad)):
        fit(compose_cfg(*base), tmp_path / "strict")  # named by the pre-flight, before the first step
    base.append("data.preflight=false")  # the skip at load time
    # 1 of 25 training images: over the default data.max_skipped_fraction (0.01), under 0.1
    summary = fit(compose_cfg(*base, "data.bad_images=skip", "data.max_skipped_fraction=0.1"), tmp_path / "lenient")
    assert summary["status"] == "completed"
    skipped = [r["data/train_skipped"] for r in _rows(tmp_path / "lenient") if "data/train_skipped" in r]
    assert skipped and max(skipped) == summary["skipped_images"]["train"] <= 1


def test_class_balanced_subset(tmp_path):
    import numpy as np

    from quest.data import build_dataset, class_balanced_subset, dataset_targets

    cfg = compose_cfg()
    ds = build_dataset(cfg.data, "train", None)
    sub = class_balanced_subset(ds, 0.25, seed=1)
    full, part = np.bincount(dataset_targets(ds)), np.bincount(dataset_targets(sub))
    np.testing.assert_array_equal(part, np.round(full * 0.25))
    assert sub.indices == class_balanced_subset(ds, 0.25, seed=1).indices != class_balanced_subset(ds, 0.25, seed=2).indices


def _train_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python train.py *args``, forked from the warm zygote (tests/warm.py): the exit code and output are the point
    here, not the interpreter's start."""
    return run_app("train.py", *args, cwd=cwd, env={**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"})


def test_cli_divergence_exit_code_and_multirun_goes_on(tmp_path):
    fast = [a for a in FAST if not a.startswith("trainer.log")]
    single = _train_cli(*fast, "recipe.lr=1e6", "recipe.warmup_epochs=0", "attention=standard",
                        f"hydra.run.dir={tmp_path / 'single'}", cwd=tmp_path)
    assert single.returncode == EXIT_DIVERGED, single.stderr[-2000:]
    multi = _train_cli("-m", *fast, "recipe.lr=1e6,1e-3", "recipe.warmup_epochs=0", "attention=standard",
                       cwd=tmp_path)
    assert multi.returncode == 0, multi.stderr[-2000:]
    summaries = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*/*/summary.json")]
    assert sorted((s["lr"], s["status"]) for s in summaries) == [(1e-3, "completed"), (1e6, "diverged")]


def test_cli_multirun_four_jobs_in_separate_directories(tmp_path):
    fast = [a for a in FAST if not a.startswith("trainer.")] + ["trainer.epochs=1"]
    out = _train_cli("-m", *fast, "attention=standard,quest", "trainer.seed=0,1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    summaries = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*/*/summary.json")]
    assert sorted((s["attention"], s["seed"]) for s in summaries) == [
        ("quest", 0), ("quest", 1), ("standard", 0), ("standard", 1)]


def _wandb_records(path: Path) -> list:
    """The protobuf records of an offline ``.wandb`` file, parsed with wandb's own ``Record`` message. The file is
    a LevelDB-style log (wandb's writer): a 7-byte header, then 32 KiB blocks of chunks, each with a 7-byte header
    (crc32c, little-endian length, type: 1 full, 2 first, 3 middle, 4 last); wandb 0.31 ships no Python reader."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the rest of a block too short for a chunk header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0 and length == 0:
            break  # zero fill at the end of the last block
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_wandb_offline_run_named_from_the_choices(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    summary = fit(compose_cfg(*FAST, "logger=wandb", "trainer.epochs=1"), tmp_path,
                  {"model": "vit_pico", "attention": "quest", "recipe": "light", "data": "fake"})
    assert summary["status"] == "completed"
    wandb.teardown()  # the run was finished by fit; this waits until wandb's service has written and exited
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    records = _wandb_records(next(runs[0].glob("*.wandb")))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"][:1]
    assert (run.run_group, run.display_name) == ("fake-vit_pico-light", "quest-seed0")  # from the choices
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["model"]["name"] == "vit_pico_patch4_16" and config["trainer"]["epochs"] == 1  # resolved config
    logged = {item.key or "/".join(item.nested_key) for r in records if r.WhichOneof("record_type") == "history"
              for item in r.history.item}
    assert {"train/loss", "val/top1"} <= logged


def test_diagnostics_are_logged_under_stable_keys(tmp_path):
    fit(compose_cfg(*FAST, "diagnostics=default", "diagnostics.every_n_steps=3"), tmp_path)
    rows = _rows(tmp_path)
    diag_steps = [r["step"] for r in rows if "diag/layer00/max_logit" in r]
    assert diag_steps == [0, 3, 6]
    for key in ("diag/max_logit", "diag/layer03/max_logit", "diag/layer03/q_norm_at_max", "diag/layer03/k_norm_at_max",
                "diag/layer03/entropy_mean", "diag/layer03/entropy_min", "diag/layer03/low_entropy_head_frac"):
        assert any(key in r for r in rows), key
    assert sum("diag_val/layer00/max_logit" in r for r in rows) == 2  # once per validation
    assert not any("diag/layer04/max_logit" in r for r in rows)  # the pico model has 4 layers


def test_disabled_diagnostics_add_nothing(tmp_path):
    fit(compose_cfg(*FAST), tmp_path)
    assert not any(k.startswith("diag") for r in _rows(tmp_path) for k in r)


def test_init_from_another_resolution_resizes_pos_embed(tmp_path):
    from quest.runtime.distributed import DistContext
    from quest.train.trainer import Run

    fit(compose_cfg(*FAST, "trainer.epochs=1"), tmp_path / "low")
    source = load_checkpoint(tmp_path / "low" / "checkpoints" / "last.pt")
    cfg = compose_cfg(*FAST, "model.img_size=32", "data.img_size=32",
                      f"trainer.init_from={tmp_path / 'low' / 'checkpoints' / 'last.pt'}")
    run = Run(cfg, tmp_path / "high", {}, DistContext())
    run.init_weights(cfg.trainer.init_from)
    weights = run.model.state_dict()
    assert weights["pos_embed"].shape[1] == 8 * 8 + 1 != source["ema"]["pos_embed"].shape[1]
    torch.testing.assert_close(weights["blocks.0.attn.qkv.weight"], source["ema"]["blocks.0.attn.qkv.weight"])
    assert fit(cfg, tmp_path / "high")["status"] == "completed"


def test_init_from_a_run_of_another_attention_says_so(tmp_path, caplog):
    """Standard, QNorm and QUEST attention have the same parameters, so weights of one load into another: a warning
    names both, where nothing else would show that the run started from another formulation's weights."""
    from quest.runtime.distributed import DistContext
    from quest.train.trainer import Run

    fit(compose_cfg(*FAST, "attention=standard", "trainer.max_steps=1"), tmp_path / "standard")
    last = tmp_path / "standard" / "checkpoints" / "last.pt"
    for attention, warned in (("quest", True), ("standard", False)):
        caplog.clear()
        cfg = compose_cfg(*FAST, f"attention={attention}", f"trainer.init_from={last}")
        Run(cfg, tmp_path / attention, {}, DistContext()).init_weights(cfg.trainer.init_from)
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "init_from" in r.getMessage()]
        assert said == ([f"trainer.init_from={last}: its weights were trained with standard attention; this run "
                         "trains them on with quest attention"] if warned else []), said


def test_a_training_step_reads_the_device_once_and_reduces_once(tmp_path, monkeypatch):
    """At most one device-to-host read and one collective per optimizer step from quest's own code, whatever the
    gradient accumulation (the reads of torch's own optimizer and samplers are not quest's to remove)."""
    import sys

    import torch.distributed as dist

    from quest.train.trainer import Run

    reads: list[int] = []
    counting = {"on": False}

    def counted(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            if counting["on"] and sys._getframe(1).f_globals.get("__name__", "").startswith("quest."):
                reads[-1] += 1
            return original(self, *args, **kwargs)
        return wrapper

    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    reduces: list[int] = []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: reduces.__setitem__(-1, reduces[-1] + 1))
    step = Run.train_step

    def observed(self, batches, **kw):
        reads.append(0)
        reduces.append(0)
        counting["on"] = True
        try:
            return step(self, batches, **kw)
        finally:
            counting["on"] = False

    monkeypatch.setattr(Run, "train_step", observed)
    fit(compose_cfg(*FAST, "trainer.accum_steps=2", "trainer.epochs=2"), tmp_path)
    assert len(reads) == 4 and reads == [1] * 4  # one read per step, two micro-batches each
    assert reduces == [0] * 4  # one process: no collective at all


@pytest.mark.parametrize("clip", [None, 0.05])
def test_a_training_step_clips_as_torch_does_and_reports_the_norm_before_clipping(tmp_path, clip):
    """recipe.clip_grad: the step equals a hand-written step on an identical copy (plain backward, torch's
    clip_grad_norm_, the same optimizer); without clipping, the gradients are left as they are."""
    import copy

    from quest.runtime.distributed import DistContext
    from quest.train.trainer import Run

    run = Run(compose_cfg(*FAST, "recipe.ema=false", f"recipe.clip_grad={clip or 'null'}"),
              tmp_path, {}, DistContext())
    model = copy.deepcopy(run.model).train()
    by_name = dict(model.named_parameters())
    names = {id(q): n for n, q in run.model.named_parameters()}
    opt = type(run.parts.optimizer)([{**{k: v for k, v in g.items() if k != "params"},
                                      "params": [by_name[names[id(q)]] for q in g["params"]]}
                                     for g in run.parts.optimizer.param_groups])
    images, targets = torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(0)), torch.arange(16) % 10
    metrics = run.train_step([(images, targets)])

    run.parts.train_loss(model(images), targets).backward()
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(q.grad) for q in model.parameters()]))
    if clip is not None:
        assert norm > 4 * clip  # so clipping changes this step
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    assert metrics["train/grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    for name, q in run.model.named_parameters():
        torch.testing.assert_close(q, by_name[name], rtol=1e-5, atol=1e-7, msg=name)
