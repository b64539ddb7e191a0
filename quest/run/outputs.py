"""Run outputs: metrics.jsonl (every logged step and epoch), summary.json, and optionally a wandb run and
TensorBoard event files (``tensorboard/`` in the run directory).

metrics.jsonl is the record; TensorBoard's files are a view of it: each start (a resume included) removes the event
files of the run's earlier attempts and writes every row metrics.jsonl holds again, so that an interrupted attempt's
rows after its last checkpoint, which a resume cuts from metrics.jsonl, are not shown twice either. Only the event
files the manifest ``tensorboard/.manifest.jsonl`` names (quest.store.manifest) are removed; any other is moved to
the run's ``.replaced/``."""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from quest.runtime.errors import UserError, describe
from quest.runtime.phase import may_change
from quest.store.damage import DamagedFile
from quest.store.files import json_text, open_records, parse_json, write_json_atomic
from quest.store.output_folder import OutputFolder
from quest.store.run_files import check_metrics_row
from quest.store.tree import move_aside

__all__ = ["RunLogger", "LOG_FORMAT", "TENSORBOARD_DIR", "WandbStartError", "init_wandb", "start_log_file",
           "start_wandb", "stop_log_file", "wandb_group"]

#: the event directory of a run (``tensorboard --logdir runs`` finds every run's)
TENSORBOARD_DIR = "tensorboard"

#: the log file's lines (train.log, eval.log), as Hydra's default job logging writes them
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


class _LogFile(logging.FileHandler):
    """logging's file handler, its file opened as every record file quest appends to is (quest.store.files.
    open_records: never through a link or a hard link, a half-written last line cut off)."""

    def __init__(self, path: Path, warn: Callable[[str], None]):
        self._warn, self._failed = warn, False
        super().__init__(path)

    def _open(self) -> TextIO:
        return open_records(self.baseFilename, warn=self._warn)

    def emit(self, record: logging.LogRecord) -> None:
        if not self._failed:
            super().emit(record)

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # the lines it still held: the failure was said once already
            if not self._failed:
                raise

    def handleError(self, record: logging.LogRecord) -> None:
        """A log file the system cannot write (a full disk): said once, as a warning on the console, which goes on
        with every record; logging's own report would print a traceback for each of them."""
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            super().handleError(record)
            return
        self._failed = True  # before the warning, which reaches this handler too
        logging.getLogger("quest").warning("the log file %s cannot be written (%s); the log goes on on the console "
                                           "only", self.baseFilename, describe(exc))


def start_log_file(path: Path) -> logging.Handler:
    """Copy every log record to ``path`` (appended). quest starts the log file itself, once a command has passed
    its checks, instead of Hydra's file handler: a refused command leaves no line in an existing run's log."""
    kept: list[str] = []  # said once the handler writes the new log: its first line
    handler = _LogFile(path, kept.append)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger().addHandler(handler)
    for line in kept:
        logging.getLogger("quest").warning("%s", line)
    return handler


def stop_log_file(handler: logging.Handler | None) -> None:
    if handler is not None:
        logging.getLogger().removeHandler(handler)
        handler.close()


log = logging.getLogger("quest.train")



def wandb_group(choices: dict[str, str]) -> str:
    """The wandb group of a run (unless logger.group names one): ``<data>-<model>-<recipe>``, so that one group holds
    the attentions and seeds of one comparison; the evaluations of a run join its group."""
    return "-".join(choices.get(k, "?") for k in ("data", "model", "recipe"))


class WandbStartError(UserError, RuntimeError):
    """wandb.init failed (its server unreachable within its init_timeout, the key refused, ...)."""


