"""quest.report's "same setting": two runs are one setting only when every value that can change a result agrees
(the config without quest.report.settings.NEUTRAL_KEYS, and the data set's fingerprint); seeds are the repetitions.
Runs are built in memory from a real composed config (no training): the grouping reads nothing else."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from quest.report import RunResult, build_report
from quest.report.runs import flatten
from quest.report.settings import DATA_SET, NEUTRAL_KEYS, REPEAT_KEYS, neutral

from ..helpers import FAST, compose_cfg

BASE = flatten(OmegaConf.to_container(compose_cfg(*FAST), resolve=True))
FINGERPRINT = {"train_size": 64, "val_size": 32, "num_classes": 10, "classes_sha256": "ab" * 32}
# keys a later quest might add: they count until someone declares them neutral
NEW_KEYS = ("trainer.a_new_option", "recipe.a_new_option", "model.a_new_option")


def run(name: str, config: dict, fingerprint: dict | None = FINGERPRINT, top1: float = 50.0) -> RunResult:
    """A completed run as quest.report.runs loads it: summary.json's identity fields follow the config, as
    quest.train.fit writes them."""
    summary = {"status": "completed", "attention": config["attention.name"], "model": config["model.name"],
               "seed": config["trainer.seed"], "val/top1": top1}
    if fingerprint is not None:
        summary.update(flatten({"data_fingerprint": fingerprint}))
    return RunResult(Path(name), "completed", summary, dict(config), {"val/top1": top1})


def changed(value):
    """One other value of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "_other"
    if isinstance(value, tuple):
        return (*value, value[-1] if value else 1)
    return 7  # None: set


def neutral_key_cases() -> list[str]:
    """Each declared neutral key once, a key under a ``prefix.*`` entry for those (logger.*, diagnostics.*)."""
    keys = [k[:-2] + ".a_key" if k.endswith(".*") else k for k in NEUTRAL_KEYS]
    return sorted({*keys, *(k for k in BASE if neutral(k) and k not in REPEAT_KEYS)})


def other_values(value) -> st.SearchStrategy:
    """Any other value of the same kind (a set value for an unset one)."""
    if isinstance(value, bool):
        return st.just(not value)
    if isinstance(value, int):
        kind = st.integers()
    elif isinstance(value, float):
        kind = st.floats(allow_nan=False)
    elif isinstance(value, str):
        kind = st.text(min_size=1)
    elif isinstance(value, tuple):
        kind = st.lists(st.floats(allow_nan=False) | st.integers(), max_size=4).map(tuple)
    else:
        kind = st.integers() | st.text(min_size=1)
    return kind.filter(lambda new: new != value)


RESULT_CHANGING = sorted(k for k in [*BASE, *NEW_KEYS] if not neutral(k))


@pytest.mark.parametrize("key", RESULT_CHANGING)
@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_a_result_changing_key_separates_runs_and_is_named(key, data):
    new = data.draw(other_values(BASE.get(key)), label=key)
    a, b = run("a", BASE), run("b", {**BASE, key: new})
    report = build_report([a, b])
    assert len(report.rows) == 2 and [row.n for row in report.rows] == [1, 1]
    shown = {"attention.name": "attention", "model.name": "model"}.get(key, key)
    assert shown in report.keys  # the column says in what they differ


def test_the_result_changing_keys_are_every_key_but_the_declared_ones():
    # the rule's reference, written out: what a run trains on and how (a new key counts by default)
    for key in ("recipe.lr", "trainer.epochs", "trainer.precision", "trainer.init_from", "trainer.eval_every_n_epochs",
                "trainer.strategy", "trainer.accum_steps", "data.pipeline", "data.bad_images", *NEW_KEYS):
        assert key in RESULT_CHANGING
    assert not {"data.root", "trainer.seed", "data.subset_seed", "logger.wandb", "trainer.log_every_n_steps",
                "diagnostics.every_n_steps", "data.num_workers"} & set(RESULT_CHANGING)


@pytest.mark.parametrize("key", neutral_key_cases())
def test_a_neutral_key_leaves_one_setting(key, caplog):
    a, b = run("a", BASE, top1=50.0), run("b", {**BASE, key: changed(BASE.get(key))}, top1=90.0)
    with caplog.at_level(logging.WARNING, logger="quest.report"):
        report = build_report([a, b])
    (row,) = report.rows
    assert report.keys == ["attention", "model"]
    assert row.n == 1 and row.duplicates == [b] and row.stat("val/top1") == (50.0, None, 1)  # same seed: counted once
    assert any("b repeats a (same setting, seed 0): counted once" in m for m in caplog.messages)


@pytest.mark.parametrize("key", REPEAT_KEYS[:2])
def test_another_seed_is_a_repetition(key):
    other = {**BASE, key: BASE[key] + 1}
    a, b = run("a", BASE, top1=50.0), run("b", other, top1=70.0)
    b.summary["seed"] = other["trainer.seed"]
    (row,) = build_report([a, b]).rows
    assert row.n == 2 and row.stat("val/top1") == pytest.approx((60.0, 14.142135623730951, 2))


def test_another_data_set_under_another_root_is_another_setting():
    a = run("a", {**BASE, "data.root": "/data/one"}, top1=50.0)
    b = run("b", {**BASE, "data.root": "/data/two"}, {**FINGERPRINT, "train_size": 32}, top1=90.0)
    report = build_report([a, b])
    assert report.keys == ["attention", "model", DATA_SET]
    assert sorted(row.keys[DATA_SET] for row in report.rows) == [
        "train 32 / val 32, 10 classes [abababababab]", "train 64 / val 32, 10 classes [abababababab]"]
    assert [row.n for row in report.rows] == [1, 1] and not any(row.duplicates for row in report.rows)
    # other classes of the same size: another data set too
    c = run("c", {**BASE, "data.root": "/data/three"}, {**FINGERPRINT, "classes_sha256": "cd" * 32})
    assert len(build_report([a, c]).rows) == 2


def test_the_same_data_under_two_paths_is_one_setting():
    # a moved or copied data set (same sizes and classes) is the same data, as a resume considers it
    a = run("a", {**BASE, "data.root": "/data/one"}, top1=50.0)
    b = run("b", {**BASE, "data.root": "/mnt/copy/one"}, top1=90.0)
    (row,) = build_report([a, b]).rows
    assert row.n == 1 and row.duplicates == [b]


def test_runs_without_a_fingerprint_are_told_apart_by_their_root():
    # written before summary.json recorded the data set: its root is all that says which data it was
    a, b = run("a", {**BASE, "data.root": "/data/one"}, None), run("b", {**BASE, "data.root": "/data/two"}, None)
    report = build_report([a, b])
    assert report.keys == ["attention", "model", DATA_SET] and len(report.rows) == 2
    assert {row.keys[DATA_SET] for row in report.rows} == {"data.root=/data/one (size not recorded)",
                                                           "data.root=/data/two (size not recorded)"}


def test_by_pools_other_settings_and_names_them(caplog):
    a = run("a", BASE, top1=50.0)
    b = run("b", {**BASE, "recipe.lr": 0.5, "trainer.seed": 1}, {**FINGERPRINT, "train_size": 32}, top1=70.0)
    b.summary["seed"] = 1
    with caplog.at_level(logging.WARNING, logger="quest.report"):
        (row,) = build_report([a, b], by=["attention"]).rows
    assert row.n == 2
    assert any("row attention=quest pools runs that differ in data_set, recipe.lr" in m for m in caplog.messages)
