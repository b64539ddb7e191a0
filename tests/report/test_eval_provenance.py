"""An evaluation counts as a run's result only while it is of the run's current weights, and runs pool an
evaluation only where its settings and data agree (docs/report.md, "Evaluations in the report"): a resumed run
with an evaluation of its earlier last.pt, and a property over evaluation settings and data."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from quest.evaluation import register_eval_configs, run_evaluation
from quest.report import build_report, load_runs
from quest.report.runs import RunResult, _eval_setting
from quest.report.tables import Row
from quest.train import fit

from ..helpers import FAST, compose_cfg, eval_cfg

register_eval_configs()


def test_an_evaluation_of_the_last_pt_a_resume_replaced_is_left_out_saying_so(tmp_path, caplog):
    sweep = tmp_path / "sweep"
    run = sweep / "run"
    fit(compose_cfg(*FAST, "trainer.max_steps=3"), run)
    last = run / "checkpoints" / "last.pt"
    early = run_evaluation(eval_cfg(f"checkpoint={last}", "eval=clean"), run / "eval" / "clean" / "last-model")
    assert early["target"]["train_step"] == 3 and early["target"]["weights"] == "model"
    # the data it read, by content as training records its data: FakeData lists no files, its size is known
    assert early["data"] == {"data.root": {"size": 32, "classes_sha256": None, "files_sha256": None}}
    fit(compose_cfg(*FAST), run)  # resumed to its end: last.pt now holds step 8
    with caplog.at_level(logging.WARNING, logger="quest.report"):
        [found] = load_runs([sweep])
    assert "clean/top1" not in found.metrics
    assert found.older == ["eval/clean/last-model: it evaluated last.pt at step 3, and the run's last.pt now holds "
                           "step 8"]
    assert "left out of the report: it evaluated last.pt at step 3" in caplog.text
    assert "1 older evaluation(s) left out" in build_report([found]).rows[0].notes()
    again = run_evaluation(eval_cfg(f"checkpoint={last}", "eval=clean", "eval.overwrite=true"),
                           run / "eval" / "clean" / "last-model")
    [found] = load_runs([sweep])
    assert found.metrics["clean/top1"] == again["results"]["clean"]["top1"] and found.older == []


CROPS, INTERPOLATIONS, FILES, ROOTS = (0.875, 1.0), ("bicubic", "bilinear"), ("a" * 64, "b" * 64, None), ("/x", "/y")


def _record(crop: float, interpolation: str, files: str | None, root: str, batch: int) -> dict:
    """An eval_results.json's parts that _eval_setting reads, as eval.py writes them."""
    return {"fingerprint": {"settings": {"batch_size": batch, "precision": "fp32", "clean": {"max_samples": None}},
                            "evaluated": {"source": "checkpoint", "checkpoint_sha256": root * 4, "img_size": 224,
                                          "crop_pct": crop, "interpolation": interpolation,
                                          "data_config": {"name": "imagenet", "root": root}}},
            "inputs": {"data.root": root},
            "data": {"data.root": {"size": 50_000, "classes_sha256": None, "files_sha256": files}}}


setup = st.tuples(st.sampled_from(CROPS), st.sampled_from(INTERPOLATIONS), st.sampled_from(FILES),
                  st.sampled_from(ROOTS), st.sampled_from((32, 256)))


@settings(max_examples=200, deadline=None)
@given(setup, setup)
def test_runs_pool_an_evaluation_only_where_its_settings_and_data_agree(a, b):
    runs = [RunResult(Path(f"/runs/{i}"), "completed", {"seed": i}, None, {"clean/top1": 50.0 + i},
                      {"clean": _eval_setting(_record(*s), "clean")}) for i, s in enumerate((a, b))]
    row = Row({"attention": "quest"}, runs)
    # the same data: the same files by content wherever they lie; files not known on either side: the same path
    same_data = a[2] == b[2] and (a[2] is not None or a[3] == b[3])
    agree = a[:2] == b[:2] and same_data  # the batch size never splits: a model in eval mode scores each image alone
    assert (row.values("clean/top1") == [50.0, 51.0]) == agree
    assert bool(row.apart("clean/top1")) == (not agree)
    assert row.values("val/top1") == []  # a metric of training: never an evaluation's, never split by one
    if not agree:
        differing = set(row.apart("clean/top1"))
        assert ("input.crop_pct" in differing) == (a[0] != b[0])
        assert ("input.interpolation" in differing) == (a[1] != b[1])
    json.dumps([r.evaluations for r in runs])  # plain values: shown in notes and warnings as they are
