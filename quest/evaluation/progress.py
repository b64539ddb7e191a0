"""Progress lines of long evaluations on the ``quest.eval`` logger (and of the toy study's chunks on its own), with
elapsed time and an ETA, as training has.

One :class:`Progress` follows one loop (the batches of a pass over a data set, the budgets' batches of an attack,
the cells of a corruption grid). A top-level loop logs its first step (the first ETA), its last step, every
``every_n``-th step and, in between, whenever ``every_s`` seconds have passed since its last line; a loop nested in
another that reports (each pass of a corruption grid) logs by time only, so that a long pass still shows it runs
without repeating what the outer loop says.

A step can itself be long (one batch of SPSA or AutoAttack takes minutes): the work inside it reports its own
iterations through :meth:`Progress.within`, counted on the host (no device sync), which logs by time only
(``<what>: batch b/B, iteration i/I, elapsed, ETA``), so a line comes at least every ``every_s`` seconds whatever
one step costs. A long call with no loop to count (an ONNX export) has a :class:`Heartbeat` instead.
"""
from __future__ import annotations

import logging
import math
import threading
from time import monotonic
from typing import Callable, Iterable, Iterator, TypeVar

__all__ = ["Progress", "tracked", "hms", "Inner", "Heartbeat"]

log = logging.getLogger("quest.eval")
T = TypeVar("T")


def hms(seconds: float) -> str:
    """``12.3 s`` under a minute, else ``H:MM:SS`` as the trainer prints its ETA; ``?`` when unknown."""
    if not math.isfinite(seconds):
        return "?"
    if seconds < 59.95:
        return f"{seconds:.1f} s"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """Counts the steps (and samples) of one loop and logs ``<what>: <unit> i/N, s/S samples, elapsed, ETA, ...``.

    ``every_n`` (0: off) and ``every_s`` (0: off) set the cadence; ``nested`` keeps only the time rule;
    ``enabled=False`` (processes other than the first) logs nothing; ``logger``: where the lines go (``quest.eval``
    when None). ``clock`` (seconds; ``time.monotonic`` when None) is for tests."""

    def __init__(self, what: str, total: int, samples: int | None = None, unit: str = "batch", every_n: int = 0,
                 every_s: float = 10.0, nested: bool = False, enabled: bool = True,
                 clock: Callable[[], float] | None = None, logger: logging.Logger | None = None):
        self.what, self.total, self.total_samples, self.unit = what, int(total), samples, unit
        self.every_n, self.every_s, self.nested, self.enabled = int(every_n), float(every_s), nested, enabled
        self.clock, self.log = clock or monotonic, logger or log
        self.start = self.last_line = self.step_start = self.clock()
        self.done = self.samples = 0
        self.lines = 0  # how many lines this loop logged

    def _due(self, now: float) -> bool:
        if self.every_s > 0 and now - self.last_line >= self.every_s:
            return True
        if self.nested:
            return False
        return self.done in (1, self.total) or (self.every_n > 0 and self.done % self.every_n == 0)

    def update(self, samples: int = 0, extra: str | Callable[[], str] = "") -> None:
        """One step done (with ``samples`` samples); ``extra`` (text, or a function giving it only when a line is
        due) ends the line, e.g. the running accuracy."""
        self.done += 1
        self.samples += samples
        now = self.step_start = self.clock()
        if not self.enabled or not self._due(now):
            return
        elapsed = now - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.total >= self.done else math.nan
        parts = [f"{self.unit} {self.done}/{self.total}"]
        if self.total_samples is not None:
            parts.append(f"{self.samples}/{self.total_samples} samples")
        parts += [f"elapsed {hms(elapsed)}", f"ETA {hms(eta)}"]
        text = extra() if callable(extra) else extra
        if text:
            parts.append(text)
        self._log(parts, now)

    def _log(self, parts: list[str], now: float) -> None:
        self.log.info("%s: %s", self.what, ", ".join(parts))
        self.last_line = now
        self.lines += 1

    def within(self, done: int, total: int | None, unit: str = "iteration", detail: str = "") -> None:
        """``done`` of ``total`` (None: unknown) ``unit``-s of the step under way, counted by the caller on the
        host; logs ``<what>: batch b/B, <unit> done/total[, detail], elapsed, ETA`` (the loop's own unit for the
        batch) when ``every_s`` seconds have passed since the last line (by time only: the step's own line still
        comes from :meth:`update`). The ETA
        counts the step under way as the fraction ``done/total`` of a step, or, with no total, its elapsed time
        against the mean of the steps done (``?`` before the first)."""
        if not self.enabled or self.every_s <= 0:
            return
        now = self.clock()
        if now - self.last_line < self.every_s:
            return
        elapsed = now - self.start
        if total:
            steps = self.done + min(done, total) / total
            eta = elapsed / steps * (self.total - steps) if steps > 0 else math.nan
        elif self.done:
            eta = max(0.0, (self.step_start - self.start) / self.done * (self.total - self.done)
                      - (now - self.step_start))
        else:
            eta = math.nan
        parts = [f"{self.unit} {self.done + 1}/{self.total}", f"{unit} {done}/{total}" if total else f"{unit} {done}"]
        if detail:
            parts.append(detail)
        self._log(parts + [f"elapsed {hms(elapsed)}", f"ETA {hms(eta)}"], now)


