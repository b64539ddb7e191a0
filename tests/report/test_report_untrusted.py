"""What the reports read back is untrusted in every field (quest.store.records): explain_maps.pt for quest-plot
explain, the perf/ rows for quest-plot perf, run.json's config values and summary.json for quest.report; a bad
file is refused, or (the report's design) noted and left out, in one line naming the file and the field. Also: the
report's Markdown escapes every string from a file in one place, linked run directories are followed, and
--decimals is bounded. Runs are written by hand, the tiniest that the readers take."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from quest.explain.maps_file import ExplainMaps, check_maps
from quest.report import build_report, load_runs, runs_markdown
from quest.report.__main__ import MAX_DECIMALS
from quest.report.__main__ import main as report_main
from quest.report.markdown import markdown_table, md_text
from quest.report.perf_plot import PerfRow, perf_figure
from quest.report.plot import main as plot_main
from quest.report.run_metrics import PlotInputError
from quest.store.damage import DamagedFile

from ..helpers import FAST, compose_cfg
from ..record_faults import faults, planted

K, H, W = 2, 8, 8


# --- explain_maps.pt ---------------------------------------------------------------------------------------------
def good_maps() -> dict:
    return {"indices": [0, 1], "labels": [3, 4], "predictions": [3, 1],
            "images": torch.zeros(K, 3, H, W, dtype=torch.uint8),
            "boxes": [torch.tensor([[1, 1, 4, 5]]), torch.zeros(0, 4, dtype=torch.int64)],
            "maps": {"agcam": torch.rand(K, H, W).half()}, "attention": "quest", "agcam_gradient": "input"}


def with_nan(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] = math.nan
    return t


#: (field named in the refusal, the fault): every field's type, shape, agreement with the others and range
EXPLAIN_FAULTS = [
    *[(name, lambda d, n=name: d.pop(n)) for name in ("indices", "labels", "images", "boxes", "maps")],
    ("maps", lambda d: d.update(maps=[1, 2])),
    ("maps", lambda d: d.update(maps={})),
    ("maps", lambda d: d["maps"].update(agcam=torch.rand(2, 2))),
    ("maps", lambda d: d["maps"].update(agcam=torch.ones(K, H, W, dtype=torch.int64))),
    ("maps", lambda d: d["maps"].update(agcam=with_nan(torch.rand(K, H, W)))),
    ("maps", lambda d: d["maps"].update(agcam=torch.full((K, H, W), 7.0))),
    ("images", lambda d: d.update(images=torch.rand(K, 3, H, W))),
    ("images", lambda d: d.update(images=torch.zeros(K, 1, H, W, dtype=torch.uint8))),
    ("images", lambda d: d.update(images=torch.zeros(100, 3, H, W, dtype=torch.uint8))),
    ("images", lambda d: d.update(images="pixels")),
    ("indices", lambda d: d.update(indices=list(range(100)))),
    ("indices", lambda d: d.update(indices=[-1, 0])),
    ("labels", lambda d: d.update(labels=list(range(100)))),
    ("labels", lambda d: d.update(labels=["a", "b"])),
    ("predictions", lambda d: d.update(predictions=[1])),
    ("boxes", lambda d: d.update(boxes=[torch.tensor([[1e12, -5, 3, 3]]), torch.zeros(0, 4)])),
    ("boxes", lambda d: d.update(boxes=[torch.tensor([[5.0, 1, 4, 5]]), torch.zeros(0, 4)])),  # x0 > x1
    ("boxes", lambda d: d.update(boxes=[torch.tensor([[1, 1, W, 5]]), torch.zeros(0, 4)])),  # past the edge
    ("boxes", lambda d: d.update(boxes=[with_nan(torch.zeros(1, 4)), torch.zeros(0, 4)])),
    ("boxes", lambda d: d.update(boxes=[torch.zeros(1, 3), torch.zeros(0, 4)])),
    ("boxes", lambda d: d.update(boxes=[torch.zeros(1, 4)])),
    ("boxes", lambda d: d.update(boxes="none")),
    ("attention", lambda d: d.update(attention=5)),
]


def test_a_good_explain_maps_file_passes():
    assert check_maps(good_maps(), Path("maps.pt"))["indices"] == [0, 1]


@pytest.mark.parametrize("name,fault", EXPLAIN_FAULTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(EXPLAIN_FAULTS)])
def test_every_explain_maps_field_is_checked(name, fault):
    data = good_maps()
    fault(data)
    with pytest.raises(DamagedFile) as err:
        check_maps(data, Path("run/eval/x/last-model/explain_maps.pt"))
    message = str(err.value)
    assert "explain_maps.pt" in message and name in message and "\n" not in message


def test_every_declared_explain_field_refuses_wrong_types():
    """The record's own declarations: every value of a wrong kind in every field is refused, naming it."""
    cases = list(faults(ExplainMaps))
    assert {path for path, _ in cases} >= {"indices", "labels", "images", "boxes", "maps", "predictions"}
    for path, value in cases:
        with pytest.raises(DamagedFile, match=path):
            check_maps(planted(good_maps(), path, value), Path("explain_maps.pt"))


