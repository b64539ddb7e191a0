"""``fit``: one run from start (or resume) to summary, in a run directory that holds that run only.

Before anything is built, every key and value of the config is checked and the run directory is locked. A run
already there is continued (same config up to the resume-safe keys), reported (finished: nothing is rewritten),
refused (another config), or archived first (``trainer.resume=never trainer.overwrite=true``). Every ending writes
summary.json and one log line: completed, stopped (trainer.max_steps), diverged, bad_data (unreadable images over
data.max_skipped_fraction, or none to train on), interrupted (SIGINT / SIGTERM,
saved at a step boundary), requeued (SIGUSR1). docs/training.md, "Runs, resume and provenance".
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from timm.utils import random_seed

from quest.attention.fused_check import configure as configure_fused
from quest.attention.fused_check import record as fused_record
from quest.config.checks import ConfigError
from quest.config.differences import Difference
from quest.run.checkpoint import Checkpointer
from quest.run.directory import RunDirectory, data_record
from quest.run.outputs import RunLogger, start_log_file, start_wandb, stop_log_file
from quest.run.plan import Plan, carry_out, finished_summary, survey
from quest.run.signals import INTERRUPTED, REQUEUED, StopSignals
from quest.run.train_state import run_perf
from quest.runtime.distributed import DistContext, barrier, init_distributed
from quest.runtime.phase import begin_changes, command_phases
from quest.store.files import write_text_atomic

from .builders import build_model, model_meta, model_spec, resolve_img_size, unused_size_keys
from .checks import check_compile_mode, check_train_config
from .compute import set_compute
from .loop import Evaluator, Outcome, StepLog, train_loop
from .telemetry import Telemetry, flops_per_image, peak_tflops
from .trainer import Run, hms

log = logging.getLogger("quest.train")

__all__ = ["fit", "exit_code", "summary_line", "EXIT_DIVERGED", "EXIT_BAD_DATA", "EXIT_INTERRUPTED"]

#: Exit code of ``train.py`` for a run that diverged (non-finite loss or grad norm, or loss above trainer.max_loss).
EXIT_DIVERGED = 3
#: Exit code of a run that failed on its data (status bad_data: too many unreadable images, or none to train on).
EXIT_BAD_DATA = 4
#: Exit codes of a run stopped by a signal after saving (the shell's 128 + signal number).
EXIT_INTERRUPTED = {"SIGINT": 130, "SIGTERM": 143}


def fit(cfg: Any, run_dir: str | Path, choices: dict[str, str] | None = None,
        provenance: dict[str, str] | None = None, given: Sequence[str] = ()) -> dict[str, Any]:
    """Train, resume, or report an already finished run; return the summary (written to summary.json).

    Every check that can refuse (the config's keys and values, the lock, the run directory's files, resume
    compatibility, the data) runs before anything is written into the run directory (quest.run.plan), so a
    refused command changes nothing. ``provenance``: files (relative path -> text) written into the run directory
    once the checks have passed, such as Hydra's record of the command (``.hydra/``). Nothing is written before
    the run directory is claimed (quest.runtime.phase). ``given``: the command line's ``key=value`` overrides, so
    that an input-size key another key overrules is refused rather than recorded as set and not used."""
    with command_phases("fit"):  # called by quest-train: its phases; called as a library: its own
        check_train_config(cfg)
        unused = unused_size_keys(cfg, given)
        if unused:
            raise ConfigError("\n".join(unused))
        run_dir = Path(run_dir)
        ctx = init_distributed(cfg.trainer.device)
        check_compile_mode(cfg.trainer, ctx)  # the checks that need the device and the process count
        # attention.fused=on checks the kernels on this device here, before the run directory is made
        configure_fused(cfg.attention.get("fused", "auto"), ctx.device)
        directory = RunDirectory(run_dir, ctx.is_main)
        if ctx.is_main:
            directory.writable(cfg.logger)
        directory.lock()
        try:
            return _fit(cfg, directory, choices, ctx, provenance or {})
        finally:
            directory.unlock()


def _accept(directory: RunDirectory, plan: Plan, provenance: dict[str, str], continuing: bool,
            start_wandb_run: Callable[[], Any] | None = None) -> tuple[logging.Handler | None, Any]:
    """Every check has passed: claim the lock, start the wandb run, clear a killed write's temporaries, make the
    plan's repairs, write the command's record and start train.log. Returns the log handler to remove at the end and
    the wandb run (None without one)."""
    directory.claim()  # every rank's changes begin here (quest.runtime.phase); only the main process writes
    if not directory.is_main:
        return None, None
    if plan.archive_all:  # the earlier run goes whole, its train.log included, before this run's log begins
        carry_out(directory, plan, continuing)
    # the first change after the checks (but the archive of the run it replaces, whose wandb/ goes with it):
    # wandb.init cannot be checked without starting it (whether its server answers and takes the key)
    wandb_run = start_wandb_run() if start_wandb_run is not None else None
    handler = start_log_file(directory.path / "train.log")
    try:
        Checkpointer(directory.path / "checkpoints", DistContext(), False).clean_temporaries()
        if not plan.archive_all:
            carry_out(directory, plan, continuing)  # repairs, logged into train.log
        for name, text in provenance.items():
            write_text_atomic(directory.path / name, text)
    except BaseException:
        stop_log_file(handler)  # the caller only stops the handler it was given
        raise
    return handler, wandb_run


def _fit(cfg: Any, directory: RunDirectory, choices: dict[str, str] | None, ctx: DistContext,
         provenance: dict[str, str]) -> dict[str, Any]:
    run_dir = directory.path
    tr = cfg.trainer
    choices = choices or {"model": cfg.model.name, "attention": cfg.attention.name,
                          "recipe": cfg.recipe.name, "data": cfg.data.name}
    config = OmegaConf.to_container(cfg, resolve=True)
    plan = survey(cfg, directory, config, model_meta(cfg))
    saved = plan.ckpt.state.get("torch_threads") if plan.ckpt is not None else None
    ran = set_compute(tr.matmul_precision, tr.torch_threads, cfg.model.name, ctx.device, saved)
    finished = finished_summary(cfg, plan)
    if finished is not None:
        if plan.aside or plan.metrics_text is not None:
            begin_changes()  # every check has passed; unclaimed, the lock file is left as it was
            carry_out(directory, plan, continuing=False)  # repairs only: nothing of the finished run is replaced
        log.info("%s already holds this finished run; nothing to do: %s", run_dir, summary_line(finished))
        longer = "trainer.max_steps=<more> (or null)" if finished.get("status") == "stopped" else "trainer.epochs=<more>"
        log.info("to train it longer: %s hydra.run.dir=%s; to train it again: trainer.resume=never "
                 "trainer.overwrite=true (archives this one); any other config gets its own directory", longer, run_dir)
        return {**finished, "resumed": True, "already_finished": True}  # the file itself stays as it was
    random_seed(tr.seed)  # the same initial weights on every rank (FSDP2, unlike DDP, does not broadcast)
    run = Run(cfg, run_dir, choices, ctx, on_save=directory.note_checkpoint)
    run.state.torch_threads = ran.get("torch_threads")  # saved with the checkpoints: a resume computes the same way
    random_seed(tr.seed, ctx.rank)  # then each rank its own augmentation and drop-path randomness
    if plan.ckpt is not None:  # checks the data and the derived values before it loads anything
        run.restore(plan.ckpt, plan.checkpoint, extended=any(d.key == "trainer.epochs" for d in plan.changes))
        plan.ckpt = None  # the model, optimizer and EMA hold their own copies now
    elif tr.init_from:
        run.init_weights(tr.init_from)
    elif cfg.model.get("pretrained"):
        run.init_pretrained(cfg.model.pretrained, bool(cfg.model.get("pretrained_download", False)))
    # wandb finishes its run at exit if a step below fails
    handler, wandb_run = _accept(directory, plan, provenance, continuing=True, start_wandb_run=lambda: start_wandb(
        run_dir, cfg, choices, run.state.wandb_id, archived=plan.archive_all))
    try:
        directory.write_record(config, "resume" if plan.checkpoint else "start", run.state.step, plan.changes,
                               ran)
        logger = RunLogger(run_dir, cfg, cfg.logger, enabled=ctx.is_main, wandb_run=wandb_run)
        run.state.logs_to(logger.wandb_id)
        # the input size the model was built for: a timm name's trailing number is its default (vit_pico_patch4_16
        # at model.img_size=32 takes 32 x 32 images)
        size = getattr(getattr(run.model, "patch_embed", None), "img_size", None)
        shown = f" at {size[0]}x{size[1]} px" if isinstance(size, (tuple, list)) and len(size) == 2 else ""
        log.info("%s%s with %s attention: %.2fM parameters; run directory %s", cfg.model.name, shown,
                 cfg.attention.name, sum(p.numel() for p in run.model.parameters()) / 1e6, run_dir)
        for split, record in run.left_out.items():  # the pre-flight's decision, in train.log too
            log.warning("data pre-flight: %d of the %d files of the %s split are left out (data.bad_images=skip): %s; "
                        "first: %s", record["files"], record["of"], split, record["by_reason"], record["first"])
        if run.left_out and not plan.checkpoint:  # a new run's first metrics row: what the pre-flight left out
            logger.log({f"data/preflight_left_out/{split}": record["files"] for split, record in run.left_out.items()},
                       run.state.step)
        telemetry = _telemetry(cfg, run)
        signals = StopSignals().install()
        try:
            out = Outcome("failed")
            try:
                out = train_loop(run, StepLog(logger, run, telemetry), signals,
                                 Evaluator(logger, tr.eval_every_n_epochs, tr.epochs))
            finally:
                if out.status != REQUEUED:  # requeue() still needs the handler that was there before ours (submitit's)
                    signals.uninstall()
            # the whole run's figures and time: every attempt's, carried by the checkpoints (quest.run.train_state.run_perf)
            perf = run_perf(run.state.timed_attempts(), telemetry.flops, telemetry.peak)
            summary = {**_summary(run, out, perf["wall_s"], plan.checkpoint is not None, plan.changes),
                       **out.ending, "perf": perf}
            if out.status == REQUEUED:
                summary["requeue"] = signals.requeue_plan()
            logger.summary(summary)
        finally:  # also when a checkpoint write fails: close metrics.jsonl and the wandb run
            logger.close()
        barrier(ctx)
        log.info("%s", summary_line(summary))
    finally:
        stop_log_file(handler)
    if out.status == REQUEUED:
        signals.requeue(ctx)
    return summary


# Training FLOPs per image by model spec (json): counting builds the model a second time, and a spec's count is the
# same for every run of a process (a sweep's jobs in one process; the test suite's many small runs).
_FLOPS: dict[str, float] = {}


def _telemetry(cfg: Any, run: Run) -> Telemetry:
    """The run's telemetry: its model's training FLOPs per image (counted once, on a copy without weights) and the
    device's peak FLOP/s at the run's precision (None on the CPU and unknown GPUs)."""
    size = resolve_img_size(cfg)
    spec = json.dumps(model_spec(cfg), sort_keys=True)
    try:
        if spec not in _FLOPS:
            _FLOPS[spec] = flops_per_image(lambda: build_model(cfg), size)
        flops = _FLOPS[spec]
    except Exception as exc:  # a model that cannot be built on the meta device: figures without FLOPs, said once
        log.warning("FLOPs not counted for %s at %d px (%s: %s): the log shows no FLOP/s or MFU", cfg.model.name,
                    size, type(exc).__name__, exc)
        flops = None
    peak = peak_tflops(run.ctx.device, run.precision)
    tr = cfg.trainer
    log.info("%s at %d px: %s training FLOPs per image; device peak %s", cfg.model.name, size,
             f"{flops / 1e9:.3g} G" if flops else "unknown",
             f"{peak:g} TFLOP/s ({run.precision})" if peak else "unknown (no MFU; achieved FLOP/s only)")
    return Telemetry(run.ctx.device, run.ctx.world_size, flops, peak, data_wait_warning=tr.data_wait_warning,
                     low_mfu_warning=tr.low_mfu_warning)


def _summary(run: Run, out: Outcome, wall_s: float, resumed: bool, changes: list[Difference]) -> dict[str, Any]:
    """summary.json: the outcome, final and best metrics (a run that ended normally was validated, EMA too, by the
    loop's Evaluator), what identifies the run, and how it was executed."""
    cfg, st, ctx, parts, val = run.cfg, run.state, run.ctx, run.parts, out.val
    summary = {
        "status": out.status, "diverged_at_step": None, "divergence_reason": None,
        "epoch": st.epoch, "step": st.step, **val, **out.ema_val,
        # none before an epoch has ended validated (a run stopped at trainer.max_steps inside its first epoch)
        "best/val/top1": st.best_top1 if st.best_top1 >= 0 else None,
        "best_epoch": st.best_epoch if st.best_top1 >= 0 else None,
        "choices": dict(run.choices), "attention": cfg.attention.name, "model": cfg.model.name,
        # the data set it trained on, from the data sets themselves (quest.report tells settings apart by it)
        "data_fingerprint": data_record(run.data_fingerprint),
        "seed": cfg.trainer.seed, "num_params": sum(p.numel() for p in run.model.parameters()), "lr": parts.lr,
        "lr_peak": parts.lr_peak, "global_batch": parts.global_batch, "world_size": ctx.world_size,
        "train_input": parts.train_input, "wall_time_s": wall_s,
        "train_img_per_s": st.images_seen / st.train_seconds if st.train_seconds else None,
        "resumed": resumed, "run_dir": str(run.run_dir), "checkpoint": run.checkpointer.saved(),
        # unreadable images left out under data.bad_images=skip (docs/data.md): training over the whole run, validation
        # in the last validation pass
        "skipped_images": {"train": st.train_skipped, "train_drawn": st.train_drawn,
                           "val": val.get("val/skipped"), "val_scored": val.get("val/images")},
        # files the pre-flight left out before the first step (data.bad_images=skip): per split, count and reasons
        "left_out_by_preflight": run.left_out,
        # which path the q/k transforms took (the fused Triton kernels or PyTorch's operators) and why
        "attention_kernels": fused_record(),
    }
    if changes:
        summary["changed_on_resume"] = {d.key: [d.stored, d.new] for d in changes}
    return summary


def _duration(seconds: float | None) -> str:
    return hms(seconds) if isinstance(seconds, (int, float)) else "?"


def summary_line(summary: dict[str, Any]) -> str:
    """One line for the end of a run: status, final and best val top-1, time, run directory."""
    status = summary.get("status", "?")
    where = summary.get("run_dir", "")
    fmt = lambda v: f"{v:.2f}" if isinstance(v, (int, float)) else "-"  # noqa: E731
    if status == "diverged":
        detail = f"at step {summary.get('diverged_at_step')} ({summary.get('divergence_reason')})"
    elif status == "bad_data":
        detail = f"at step {summary.get('step')}: {summary.get('data_failure')}"
    elif status in (INTERRUPTED, REQUEUED):
        saved = summary.get("checkpoint") if summary.get("saved") else None
        detail = (f"by {summary.get('signal')} after step {summary.get('step')} ({summary.get('epoch')} epochs done); "
                  + (f"saved {saved}" if saved else f"last checkpoint {summary.get('checkpoint') or 'none'}")
                  + ("; " + summary["requeue"] if status == REQUEUED and summary.get("requeue") else
                     "; run the same command to resume"))
    else:
        best_epoch = summary.get("best_epoch")
        best = (f"best {fmt(summary.get('best/val/top1'))} at epoch {best_epoch}"
                if isinstance(best_epoch, int) and best_epoch >= 0 else "no best yet: no epoch ended")
        detail = (f"val top-1 {fmt(summary.get('val/top1'))} ({best}, EMA {fmt(summary.get('val_ema/top1'))}) after "
                  f"{summary.get('step')} steps")
    return f"run {status} {detail} in {_duration(summary.get('wall_time_s'))}; {where}"


def exit_code(summary: dict[str, Any], multirun: bool = False) -> int:
    """train.py's exit code for a summary (docs/training.md): 0 done (completed, stopped, requeued, or a diverged
    job inside a multirun, so that the sweep goes on), 3 diverged, 4 bad_data, 130 / 143 interrupted by SIGINT / SIGTERM."""
    status = summary.get("status")
    if status == "diverged":
        return 0 if multirun else EXIT_DIVERGED
    if status == "bad_data":
        return EXIT_BAD_DATA
    if status == INTERRUPTED:
        return EXIT_INTERRUPTED.get(str(summary.get("signal")), EXIT_INTERRUPTED["SIGINT"])
    return 0
