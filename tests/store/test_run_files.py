"""The files of a run directory and of an export as typed records (quest.store.run_files): metrics.jsonl's rows, run.json,
summary.json and an exported config.json. Every field of each, set to a wrong type, an out-of-range value or (a
path) a path outside its folder, is refused naming the file and the field; a good file reads back as it is; and
each program that reads the file (resume, quest-report, quest-plot, quest-export, eval.py weights=) goes through the
check."""
from __future__ import annotations

import copy
import json
import logging
import re

import pytest

from quest.store import run_files as rf
from quest.store.damage import DamagedFile

from ..record_faults import OUTSIDE, faults, planted

# each kind as quest writes it (a tiny run's files, cut down)
TRAIN_ROW = {"step": 2, "train/loss": 2.33, "train/grad_norm": 5.5, "train/lr": 0.0005, "train/img_per_s": 706.6,
             "epoch": 0.5, "perf/peak_mem_gib": 0.75, "perf/mfu": None, "data/train_skipped": 0,
             "data/train_drawn": 32}
VAL_ROW = {"step": 2, "val/top1": 6.25, "val/top5": 46.9, "val/loss": 2.33, "val/images": 32, "val/skipped": 0,
           "val_ema/top1": 12.5, "val_ema/top5": 56.2, "val_ema/loss": "nan", "epoch": 0,
           "diag/layer00/entropy": 1.5}
HISTORY = {"event": "resume", "time": "2026-12-04T22:39:13+00:00", "step": 4, "note": "rebuilt",
           "changed": {"trainer.epochs": [2, 3]},
           "ran": {"float32_matmul_precision": "highest", "cuda_matmul_allow_tf32": False, "cudnn_allow_tf32": False}}
RUN = {"format": "quest-run-v1", "created": "2026-12-04T22:39:13+00:00", "history": [HISTORY],
       "config": {"model": {"name": "vit_pico_patch4_16"}}, "checkpoint_step": 4}
SUMMARY = {
    "status": "stopped", "diverged_at_step": None, "divergence_reason": None, "epoch": 0, "step": 2,
    "val/top1": 6.25, "val/top5": 46.875, "val/loss": 2.33, "val/images": 32, "val/skipped": 0, "val_ema/top1": 12.5,
    "val_ema/top5": 56.25, "val_ema/loss": 2.31, "best/val/top1": None, "best_epoch": -1,
    "choices": {"model": "vit_pico_patch4_16", "attention": "quest"}, "attention": "quest",
    "model": "vit_pico_patch4_16", "seed": 0, "num_params": 138954, "lr": 0.002, "lr_peak": 0.00175,
    "global_batch": 16, "world_size": 1, "train_input": "timm", "wall_time_s": 0.26, "train_img_per_s": 330.1,
    "resumed": False, "run_dir": "/tmp/run", "checkpoint": "/tmp/run/checkpoints/last.pt (step 2)",
    "skipped_images": {"train": 0, "train_drawn": 32, "val": 0, "val_scored": 32}, "left_out_by_preflight": {},
    "perf": {"train_flops_per_image": 2.1e7, "device_peak_tflops": None, "steps": 2, "images": 32, "train_s": 0.1,
             "wall_s": 0.26, "img_per_s": 320.0, "compile_s": 0.0, "compile_steps": 0, "loader_start_s": 0.02,
             "peak_mem_gib_max": 0.75, "mfu_mean": None,
             "attempts": [{"first_step": 0, "steps": 2, "images": 32, "train_s": 0.1, "wall_s": 0.26,
                           "img_per_s": 320.0, "data_wait_mean": 0.1}]},
    "data_fingerprint": {"train_size": 32, "val_size": 32, "num_classes": 10, "classes_sha256": "ab"},
    "signal": "SIGTERM", "saved": True, "requeue": "r",
    "data_failure": "d", "changed_on_resume": {"trainer.epochs": [2, 3]},
}
EXPORT = {
    "architecture": "quest_vit.quest", "num_classes": 10, "num_features": 64, "global_pool": "token",
    "model_args": {"model": "vit_pico_patch4_16", "attention": "quest", "attention_options": {"eps": 1e-6},
                   "num_classes": 10, "img_size": 16},
    "pretrained_cfg": {"input_size": [3, 16, 16], "fixed_input_size": True, "mean": [0.5] * 3, "std": [0.5] * 3,
                       "crop_pct": 0.875, "crop_mode": "center", "interpolation": "bilinear", "num_classes": 10,
                       "first_conv": "patch_embed.proj", "classifier": "head"},
    "quest": {"weights": "model", "checkpoint": "/tmp/run/checkpoints/last.pt", "checkpoint_sha256": "ab",
              "step": 2, "epoch": 0, "train_data": "fake", "choices": {"model": "vit_pico"}, "quest_version": "0.2",
              "onnx": {"file": "model.onnx", "opset": 17, "max_abs_diff_vs_pytorch": 1e-6}, "val_top1": 6.25,
              "run_status": "completed"},
    "label_names": ["a", "b"],
}

KINDS = {  # record class -> (a good file, its reader)
    "metrics row": (rf.MetricsRow, {**TRAIN_ROW, **VAL_ROW}, rf.check_metrics_row),
    "run.json": (rf.RunRecord, RUN, rf.checked_run_record),
    "history entry": (rf.HistoryEntry, HISTORY,
                      lambda data, path: rf.checked_run_record({**RUN, "history": [data]}, path)["history"][0]),
    "summary.json": (rf.RunSummary, SUMMARY, rf.checked_summary),
    "config.json": (rf.ExportConfig, EXPORT, rf.checked_export_config),
}
CASES = [(kind, field, value) for kind, (cls, _, _) in KINDS.items() for field, value in faults(cls)]