class Inner:
    """The iterations inside one step of ``progress``, for a loop that cannot see it: ``inner(done, total)``
    (after each iteration) or ``inner.count(detail)`` (one more of an open-ended count) report to
    :meth:`Progress.within`; ``None`` progress reports nothing. Costs a clock read per call, no device work."""

    def __init__(self, progress: Progress | None, unit: str = "iteration"):
        self.progress, self.unit, self.counted = progress, unit, 0

    def __call__(self, done: int, total: int | None, detail: str = "") -> None:
        if self.progress is not None:
            self.progress.within(done, total, self.unit, detail)

    def count(self, detail: str = "") -> None:
        self.counted += 1
        self(self.counted, None, detail)


class tracked:
    """``iterable`` (a DataLoader: batches of (images, targets, ...)) counting each batch into ``progress`` once the
    consumer is done with it, i.e. when it asks for the next one; ``len`` is the iterable's."""

    def __init__(self, iterable: Iterable[T], progress: Progress):
        self.iterable, self.progress = iterable, progress

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __getattr__(self, name: str):
        # everything else (dataset, sampler, batch_size) is the loader's, so the wrapper passes for it
        return getattr(self.iterable, name)

    def __iter__(self) -> Iterator[T]:
        for batch in self.iterable:
            yield batch
            self.progress.update(len(batch[1]))


class Heartbeat:
    """A line every ``every_s`` seconds while one long call runs that has no loop to count (an ONNX export), from a
    daemon thread: ``<what>: still running, elapsed 20.0 s``, given to ``emit``. A context manager; nothing is
    emitted once it is left. ``wait`` (``threading.Event.wait`` of its stop event when None) and ``clock`` are for
    tests."""

    def __init__(self, what: str, emit: Callable[[str], None], every_s: float = 10.0,
                 clock: Callable[[], float] | None = None, wait: Callable[[float], bool] | None = None):
        self.what, self.emit, self.every_s, self.clock = what, emit, float(every_s), clock or monotonic
        self.stopped = threading.Event()
        self.wait = wait or self.stopped.wait
        self.thread: threading.Thread | None = None
        self.start = self.clock()

    def beat(self) -> None:
        """The thread's work: a line at each ``every_s`` that passes before the stop."""
        while not self.wait(self.every_s) and not self.stopped.is_set():
            self.emit(f"{self.what}: still running, elapsed {hms(self.clock() - self.start)}")

    def __enter__(self) -> "Heartbeat":
        self.start = self.clock()
        if self.every_s > 0:
            self.thread = threading.Thread(target=self.beat, name="heartbeat", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()
