"""``python -m quest.report`` on real short trainings (quest.train.fit on the tiny FAST setup, 1 epoch each), laid
out as Hydra does (.hydra/config.yaml beside summary.json). Every number is checked against a hand computation from
the summary.json files. Where a test needs particular values (a clear winner, a stopped or diverged seed inside a
row) it edits copies of real runs and says so."""
from __future__ import annotations

import csv
import io
import json
import math
import shutil
from pathlib import Path
from statistics import fmean, mean, stdev

import pytest
from omegaconf import OmegaConf
from scipy.stats import t as t_dist

from quest.report import ReportInputError, build_report, load_runs, lr_csv, lr_markdown, runs_markdown
from quest.report.__main__ import main
from quest.train import fit

from ..helpers import FAST, ROOT, compose_cfg
from ..warm import run_app

NUM_CLASSES = 10  # data=fake
LR = 2e-3  # recipe=light


def train(root: Path, name: str, *overrides: str) -> Path:
    # no warmup: the 4 steps move the formulations apart, and lr 1e6 diverges at once
    cfg = compose_cfg(*FAST, "trainer.epochs=1", "recipe.warmup_epochs=0", *overrides)
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")  # what Hydra writes for python train.py
    fit(cfg, run)
    return run


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[tuple, Path]:
    """2 formulations x 3 seeds at the recipe's lr, one seed each at lr 1e-2 and 1e6 (diverges), and a run stopped
    by trainer.max_steps: 11 trainings of 4 steps (2 for the stopped one)."""
    root = tmp_path_factory.mktemp("trained")
    runs: dict[tuple, Path] = {}
    for att in ("standard", "quest"):
        for seed in (0, 1, 2):
            runs[att, LR, seed] = train(root, f"{att}-s{seed}", f"attention={att}", f"trainer.seed={seed}")
        runs[att, 1e-2, 0] = train(root, f"{att}-lr1e-2", f"attention={att}", "recipe.lr=1e-2")
        runs[att, 1e6, 0] = train(root, f"{att}-lr1e6", f"attention={att}", "recipe.lr=1e6")
    runs["quest", "stopped"] = train(root, "quest-stopped", "attention=quest", "trainer.seed=3", "trainer.max_steps=2")
    assert json.loads((runs["standard", 1e6, 0] / "summary.json").read_text())["status"] == "diverged"
    assert json.loads((runs["quest", "stopped"] / "summary.json").read_text())["status"] == "stopped"
    return runs


def sweep(dest: Path, runs: dict[tuple, Path], *keys: tuple) -> Path:
    """Copies of the chosen runs (without checkpoints) in one sweep directory."""
    for key in keys:
        shutil.copytree(runs[key], dest / runs[key].name, ignore=shutil.ignore_patterns("checkpoints"))
    return dest


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def edit_summary(run: Path, **values) -> None:
    data = summary(run)
    data.update({k.replace("__", "/"): v for k, v in values.items()})
    (run / "summary.json").write_text(json.dumps(data))


def edit_config(run: Path, key: str, value) -> None:
    """Both records of a run's config: run.json (quest's, read first) and .hydra/config.yaml."""
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    OmegaConf.update(cfg, key, value)
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    record = json.loads((run / "run.json").read_text())
    node = OmegaConf.create(record["config"])
    OmegaConf.update(node, key, value)
    record["config"] = OmegaConf.to_container(node)
    (run / "run.json").write_text(json.dumps(record))


def hand_welch_p(a: list[float], b: list[float]) -> float:
    va, vb = stdev(a) ** 2 / len(a), stdev(b) ** 2 / len(b)
    t = (mean(a) - mean(b)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))  # Welch-Satterthwaite
    return 2 * t_dist.sf(abs(t), df)


def cell(values: list[float], d: int) -> str:
    return f"{mean(values):.{d}f} ± {stdev(values):.{d}f}"


SEEDS = [(att, LR, s) for att in ("standard", "quest") for s in (0, 1, 2)]


