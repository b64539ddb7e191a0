"""quest.toy.workers.share_tasks: every task runs once, in this thread or the pool, and failures surface.

A thread pool stands in for the process pool (the same ``apply_async`` contract); the process pool itself runs in
tests/toy/test_toy.py (the sensitivity command with three workers reproduces the single-process runs exactly).
"""
from __future__ import annotations

import threading
from multiprocessing.pool import ThreadPool

import pytest

from quest.toy.workers import share_tasks


def test_every_task_runs_once_here_or_in_the_pool():
    pool_ran, here_ran, done = [], [], []
    pool_finished_one, here_started = threading.Event(), threading.Event()
    active = [0]

    def run_in_pool(t: int) -> int:
        # the pool's first task ends at once; later ones wait until this thread has started one, so that however
        # the threads are scheduled the pool cannot take every task before this thread takes its first
        if pool_finished_one.is_set():
            assert here_started.wait(60), "this thread never took a task"
        pool_ran.append(t)
        pool_finished_one.set()
        return t * t

    def run_here(t: int) -> int:
        here_started.set()
        if not here_ran:  # hold this thread's first task until the pool has finished one: both take part
            assert pool_finished_one.wait(60), "the pool was never given a task"
        here_ran.append(t)
        return t * t

    def on_done(t: int, result: int) -> None:
        active[0] += 1
        assert active[0] == 1, "on_done ran concurrently"
        done.append((t, result))
        active[0] -= 1

    with ThreadPool(2) as pool:
        share_tasks(list(range(20)), run_here, pool, run_in_pool, 2, on_done)
    assert sorted(pool_ran + here_ran) == list(range(20))  # each once, nowhere twice
    assert pool_ran and here_ran
    assert sorted(done) == [(t, t * t) for t in range(20)]


def test_a_pool_failure_is_raised_and_stops_handing_out_tasks():
    here_ran = []
    failed = threading.Event()

    def run_in_pool(t: int) -> int:
        failed.set()
        raise ValueError(f"chunk {t} broke")

    def run_here(t: int) -> int:
        # the pool's failure comes first, while this thread is busy: the feeder thread records it and ends
        assert failed.wait(60)
        for thread in threading.enumerate():
            if thread.name == "toy-pool-feeder":
                thread.join(60)
                assert not thread.is_alive()
        here_ran.append(t)
        return t

    with ThreadPool(1) as pool, pytest.raises(ValueError, match="chunk .* broke"):
        share_tasks(list(range(10)), run_here, pool, run_in_pool, 1, lambda t, r: None)
    assert len(here_ran) <= 1  # this thread finishes the task it had, then takes no other


def test_a_failure_here_is_raised():
    here_started = threading.Event()

    def run_here(t: int) -> int:
        here_started.set()
        raise RuntimeError("out of memory here")

    def run_in_pool(t: int) -> int:
        # holds the pool's task until this thread has taken one: otherwise, on a busy machine, the pool could
        # finish all three before this thread takes any, and there would be no failure here to raise
        assert here_started.wait(60), "this thread never took a task"
        return t

    with ThreadPool(1) as pool, pytest.raises(RuntimeError, match="out of memory here"):
        share_tasks([0, 1, 2], run_here, pool, run_in_pool, 1, lambda t, r: None)


def test_one_task_and_no_tasks():
    done = []
    with ThreadPool(1) as pool:
        share_tasks([], lambda t: t, pool, lambda t: t, 1, lambda t, r: done.append(t))
        assert done == []
        share_tasks([7], lambda t: t, pool, lambda t: t, 1, lambda t, r: done.append((t, r)))
    assert done == [(7, 7)]