def init_wandb(out_dir: Path, then: str, **kwargs: Any) -> Any:
    """``wandb.init(dir=out_dir, **kwargs)``; when it fails, ``out_dir/wandb`` is put back as it was: the entries it
    made (the failed run's folder, the folder itself) are removed and the links it re-pointed at that folder
    (``latest-run``, ``debug.log``, ``debug-internal.log``) point where they did. :class:`WandbStartError` says what
    wandb said and, in ``then``, what the user can do; the command stops with that one line."""
    from quest.runtime.extras import require

    wandb = require("wandb", "wandb", "logger=wandb")
    folder = Path(out_dir) / "wandb"
    before = {p: (os.readlink(p) if p.is_symlink() else None) for p in folder.iterdir()} if folder.is_dir() else None
    # a link's own times, put back with it: a link re-made with its old target is otherwise a new one
    times = {p: (p.lstat().st_atime_ns, p.lstat().st_mtime_ns) for p, link in (before or {}).items() if link}
    try:
        return wandb.init(dir=str(out_dir), **kwargs)
    except BaseException as exc:
        was = before or {}
        for path in sorted(folder.iterdir()) if folder.is_dir() else []:
            if path in was and was[path] == (os.readlink(path) if path.is_symlink() else None):
                continue  # as it was
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        for path, link in was.items():
            if link is not None and not os.path.lexists(path):
                os.symlink(link, path)
                if os.utime in os.supports_follow_symlinks:
                    os.utime(path, ns=times[path], follow_symlinks=False)
        if before is None and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        if not isinstance(exc, Exception):  # an interrupt: as it came
            raise
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise WandbStartError(f"the wandb run did not start ({type(exc).__name__}: {said}); {then}") from exc


def start_wandb(run_dir: Path, cfg: Any, choices: dict[str, str], resume_id: str | None,
                archived: bool = False) -> Any:
    """The training run's wandb run (logger.wandb; else None), started as the first change once the run directory is
    claimed (wandb.init cannot be checked without starting it): a wandb.init that fails leaves the run directory as
    it was but its lock (:func:`init_wandb`). ``archived``: started after an earlier run was moved to ``.replaced/``
    (trainer.overwrite=true), which a failure leaves there. A resume continues ``resume_id``'s wandb run."""
    from omegaconf import OmegaConf

    lc = cfg.logger
    if not lc.wandb:
        return None
    group = lc.group or wandb_group(choices)
    name = lc.name or f"{choices.get('attention', '?')}-seed{cfg.trainer.seed}"
    done = (f"the earlier run was moved to {run_dir / '.replaced'}/" if archived else
            f"nothing was written to {run_dir} but its lock file")
    then = (f"{done}: rerun the same command once wandb's server can be reached, or log offline (WANDB_MODE=offline "
            "or logger.mode=offline; `wandb sync` uploads the run later)")
    return init_wandb(run_dir, then, project=lc.project, entity=lc.entity, mode=lc.mode, group=group, name=name,
                      tags=list(lc.tags), config=OmegaConf.to_container(cfg, resolve=True), id=resume_id,
                      resume="allow" if resume_id else None)


