"""Tasks shared between this process and a pool of worker processes, handed out one at a time.

The parent trains chunks too instead of waiting on the pool: a pool of ``workers - 1`` processes keeps every core
busy with one interpreter fewer to start (importing torch, timm and quest costs a spawned worker about 4 s of a core
before it trains anything, which sat on the critical path of ``grid=quick``'s two chunks). Whoever is free first, the
parent or a pool worker, takes the next task from one queue, so a slow chunk does not hold the others back.

A spawned worker's logging is not configured (INFO is dropped), so the workers' ``quest.toy`` records (their chunks'
progress lines) travel through a queue to the parent, which logs them through its own handlers (console, toy.log).
"""
from __future__ import annotations

import logging
import logging.handlers
import queue
import threading
from typing import Any, Callable, Sequence, TypeVar

__all__ = ["share_tasks", "send_logs_to", "relay_logs"]

T = TypeVar("T")
R = TypeVar("R")


def share_tasks(tasks: Sequence[T], run_here: Callable[[T], R], pool: Any, run_in_pool: Callable[[T], R],
                slots: int, on_done: Callable[[T, R], None]) -> None:
    """Run every task once, in this thread (``run_here``) or in ``pool`` (``pool.apply_async(run_in_pool, (task,))``,
    at most ``slots`` at a time), and call ``on_done(task, result)`` for each as it finishes (one call at a time).

    The first exception, raised by ``run_here`` or by a pool task, stops handing out tasks and is raised here once
    this thread's task has ended; the caller's pool context (``with Pool(...)``) then stops the workers.
    """
    lock = threading.Lock()
    pending = iter(tasks)
    failures: list[BaseException] = []
    results: queue.SimpleQueue = queue.SimpleQueue()  # (task, result, exception) from the pool's result thread

    def take() -> T | None:
        with lock:
            return None if failures else next(pending, None)

    def finish(task: T, result: R) -> None:
        with lock:
            on_done(task, result)

    def fail(exc: BaseException) -> None:
        with lock:
            failures.append(exc)

    def feed_pool() -> None:
        # A thread of this process: keeps `slots` tasks in the pool and collects their results while this
        # process's main thread trains its own.
        in_flight = 0
        while True:
            while in_flight < slots and (task := take()) is not None:
                pool.apply_async(run_in_pool, (task,), callback=lambda r, t=task: results.put((t, r, None)),
                                 error_callback=lambda e, t=task: results.put((t, None, e)))
                in_flight += 1
            if not in_flight:
                return
            task, result, exc = results.get()
            in_flight -= 1
            if exc is not None:
                fail(exc)
                return  # the tasks still in the pool are abandoned: the caller stops the pool
            try:
                finish(task, result)
            except BaseException as e:  # noqa: BLE001 - raised in the main thread below
                fail(e)
                return

    feeder = threading.Thread(target=feed_pool, name="toy-pool-feeder", daemon=True)
    feeder.start()
    try:
        while (task := take()) is not None:
            finish(task, run_here(task))
    except BaseException as e:
        fail(e)
        raise
    feeder.join()
    if failures:
        raise failures[0]


def send_logs_to(records: Any) -> None:
    """A worker's ``quest.toy`` records go to the queue ``records`` (the parent logs them through its own handlers:
    console and toy.log) instead of a spawned interpreter's unconfigured logging, which drops INFO."""
    toy_log = logging.getLogger("quest.toy")
    toy_log.addHandler(logging.handlers.QueueHandler(records))
    toy_log.setLevel(logging.INFO)
    toy_log.propagate = False


def relay_logs(records: Any) -> threading.Thread:
    """A thread of the parent logging each record from ``records`` on its own logger until it reads None. It ends
    on a record it cannot read (a worker terminated while writing one) rather than hang the study."""
    def relay() -> None:
        while True:
            try:
                record = records.get()
            except Exception:  # noqa: BLE001 - a torn record of a terminated worker: the lines stop, the study goes on
                return
            if record is None:
                return
            logging.getLogger(record.name).handle(record)

    thread = threading.Thread(target=relay, name="toy-log-relay", daemon=True)
    thread.start()
    return thread
