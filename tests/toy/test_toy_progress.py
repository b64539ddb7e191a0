"""The toy study's progress: a chunk trains for minutes, so it logs a line every ``log_every_s`` seconds (epoch e/E,
elapsed, ETA, chunk k/K) besides the line at its end; lines of chunks trained by pool workers reach the parent's
logger through a queue. Time never decides a test: a clock that ticks once per reading stands in for the real one."""
from __future__ import annotations

import logging
import logging.handlers
import queue
import re

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from quest.toy.config import register_toy_config
from quest.toy.study import run_study
from quest.toy.workers import relay_logs, send_logs_to

from ..helpers import CONFIGS, TickingClock


def _tiny(*overrides: str) -> dict:
    register_toy_config()
    with initialize_config_dir(config_dir=str(CONFIGS / "toy"), version_base="1.3"):
        cfg = compose(config_name="toy", overrides=[
            "grid=quick", "grid.lrs=[0.01]", "grid.weight_decays=[0.0]", "grid.data_seeds=[0]", "grid.init_seeds=[0]",
            "data.train_size=16", "data.test_size=16", "train.epochs=3", "probe_size=8", "workers=1", "compile=false",
            "attentions=[standard,quest]", "device=cpu", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


@pytest.fixture
def toy_lines(caplog):
    caplog.set_level(logging.INFO, logger="quest.toy")
    return lambda: [r.getMessage() for r in caplog.records if r.name.startswith("quest.toy")]


def test_each_chunk_logs_by_time_with_its_epoch_eta_and_place(tmp_path, monkeypatch, toy_lines):
    monkeypatch.setattr("quest.evaluation.progress.monotonic", TickingClock())
    run_study(_tiny("log_every_s=2"), tmp_path / "toy")
    # a reading when the chunk starts and one per epoch: 2 s after the start is the end of epoch 2 of 3
    progress = [m for m in toy_lines() if re.search(r": epoch \d+/\d+, ", m)]
    assert progress == ["standard, n=16, data 0: epoch 2/3, elapsed 2.0 s, ETA 1.0 s, chunk 1/2",
                        "quest, n=16, data 0: epoch 2/3, elapsed 2.0 s, ETA 1.0 s, chunk 2/2"]
    # the line at each chunk's end is still there, with the study's ETA
    assert sum("trained in" in m and "chunks," in m for m in toy_lines()) == 2


def test_a_worker_s_records_reach_the_parent_s_handlers_through_the_queue(monkeypatch, caplog):
    toy_log = logging.getLogger("quest.toy")
    # send_logs_to rewires the worker's quest.toy logger: put it back after the test
    monkeypatch.setattr(toy_log, "handlers", list(toy_log.handlers))
    monkeypatch.setattr(toy_log, "propagate", toy_log.propagate)
    monkeypatch.setattr(toy_log, "level", toy_log.level)
    records: queue.Queue = queue.Queue()
    send_logs_to(records)  # what a spawned worker does first
    logging.getLogger("quest.toy.study").info("standard, n=%d, data 0: epoch 1/3", 16)
    sent = records.get_nowait()
    assert records.empty() and sent.name == "quest.toy.study" and sent.getMessage() == "standard, n=16, data 0: epoch 1/3"
    # the parent: its handlers (here pytest's) log the worker's record once, under the worker's logger name
    toy_log.handlers, toy_log.propagate = [h for h in toy_log.handlers
                                           if not isinstance(h, logging.handlers.QueueHandler)], True
    caplog.set_level(logging.INFO, logger="quest.toy")
    records.put(sent)
    records.put(None)
    relay = relay_logs(records)
    relay.join(timeout=60)
    assert not relay.is_alive()
    assert [(r.name, r.getMessage()) for r in caplog.records] == [("quest.toy.study", "standard, n=16, data 0: epoch 1/3")]
