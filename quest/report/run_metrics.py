"""What the figures read from a run directory: ``metrics.jsonl``'s records and the run's formulation (its
``summary.json``), with :class:`PlotInputError` naming the path and what was expected."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from quest.store.damage import DamagedFile
from quest.store.files import OutsideFolder, inside_folder, parse_json, read_json
from quest.store.records import check_fields
from quest.store.run_files import RunSummary, check_metrics_row

__all__ = ["PlotInputError", "load_metrics", "run_formulation", "run_label"]

logger = logging.getLogger("quest.report")


class PlotInputError(ValueError):
    """A run directory that cannot be plotted; the message names the path and what was expected."""


def _own(run_dir: Path, name: str) -> Path:
    """``run_dir/name`` when it is the run's own file (quest.store.files.inside_folder), never a link to another run's."""
    try:
        return inside_folder(run_dir / name, run_dir)
    except OutsideFolder as exc:
        raise PlotInputError(str(exc)) from None


def load_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl``; a truncated last line (a run killed mid-write) is skipped."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PlotInputError(f"{run_dir}: not a directory (expected a run directory containing metrics.jsonl)")
    path = _own(run_dir, "metrics.jsonl")
    if not path.is_file():
        raise PlotInputError(
            f"{path}: file not found (expected the run's metrics.jsonl, one JSON object per line with an integer "
            "'step')"
        )
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError as err:
        raise PlotInputError(f"{path}: not text ({err}); expected one JSON object per line") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = parse_json(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                logger.warning("%s:%d: skipping a truncated last line", path, number)
                continue
            raise PlotInputError(f"{path}:{number}: not valid JSON ({err.msg}); expected one JSON object per line")
        try:  # every field checked (quest.store.run_files)
            records.append(check_metrics_row(record, f"{path}:{number}"))
        except DamagedFile as exc:
            raise PlotInputError(str(exc)) from None
    return records


def run_formulation(run_dir: Path) -> str | None:
    """The run's attention formulation: ``attention`` (or ``choices.attention``) from ``summary.json``, else None."""
    summary_path = _own(Path(run_dir), "summary.json")
    if not summary_path.is_file():
        return None
    try:  # every field it holds checked (quest.store.run_files); a label needs no status
        summary = read_json(summary_path) or {}
        check_fields(RunSummary, summary, summary_path)
    except DamagedFile as exc:
        logger.warning("%s; labelling the run by its directory name", exc)
        return None
    return summary.get("attention") or summary.get("choices", {}).get("attention")


def run_label(run_dir: Path) -> str:
    """``attention`` (or ``choices.attention``) from ``summary.json``, else the directory name."""
    return run_formulation(run_dir) or Path(run_dir).resolve().name
