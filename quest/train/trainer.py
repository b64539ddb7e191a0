"""A run's parts and what one optimizer step and one epoch do: ``Run`` builds the components, takes an optimizer step
(with its divergence check and the stop request agreed in one collective), yields an epoch's micro-batches step by
step, ends an epoch, validates, and loads a checkpoint's state into its parts. It owns its counters
(quest.run.train_state.TrainState, a stateful part the Checkpointer saves and restores with the others) and returns
what is to be logged instead of logging it: quest.train.loop.train_loop drives it, logs, and decides when it is
saved."""
from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from quest.config.checks import ConfigError
from quest.data.pipelines.prefetch import finish_ahead
from quest.data.preflight import preflight_left_out
from quest.run.checkpoint import Checkpointer, CheckpointRecord, read_init_from
from quest.run.directory import check_data, data_fingerprint
from quest.run.train_state import TrainState
from quest.runtime.distributed import DistContext
from quest.store.weights_check import WeightsError, check_weights

from .builders import Components, build_components, model_meta, scheduler_epoch, train_module
from .compute import autocast_for, resolve_precision
from .update import Diverged, StepGuard, Update, divergence_threshold
from .validation import evaluate

log = logging.getLogger("quest.train")

__all__ = ["Run", "TrainState", "Diverged", "BadData", "check_skipped", "hms"]


