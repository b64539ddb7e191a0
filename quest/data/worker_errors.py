"""A loader's worker failures as one line naming the loader, the worker and the cause, never a hang.

torch's DataLoader reports a failed worker in three ways, none naming the training input that ran in it: an
exception raised in the worker comes back in the training process as "Caught <type> in DataLoader worker process
<n>" with the worker's whole traceback; a worker that dies (``os._exit``, a signal, the kernel's OOM killer) is
"DataLoader worker (pid <p>) exited unexpectedly" or "... is killed by signal", naming a process id; and a worker
that lives on without sending its batch (a batch it failed to pickle: the error is printed by the worker's queue
thread, and the worker waits for its next index) is never reported: the loader waits forever, unless its ``timeout``
is set. :class:`NamedLoader` sets one (:data:`WORKER_TIMEOUT_S`, generous: a worker that sends nothing for that
long is stuck, not slow) and turns each of the three into ``<name>: loader worker <n> failed: <cause>``, the name
saying which loader: training's ``data.pipeline=<p>``, ``validation``, ``eval``.
"""
from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from quest.runtime.errors import UserError, is_user_error

__all__ = ["LoaderWorkerError", "NamedLoader", "WORKER_TIMEOUT_S", "worker_failure"]

#: seconds without a batch from the worker whose batch is next: longer than any batch takes to read
WORKER_TIMEOUT_S = 600.0


class LoaderWorkerError(UserError, RuntimeError):
    """A loader worker died, stopped sending batches, or raised an error the user can fix (a bad file, a full
    disk, too little memory)."""


_CAUGHT = re.compile(r"Caught (\w+) in DataLoader worker process (\d+)")
_TIMED_OUT = "DataLoader timed out after"
_PIDS = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\)")


def _worker_of_pid(iterator: Any, pid: int) -> int | None:
    for worker_id, process in enumerate(getattr(iterator, "_workers", [])):
        if process.pid == pid:
            return worker_id
    return None


def _exit_cause(iterator: Any, worker_id: int | None, fallback: str) -> str:
    """How the worker's process ended: its exit code or the signal that killed it (multiprocessing's exitcode)."""
    workers = getattr(iterator, "_workers", [])
    code = workers[worker_id].exitcode if worker_id is not None and worker_id < len(workers) else None
    if code is None:
        return fallback
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _awaited_worker(iterator: Any) -> int | None:
    """The worker whose batch the loader waits for (torch's bookkeeping: the next index it hands out in order)."""
    task = getattr(iterator, "_task_info", {}).get(getattr(iterator, "_rcvd_idx", None))
    return task[0] if task else None


def worker_failure(exc: BaseException, iterator: Any, name: str) -> BaseException | None:
    """The one-line error for ``exc`` raised while iterating ``iterator`` (a DataLoader's), or None when it is not a
    worker's failure. An exception the worker raised keeps its traceback as the cause; one that is not the user's to
    fix (a bug) comes back as a RuntimeError, so that its traceback is printed."""
    text = str(exc)
    head = f"{name}: loader worker"
    caught = _CAUGHT.search(text)
    if caught:
        lines = [line for line in text.splitlines() if line.strip()]
        cause = lines[-1].strip() if len(lines) > 1 else caught.group(1)  # the worker's own last line
        cause = re.sub(r"^(?:\w+\.)+(\w+): ", r"\1: ", cause)  # the class by its name, as the user knows it
        message = f"{head} {caught.group(2)} failed: {cause}"
        return LoaderWorkerError(message) if is_user_error(exc) else RuntimeError(message)
    if not isinstance(exc, RuntimeError):
        return None
    pids = _PIDS.search(text)
    if pids:
        pid = int(pids.group(1).split(",")[0])
        worker_id = _worker_of_pid(iterator, pid)
        cause = _exit_cause(iterator, worker_id, text.split(". ")[0].replace("DataLoader worker", "process"))
        return LoaderWorkerError(f"{head} {worker_id if worker_id is not None else f'(pid {pid})'} failed: {cause}")
    if text.startswith(_TIMED_OUT):
        worker_id = _awaited_worker(iterator)
        return LoaderWorkerError(f"{head} {worker_id if worker_id is not None else '?'} failed: sent no batch in "
                                 f"{iterator._timeout:g} s (alive, but stuck: its log may show why, e.g. a batch it "
                                 "could not send)")
    return None


class NamedLoader(DataLoader):
    """A DataLoader whose worker failures are :func:`worker_failure`'s one line starting with ``name`` (training's
    ``data.pipeline=<p>``, ``validation``, ``eval``); with workers, a ``timeout`` of :data:`WORKER_TIMEOUT_S` unless
    one is given. Every loader quest builds over image files is one (tar shards have their own loader)."""

    def __init__(self, *args: Any, name: str, **kwargs: Any):
        if kwargs.get("num_workers", 0) > 0:
            kwargs.setdefault("timeout", WORKER_TIMEOUT_S)
        super().__init__(*args, **kwargs)
        self.name = name

    def __iter__(self) -> Iterator[Any]:
        iterator = super().__iter__()
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            except Exception as exc:
                failure = worker_failure(exc, iterator, self.name)
                if failure is None:
                    raise
                stuck = _awaited_worker(iterator) if str(exc).startswith(_TIMED_OUT) else None
                self._stop_workers(iterator, stuck)
                raise failure from exc
            yield batch

    def _stop_workers(self, iterator: Any, stuck: int | None) -> None:
        """The workers stopped now, not when the garbage collector reaches the iterator: the exception's traceback
        holds it in a reference cycle, whose queues may be finalised before the iterator asks its workers to stop,
        and each worker then waits out torch's 5 s join before it is terminated. A ``stuck`` worker (the timeout's)
        would not answer that request: it is terminated first."""
        workers = getattr(iterator, "_workers", [])
        if stuck is not None and stuck < len(workers) and workers[stuck].is_alive():
            workers[stuck].terminate()
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        if getattr(self, "_iterator", None) is iterator:  # persistent workers: the next epoch starts new ones
            self._iterator = None
