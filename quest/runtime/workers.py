"""No worker outlives its command: every process quest starts to help it (the data pre-flight's and the resolution
cap's pools, data loader workers, the toy study's pool, evaluation loaders) runs :func:`die_with_parent` first.

A parent killed by a signal it does not handle (SIGTERM during the pre-flight, SIGKILL, the OOM killer) runs no
cleanup, so ``with ProcessPoolExecutor(...)`` never joins its workers: they would wait on their queue forever,
re-parented to init. Linux's ``PR_SET_PDEATHSIG`` has the kernel send them SIGKILL the moment the parent goes,
whatever ended it. Elsewhere (macOS) it is a no-op: the workers end when their queue's pipe breaks.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any

__all__ = ["die_with_parent", "worker_pool", "loader_worker_init", "most_processes", "process_count", "process_count_problem"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(*_: Any) -> None:
    """In a worker process: be killed when the process that started it ends (any arguments are ignored, so this
    is usable as a pool ``initializer`` or a DataLoader ``worker_init_fn``)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl (another libc): the queue's broken pipe still ends the worker
        return
    if parent == 1 or os.getppid() != parent:  # the parent ended before the request took effect
        os._exit(1)


@contextmanager
def worker_pool(workers: int) -> Iterator[ProcessPoolExecutor]:
    """A pool of ``workers`` processes that die with this one. On an exception (Ctrl-C) its queued work is dropped,
    not waited for: waiting for it after a KeyboardInterrupt could hang the command's exit (measured: 2 of 5
    interrupted pre-flights of 1,500 images hung, none in 11 once it stopped waiting)."""
    pool = ProcessPoolExecutor(workers, initializer=die_with_parent)
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


def loader_worker_init(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: dies with the training process, and leaves Ctrl-C to it: Ctrl-C reaches the
    whole foreground process group, but only the main process decides (a worker killed by it would break the batch
    the main process still needs for a clean stop). SIGTERM keeps its default: it is how the main process (and
    multiprocessing at exit) ends its workers."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# --- how many: a count of processes or threads a config may ask for (declared on config fields) -----------
def most_processes() -> int:
    """The most worker processes or threads a config may ask for: 4 per CPU this process may use, at least 64. Past a
    few per CPU they only add memory, and a typo (10**6) would fork or spawn until the machine runs out of it."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(64, 4 * cpus)


def process_count_problem(value: Any, minimum: int) -> str | None:
    """What a count of processes or threads must be, when ``value`` is not that (see :func:`most_processes`)."""
    most = most_processes()
    if isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= most:
        return None
    return f"an integer in {minimum}..{most} (at most 4 per CPU this process may use, or 64)"


def process_count(minimum: int = 1) -> dict[str, Any]:
    """Field metadata of a count of worker processes or threads: ``minimum``..:func:`most_processes`, the upper end
    found when the value is checked (it depends on the machine)."""
    return {"bounds": (minimum, most_processes), "allowed": lambda: process_count_problem(None, minimum)}
