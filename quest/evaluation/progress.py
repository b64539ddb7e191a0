"""Progress lines of long evaluations on the ``quest.eval`` logger, with elapsed time and an ETA, as training has.

One :class:`Progress` follows one loop (the batches of a pass over a data set, the budgets' batches of an attack,
the cells of a corruption grid). A top-level loop logs its first step (the first ETA), its last step, every
``every_n``-th step and, in between, whenever ``every_s`` seconds have passed since its last line; a loop nested in
another that reports (each pass of a corruption grid) logs by time only, so that a long pass still shows it runs
without repeating what the outer loop says.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable, Iterable, Iterator, TypeVar

__all__ = ["Progress", "tracked", "hms"]

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
    ``enabled=False`` (processes other than the first) logs nothing. ``clock`` is for tests."""

    def __init__(self, what: str, total: int, samples: int | None = None, unit: str = "batch", every_n: int = 0,
                 every_s: float = 30.0, nested: bool = False, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.what, self.total, self.total_samples, self.unit = what, int(total), samples, unit
        self.every_n, self.every_s, self.nested, self.enabled = int(every_n), float(every_s), nested, enabled
        self.clock = clock
        self.start = self.last_line = clock()
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
        now = self.clock()
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
        log.info("%s: %s", self.what, ", ".join(parts))
        self.last_line = now
        self.lines += 1


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