@pytest.mark.parametrize("fault", ["nan maps", "big boxes", "cut"])
def test_quest_plot_explain_refuses_in_one_line(tmp_path, capsys, fault):
    data = good_maps()
    target = tmp_path / "run" / "eval" / "explain" / "last-model" / "explain_maps.pt"
    target.parent.mkdir(parents=True)
    if fault == "nan maps":
        data["maps"]["agcam"] = with_nan(data["maps"]["agcam"])
    if fault == "big boxes":
        data["boxes"][0] = torch.tensor([[1e12, -5, 3, 3]])
    torch.save(data, target)
    if fault == "cut":
        target.write_bytes(target.read_bytes()[:50])
    assert plot_main(["explain", str(tmp_path / "run"), "--out", str(tmp_path / "f.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert str(target) in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "f.png").exists()


# --- perf/ rows ----------------------------------------------------------------------------------------------------
GOOD_PERF = {"step": 10, "perf/data_wait": 0.25, "perf/img_per_s_per_device": 500.0, "perf/step_s": 0.1,
             "perf/img_per_s": 500.0, "perf/peak_mem_gib": 1.0, "perf/tflops_per_device": 1.0, "perf/mfu": 0.3,
             "perf/compile_s": 1.0, "perf/compile_steps": 2, "perf/loader_start_s": 0.5}
PERF_FAULTS = [(path, value) for path, value in faults(PerfRow) if value is not None] + [
    ("perf/data_wait", -7), ("perf/data_wait", 1e308), ("perf/mfu", 3.0), ("perf/img_per_s_per_device", 1e308),
    ("perf/data_wait", "nan")]


def perf_run(tmp_path: Path, row: dict) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(GOOD_PERF) + "\n" + json.dumps({**row, "step": 20}) + "\n")
    return run


def test_good_perf_rows_are_plotted(tmp_path):
    assert perf_figure([perf_run(tmp_path, GOOD_PERF)]) is not None


@pytest.mark.parametrize("key,value", PERF_FAULTS, ids=[f"{k}={v!r}" for k, v in PERF_FAULTS])
def test_every_perf_key_is_checked_for_its_meaning(tmp_path, key, value):
    run = perf_run(tmp_path, {**GOOD_PERF, key: value})
    with pytest.raises(PlotInputError) as err:
        perf_figure([run])
    assert "metrics.jsonl" in str(err.value) and key in str(err.value)


# --- run.json and summary.json of quest.report -------------------------------------------------------------------
CONFIG = OmegaConf.to_container(compose_cfg(*FAST), resolve=True)
TIME = "2026-01-01T00:00:00+00:00"


def write_run(folder: Path, seed: int, config: dict | None = None, model: str | None = None,
              top1: float = 50.0) -> Path:
    """A run directory as train.py leaves it: its summary names the model, attention and seed of its config."""
    folder.mkdir(parents=True)
    config = json.loads(json.dumps(config or CONFIG))
    config["trainer"]["seed"] = seed
    model = config["model"]["name"] = model or config["model"]["name"]
    config["attention"]["name"] = "quest"
    (folder / "run.json").write_text(json.dumps({"format": "quest-run-v1", "created": TIME, "config": config,
                                                 "history": [{"event": "start", "time": TIME, "step": 0}]}))
    (folder / "summary.json").write_text(json.dumps({"status": "completed", "attention": "quest", "model": model,
                                                     "seed": seed, "val/top1": top1}))
    return folder


def with_value(key: str, value) -> dict:
    config = json.loads(json.dumps(CONFIG))
    group, name = key.split(".")
    config[group][name] = value
    return config


WRONG_CONFIG = [("recipe.lr", "0.002"), ("recipe.lr", math.nan), ("recipe.lr", -1.0), ("recipe.lr", [1]),
                ("trainer.epochs", 1.5), ("trainer.epochs", "1"), ("recipe.weight_decay", {"a": 1})]


@pytest.mark.parametrize("key,value", WRONG_CONFIG, ids=[f"{k}={v!r}" for k, v in WRONG_CONFIG])
def test_a_config_value_of_the_wrong_type_is_noted_and_left_out(tmp_path, key, value):
    write_run(tmp_path / "s0", 0)
    write_run(tmp_path / "s1", 1, with_value(key, value))
    runs = load_runs([tmp_path])
    assert [r.path.name for r in runs] == ["s0"]
    [why] = runs.left_out
    assert str(tmp_path / "s1" / "run.json") in why and key in why
    text = runs_markdown(build_report(runs))
    assert "left out" in text and key in text


@pytest.mark.parametrize("value", [{"a": [1, {}]}, [1, {"b": [2]}], "0.002", 0.002, None])
def test_new_nested_keys_group_without_crashing(tmp_path, value):
    write_run(tmp_path / "s0", 0, with_value("recipe.zz", value))
    write_run(tmp_path / "s1", 1, with_value("recipe.zz", value))
    write_run(tmp_path / "t0", 0, with_value("recipe.zz", "other"))
    report = build_report(load_runs([tmp_path]))
    assert sorted(row.n for row in report.rows) == [1, 2]


def test_a_string_and_a_number_are_two_settings_told_apart(tmp_path):
    write_run(tmp_path / "s0", 0, with_value("recipe.zz", "0.002"))
    write_run(tmp_path / "s1", 0, with_value("recipe.zz", 0.002))
    text = runs_markdown(build_report(load_runs([tmp_path])))
    assert 'recipe.zz="0.002"' in text and "recipe.zz=0.002" in text


def test_a_linked_run_directory_is_followed(tmp_path):
    write_run(tmp_path / "sweep" / "s1", 1)
    write_run(tmp_path / "sweep3" / "s0", 0)
    os.symlink(tmp_path / "sweep" / "s1", tmp_path / "sweep3" / "s1")
    os.symlink(tmp_path / "sweep3", tmp_path / "sweep3" / "loop")  # a link back up is walked once
    report = build_report(load_runs([tmp_path / "sweep3"]))
    assert [row.n for row in report.rows] == [2]


def test_a_summary_json_folder_is_noted_as_what_it_is(tmp_path):
    write_run(tmp_path / "s0", 0)
    (tmp_path / "s1").mkdir()
    (tmp_path / "s1" / "summary.json").mkdir()
    runs = load_runs([tmp_path])
    assert [r.path.name for r in runs] == ["s0"]
    assert "summary.json" in runs.left_out[0] and "a directory" in runs.left_out[0]


# --- Markdown ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["vit\n| x |", "a|b", "a\r\nb", "a\rb", "a\u2028b", "x\x00y", "###\n# h"])
def test_every_string_stays_on_its_line(text):
    escaped = md_text(text)
    assert len(escaped.splitlines()) == 1 and "|" not in escaped.replace("\\|", "")
    assert len(markdown_table([text], [[text]])) == 3


def test_a_model_name_from_summary_cannot_break_the_tables(tmp_path):
    write_run(tmp_path / "s0", 0, model="vit\n| x |")
    write_run(tmp_path / "s1", 1, model="other")
    text = runs_markdown(build_report(load_runs([tmp_path])))
    headings = [line for line in text.splitlines() if line.startswith("###")]
    assert len(headings) == 2 and any("vit \\| x \\|" in h for h in headings)
    assert all(line.startswith(("|", "#", "Primary", "Runs")) or not line for line in text.splitlines())


# --- --decimals ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("decimals", ["-1", str(MAX_DECIMALS + 1), "100000", "two"])
def test_decimals_is_bounded(tmp_path, capsys, decimals):
    with pytest.raises(SystemExit) as exit_:
        report_main([str(tmp_path), "--decimals", decimals])
    assert exit_.value.code == 2
    assert f"0..{MAX_DECIMALS}" in capsys.readouterr().err
