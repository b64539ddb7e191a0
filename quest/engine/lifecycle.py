"""``fit``: one run from start (or resume) to summary, in a run directory that holds that run only.

Before anything is built, every key and value of the config is checked and the run directory is locked. A run
already there is continued (same config up to the resume-safe keys), reported (finished: nothing is rewritten),
refused (another config), or archived first (``trainer.resume=never trainer.overwrite=true``). Every ending writes
summary.json and one log line: completed, stopped (trainer.max_steps), diverged, interrupted (SIGINT / SIGTERM,
saved at a step boundary), requeued (SIGUSR1). docs/training.md, "Runs, resume and provenance".
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from timm.utils import random_seed

from quest.validation import ConfigError

from .builders import model_meta
from .checkpoint import Checkpointer, check_compatible, load_checkpoint
from .distributed import DistContext, barrier, init_distributed
from .evaluate import evaluate
from .logger import RunLogger
from .run_dir import FINAL_STATUSES, Difference, RunDirectory, check_resume
from .signals import INTERRUPTED, REQUEUED, StopRequested, StopSignals
from .trainer import Diverged, Run, hms
from .validate import validate_train_config

log = logging.getLogger("quest.train")

__all__ = ["fit", "exit_code", "summary_line", "EXIT_DIVERGED", "EXIT_INTERRUPTED"]

#: Exit code of ``train.py`` for a run that diverged (non-finite loss or grad norm, or loss above trainer.max_loss).
EXIT_DIVERGED = 3
#: Exit codes of a run stopped by a signal after saving (the shell's 128 + signal number).
EXIT_INTERRUPTED = {"SIGINT": 130, "SIGTERM": 143}


def fit(cfg: Any, run_dir: str | Path, choices: dict[str, str] | None = None) -> dict[str, Any]:
    """Train, resume, or report an already finished run; return the summary (written to summary.json).

    Before anything is built: every key and value of ``cfg`` is checked, the run directory is locked, and a run
    already in it is either continued (same config up to the resume-safe keys), reported (finished), refused
    (another config), or archived (``trainer.resume=never trainer.overwrite=true``)."""
    validate_train_config(cfg)
    run_dir = Path(run_dir)
    ctx = init_distributed(cfg.trainer.device)
    directory = RunDirectory(run_dir, ctx.is_main)
    directory.lock()
    try:
        return _fit(cfg, directory, choices, ctx)
    finally:
        directory.unlock()


def _plan(cfg: Any, directory: RunDirectory,
          config: dict[str, Any]) -> tuple[Path | None, dict[str, Any] | None, list[Difference]]:
    """Which checkpoint to continue from (None: a fresh start), its content and the resume-safe keys that changed;
    archives a run being replaced, refuses a resume with another config."""
    tr, run_dir = cfg.trainer, directory.path
    if tr.resume == "never":
        if directory.has_run():
            if not tr.overwrite:
                raise ConfigError(
                    f"{run_dir} already holds a run and trainer.resume=never would start another one in it; add "
                    "trainer.overwrite=true to replace it (the old run is moved to .replaced/), or choose another "
                    "directory (hydra.run.dir=...)")
            directory.archive()
        return None, None, []
    path = run_dir / "checkpoints" / "last.pt" if tr.resume == "auto" else Path(tr.resume).expanduser()
    if tr.resume != "auto" and directory.has_run() and path.resolve() != (run_dir / "checkpoints" / "last.pt").resolve():
        raise ConfigError(f"trainer.resume={tr.resume}: {run_dir} already holds a run of its own; resume a "
                          "checkpoint into a new directory (hydra.run.dir=...) so that two runs' metrics never mix")
    if not path.is_file():
        record = directory.record()
        if record is not None:  # an attempt that never reached its first checkpoint: same config only
            check_resume(record["config"], config, run_dir)
        return None, None, []
    ckpt = load_checkpoint(path, map_location="cpu")
    check_compatible(ckpt, model_meta(cfg), path)
    changes = check_resume(ckpt["config"], config, path if tr.resume != "auto" else run_dir)
    return path, ckpt, changes


def _finished(cfg: Any, directory: RunDirectory, ckpt: dict[str, Any] | None) -> dict[str, Any] | None:
    """The stored summary when the run in the directory has nothing left to do with this config, else None."""
    summary = directory.summary()
    if summary is None or summary.get("status") not in FINAL_STATUSES:
        return None
    if summary["status"] == "diverged":
        return summary
    state = (ckpt or {}).get("state") or {"epoch": summary.get("epoch", 0), "step": summary.get("step", 0)}
    tr = cfg.trainer
    more = state["epoch"] < tr.epochs and (tr.max_steps is None or state["step"] < tr.max_steps)
    return None if more else summary


def _fit(cfg: Any, directory: RunDirectory, choices: dict[str, str] | None, ctx: DistContext) -> dict[str, Any]:
    run_dir, tr = directory.path, cfg.trainer
    if tr.torch_threads:
        torch.set_num_threads(tr.torch_threads)
    choices = choices or {"model": cfg.model.name, "attention": cfg.attention.name,
                          "recipe": cfg.recipe.name, "data": cfg.data.name}
    config = OmegaConf.to_container(cfg, resolve=True)
    if ctx.is_main:
        Checkpointer(run_dir / "checkpoints", ctx, False).clean_temporaries()
    path, ckpt, changes = _plan(cfg, directory, config)
    finished = _finished(cfg, directory, ckpt)
    if finished is not None:
        log.info("%s already holds this finished run; nothing to do: %s", run_dir, summary_line(finished))
        log.info("to train it longer: trainer.epochs=<more> hydra.run.dir=%s; to train it again: "
                 "trainer.resume=never trainer.overwrite=true (archives this one); any other config gets its own "
                 "directory", run_dir)
        return {**finished, "resumed": True, "already_finished": True}  # the file itself stays as it was
    start = time.perf_counter()
    random_seed(tr.seed)  # the same initial weights on every rank (FSDP2, unlike DDP, does not broadcast)
    run = Run(cfg, run_dir, choices, ctx)
    random_seed(tr.seed, ctx.rank)  # then each rank its own augmentation and drop-path randomness
    # metrics.jsonl keeps what the checkpoint had seen; a fresh start drops what an attempt killed before its first
    # checkpoint logged (None: nothing to drop, or a checkpoint of a quest that did not record it)
    truncate = ckpt.get("metrics_bytes") if ckpt is not None else (0 if directory.has_run() else None)
    if ckpt is not None:
        run.restore(ckpt, path, extended=any(d.key == "trainer.epochs" for d in changes))
        del ckpt  # the model, optimizer and EMA hold their own copies now
    elif tr.init_from:
        run.init_weights(tr.init_from)
    elif cfg.model.get("pretrained"):
        run.init_pretrained(cfg.model.pretrained, bool(cfg.model.get("pretrained_download", False)))
    directory.write_record(config, "resume" if path else "start", run.state.step, changes)
    run.logger = RunLogger(run_dir, cfg, cfg.logger, choices, enabled=ctx.is_main, resume_id=run.state.wandb_id,
                           truncate_to=truncate)
    run.state.wandb_id = run.logger.wandb_id
    log.info("%s with %s attention: %.2fM parameters; run directory %s", cfg.model.name, cfg.attention.name,
             sum(p.numel() for p in run.model.parameters()) / 1e6, run_dir)
    try:
        status, val, ending = _train(run)
        summary = {**_summary(run, status, val, start, path is not None, changes), **ending}
        if status == REQUEUED:
            summary["requeue"] = run.signals.requeue_plan()
        run.logger.summary(summary)
    finally:  # also when a checkpoint write fails: close metrics.jsonl and the wandb run
        run.logger.close()
    barrier(ctx)
    log.info("%s", summary_line(summary))
    if status == REQUEUED:
        run.signals.requeue(ctx)
    return summary


def _train(run: Run) -> tuple[str, dict[str, float], dict[str, Any]]:
    """Epochs until the run is done, diverges or is stopped by a signal: (status, last validation, details)."""
    st, tr, ctx = run.state, run.cfg.trainer, run.ctx
    status, val, ending = "completed", {}, {}
    run.signals = StopSignals().install()
    try:
        while st.epoch < tr.epochs and (tr.max_steps is None or st.step < tr.max_steps):
            run.train_epoch(run.logger)
            best = False
            if st.micro_in_epoch == 0 and (st.epoch % tr.eval_every_n_epochs == 0 or st.epoch == tr.epochs):
                val = run.validate(run.logger)
                if val["val/top1"] > st.best_top1:
                    st.best_top1, st.best_epoch, best = val["val/top1"], st.epoch, True
            run.save(best=best)
            stop_reason = run.signals.due(ctx)
            if stop_reason:  # a signal during validation or the save: the state just written is the stop point
                raise StopRequested(stop_reason, run.signals.signal_name or "?")
        if st.epoch < tr.epochs:
            status = "stopped"  # trainer.max_steps reached first
    except Diverged as exc:
        status, ending = "diverged", {"diverged_at_step": exc.step, "divergence_reason": exc.reason}
        saved = _saved_checkpoint(run)
        log.error("run diverged at step %d (%s); %s", exc.step, exc.reason,
                  f"the last good checkpoint is {saved}" if saved else "no checkpoint was written before it")
    except StopRequested as exc:
        status, ending = exc.reason, {"signal": exc.signal_name, "saved": True}
    except KeyboardInterrupt as exc:  # a second Ctrl-C / SIGTERM: stopped at once, the last checkpoint stays
        status, ending = INTERRUPTED, {"signal": str(exc) or "SIGINT", "saved": False}
    finally:
        if status != REQUEUED:  # requeue() still needs the handler that was there before ours (submitit's)
            run.signals.uninstall()
    return status, val, ending


def _summary(run: Run, status: str, val: dict[str, float], start: float, resumed: bool,
             changes: list[Difference]) -> dict[str, Any]:
    """summary.json: the outcome, final and best metrics (a run that ended normally is validated, EMA too), what
    identifies the run, and how it was executed."""
    cfg, st, ctx, parts = run.cfg, run.state, run.ctx, run.parts
    if not val and status in ("completed", "stopped"):
        val = run.validate(run.logger)
    ema_val = {}
    if parts.ema is not None and status in ("completed", "stopped"):
        ema_val = evaluate(parts.ema.module, parts.val_loader, ctx.device, cfg.data.num_classes, run.autocast,
                           prefix="val_ema/")
    summary = {
        "status": status, "diverged_at_step": None, "divergence_reason": None,
        "epoch": st.epoch, "step": st.step, **val, **ema_val,
        "best/val/top1": st.best_top1 if st.best_top1 >= 0 else None, "best_epoch": st.best_epoch,
        "choices": dict(run.choices), "attention": cfg.attention.name, "model": cfg.model.name,
        "seed": cfg.trainer.seed, "num_params": sum(p.numel() for p in run.model.parameters()), "lr": parts.lr,
        "global_batch": parts.global_batch, "world_size": ctx.world_size, "wall_time_s": time.perf_counter() - start,
        "train_img_per_s": st.images_seen / st.train_seconds if st.train_seconds else None,
        "resumed": resumed, "run_dir": str(run.run_dir), "checkpoint": _saved_checkpoint(run),
    }
    if changes:
        summary["changed_on_resume"] = {d.key: [d.stored, d.new] for d in changes}
    return summary


def _saved_checkpoint(run: Run) -> str | None:
    """``last.pt`` and the step it holds, when this run wrote or resumed from one."""
    if run.saved_step is None or not run.checkpointer.last.is_file():
        return None
    return f"{run.checkpointer.last} (step {run.saved_step})"


def _duration(seconds: float | None) -> str:
    return hms(seconds) if isinstance(seconds, (int, float)) else "?"


def summary_line(summary: dict[str, Any]) -> str:
    """One line for the end of a run: status, final and best val top-1, time, run directory."""
    status = summary.get("status", "?")
    where = summary.get("run_dir", "")
    fmt = lambda v: f"{v:.2f}" if isinstance(v, (int, float)) else "-"  # noqa: E731
    if status == "diverged":
        detail = f"at step {summary.get('diverged_at_step')} ({summary.get('divergence_reason')})"
    elif status in (INTERRUPTED, REQUEUED):
        saved = summary.get("checkpoint") if summary.get("saved") else None
        detail = (f"by {summary.get('signal')} at step {summary.get('step')} (epoch {summary.get('epoch')}); "
                  + (f"saved {saved}" if saved else f"last checkpoint {summary.get('checkpoint') or 'none'}")
                  + ("; " + summary["requeue"] if status == REQUEUED and summary.get("requeue") else
                     "; run the same command to resume"))
    else:
        detail = (f"val top-1 {fmt(summary.get('val/top1'))} (best {fmt(summary.get('best/val/top1'))} at epoch "
                  f"{summary.get('best_epoch')}, EMA {fmt(summary.get('val_ema/top1'))}) after {summary.get('step')} "
                  "steps")
    return f"run {status} {detail} in {_duration(summary.get('wall_time_s'))}; {where}"


def exit_code(summary: dict[str, Any], multirun: bool = False) -> int:
    """train.py's exit code for a summary (docs/training.md): 0 done (completed, stopped, requeued, or a diverged
    job inside a multirun, so that the sweep goes on), 3 diverged, 130 / 143 interrupted by SIGINT / SIGTERM."""
    status = summary.get("status")
    if status == "diverged":
        return 0 if multirun else EXIT_DIVERGED
    if status == INTERRUPTED:
        return EXIT_INTERRUPTED.get(str(summary.get("signal")), EXIT_INTERRUPTED["SIGINT"])
    return 0
