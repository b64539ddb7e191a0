"""The training loop: DeiT's engine.py in spirit, with resumable state, divergence checks and run outputs."""
from __future__ import annotations

import logging
import math
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from timm.utils import random_seed

from .builders import Components, build_components, model_meta
from .checkpoint import check_compatible, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from .distributed import DistContext, all_reduce_max, barrier, gather_objects, init_distributed
from .evaluate import evaluate
from .logger import RunLogger
from .preemption import Preemption

log = logging.getLogger("quest.train")

__all__ = ["fit", "EXIT_DIVERGED", "TrainState"]

#: Exit code of ``train.py`` for a run that diverged (non-finite loss or grad norm, or loss above trainer.max_loss).
EXIT_DIVERGED = 3


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    epoch: int = 0  # epochs completed
    micro_in_epoch: int = 0  # batches of the current epoch already consumed
    best_top1: float = -1.0
    best_epoch: int = -1
    images_seen: int = 0
    train_seconds: float = 0.0
    wandb_id: str | None = None


class Diverged(Exception):
    def __init__(self, step: int, reason: str):
        super().__init__(f"diverged at step {step}: {reason}")
        self.step, self.reason = step, reason


def _precision(trainer: Any, device: torch.device) -> tuple[str, torch.dtype | None]:
    p = trainer.precision
    if p == "auto":
        p = "bf16" if device.type == "cuda" else "fp32"
    dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    if p not in dtypes:
        raise ValueError(f"trainer.precision must be auto, fp32, bf16 or fp16, got {p!r}")
    if p == "fp16" and device.type != "cuda":
        raise ValueError("trainer.precision=fp16 needs CUDA; use bf16 or fp32 on CPU")
    return p, dtypes[p]