def test_means_stds_and_welch_on_real_losses(trained, tmp_path):
    runs = load_runs([sweep(tmp_path, trained, *SEEDS)])
    report = build_report(runs, metrics=["val/top1", "val/loss"], primary="val/loss")
    assert report.keys == ["attention", "model"]  # the seeds are repetitions, not rows
    assert [r.keys["attention"] for r in report.rows] == ["standard", "quest"]
    losses = {att: [summary(trained[att, LR, s])["val/loss"] for s in (0, 1, 2)] for att in ("standard", "quest")}
    top1 = {att: [summary(trained[att, LR, s])["val/top1"] for s in (0, 1, 2)] for att in ("standard", "quest")}
    best = min(losses, key=lambda a: mean(losses[a]))  # a loss: lower is better
    other = "quest" if best == "standard" else "standard"
    p = hand_welch_p(losses[other], losses[best])
    text = runs_markdown(report)
    for row in report.rows:
        att = row.keys["attention"]
        assert row.n == 3 and row.stat("val/loss") == pytest.approx((mean(losses[att]), stdev(losses[att]), 3))
        assert row.stat("val/top1") == pytest.approx((mean(top1[att]), stdev(top1[att]), 3))
        assert row.best == (att == best)
        if att == other:
            assert row.p_value == pytest.approx(p, rel=1e-9)
        verdict = "best" if att == best else f"{p:.3f}"
        assert f"| {att} | 3 | {cell(top1[att], 2)} | {cell(losses[att], 3)} | {verdict} |  |" in text, text
    assert 0.001 < p < 0.999  # the runs differ: a real test of the statistic