class BadData(Exception):
    """Too many unreadable images (data.max_skipped_fraction), or nothing to train on: the run's status bad_data."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Run:
    """One training run: its components, state and outputs. ``fit`` drives it."""

    def __init__(self, cfg: Any, run_dir: Path, choices: dict[str, str], ctx: DistContext,
                 on_save: Callable[[int], None] | None = None):
        self.cfg, self.run_dir, self.choices, self.ctx = cfg, run_dir, choices, ctx
        self.state = TrainState()  # first: its clock times this attempt from here (quest.run.train_state.Attempt)
        self.sharded = cfg.trainer.strategy == "fsdp"
        # ``on_save`` is told the step of every checkpoint written (the run directory's record of it)
        self.checkpointer = Checkpointer(run_dir / "checkpoints", ctx, self.sharded,
                                         every_n_steps=cfg.trainer.checkpoint_every_n_steps, on_save=on_save)
        self.parts: Components = build_components(cfg, ctx)
        self.model = self.parts.model
        # (images, targets) -> loss: the model and the loss, compiled together (trainer.compile), under DDP wrapped
        self.train_model = train_module(self.model, self.parts.train_loss, cfg.trainer, ctx)
        self.precision = resolve_precision(cfg.trainer.precision, cfg.recipe.get("precision"), ctx.device)
        self.autocast = autocast_for(self.precision, ctx.device)
        # fp16 needs dynamic loss scaling (DeiT's NativeScaler is this GradScaler); disabled it is a pass-through
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=self.precision == "fp16")
        self.diagnostics = self._diagnostics()
        self.data_fingerprint = data_fingerprint(self.parts.train_loader.dataset, self.parts.val_loader.dataset,
                                                 cfg.data.get("root"))
        # the image-folder files the pre-flight left out (data.bad_images=skip), per split: summary.json and the
        # first metrics row say so
        self.left_out = {split: record for split, loader in (("train", self.parts.train_loader),
                                                             ("val", self.parts.val_loader))
                         if (record := preflight_left_out(loader.dataset))}
        self._counts = [0, 0]  # this rank's skipped and drawn images not yet in the state
        self.data_wait = 0.0  # seconds this process waited for the loader since StepLog last took it
        self._epoch_start = (0, 0)  # (step, micro_in_epoch) where the current epoch (or its resumed rest) began
        self.guard = StepGuard(ctx.device, divergence_threshold(cfg.trainer, cfg.recipe, cfg.data.num_classes),
                               scaler=self.scaler.is_enabled(), distributed=ctx.distributed)
        self.update = Update(self.model, self.parts.optimizer, self.scaler, self.parts.ema, self.guard,
                             cfg.recipe.clip_grad)

    def _diagnostics(self):
        d = self.cfg.diagnostics
        if d.every_n_steps <= 0:
            return None
        from quest.diagnostics import AttentionDiagnostics

        return AttentionDiagnostics(self.model, every_n_steps=d.every_n_steps, num_samples=d.num_samples,
                                    per_head=d.per_head, entropy_threshold=d.entropy_threshold,
                                    max_logit_warning=d.max_logit_warning)

    # --- checkpoints ------------------------------------------------------------------------------------------
    @property
    def derived(self) -> dict[str, Any]:
        """Values computed from the config and the process count that a resume must reproduce."""
        p = self.parts
        return {"global_batch": p.global_batch, "lr": p.lr, "steps_per_epoch": p.steps_per_epoch,
                "precision": self.precision}

    @property
    def stateful(self) -> dict[str, Any]:
        """The run's stateful parts by name, as Checkpointer.save/restore take them (CheckpointRecord's fields)."""
        p = self.parts
        return {"model": self.model, "ema": p.ema.module if p.ema is not None else None, "optimizer": p.optimizer,
                "scheduler": p.scheduler, "scaler": self.scaler, "state": self.state}

    def record(self) -> dict[str, Any]:
        """What identifies the run in a CheckpointRecord (Checkpointer.save adds the stateful parts and the RNGs; the
        loop adds the position in metrics.jsonl, RunLogger.position)."""
        return {
            # plain containers only: a ListConfig option (elliptical's `layers`) would not load with weights_only=True
            "meta": {**model_meta(self.cfg),
                     "attention_options": OmegaConf.to_container(self.cfg.attention.options, resolve=True)},
            "config": OmegaConf.to_container(self.cfg, resolve=True),
            "choices": dict(self.choices),
            "derived": self.derived,
            "data": self.data_fingerprint,
        }

    def restore(self, saved: CheckpointRecord, path: Path, extended: bool) -> None:
        """Continue from ``saved``; ``extended``: the run was given more epochs, so the schedule built for the new
        length continues from the current step instead of the stored (shorter) one."""
        check_data(saved.data, self.data_fingerprint, self.run_dir)
        stored = saved.derived or {}
        changed = {k: (stored[k], v) for k, v in self.derived.items() if k in stored and k != "steps_per_epoch"
                   and stored[k] != v}
        if changed:
            raise ConfigError(f"{self.run_dir} holds a run trained with " + ", ".join(
                f"{k}={a}" for k, (a, _) in changed.items()) + "; this one would train with " + ", ".join(
                f"{k}={b}" for k, (_, b) in changed.items()) + " (another number of processes, or trainer.precision="
                "auto on another kind of device): resume it as it was started, or set trainer.precision explicitly")
        p = self.parts
        self.checkpointer.restore(saved, path, self.stateful, schedule=not extended)  # self.state too
        self.state.resumed()  # this process is the run's next attempt
        if extended:  # the longer schedule, where the run stands (updates or epochs, whichever it steps on)
            p.scheduler.step_update(num_updates=self.state.step)
            self.step_schedule_on_epoch()
        log.info("resumed from %s after step %d (%d epochs done)", path, self.state.step, self.state.epoch)

    def init_weights(self, path: str) -> None:
        """Start from another run's weights (e.g. DeiT-III's low-resolution phase), resizing pos_embed."""
        from timm.models.vision_transformer import checkpoint_filter_fn

        saved = read_init_from(path)
        which = self.cfg.recipe.get("init_weights", "ema")
        source = saved.ema if which == "ema" and saved.ema is not None else saved.model
        what = f"{'EMA' if source is saved.ema else 'model'} weights"
        try:  # pos_embed / patch_embed resampled to this model's size; another model's fails here or in the check
            weights = checkpoint_filter_fn(source, self.model)
        except (RuntimeError, ValueError) as exc:
            raise WeightsError(f"trainer.init_from={path}: its {what} cannot be resized to this model "
                               f"({' '.join(str(exc).split())[:200]}); is "
                               "it a checkpoint of another model?") from None
        own = self.model.state_dict()  # every tensor but the classifier's, which may start afresh
        check_weights(weights, f"trainer.init_from={path}", what, own, [k for k in own if k.startswith("head")])
        log.info("trainer.init_from=%s: starting from its %s", path, what)
        trained = saved.meta.get("attention")
        if trained != self.cfg.attention.name:  # standard, QNorm and QUEST have the same parameters: nothing else says it
            log.warning("trainer.init_from=%s: its weights were trained with %s attention; this run trains them on "
                        "with %s attention", path, trained, self.cfg.attention.name)
        self.model.load_state_dict(weights, strict=False)
        if self.parts.ema is not None:
            self.parts.ema.module.load_state_dict(self.model.state_dict())

    def init_pretrained(self, source: str, download: bool) -> None:
        """Start from pretrained weights (model.pretrained=, docs/interop.md), converted to this run's attention."""
        from quest.models.pretrained import load_pretrained_weights

        info = load_pretrained_weights(self.model, source, download)
        log.info("model.pretrained=%s loaded%s%s", source, "; new classifier head" if info["new_head"] else "",
                 f"; initial values kept for {len(info['initial_values_kept'])} formulation parameters"
                 if info["initial_values_kept"] else "")
        if self.parts.ema is not None:
            self.parts.ema.module.load_state_dict(self.model.state_dict())

    def at_max_steps(self) -> bool:
        """Whether trainer.max_steps optimizer steps are taken (the run stops there, status stopped)."""
        return self.cfg.trainer.max_steps is not None and self.state.step >= self.cfg.trainer.max_steps

    def step_schedule_on_epoch(self) -> None:
        """A per-epoch schedule's step once ``state.epoch`` epochs are done (nothing for a per-update schedule)."""
        epoch = scheduler_epoch(self.cfg.recipe.get("sched_on", "updates"), self.state.epoch)
        if epoch is not None:
            self.parts.scheduler.step(epoch)

    # --- one optimizer step -----------------------------------------------------------------------------------
    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]], log: bool = True,
                   stop: float = 0.0) -> dict[str, float]:
        """Forward/backward over ``batches`` (gradient accumulation), clipping, the optimizer, EMA and schedule
        updates, with no host read unless ``log``: the divergence check (every micro-batch's loss and the gradient
        norm finite, the loss at most trainer.max_loss) stays on the device (quest.train.update), where from the
        first bad step on the optimizer skips its update. ``log``: read the check and the values to log (Diverged
        when a step since the last read went bad). ``stop``: this rank's stop request; under DDP it rides in the
        step's one collective and the result's ``"stop"`` is a reduced request that every rank reads at the same
        step (this step's when logged, else the previous step's)."""
        p, st, device = self.parts, self.state, self.ctx.device
        loss_sum = worst = None
        for i, (images, targets) in enumerate(batches):
            images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            if p.mixup is not None:
                images, targets = p.mixup(images, targets)
            sync = i == len(batches) - 1 or not self.ctx.distributed
            with (nullcontext() if sync else self.train_model.no_sync()), self.autocast():
                loss = self.train_model(images, targets)  # the model and the loss (compiled: trainer.compile)
            value = loss.detach().float()
            # the largest loss; NaN wins, so a non-finite micro-batch cannot hide behind a finite one
            worst = value if worst is None else torch.where(value.isnan() | (value > worst), value, worst)
            if log:  # the mean loss is only computed to be logged
                loss_sum = value if loss_sum is None else loss_sum + value
            self.scaler.scale(loss / len(batches)).backward()
        grad_norm, scale = self.update(worst, stop, st.step + 1, log)
        st.took_step(sum(len(t) for _, t in batches) * self.ctx.world_size)
        p.scheduler.step_update(num_updates=st.step)
        self._add_skip_counts(reduce=log)
        if not log:
            return {"stop": self.guard.previous_stop() if self.ctx.distributed else stop}
        loss_v, norm_v, *rest = self.guard.read(st.step, loss_sum / len(batches), grad_norm, *scale, stop=True)
        metrics = {"train/loss_scale": rest.pop(0)} if scale else {}
        return {"train/loss": loss_v, "train/grad_norm": norm_v, **metrics, "stop": rest[0] if rest else stop}

    def check_diverged(self) -> None:
        """Raise Diverged when a step since the last read went bad (one device-to-host read): before a checkpoint,
        an epoch's end and diagnostics, so that none of them sees weights from after a bad step."""
        self.guard.read(self.state.step)

    # --- epochs -----------------------------------------------------------------------------------------------
    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches in a whole epoch (a resumed epoch's loader is shorter: its sampler skips what was used)."""
        return len(self.parts.train_loader.sampler.sampler) // self.cfg.data.batch_size

    def step_batches(self) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        """The rest of the current epoch, one optimizer step at a time: the micro-batches of each (trainer.accum_steps,
        fewer at the epoch's end), counting the images drawn and skipped (added to the state after each step)."""
        p, cfg, st = self.parts, self.cfg, self.state
        p.train_loader.sampler.set_epoch(st.epoch, start=st.micro_in_epoch * cfg.data.batch_size)
        p.train_loader.generator.manual_seed(cfg.trainer.seed * 100_003 + st.epoch)
        self.train_model.train()
        self._epoch_start, self._counts = (st.step, st.micro_in_epoch), [0, 0]
        per_epoch = self.batches_per_epoch
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        # data.pipeline: the rest of the transform on the device, per batch (on CUDA one batch ahead, same draws)
        for images, targets, n_bad in finish_ahead(self._timed(p.train_loader), p.train_finish, self.ctx.device):
            self._counts[0] += n_bad
            self._counts[1] += n_bad + len(targets)
            st.drew_batch()
            if len(targets):
                pending.append((images, targets))
            if pending and not (st.micro_in_epoch % cfg.trainer.accum_steps
                                and st.micro_in_epoch < per_epoch):
                yield pending
                pending = []

    def _timed(self, loader: Any) -> Iterator[Any]:
        """The loader's batches, the time spent waiting for each (its workers' start included) added to
        ``data_wait``: host clocks only, nothing on the device."""
        tic = time.perf_counter()
        for batch in loader:
            self.data_wait += time.perf_counter() - tic
            yield batch
            tic = time.perf_counter()

    def take_data_wait(self) -> float:
        wait, self.data_wait = self.data_wait, 0.0
        return wait

    def diagnose(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
        """Attention statistics (diagnostics.every_n_steps) on the first images of a step, once the divergence check
        is read (they read the device anyway)."""
        self.check_diverged()
        sample = batches[0][0][: self.cfg.diagnostics.num_samples].to(self.ctx.device)
        return self.diagnostics.collect(sample, step=self.state.step)

    def end_epoch(self) -> dict[str, Any] | None:
        """The epoch's loader is exhausted: count its images, move the state to the next epoch, and step a per-epoch
        schedule. Returns the data counts to log when images were skipped; raises Diverged when a step since the last
        read went bad (before validation or the save see its weights), BadData when no step was taken."""
        self.check_diverged()
        st = self.state
        self._add_skip_counts()
        steps_before, micro_before = self._epoch_start
        if st.step == steps_before and st.micro_in_epoch > micro_before:  # batches drawn, none trained on
            raise BadData(f"no training step in epoch {st.epoch + 1}: none of its {st.train_drawn} images could be "
                          "read (data.bad_images=skip skipped them all)" if st.train_drawn else
                          f"no training step in epoch {st.epoch + 1}: the training split yielded no images")
        st.end_epoch()
        self.step_schedule_on_epoch()
        if not st.train_skipped:
            return None
        return {"data/train_skipped": st.train_skipped, "data/train_drawn": st.train_drawn, "epoch": st.epoch}

    def check_skipped(self) -> None:
        """BadData when more than data.max_skipped_fraction of the training images drawn so far were unreadable."""
        check_skipped("training", self.state.train_skipped, self.state.train_drawn,
                      self.cfg.data.get("max_skipped_fraction", 0.01))

    def _add_skip_counts(self, reduce: bool = True) -> None:
        """Add this rank's skipped / drawn images since the last call to the state, summed over ranks. Under DDP with
        data.bad_images=skip (where ranks can skip different numbers) the sum takes a collective and a host read,
        so the counts wait on the host until ``reduce``: a logged step, a save or an epoch's end, which every rank
        reaches at the same step."""
        if self.ctx.distributed and self.cfg.data.get("bad_images") == "skip":
            if not reduce:
                return
            total = torch.tensor(self._counts, dtype=torch.int64, device=self.ctx.device)
            dist.all_reduce(total)
            counts = total.tolist()
        else:
            counts = [c * self.ctx.world_size for c in self._counts]  # every rank draws the same number of images
        self._counts = [0, 0]
        self.state.add_drawn(*counts)

    def sync_counts(self) -> None:
        """Bring the state's image counts up to date on every rank (before a save: the checkpoint holds them)."""
        self._add_skip_counts()

    def validate(self, model: torch.nn.Module | None = None, prefix: str = "val/") -> tuple[dict[str, float],
                                                                                           dict[str, float]]:
        """The validation metrics of ``model`` (the run's model by default; the EMA model with prefix="val_ema/"),
        and, for the run's model, the attention statistics of the first validation batch (diagnostics on)."""
        diag: dict[str, float] = {}
        own = model is None

        def on_first_batch(images: torch.Tensor) -> None:  # attention statistics on validation images too
            if own and self.diagnostics is not None:
                diag.update(self.diagnostics.collect(images, prefix="diag_val/", step=self.state.step))

        try:
            metrics = evaluate(self.model if own else model, self.parts.val_loader, self.ctx.device,
                               self.cfg.data.num_classes, self.autocast, prefix=prefix,
                               first_batch_hook=on_first_batch, lockstep=self.ctx if self.sharded else None)
        except ValueError as exc:  # Counts.summary: nothing was scored
            if "no samples" not in str(exc):
                raise
            raise BadData("no validation image could be read (data.bad_images=skip skipped them all)") from exc
        return metrics, diag


def check_skipped(split: str, skipped: int, drawn: int, limit: float) -> None:
    """Raise :class:`BadData` when more than ``limit`` of the ``drawn`` images of a split were unreadable."""
    if drawn and skipped / drawn > limit:
        raise BadData(f"{skipped} of the {drawn} {split} images drawn ({100 * skipped / drawn:.2f}%) could not be read "
                      f"and were skipped, more than data.max_skipped_fraction={limit} (docs/data.md); fix or remove "
                      "them (quest-data check ROOT lists them), or raise the limit")


def hms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
