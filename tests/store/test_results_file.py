"""eval_results.json's one reader (quest.store.results_file): every field of a wrong type or out of range,
at the top level and in any evaluation's numbers, is refused naming the file and the field, by eval.py's reader and
by quest-report's; a good file reads back unchanged."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quest.evaluation.directory import EvalDirectoryError, read_results
from quest.report.runs import ReportInputError, _eval_metrics
from quest.store.damage import DamagedFile
from quest.store.results_file import METRIC_RULES, EvalResultsRecord, checked_results

from ..record_faults import SAMPLES, faults, planted

GOOD = {
    "suite": "clean", "evaluations": ["clean", "adversarial"], "status": "complete",
    "target": {"source": "checkpoint", "model": "vit_pico_patch4_16"}, "inputs": {"data.root": "digits"},
    "settings": {"name": "clean"}, "command": ["eval=clean"], "world_size": 1, "device": "cpu", "precision": "fp32",
    "versions": {"torch": "2.14.1", "pyautoattack": None}, "started": "2026-12-04T21:05:09+00:00",
    "fingerprint": {"evaluated": {}}, "key": "43103a05fe7f7b42", "wall_time_s": 6.26,
    "results": {"clean": {"top1": 10.0, "top5": 100 * 175 / 360, "nll": 2.31, "correct": 36, "top5_correct": 175,
                          "n": 360,
                          "subset": {"samples": 360, "of": 360}},
                "adversarial": {"fgsm": [{"eps": 0.004, "top1": 5.0, "clean_top1": 10.0, "n": 360}],
                                "real": {"top1": None}}},
}


def test_a_good_file_reads_back_unchanged():
    assert checked_results(json.loads(json.dumps(GOOD)), "r.json") == GOOD


@pytest.mark.parametrize(("field", "value"), list(faults(EvalResultsRecord)),
                         ids=lambda v: v if isinstance(v, str) else repr(v))
def test_every_top_level_field_of_a_wrong_type_or_range_is_refused_naming_it(field, value):
    with pytest.raises(DamagedFile, match=rf"^r\.json: {field}"):
        checked_results(planted(GOOD, field, value), "r.json")


@settings(max_examples=60)
@given(where=st.just("adversarial.real"), name=st.sampled_from(sorted(METRIC_RULES)),
       value=st.sampled_from(SAMPLES + [101.0, -1, -0.5, 1e9]))
def test_a_number_of_the_results_out_of_its_kind_is_refused_naming_it(where, name, value):
    """A percentage outside [0, 100], a negative or fractional count, a negative loss, a string, a bool: refused
    wherever it sits in an evaluation's numbers; anything it may be is read (here where no counts stand beside it:
    the next test holds a percentage to its counts)."""
    from quest.store.records import field_problem

    hint, bounds = METRIC_RULES[name]
    record = planted(GOOD, f"results.{where}.{name}", value)
    if field_problem(value, hint, bounds) is None:
        assert checked_results(record, "r.json")["results"] == record["results"]
    else:
        with pytest.raises(DamagedFile, match=rf"^r\.json: results\.{where}\.{name} is"):
            checked_results(record, "r.json")


def test_a_number_inside_a_list_of_an_evaluation_is_checked():
    bad = json.loads(json.dumps(GOOD))
    bad["results"]["adversarial"]["fgsm"][0]["top1"] = "5"
    with pytest.raises(DamagedFile, match=r"results\.adversarial\.fgsm\[0\]\.top1 is str '5'"):
        checked_results(bad, "r.json")


def test_eval_and_report_both_refuse_an_unknown_status_and_a_string_top1(tmp_path):
    for change, field in [({"status": "done"}, "status"), ({"results": {"clean": {"top1": "98.6"}}}, "results")]:
        folder = tmp_path / field / "eval" / "clean" / "last-model"
        folder.mkdir(parents=True)
        path = folder / "eval_results.json"
        path.write_text(json.dumps({**GOOD, **change}))
        with pytest.raises(EvalDirectoryError, match=rf"{path}: {field}"):
            read_results(path)
        with pytest.raises(ReportInputError, match=rf"{path}: {field}"):
            _eval_metrics(tmp_path / field)


@settings(max_examples=80)
@given(n=st.integers(1, 10**6), data=st.data())
def test_a_percentage_beside_its_counts_must_be_the_one_they_make(n, data):
    """top1 and top5 beside n and their counts are read only where they are 100 * count / n, and a count above n
    never: a figure edited by hand (top1 99 where 70 of 360 were correct) is refused naming it."""
    correct = data.draw(st.integers(0, n + 2), "correct")
    top1 = data.draw(st.one_of(st.just(100 * correct / n), st.floats(0, 100)), "top1")
    record = planted(planted(planted(GOOD, "results.clean.n", n), "results.clean.correct", correct),
                     "results.clean.top1", top1)
    record = planted(planted(record, "results.clean.top5_correct", n), "results.clean.top5", 100.0)
    if correct <= n and abs(top1 - 100 * correct / n) <= 1e-7:
        assert checked_results(record, "r.json")["results"]["clean"]["top1"] == top1
    else:
        with pytest.raises(DamagedFile, match=r"^r\.json: results\.clean\.(top1|correct) is"):
            checked_results(record, "r.json")
