"""What a run directory holds when ``train.py`` starts, and what quest does with it: the run directory as a state
machine (docs/training.md, "What a run directory holds").

:func:`survey` only reads. It returns a :class:`Plan` or raises :class:`~quest.config.checks.ConfigError` naming the
file and the way out, so that a refused command changes nothing; :func:`carry_out` makes the plan's changes once
every other check has passed. The rules, for ``trainer.resume=auto``:

- ``checkpoints/last.pt`` is the source of truth. Damaged (cut short, garbage, a failed CRC): refused. Missing:
  the run continues from ``best.pt`` only where that is the one crash point that leaves it so (killed after
  ``best.pt`` was written and before ``last.pt`` became the same file, nothing logged since); otherwise refused,
  saying how to continue from ``best.pt`` or start afresh.
- ``best.pt`` damaged: kept aside (``.replaced/``) with a warning; it is written again at the next better epoch.
- ``metrics.jsonl``: what the checkpoint saw is stored in it (``metrics_text``). Missing, cut short or overwritten:
  rebuilt from the checkpoint, a damaged copy kept aside. Lines logged after the checkpoint (an interrupted attempt,
  which the resumed run logs again) are cut off, the whole file kept aside first.
- ``summary.json`` / ``run.json`` damaged, or ``run.json`` of another run (not JSON, not an object, a field of the
  wrong type or range, a config that differs from the checkpoint's in a key no resume changes:
  quest.store.run_files): kept aside and written again (run.json from the checkpoint's config). A final
  ``summary.json`` (completed, stopped) that a continuing run will replace is kept aside first.
- No checkpoint at all: an attempt killed before its first checkpoint (run.json records none) starts again with the
  same config, its metrics kept aside; a run whose checkpoints are gone, or files nobody can place, are refused.
- ``.lock``, ``.hydra/`` and ``train.log`` carry no state: the lock's content is rewritten, ``.hydra/`` written
  anew by the command that passed every check, ``train.log`` appended to.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quest.config.checks import ConfigError
from quest.config.differences import Difference
from quest.config.schema import RESUME_SAFE_KEYS, matches_key
from quest.store.compat import checkpoint_metrics_text
from quest.store.damage import DamagedFile
from quest.store.files import read_json, write_text_atomic
from quest.store.run_files import checked_run_record, checked_summary
from quest.store.torch_files import ZIP_MAGIC, damaged_member
from quest.store.tree import move_aside

from .checkpoint import CheckpointRecord, CheckpointRecordError, check_compatible, load_record
from .directory import FINAL_STATUSES, RunDirectory, check_resume, config_differences

log = logging.getLogger("quest.train")

__all__ = ["Plan", "survey", "carry_out", "finished_summary"]

_AFRESH = "start afresh with trainer.resume=never trainer.overwrite=true (the run is moved to .replaced/ first)"


@dataclass
class Plan:
    """What a start does with the run directory: which checkpoint it continues from and what it repairs first."""
    checkpoint: Path | None = None  # None: a fresh start
    ckpt: CheckpointRecord | None = None
    changes: list[Difference] = field(default_factory=list)
    summary: dict[str, Any] | None = None  # the stored summary.json, when readable
    archive_all: bool = False  # trainer.resume=never trainer.overwrite=true
    aside: list[tuple[str, str]] = field(default_factory=list)  # (file relative to the run directory, why)
    metrics_text: bytes | None = None  # what metrics.jsonl must hold before training goes on (None: no change)
    metrics_cut: bool = False  # metrics_text only cuts off lines logged after the checkpoint


def _damage(path: Path) -> str | None:
    """What is wrong with a checkpoint quest wrote (always torch's zip format), read without loading it."""
    with open(path, "rb") as f:
        if f.read(4) != ZIP_MAGIC:
            return "not a zip archive as torch.save writes"
    bad = damaged_member(path)
    return None if bad is None else f"the bytes of its member {bad!r} do not match their checksum"


def _checkpoint(path: Path, others: str) -> CheckpointRecord:
    """``path`` loaded, or ConfigError saying it is damaged and what the user can do."""
    try:
        bad = _damage(path)
        if bad is not None:
            raise ValueError(bad)
        return load_record(path)
    except CheckpointRecordError as exc:  # whole, but not a record this quest reads: no copy would help
        raise ConfigError(str(exc)) from None
    except (ValueError, OSError) as exc:
        problem = str(exc).removeprefix(f"cannot load checkpoint {path}: ")
        raise ConfigError(f"{path} is damaged ({problem}); it is the run's record of where training stands. "
                          f"Restore it from a copy{others}, or {_AFRESH}") from None


def _json(directory: RunDirectory, name: str, plan: Plan) -> dict[str, Any] | None:
    """A JSON record of the run directory, every field checked (quest.store.run_files); a damaged one is planned to be
    kept aside and counts as missing."""
    path = directory.path / name
    try:
        data = read_json(path)
        return None if data is None else _CHECKS[name](data, path)
    except DamagedFile as exc:  # not JSON, not an object, a field of the wrong type or range
        plan.aside.append((name, f"damaged: {exc.problem}"))
    return None


_CHECKS = {"summary.json": checked_summary, "run.json": checked_run_record}


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def survey(cfg: Any, directory: RunDirectory, config: dict[str, Any], model_meta: dict[str, Any]) -> Plan:
    """Read the run directory and decide what this start does (see the module docstring); raise ConfigError for a
    state that cannot continue exactly. Writes nothing."""
    tr, run_dir, plan = cfg.trainer, directory.path, Plan()
    last, best = run_dir / "checkpoints" / "last.pt", run_dir / "checkpoints" / "best.pt"
    if tr.resume == "never":
        if directory.has_run():
            if not tr.overwrite:
                raise ConfigError(
                    f"{run_dir} already holds a run and trainer.resume=never would start another one in it; add "
                    "trainer.overwrite=true to replace it (the old run is moved to .replaced/), or choose another "
                    "directory (hydra.run.dir=...)")
            plan.archive_all = True
        return plan
    if tr.resume != "auto":  # an explicit checkpoint, into a directory of its own
        path = Path(tr.resume).expanduser()
        if directory.has_run() and path.resolve() != last.resolve():
            raise ConfigError(f"trainer.resume={tr.resume}: {run_dir} already holds a run of its own; resume a "
                              "checkpoint into a new directory (hydra.run.dir=...) so that two runs' metrics never mix")
        if not path.is_file():
            raise ConfigError(f"trainer.resume={tr.resume}: there is no such file")
        plan.checkpoint, plan.ckpt = path, _checkpoint(path, "")
    # every file read here is the run's own, of its kind: RunDirectory.writable checked that before the lock
    plan.summary = _json(directory, "summary.json", plan)
    record = _json(directory, "run.json", plan)
    metrics = run_dir / "metrics.jsonl"
    if plan.ckpt is None and last.is_file():
        best_note = " (or copy checkpoints/best.pt over it to continue from there)" if best.is_file() else ""
        plan.checkpoint, plan.ckpt = last, _checkpoint(last, best_note)
    elif plan.ckpt is None and best.is_file():
        ckpt = _checkpoint(best, "")
        step = ckpt.state.get("step")
        if ckpt.metrics_bytes is not None and _size(metrics) == ckpt.metrics_bytes and \
                (plan.summary or {}).get("status") not in FINAL_STATUSES:
            # killed between best.pt and last.pt: best.pt is the latest state, and nothing was logged after it
            log.warning("%s is missing and %s holds the latest state (step %s): continuing from it", last, best, step)
            plan.checkpoint, plan.ckpt = best, ckpt
        else:
            raise ConfigError(
                f"{last} is missing, but the run went on after {best} (step {step}) was written "
                f"({'summary.json says ' + repr(plan.summary.get('status')) if plan.summary else 'metrics.jsonl holds more'})"
                f". Restore last.pt from a copy; or continue from step {step} with `cp {best} {last}` (what was "
                f"logged after it is kept in .replaced/); or {_AFRESH}")
    if plan.ckpt is None:
        return _no_checkpoint(directory, config, record, plan)
    ckpt = plan.ckpt
    check_compatible(ckpt, model_meta, plan.checkpoint)
    if record is not None and isinstance(record.get("config"), dict):  # run.json of another run: its history too
        foreign = [d for d in config_differences(record["config"], ckpt.config)
                   if not matches_key(d.key, RESUME_SAFE_KEYS)]
        if foreign:
            plan.aside.append(("run.json", f"of another run: its config differs from the checkpoint's in "
                                           f"{len(foreign)} key(s) that no resume changes ({foreign[0]}); written "
                                           "again from the checkpoint"))
    explicit = tr.resume != "auto" and plan.checkpoint.resolve() != last.resolve()  # into a directory of its own
    plan.changes = check_resume(ckpt.config, config, plan.checkpoint if tr.resume != "auto" else run_dir,
                                checkpoint=explicit)
    bad_best = _damage(best) if best.is_file() and plan.checkpoint != best else None
    if bad_best:
        plan.aside.append(("checkpoints/best.pt", f"damaged ({bad_best}); written again at the next better "
                                                  "validation"))
    if tr.resume == "auto":  # a checkpoint resumed into a new directory brings no metrics of its old one
        _plan_metrics(directory, ckpt, plan)
    return plan


def _no_checkpoint(directory: RunDirectory, config: dict[str, Any], record: dict[str, Any] | None, plan: Plan) -> Plan:
    """No checkpoint: a fresh start, an attempt killed before its first checkpoint, or a run whose checkpoints went
    missing (refused)."""
    run_dir, summary = directory.path, plan.summary or {}
    saved = (record or {}).get("checkpoint_step") or summary.get("checkpoint")
    if saved:
        raise ConfigError(f"{run_dir / 'checkpoints'} holds no checkpoint, but this run saved one "
                          f"({'run.json: step ' + str(saved) if (record or {}).get('checkpoint_step') else saved}); "
                          f"it cannot continue exactly. Restore checkpoints/last.pt from a copy, or {_AFRESH}")
    leftovers = [n for n in ("metrics.jsonl", "summary.json") if (run_dir / n).exists()]
    if record is not None and isinstance(record.get("config"), dict):  # same config only
        check_resume(record["config"], config, run_dir)
    if summary.get("status") != "diverged":  # a diverged run before its first checkpoint is reported as it is
        # nothing to continue from: the run starts again, and what an earlier attempt wrote is kept aside
        why = "logged by an attempt that stopped before its first checkpoint" if record is not None else \
            "found without a checkpoint or run.json (an attempt that stopped before its first checkpoint)"
        plan.aside += [(n, why) for n in leftovers if n not in dict(plan.aside)]
    return plan


def _plan_metrics(directory: RunDirectory, ckpt: CheckpointRecord, plan: Plan) -> None:
    """metrics.jsonl against what the checkpoint saw of it."""
    path = directory.path / "metrics.jsonl"
    held = path.read_bytes() if path.is_file() else None
    # a checkpoint of an older quest that stored only the file's size gets its text from the file (quest.store.compat)
    text = checkpoint_metrics_text(ckpt.metrics_text, ckpt.metrics_bytes, held)
    if text is None:  # written without a metrics log
        return
    if held is None:
        if text:
            log.warning("%s is missing: rebuilt from the checkpoint (%d bytes)", path, len(text))
            plan.metrics_text = text
        return
    if held[:len(text)] != text:
        plan.aside.append(("metrics.jsonl", "damaged: it differs from what the checkpoint saw; rebuilt from it"))
        plan.metrics_text = text
    elif len(held) > len(text):
        plan.metrics_cut = True
        plan.aside.append(("metrics.jsonl", f"logged after the checkpoint of step {ckpt.state['step']} (cut "
                                            "off; the resumed run logs those steps again)"))
        plan.metrics_text = text


def finished_summary(cfg: Any, plan: Plan) -> dict[str, Any] | None:
    """The stored summary when the run in the directory has nothing left to do with this config, else None."""
    summary = plan.summary
    if summary is None or summary.get("status") not in FINAL_STATUSES:
        return None
    if summary["status"] == "diverged":
        return summary
    state = plan.ckpt.state if plan.ckpt is not None else \
        {"epoch": summary.get("epoch", 0), "step": summary.get("step", 0)}
    tr = cfg.trainer
    more = state["epoch"] < tr.epochs and (tr.max_steps is None or state["step"] < tr.max_steps)
    return None if more else summary


def carry_out(directory: RunDirectory, plan: Plan, continuing: bool = True) -> None:
    """Make the plan's changes (every check has passed): archive or keep aside, then rebuild or cut metrics.jsonl.
    Nothing is deleted: what is replaced goes to ``.replaced/<UTC time>/`` first. ``continuing=False`` (a finished
    run, reported): only what is damaged or missing is repaired; lines logged after the last checkpoint stay."""
    if not directory.is_main:
        return
    if plan.archive_all:
        directory.archive()
        return
    aside = list(plan.aside)
    if not continuing and plan.metrics_cut:
        aside = [(n, w) for n, w in aside if n != "metrics.jsonl"]
        plan.metrics_text = None
    if continuing and plan.summary is not None and plan.summary.get("status") in ("completed", "stopped") \
            and plan.checkpoint:
        aside.append(("summary.json", f"the final summary of a run that now continues (status "
                                      f"{plan.summary['status']!r} at step {plan.summary.get('step')})"))
    present = [(name, why) for name, why in aside if (directory.path / name).exists()]
    # all or nothing (quest.store.tree.move_aside): a move that fails puts back those before it, so a refused resume
    # replaces nothing; metrics.jsonl is moved too and written anew below (a missing one is rebuilt at the next start)
    dest = move_aside(directory.path, [directory.path / name for name, _ in present])
    if dest is not None:
        for name, why in present:
            log.warning("%s: %s; the previous file is kept as %s", directory.path / name, why, dest / name)
        write_text_atomic(dest / "why.txt", "".join(f"{n}: {w}\n" for n, w in present))
    if plan.metrics_text is not None:
        from quest.store.files import atomic_write

        atomic_write(directory.path / "metrics.jsonl", lambda f: f.write(plan.metrics_text))