class Run:
    """One training run: its components, state and outputs. ``fit`` drives it."""

    def __init__(self, cfg: Any, run_dir: Path, choices: dict[str, str], ctx: DistContext):
        self.cfg, self.run_dir, self.choices, self.ctx = cfg, run_dir, choices, ctx
        self.ckpt_dir = run_dir / "checkpoints"
        self.parts: Components = build_components(cfg, ctx)
        self.model = self.parts.model
        self.train_model = torch.compile(self.model) if cfg.trainer.compile else self.model
        self.sharded = cfg.trainer.strategy == "fsdp"
        if ctx.distributed and not self.sharded:
            self.train_model = torch.nn.parallel.DistributedDataParallel(
                self.train_model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        self.precision, dtype = _precision(cfg.trainer, ctx.device)
        self.autocast = (partial(torch.autocast, device_type=ctx.device.type, dtype=dtype) if dtype else nullcontext)
        self.scaler = torch.amp.GradScaler(ctx.device.type) if self.precision == "fp16" else None
        self.state = TrainState()
        self.diagnostics = self._diagnostics()
        self.preemption: Preemption | None = None

    def _diagnostics(self):
        d = self.cfg.diagnostics
        if d.every_n_steps <= 0:
            return None
        from quest.diagnostics import AttentionDiagnostics

        return AttentionDiagnostics(self.model, every_n_steps=d.every_n_steps, num_samples=d.num_samples,
                                    per_head=d.per_head, entropy_threshold=d.entropy_threshold,
                                    max_logit_warning=d.max_logit_warning)

    # --- checkpoints ------------------------------------------------------------------------------------------
    def save(self, name: str = "last.pt") -> None:
        # every rank draws its own augmentation randomness: keep each rank's RNG state, not only rank 0's
        rngs = gather_objects(rng_state(), self.ctx)
        p = self.parts
        sharded_dir = None
        if self.sharded:  # collectives: every rank writes its shard and helps gather the full weights
            from .fsdp import full_model_state_dict, save_sharded

            sharded_dir = name.replace(".pt", ".dcp")
            save_sharded(self.ckpt_dir / sharded_dir, self.model, p.optimizer, self.ctx)
            weights = full_model_state_dict(self.model)
        if not self.ctx.is_main:
            return
        save_checkpoint(self.ckpt_dir / name, {
            "model": weights if self.sharded else self.model.state_dict(),
            "sharded": sharded_dir,
            "ema": p.ema.module.state_dict() if p.ema is not None else None,
            "optimizer": None if self.sharded else p.optimizer.state_dict(),
            "scheduler": p.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "state": asdict(self.state),
            "rng": rngs,
            # plain containers only: a ListConfig option (elliptical's `layers`) would not load with weights_only=True
            "meta": {**model_meta(self.cfg),
                     "attention_options": OmegaConf.to_container(self.cfg.attention.options, resolve=True)},
            "config": OmegaConf.to_container(self.cfg, resolve=True),
            "choices": dict(self.choices),
        })

    def resume(self) -> bool:
        """Restore everything from ``trainer.resume`` (auto: run_dir/checkpoints/last.pt when present)."""
        how = self.cfg.trainer.resume
        if how == "never":
            return False
        path = self.ckpt_dir / "last.pt" if how == "auto" else Path(how).expanduser()
        if how == "auto" and not path.exists():
            return False
        ckpt = load_checkpoint(path, map_location=self.ctx.device)
        check_compatible(ckpt, model_meta(self.cfg), path)
        p = self.parts
        if bool(ckpt.get("sharded")) != self.sharded:
            raise ValueError(f"checkpoint {path} was written with strategy "
                             f"{'fsdp' if ckpt.get('sharded') else 'ddp'}, this run uses {self.cfg.trainer.strategy}")
        if self.sharded:
            from .fsdp import load_sharded

            load_sharded(path.parent / ckpt["sharded"], self.model, p.optimizer)
        else:
            self.model.load_state_dict(ckpt["model"])
            p.optimizer.load_state_dict(ckpt["optimizer"])
        if p.ema is not None and ckpt["ema"] is not None:
            p.ema.module.load_state_dict(ckpt["ema"])
        p.scheduler.load_state_dict(ckpt["scheduler"])
        if self.scaler is not None and ckpt["scaler"] is not None:
            self.scaler.load_state_dict(ckpt["scaler"])
        self.state = TrainState(**ckpt["state"])
        rngs = ckpt["rng"]
        if len(rngs) != self.ctx.world_size:
            log.warning("checkpoint was written by %d processes, this run has %d: RNG streams restart from rank 0's",
                        len(rngs), self.ctx.world_size)
        set_rng_state(rngs[self.ctx.rank] if len(rngs) == self.ctx.world_size else rngs[0])
        log.info("resumed from %s at epoch %d, step %d", path, self.state.epoch, self.state.step)
        return True

    def init_weights(self, path: str) -> None:
        """Start from another run's weights (e.g. DeiT-III's low-resolution phase), resizing pos_embed."""
        from timm.models.vision_transformer import checkpoint_filter_fn

        ckpt = load_checkpoint(path)
        weights = checkpoint_filter_fn(ckpt["ema"] or ckpt["model"], self.model)
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        if unexpected or [k for k in missing if not k.startswith("head")]:
            raise ValueError(f"trainer.init_from={path}: missing {missing}, unexpected {unexpected}")
        if self.parts.ema is not None:
            self.parts.ema.module.load_state_dict(self.model.state_dict())

    # --- one optimizer step -----------------------------------------------------------------------------------
    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
        """Forward/backward over ``batches`` (gradient accumulation), finiteness checks agreed across ranks,
        clipping, optimizer, EMA and schedule updates."""
        p, cfg, st = self.parts, self.cfg, self.state
        loss_sum = 0.0
        for i, (images, targets) in enumerate(batches):
            images, targets = images.to(self.ctx.device, non_blocking=True), targets.to(self.ctx.device, non_blocking=True)
            if p.mixup is not None:
                images, targets = p.mixup(images, targets)
            sync = i == len(batches) - 1 or not self.ctx.distributed
            with (nullcontext() if sync else self.train_model.no_sync()), self.autocast():
                loss = p.train_loss(self.train_model(images), targets)
            loss_value = loss.item()
            bad = not math.isfinite(loss_value) or (cfg.trainer.max_loss is not None and loss_value > cfg.trainer.max_loss)
            if all_reduce_max(float(bad), self.ctx) > 0:
                raise Diverged(st.step, f"loss {loss_value:.4g}" + ("" if math.isfinite(loss_value) else " is not finite"))
            loss_sum += loss_value
            loss = loss / len(batches)
            (self.scaler.scale(loss) if self.scaler else loss).backward()
        if self.scaler is not None:
            self.scaler.unscale_(p.optimizer)
        clip = cfg.recipe.clip_grad if cfg.recipe.clip_grad is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        grad_norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()
        # fp16: an overflow is the scaler's business (it skips the step); otherwise a non-finite norm is divergence
        if self.scaler is None and all_reduce_max(float(not math.isfinite(grad_norm)), self.ctx) > 0:
            raise Diverged(st.step, f"gradient norm {grad_norm}")
        if self.scaler is not None:
            self.scaler.step(p.optimizer)
            self.scaler.update()
        else:
            p.optimizer.step()
        p.optimizer.zero_grad(set_to_none=True)
        st.step += 1
        if p.ema is not None:
            p.ema.update(self.model, step=st.step)
        p.scheduler.step_update(num_updates=st.step)
        return {"train/loss": loss_sum / len(batches), "train/grad_norm": grad_norm}

    # --- epochs -----------------------------------------------------------------------------------------------
    def train_epoch(self, logger: RunLogger) -> None:
        p, cfg, st = self.parts, self.cfg, self.state
        accum, max_steps = cfg.trainer.accum_steps, cfg.trainer.max_steps
        sampler = p.train_loader.sampler
        sampler.set_epoch(st.epoch, start=st.micro_in_epoch * cfg.data.batch_size)
        # the loader of a resumed epoch is shorter (its sampler skips what was consumed): count against the full epoch
        batches_per_epoch = len(sampler.sampler) // cfg.data.batch_size
        p.train_loader.generator.manual_seed(cfg.trainer.seed * 100_003 + st.epoch)
        self.train_model.train()
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        tic, images_since_log, skipped = time.perf_counter(), 0, 0
        total_steps = min(cfg.trainer.epochs * p.steps_per_epoch, max_steps or math.inf)
        for images, targets, n_bad in p.train_loader:
            skipped += n_bad
            st.micro_in_epoch += 1
            if len(targets):
                pending.append((images, targets))
            if st.micro_in_epoch % accum and st.micro_in_epoch < batches_per_epoch:
                continue
            if not pending:
                continue
            if self.diagnostics is not None and self.diagnostics.due(st.step):
                sample = pending[0][0][: cfg.diagnostics.num_samples].to(self.ctx.device)
                logger.log(self.diagnostics.collect(sample, step=st.step), st.step)
            metrics = self.train_step(pending)
            n_images = sum(len(t) for _, t in pending) * self.ctx.world_size
            st.images_seen += n_images
            images_since_log += n_images
            pending = []
            if st.step % cfg.trainer.log_every_n_steps == 0 or st.step == total_steps:
                elapsed = time.perf_counter() - tic
                st.train_seconds += elapsed
                rate = images_since_log / max(elapsed, 1e-9)
                metrics.update({"train/lr": p.optimizer.param_groups[0]["lr"], "train/img_per_s": rate,
                                "epoch": st.epoch + st.micro_in_epoch / batches_per_epoch})
                if skipped:
                    metrics["data/skipped_images"] = skipped
                logger.log(metrics, st.step)
                eta = (total_steps - st.step) * p.global_batch / max(rate, 1e-9)
                log.info("epoch %d/%d step %d/%d loss %.4f lr %.3g grad %.3g %.0f img/s ETA %s",
                         st.epoch + 1, cfg.trainer.epochs, st.step, total_steps, metrics["train/loss"],
                         metrics["train/lr"], metrics["train/grad_norm"], rate, _hms(eta))
                tic, images_since_log = time.perf_counter(), 0
            if cfg.trainer.checkpoint_every_n_steps and st.step % cfg.trainer.checkpoint_every_n_steps == 0:
                self.save()
            if self.preemption is not None and self.preemption.due(self.ctx):
                self.save()
                self.preemption.requeue(self.ctx)
            if max_steps is not None and st.step >= max_steps:
                break
        else:  # the epoch ran to its end
            st.epoch += 1
            st.micro_in_epoch = 0
        st.train_seconds += time.perf_counter() - tic

    def validate(self, logger: RunLogger) -> dict[str, float]:
        diag: dict[str, float] = {}

        def on_first_batch(images: torch.Tensor) -> None:  # attention statistics on validation images too
            if self.diagnostics is not None:
                diag.update(self.diagnostics.collect(images, prefix="diag_val/", step=self.state.step))

        metrics = evaluate(self.model, self.parts.val_loader, self.ctx.device, self.cfg.data.num_classes,
                           self.autocast, first_batch_hook=on_first_batch,
                           lockstep=self.ctx if self.sharded else None)
        logger.log({**metrics, **diag, "epoch": self.state.epoch}, self.state.step)
        log.info("epoch %d: val top-1 %.2f top-5 %.2f loss %.4f", self.state.epoch, metrics["val/top1"],
                 metrics["val/top5"], metrics["val/loss"])
        return metrics


def _hms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def fit(cfg: Any, run_dir: str | Path, choices: dict[str, str] | None = None) -> dict[str, Any]:
    """Train (or resume, or report an already finished run) and return the summary written to summary.json."""
    run_dir = Path(run_dir)
    ctx = init_distributed(cfg.trainer.device)
    if cfg.trainer.torch_threads:
        torch.set_num_threads(cfg.trainer.torch_threads)
    choices = choices or {"model": cfg.model.name, "attention": cfg.attention.name,
                          "recipe": cfg.recipe.name, "data": cfg.data.name}
    start = time.perf_counter()
    random_seed(cfg.trainer.seed)  # the same initial weights on every rank (FSDP2, unlike DDP, does not broadcast)
    run = Run(cfg, run_dir, choices, ctx)
    random_seed(cfg.trainer.seed, ctx.rank)  # then each rank its own augmentation and drop-path randomness
    resumed = run.resume()
    if not resumed and cfg.trainer.init_from:
        run.init_weights(cfg.trainer.init_from)
    st, tr = run.state, cfg.trainer
    logger = RunLogger(run_dir, cfg, cfg.logger, choices, enabled=ctx.is_main, resume_id=st.wandb_id)
    st.wandb_id = logger.wandb_id
    num_params = sum(p.numel() for p in run.model.parameters())
    log.info("%s with %s attention: %.2fM parameters; run directory %s", cfg.model.name, cfg.attention.name,
             num_params / 1e6, run_dir)
    status, diverged_at, reason, val = "completed", None, None, {}
    run.preemption = Preemption().install()
    try:
        while st.epoch < tr.epochs and (tr.max_steps is None or st.step < tr.max_steps):
            run.train_epoch(logger)
            if st.micro_in_epoch == 0 and (st.epoch % tr.eval_every_n_epochs == 0 or st.epoch == tr.epochs):
                val = run.validate(logger)
                if val["val/top1"] > st.best_top1:
                    st.best_top1, st.best_epoch = val["val/top1"], st.epoch
                    run.save()
                    if ctx.is_main:
                        shutil.copyfile(run.ckpt_dir / "last.pt", run.ckpt_dir / ".best.pt.tmp")
                        (run.ckpt_dir / ".best.pt.tmp").replace(run.ckpt_dir / "best.pt")
                    continue
            run.save()
        if st.epoch < tr.epochs:
            status = "stopped"  # trainer.max_steps reached first
    except Diverged as exc:
        status, diverged_at, reason = "diverged", exc.step, exc.reason
        log.error("run diverged at step %d (%s); the last good checkpoint stays in %s", exc.step, exc.reason, run.ckpt_dir)
    finally:
        run.preemption.uninstall()
    if not val and status != "diverged":
        val = run.validate(logger)
    ema_val = {}
    if run.parts.ema is not None and status != "diverged":
        ema_val = evaluate(run.parts.ema.module, run.parts.val_loader, ctx.device, cfg.data.num_classes,
                           run.autocast, prefix="val_ema/")
    summary = {
        "status": status, "diverged_at_step": diverged_at, "divergence_reason": reason,
        "epoch": st.epoch, "step": st.step, **val, **ema_val,
        "best/val/top1": st.best_top1 if st.best_top1 >= 0 else None, "best_epoch": st.best_epoch,
        "choices": dict(choices), "attention": cfg.attention.name, "model": cfg.model.name, "seed": tr.seed,
        "num_params": num_params, "lr": run.parts.lr, "global_batch": run.parts.global_batch,
        "world_size": ctx.world_size, "wall_time_s": time.perf_counter() - start,
        "train_img_per_s": st.images_seen / st.train_seconds if st.train_seconds else None,
        "resumed": resumed, "run_dir": str(run_dir),
    }
    logger.summary(summary)
    logger.close()
    barrier(ctx)
    return summary
