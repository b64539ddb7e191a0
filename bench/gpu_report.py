"""bench/gpu.py's bookkeeping: the time budget, the parts run in priority order, and the report written row by row.

Every row is on disk as soon as it ends: one JSON line appended to ``gpu_check.jsonl``, and ``gpu_check.json`` and
``gpu_check.md`` rewritten whole (a temporary file, then os.replace), so that a call cut short (a time limit, a
killed machine) leaves every row it finished, readable.

A second call into the same folder (the compiled rows the first left out, say) appends to ``gpu_check.jsonl`` after
the first call's lines and never truncates it; the .json and .md are rebuilt from every call's rows, each row
carrying ``call`` (0 for the first call's). A part run again keeps its earlier rows and takes the later status."""
from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from quest.store.files import json_text, open_records, plain, write_text_atomic

__all__ = ["Budget", "Part", "PartRun", "Report", "run_parts"]


@dataclass
class Budget:
    """``total_s`` seconds from ``start`` on ``clock`` (a test drives its own; None: from the moment it is made)."""

    total_s: float
    clock: Callable[[], float] = time.perf_counter
    start: float | None = None

    def __post_init__(self) -> None:
        if self.start is None:
            self.start = self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return self.total_s - self.elapsed()


@dataclass
class Part:
    """One part of the check: ``run(part_run)`` emits its rows. ``estimate_s``: what its first row (or the whole
    part, for a one-row part) is expected to take, on the GPU and in the CPU smoke; ``cap_s``: the most it may use
    (None: whatever the budget leaves), so that one expensive part cannot starve the ones after it; the last part
    run has no cap."""

    name: str
    what: str
    run: Callable[[PartRun], None]
    estimate_s: tuple[float, float]
    cap_s: float | None = None


class Report:
    """The rows of every part so far, this call's and the earlier calls' into the same folder, on disk after each
    one (the module's docstring says how). ``earlier``: the earlier calls' meta (with their ``end`` where they
    ended); ``call``: this call's number."""

    def __init__(self, out_dir: Path, meta: dict[str, Any], render: Callable[[Report], str]):
        self.out_dir, self.meta, self.render = out_dir, meta, render
        self.parts: dict[str, dict[str, Any]] = {}
        self.earlier: list[dict[str, Any]] = []
        out_dir.mkdir(parents=True, exist_ok=True)
        self._lines = open_records(out_dir / "gpu_check.jsonl")  # appends (after cutting a half-written last line)
        self._load(out_dir / "gpu_check.jsonl")
        self.call = len(self.earlier)
        self._line({"meta": meta})

    def _load(self, path: Path) -> None:
        """The earlier calls' rows and part ends from ``path``, as they were added."""
        for line in path.read_text().splitlines():
            record = json.loads(line) if line.strip() else {}
            if "meta" in record:
                self.earlier.append(record["meta"])
            elif "end" in record and self.earlier:
                self.earlier[-1] = {**self.earlier[-1], "end": record["end"]}
            elif "part" in record and "part_status" in record:
                entry = self.part(record["part"])
                entry.update(status=record["part_status"], seconds=record.get("seconds", 0.0),
                             call=len(self.earlier) - 1)
                entry.pop("reason", None)
                if record.get("reason"):
                    entry["reason"] = record["reason"]
            elif "part" in record:
                row = {k: v for k, v in record.items() if k != "part"}
                self.part(record["part"])["rows"].append({"call": len(self.earlier) - 1, **row})

    def _line(self, record: dict[str, Any]) -> None:
        self._lines.write(json_text(plain(record)).strip().replace("\n", " ") + "\n")
        self._lines.flush()

    def part(self, name: str) -> dict[str, Any]:
        return self.parts.setdefault(name, {"status": "running", "rows": []})

    def add(self, name: str, row: dict[str, Any]) -> None:
        row = {"call": self.call, **row}
        self.part(name)["rows"].append(row)
        self._line({"part": name, **row})
        self.write()

    def start(self, name: str) -> None:
        """``name`` on disk as running in this call (a call cut short shows where it was)."""
        entry = self.part(name)
        entry.pop("reason", None)
        entry.update(status="running", call=self.call)
        self.write()

    def end(self, name: str, status: str, seconds: float, reason: str = "") -> None:
        entry = self.part(name)
        entry.pop("reason", None)
        entry.update(status=status, seconds=seconds, call=self.call, **({"reason": reason} if reason else {}))
        self._line({"part": name, "part_status": status, "seconds": seconds, **({"reason": reason} if reason else {})})
        self.write()

    def rows(self, name: str, this_call: bool = True) -> list[dict[str, Any]]:
        """``name``'s rows: this call's (``this_call``), else every call's."""
        rows = self.parts.get(name, {}).get("rows", [])
        return [r for r in rows if r.get("call") == self.call] if this_call else rows

    def write(self) -> None:
        whole = {**self.meta, "earlier_calls": self.earlier, "parts": self.parts}
        write_text_atomic(self.out_dir / "gpu_check.json", json_text(plain(whole)))
        write_text_atomic(self.out_dir / "gpu_check.md", self.render(self))

    def close(self, ending: dict[str, Any] | None = None) -> None:
        """The last line (``{"end": ending}``: a file without it is from a call cut short), and the file closed."""
        if ending is not None:
            self._line({"end": ending})
        self._lines.close()