def test_cli_tables_and_csv_with_known_values(trained, tmp_path, capsys):
    # copies of real runs with val/top1 edited so that one formulation clearly wins
    root = sweep(tmp_path / "sweep", trained, *SEEDS)
    top1 = {"standard": [70.1, 71.3, 69.8], "quest": [72.4, 73.0, 72.9]}
    for (att, _, seed) in SEEDS:
        edit_summary(root / trained[att, LR, seed].name, val__top1=top1[att][seed])
    assert main([str(root), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    p = hand_welch_p(top1["standard"], top1["quest"])
    ema = {att: [summary(trained[att, LR, s])["val_ema/top1"] for s in (0, 1, 2)] for att in top1}
    assert "### model=vit_pico_patch4_16" in out
    assert "| attention | n | val/top1 | val_ema/top1 | p (val/top1) | notes |" in out
    assert f"| standard | 3 | {cell(top1['standard'], 2)} | {cell(ema['standard'], 2)} | {p:.3f} |  |" in out
    assert f"| quest | 3 | {cell(top1['quest'], 2)} | {cell(ema['quest'], 2)} | best |  |" in out
    assert "Learning-rate sensitivity" not in out  # one lr: no sweep
    assert sorted(f.name for f in (tmp_path / "out").iterdir()) == ["runs.csv", "runs.md"]
    assert (tmp_path / "out" / "runs.md").read_text().strip() == out.strip()
    rows = {r["attention"]: r for r in csv.DictReader(io.StringIO((tmp_path / "out" / "runs.csv").read_text()))}
    for att, values in top1.items():
        r = rows[att]
        assert r["model"] == "vit_pico_patch4_16" and r["n"] == "3" and r["diverged"] == "0"
        assert float(r["val/top1 mean"]) == pytest.approx(mean(values), rel=1e-12)
        assert float(r["val/top1 std"]) == pytest.approx(stdev(values), rel=1e-12)
        assert float(r["val_ema/top1 mean"]) == pytest.approx(mean(ema[att]), rel=1e-12)
        assert r["val/top1 n"] == "3"
    assert rows["quest"]["best"] == "True" and rows["quest"]["p_welch val/top1"] == ""
    assert float(rows["standard"]["p_welch val/top1"]) == pytest.approx(p, rel=1e-9)


def test_a_diverged_seed_marks_the_row(trained, tmp_path):
    # the real diverged run (lr 1e6) relabelled as seed 2 of standard at the recipe's lr
    root = sweep(tmp_path, trained, *SEEDS[:2], *SEEDS[3:], ("standard", 1e6, 0))
    diverged = root / trained["standard", 1e6, 0].name
    edit_config(diverged, "recipe.lr", LR)
    edit_config(diverged, "trainer.seed", 2)
    edit_summary(diverged, lr=LR, seed=2)
    report = build_report(load_runs([root]))
    standard, quest = report.rows
    assert standard.n == 3 and standard.n_diverged == 1 and standard.stat("val/top1") is None
    assert quest.best and standard.p_value is None
    assert "| standard | 3 | diverged (1/3) | diverged (1/3) | n/a |  |" in runs_markdown(report)


def test_stopped_and_incomplete_runs_are_marked_not_averaged(trained, tmp_path):
    root = sweep(tmp_path, trained, *SEEDS, ("quest", "stopped"))
    (root / trained["standard", LR, 2].name / "summary.json").unlink()  # as if killed before the end
    quest = [summary(trained["quest", LR, s])["val/top1"] for s in (0, 1, 2)]
    stopped = summary(trained["quest", "stopped"])["val/top1"]
    standard = [summary(trained["standard", LR, s])["val/top1"] for s in (0, 1)]
    report = build_report(load_runs([root]))
    assert report.keys == ["attention", "model"]  # trainer.max_steps does not make a row of its own
    rows = {r.keys["attention"]: r for r in report.rows}
    assert rows["quest"].stat("val/top1") == pytest.approx((mean(quest), stdev(quest), 3))
    assert rows["quest"].notes() == "1 stopped (excluded)"
    assert rows["standard"].stat("val/top1") == pytest.approx((mean(standard), stdev(standard), 2))
    assert rows["standard"].notes() == "1 incomplete (no summary.json)"
    text = runs_markdown(report)
    assert "1 stopped (excluded) |" in text and "--include-stopped" in text
    both = build_report(load_runs([root]), include_stopped=True)
    rows = {r.keys["attention"]: r for r in both.rows}
    assert rows["quest"].stat("val/top1") == pytest.approx((mean([*quest, stopped]), stdev([*quest, stopped]), 4))
    assert rows["quest"].notes() == "includes 1 stopped"


def test_lr_sensitivity_matches_hand_computation(trained, tmp_path, capsys):
    keys = [k for k in trained if len(k) == 3]  # both formulations at lr 2e-3 (3 seeds), 1e-2 and 1e6 (diverged)
    root = sweep(tmp_path / "sweep", trained, *keys)
    # Random labels (FakeData) leave every real final loss above ln(10), so all would cap at loss0 and the
    # sensitivity would be 0: the 2e-3 seeds get losses below it; lr 1e-2 (real, capped) and 1e6 (diverged) stay.
    edited = {"standard": [1.9, 2.0, 2.1], "quest": [1.6, 1.7, 1.8]}
    for att, values in edited.items():
        for seed, loss in enumerate(values):
            edit_summary(root / trained[att, LR, seed].name, val__loss=loss)
    report = build_report(load_runs([root]))
    assert report.keys == ["attention", "model", "recipe.lr"]
    loss0 = math.log(NUM_CLASSES)
    expected = {}
    for att in ("standard", "quest"):
        capped = {}
        for lr in (LR, 1e-2, 1e6):
            seeds = [summary(root / trained[k].name) for k in keys if k[:2] == (att, lr)]
            capped[lr] = fmean(loss0 if s["status"] == "diverged" else min(s["val/loss"], loss0) for s in seeds)
        star = min(capped.values())
        expected[att] = (capped, star, fmean(v - star for v in capped.values()))
    assert summary(root / trained["standard", 1e-2, 0].name)["val/loss"] > loss0  # really capped
    assert expected["standard"][2] == pytest.approx((0 + 2 * (loss0 - 2.0)) / 3)
    assert [s.keys for s in report.sweeps] == [{"attention": a, "model": "vit_pico_patch4_16"}
                                               for a in ("standard", "quest")]
    for s in report.sweeps:
        capped, star, value = expected[s.keys["attention"]]
        assert s.num_classes == NUM_CLASSES and s.sensitivity.loss0 == pytest.approx(loss0)
        assert s.sensitivity.loss_at == pytest.approx(capped) and s.sensitivity.loss_star == pytest.approx(star)
        assert s.sensitivity.value == pytest.approx(value, rel=1e-12)
    text = lr_markdown(report)
    for att in ("standard", "quest"):
        _, _, value = expected[att]
        assert f"LR sensitivity: **{value:.3f}** (loss0 = ln(10) = {loss0:.3f}" in text
        top1 = [summary(trained[att, LR, s])["val/top1"] for s in (0, 1, 2)]
        lr2 = summary(trained[att, 1e-2, 0])["val/top1"]
        assert f"| attention={att}, model=vit_pico_patch4_16 | {cell(top1, 2)} | {lr2:.2f} | diverged | {value:.3f} |" \
            in text
        assert "| 1e+06 | 1 | diverged | diverged |" in text
    rows = list(csv.DictReader(io.StringIO(lr_csv(report))))
    assert [(r["attention"], float(r["lr"]), r["diverged"]) for r in rows] == [
        (a, lr, "1" if lr == 1e6 else "0") for a in ("standard", "quest") for lr in (LR, 1e-2, 1e6)]
    for r in rows:
        capped, star, value = expected[r["attention"]]
        assert float(r["capped_loss"]) == pytest.approx(capped[float(r["lr"])], rel=1e-12)
        assert float(r["lr_sensitivity"]) == pytest.approx(value, rel=1e-12)

    # without a config record (run.json, .hydra/config.yaml): rows from summary.json (the lr actually used), classes
    # from --num-classes
    for run in root.iterdir():
        shutil.rmtree(run / ".hydra")
        (run / "run.json").unlink()
    assert main([str(root)]) == 0
    assert "LR sensitivity: n/a (the number of classes is unknown: pass --num-classes)" in capsys.readouterr().out
    report = build_report(load_runs([root]), num_classes=NUM_CLASSES)
    assert report.keys == ["attention", "model", "lr"]
    assert [s.sensitivity.value for s in report.sweeps] == pytest.approx([expected[a][2] for a in ("standard", "quest")])


def test_eval_results_become_columns(trained, tmp_path):
    from quest.evaluation.report import write_reports  # the writer eval.py uses

    root = sweep(tmp_path, trained, *SEEDS)
    mce = {"standard": [61.0, 62.5, 60.7], "quest": [58.2, 57.9, 58.8]}
    clean = {"standard": [40.0, 41.0, 42.0], "quest": [43.0, 45.0, 44.0]}
    for att, _, seed in SEEDS:
        results = {"clean": {"top1": clean[att][seed], "top5": 90.0, "nll": 1.5, "n": 32, "seconds": 0.1},
                   "imagenet_c": {"mce": mce[att][seed], "relative_mce": 70.0 + seed, "ce": {"fog": 50.0 + seed},
                                  "error": {"fog": {"1": 30.0}}, "corruption_error": {"fog": 30.0},
                                  "note": "test"}}
        run = root / trained[att, LR, seed].name
        target = {"checkpoint": str(run / "checkpoints" / "last.pt"), "weights": "model"}
        write_reports(run / "eval" / "suite" / "last-model", {
            "suite": "suite", "target": target, "world_size": 1, "device": "cpu", "wall_time_s": 1.0,
            "results": results})
        ema = {"clean": {**results["clean"], "top1": clean[att][seed] + 1.0}}  # the EMA weights, beside
        write_reports(run / "eval" / "suite" / "last-ema", {
            "suite": "suite", "target": {**target, "weights": "ema"}, "world_size": 1, "device": "cpu",
            "wall_time_s": 1.0, "results": ema})
    report = build_report(load_runs([root]), primary="imagenet_c/mce")
    assert report.metrics == ["val/top1", "val_ema/top1", "clean/top1", "imagenet_c/mce", "imagenet_c/relative_mce",
                              "clean_ema/top1"]
    rows = {r.keys["attention"]: r for r in report.rows}
    assert rows["quest"].best  # lowest mCE
    assert rows["standard"].p_value == pytest.approx(hand_welch_p(mce["standard"], mce["quest"]), rel=1e-9)
    assert rows["standard"].stat("clean/top1") == pytest.approx((41.0, 1.0, 3))
    assert rows["standard"].stat("clean_ema/top1") == pytest.approx((42.0, 1.0, 3))
    assert "lower is better" in runs_markdown(report)
    picked = build_report(load_runs([root]), metrics=["imagenet_c/ce/*", "clean/nll"])
    assert picked.metrics == ["val/top1", "imagenet_c/ce/fog", "clean/nll"]


def test_missing_or_empty_sweep_dir_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert main([str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"{missing}: does not exist" in err and "summary.json" in err
    empty = tmp_path / "empty"
    (empty / "run").mkdir(parents=True)
    assert main([str(empty)]) == 2
    assert f"{empty}: no summary.json under it (expected a sweep directory" in capsys.readouterr().err
    (empty / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ReportInputError, match="1 run directories have metrics.jsonl but no summary.json"):
        load_runs([empty])


def test_unknown_metric_or_setting_is_named(trained, tmp_path, capsys):
    root = sweep(tmp_path, trained, *SEEDS[:1])
    assert main([str(root), "--primary", "val/top9"]) == 2
    assert "--primary 'val/top9': no run has it" in capsys.readouterr().err
    assert main([str(root), "--metrics", "imagenet_x/*"]) == 2
    assert "--metrics 'imagenet_x/*' matches no metric" in capsys.readouterr().err
    assert main([str(root), "--by", "attention", "recipe.nope"]) == 2
    assert "--by 'recipe.nope': no run has this setting" in capsys.readouterr().err


def test_module_runs_as_a_script(trained, tmp_path):
    root = sweep(tmp_path, trained, *SEEDS)
    # python -m quest.report as a command of its own (forked warm, tests/warm.py): its exit status and stdout
    result = run_app("quest.report", str(root), "--by", "attention", cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "| attention | n | val/top1 | val_ema/top1 | p (val/top1) | notes |" in result.stdout


def test_a_repeated_seed_is_counted_once_with_a_warning(trained, tmp_path, caplog):
    # the same setting and seed in a second directory (as a rerun with diagnostics on): one repetition, not two
    root = sweep(tmp_path, trained, *SEEDS)
    first = trained["standard", LR, 0]
    again = root / "zz-standard-s0-diagnostics"
    shutil.copytree(first, again, ignore=shutil.ignore_patterns("checkpoints"))
    edit_config(again, "diagnostics.every_n_steps", 1)
    edit_summary(again, val__top1=summary(first)["val/top1"] + 7.0)  # were it counted, the mean would move
    standard = [summary(trained["standard", LR, s])["val/top1"] for s in (0, 1, 2)]
    with caplog.at_level("WARNING", logger="quest.report"):
        report = build_report(load_runs([root]))
    rows = {r.keys["attention"]: r for r in report.rows}
    assert report.keys == ["attention", "model"]  # diagnostics never make a row
    assert rows["standard"].n == 3 and [r.path.name for r in rows["standard"].duplicates] == [again.name]
    assert rows["standard"].stat("val/top1") == pytest.approx((mean(standard), stdev(standard), 3))
    assert rows["standard"].notes() == "1 duplicate seed (counted once)" and rows["quest"].notes() == ""
    assert "1 duplicate seed (counted once)" in runs_markdown(report)
    assert any(again.name in m and first.name in m and "seed 0" in m and "counted once" in m for m in caplog.messages)
    # another seed in the copy is a repetition of its own
    edit_config(again, "trainer.seed", 7)
    edit_summary(again, seed=7)
    assert {r.keys["attention"]: r for r in build_report(load_runs([root])).rows}["standard"].n == 4


def test_a_run_directory_removed_while_scanning_is_skipped(trained, tmp_path, monkeypatch, caplog):
    import quest.report.runs as runs_module

    root = sweep(tmp_path, trained, *SEEDS)
    victim = root / trained["quest", LR, 1].name
    load = runs_module._load_run

    def racing(run_dir: Path):
        if run_dir == victim and victim.exists():
            shutil.rmtree(victim)  # another process removes it between the scan and the read
        return load(run_dir)

    monkeypatch.setattr(runs_module, "_load_run", racing)
    with caplog.at_level("WARNING", logger="quest.report"):
        runs = load_runs([root])
    assert sorted(r.path.name for r in runs) == sorted(trained[k].name for k in SEEDS if k != ("quest", LR, 1))
    assert any(victim.name in m and "disappeared" in m for m in caplog.messages)
    # a walk over a directory that vanishes does not fail either
    gone = tmp_path / "gone"
    gone.mkdir()
    assert runs_module._run_files(gone / "missing", "summary.json") == []