@pytest.mark.parametrize("kind", KINDS)
def test_a_good_file_reads_back_unchanged(kind):
    _, good, read = KINDS[kind]
    assert read(copy.deepcopy(good), "f.json") == good
    for row in (TRAIN_ROW, VAL_ROW):
        assert rf.check_metrics_row(dict(row), "m") == row


def test_the_faults_cover_every_kind_and_the_paths():
    kinds = {kind for kind, _, _ in CASES}
    assert kinds == set(KINDS)
    assert ("config.json", "quest.onnx.file", OUTSIDE[0]) in CASES  # a path outside the export folder
    assert any(f == "val/top1" and v == 100.5 for _, f, v in CASES)  # a key a Python name cannot hold, its range


@pytest.mark.parametrize(("kind", "field", "value"), CASES, ids=lambda v: v if isinstance(v, str) else repr(v))
def test_every_field_of_a_wrong_type_range_or_path_is_refused_naming_the_file_and_it(kind, field, value):
    _, good, read = KINDS[kind]
    named = re.escape(f"history[0].{field}" if kind == "history entry" else field)
    with pytest.raises(DamagedFile, match=rf"^f\.json: {named}[ .\[]"):  # the field, or the element inside it
        read(planted(copy.deepcopy(good), field, value), "f.json")


@pytest.mark.parametrize(("kind", "key"), [("metrics row", "step"), ("run.json", "history"),
                                           ("run.json", "config"), ("summary.json", "status"),
                                           ("config.json", "architecture")])
def test_a_missing_required_field_is_refused_naming_it(kind, key):
    _, good, read = KINDS[kind]
    with pytest.raises(DamagedFile, match=rf"^f\.json: no {key}; expected"):
        read({k: v for k, v in good.items() if k != key}, "f.json")


@pytest.mark.parametrize("kind", KINDS)
def test_not_an_object_is_refused_naming_the_file(kind):
    _, _, read = KINDS[kind]
    with pytest.raises(DamagedFile, match=r"^f\.json"):
        read([1, 2], "f.json")


def test_unknown_keys_are_allowed_for_a_newer_quest_but_a_metrics_value_must_be_a_number():
    assert rf.checked_summary({**SUMMARY, "new_key": {"x": 1}}, "f.json")["new_key"] == {"x": 1}
    assert rf.checked_export_config({**EXPORT, "label_descriptions": {"a": "A"}}, "f.json")
    with pytest.raises(DamagedFile, match=r"^m:3: diag/layer00/entropy is str"):
        rf.check_metrics_row({**VAL_ROW, "diag/layer00/entropy": "1.5"}, "m:3")


def test_an_input_size_without_three_parts_is_refused():
    bad = planted(copy.deepcopy(EXPORT), "pretrained_cfg.input_size", [16])
    with pytest.raises(DamagedFile, match=r"pretrained_cfg\.input_size is \[16\], expected \[channels"):
        rf.checked_export_config(bad, "f.json")


# --- every reader goes through the check ---------------------------------------------------------------------------
def _run_dir(tmp_path, summary=SUMMARY, rows=(TRAIN_ROW, VAL_ROW), run=RUN):
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "run.json").write_text(json.dumps(run))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_quest_report_refuses_a_summary_or_run_json_field_naming_it(tmp_path):
    from quest.report.runs import ReportInputError, load_runs

    run_dir = _run_dir(tmp_path / "a", summary={**SUMMARY, "status": "completed", "val/top1": "98.6"})
    with pytest.raises(ReportInputError, match=rf"^{run_dir / 'summary.json'}: val/top1 is str '98.6'"):
        load_runs([run_dir.parent])
    run_dir = _run_dir(tmp_path / "b", summary={**SUMMARY, "status": "completed"}, run={**RUN, "config": [1]})
    with pytest.raises(ReportInputError, match=rf"^{run_dir / 'run.json'}: config is list"):
        load_runs([run_dir.parent])


def test_quest_plot_refuses_a_metrics_row_field_naming_the_line(tmp_path, caplog):
    from quest.report.run_metrics import PlotInputError, load_metrics, run_label

    run_dir = _run_dir(tmp_path, rows=(TRAIN_ROW, {**VAL_ROW, "val/top1": 250}))
    with pytest.raises(PlotInputError, match=rf"^{run_dir / 'metrics.jsonl'}:2: val/top1 is 250"):
        load_metrics(run_dir)
    (run_dir / "summary.json").write_text(json.dumps({**SUMMARY, "attention": 7}))
    with caplog.at_level(logging.WARNING):
        assert run_label(run_dir) == "r"  # not believed: the directory's name, said
    assert "summary.json: attention is int 7" in caplog.text


def test_quest_export_refuses_a_summary_field_naming_it(tmp_path):
    from quest.tools.export import run_summary

    run_dir = _run_dir(tmp_path, summary={**SUMMARY, "step": -2})
    with pytest.raises(ValueError, match=rf"^cannot read {run_dir / 'summary.json'}: step is -2, expected"):
        run_summary(run_dir / "checkpoints" / "last.pt")


def test_eval_weights_refuse_an_exported_config_field_naming_it(tmp_path):
    from quest.evaluation.foreign import export_record

    (tmp_path / "config.json").write_text(json.dumps(planted(copy.deepcopy(EXPORT), "model_args.attention", 3)))
    with pytest.raises(DamagedFile, match=rf"^{tmp_path / 'config.json'}: model_args\.attention is int 3"):
        export_record(f"local-dir:{tmp_path}")
    assert export_record("timm-name") is None