class PartRun:
    """What a part sees while it runs: its time left (the budget's, or its cap's if sooner), a way to emit a row,
    and :meth:`afford`, the check before each row."""

    def __init__(self, part: Part, report: Report, budget: Budget, smoke: bool, capped: bool = True):
        self.part, self.report, self.budget, self.smoke = part, report, budget, smoke
        self.cap_s = part.cap_s if capped else None
        self.start = budget.elapsed()
        self.last_row_s: float | None = None  # how long the part's previous row took: the next one's estimate
        self._row_start = self.start

    def left(self) -> float:
        left = self.budget.left()
        if self.cap_s is not None:
            left = min(left, self.cap_s - (self.budget.elapsed() - self.start))
        return left

    def estimate(self) -> float:
        """The next row's expected seconds: the previous row's, else the part's estimate for its first row."""
        return self.last_row_s if self.last_row_s is not None else self.part.estimate_s[1 if self.smoke else 0]

    def afford(self, what: str, estimate: float | None = None) -> bool:
        """Whether ``what`` (expected to take ``estimate`` s, default :meth:`estimate`) fits in the time left; when
        it does not, a row says it was skipped and why."""
        need = self.estimate() if estimate is None else estimate
        if need <= self.left():
            self._row_start = self.budget.elapsed()
            return True
        self.report.add(self.part.name, {"skipped": what, "reason": f"needs ~{need:.0f} s, {max(self.left(), 0):.0f} "
                                                                    "s left"})
        return False

    def row(self, row: dict[str, Any]) -> None:
        now = self.budget.elapsed()
        self.last_row_s = now - self._row_start
        self._row_start = now
        self.report.add(self.part.name, {**row, "row_s": self.last_row_s})


def run_parts(parts: list[Part], report: Report, budget: Budget, smoke: bool) -> None:
    """Each part in order (the list is the priority), each started only when its first row's estimate fits in
    the time left, and held to its cap only when parts follow it (the last may use what is left); a part that
    raises is recorded as failed with its traceback and the next one runs."""
    for index, part in enumerate(parts):
        need = part.estimate_s[1 if smoke else 0]
        if need > budget.left():
            report.end(part.name, "skipped", 0.0, f"needs ~{need:.0f} s, {max(budget.left(), 0):.0f} s left of "
                                                  f"the {budget.total_s:.0f} s budget")
            continue
        run = PartRun(part, report, budget, smoke, capped=index < len(parts) - 1)
        report.start(part.name)
        print(f"== {part.name}: {part.what} ({budget.left():.0f} s left)", flush=True)
        try:
            part.run(run)
        except KeyboardInterrupt:  # a call cut short: what ran so far stays on disk, marked so
            report.end(part.name, "interrupted", budget.elapsed() - run.start)
            raise
        except Exception:
            report.end(part.name, "failed", budget.elapsed() - run.start, traceback.format_exc()[-2000:])
            continue
        skipped = any("skipped" in r for r in report.rows(part.name))
        report.end(part.name, "ended at the budget" if skipped else "done", budget.elapsed() - run.start)