class RunLogger:
    """Appends one JSON object per log call to ``metrics.jsonl``; mirrors to wandb when configured.
    Only the main process constructs one with ``enabled=True``. What a resumed run's metrics.jsonl must hold is
    settled before (quest.run.plan); the file is opened after any half-written last line is cut off."""

    def __init__(self, run_dir: Path, cfg: Any | None = None, logger_cfg: Any | None = None,
                 enabled: bool = True, wandb_run: Any | None = None):
        """``wandb_run``: the run's wandb run, started before the run directory was claimed (:func:`start_wandb`);
        closed with this logger."""
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.wandb_run = wandb_run
        if not enabled:
            return
        self._metrics = open_records(self.run_dir / "metrics.jsonl")
        self.tensorboard = None
        if logger_cfg is not None and logger_cfg.get("tensorboard"):
            self.tensorboard = self._start_tensorboard(cfg)

    def _start_tensorboard(self, cfg: Any):
        from quest.runtime.extras import require

        require("tensorboard", "tensorboard", "logger.tensorboard=true")
        from omegaconf import OmegaConf
        from torch.utils.tensorboard import SummaryWriter

        directory = self.run_dir / TENSORBOARD_DIR
        # the run directory's lock holds this folder; its manifest names the event files earlier attempts wrote
        view = OutputFolder(directory, "quest-train tensorboard", lock=False)
        try:
            view.manifest
        except DamagedFile as exc:  # not believed: kept, and every event file beside it counts as not this run's
            log.warning("%s is damaged (%s): moved to %s", exc.path, exc.problem,
                        move_aside(self.run_dir, [exc.path], TENSORBOARD_DIR))
        stale = sorted(directory.glob("events.out.tfevents.*"))
        for path in stale:  # a view of metrics.jsonl, rewritten below
            view.manifest.remove_if_owned(path)
        kept = move_aside(self.run_dir, [p for p in stale if p.exists()], TENSORBOARD_DIR)  # not this run's
        if kept is not None:
            log.warning("event files this run did not write were in %s: moved to %s", directory, kept)
        before = set(directory.glob("events.out.tfevents.*"))
        may_change(directory)  # TensorBoard's writer writes there, not quest.store: the same rule
        writer = SummaryWriter(log_dir=str(directory))
        view.manifest.note(sorted(set(directory.glob("events.out.tfevents.*")) - before), digest=False)
        if cfg is not None:
            writer.add_text("config", "```yaml\n" + OmegaConf.to_yaml(cfg, resolve=True) + "```", 0)
        self._metrics.flush()
        with open(self._metrics.name, "rb") as f:
            for number, line in enumerate(f, start=1):
                source = f"{self._metrics.name}:{number}"
                try:
                    row = check_metrics_row(parse_json(line.decode()), source)  # every field checked
                except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                    raise DamagedFile(Path(self._metrics.name), f"line {number} is not JSON ({exc})") from None
                _scalars(writer, row, row["step"])
        return writer

    def metrics_bytes(self) -> int | None:
        """The size of metrics.jsonl so far (stored in checkpoints)."""
        if not self.enabled:
            return None
        self._metrics.flush()
        return self._metrics.tell()

    def metrics_text(self) -> str | None:
        """metrics.jsonl so far: a checkpoint stores it, so that a missing or damaged file is rebuilt on resume."""
        size = self.metrics_bytes()
        if size is None:
            return None
        with open(self._metrics.name, "rb") as f:
            return f.read(size).decode()

    def position(self) -> dict[str, Any]:
        """Where metrics.jsonl stands, for a checkpoint (its metrics_bytes and metrics_text fields): a resume cuts off
        what an interrupted attempt logged after this state, and rebuilds the file from the text when it is missing
        or damaged."""
        return {"metrics_bytes": self.metrics_bytes(), "metrics_text": self.metrics_text()}

    @property
    def wandb_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self.enabled:
            return
        self._metrics.write(json_text({"step": step, **metrics}, indent=None))
        if self.tensorboard is not None:
            _scalars(self.tensorboard, metrics, step)
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)

    def summary(self, summary: dict[str, Any]) -> None:
        if not self.enabled:
            return
        write_json_atomic(self.run_dir / "summary.json", summary)
        if self.tensorboard is not None:
            _hparams(self.tensorboard, summary)
        if self.wandb_run is not None:
            self.wandb_run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})

    def close(self) -> None:
        if not self.enabled:
            return
        self._metrics.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _scalars(writer: Any, row: dict[str, Any], step: int) -> None:
    for key, value in row.items():
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
            writer.add_scalar(key, value, step)


def _hparams(writer: Any, summary: dict[str, Any]) -> None:
    """The run's choices and seed as hparams, with its final metrics, in the run's own event directory."""
    from torch.utils.tensorboard.summary import hparams

    params = {**{k: str(v) for k, v in (summary.get("choices") or {}).items()}, "seed": summary.get("seed")}
    metrics = {f"hparam/{k}": float(v) for k, v in summary.items()
               if k.startswith(("val/", "val_ema/", "best/")) and isinstance(v, (int, float))}
    for event in hparams({k: v for k, v in params.items() if v is not None}, metrics):
        writer.file_writer.add_summary(event)
