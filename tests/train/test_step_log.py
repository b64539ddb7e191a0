"""The training log's first line (quest.train.loop.StepLog): an attempt's first step gets a line whatever
trainer.log_every_n_steps is (a first step can take minutes, the first logged one an epoch), with no metrics row;
the rows and the usual lines stay those of the interval. That the line reads nothing from the device is held by
tests/train/test_host_reads.py (one read per logged step, none at step 1 with an interval of 3)."""
from __future__ import annotations

import json
import logging
import re

import pytest

from quest.train import fit

from ..helpers import FAST, compose_cfg

FIRST = re.compile(r"epoch (\d+)/2 step (\d+)/(\d+): first step \d+\.\d\d s \(loader start and compilation "
                   r"included\); next line at step (\d+)")
STEP_LINE = re.compile(r"epoch \d+/\d+ step (\d+)/\d+ loss")


@pytest.fixture(autouse=True)
def _info_logged(caplog):
    caplog.set_level(logging.INFO, logger="quest")  # train.log's lines, as train.py's logging writes them


def test_each_attempt_s_first_step_has_a_line_and_no_row_whatever_the_interval(tmp_path):
    # 8 steps (4 an epoch), logged every 100: the first attempt stops at trainer.max_steps=3, the second resumes
    fit(compose_cfg(*FAST, "trainer.log_every_n_steps=100", "trainer.max_steps=3"), tmp_path)
    fit(compose_cfg(*FAST, "trainer.log_every_n_steps=100"), tmp_path)
    log = (tmp_path / "train.log").read_text()
    # each attempt: its first step, and the next line at its last step (the interval is longer than the run)
    assert [tuple(map(int, m)) for m in FIRST.findall(log)] == [(1, 1, 3, 3), (1, 4, 8, 8)]
    assert [int(s) for s in STEP_LINE.findall(log)] == [3, 8]
    assert log.index("step 1/3: first step") < log.index("step 3/3 loss")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "train/loss" in row] == [3, 8]  # the rows of the interval only


def test_a_first_step_that_is_logged_has_its_usual_line_only(tmp_path):
    fit(compose_cfg(*FAST, "trainer.max_steps=2"), tmp_path)  # FAST logs every step
    log = (tmp_path / "train.log").read_text()
    assert not FIRST.search(log) and [int(s) for s in STEP_LINE.findall(log)] == [1, 2]
