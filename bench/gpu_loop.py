"""train.py's loop on the device before any timing (bench/gpu.py's ``loop`` part): its host syncs, a bad step
skipped, compilation with CUDA graphs and accumulation, and finishing batches ahead.

- ``host_syncs``: 20 steps of quest's loop (quest.train.fit, data=fake, ViT-pico) counting the device-to-host
  syncs, each put in the phase it happened in: between log intervals (inside a step that logs nothing, or after it
  until the next step), at a log step (its read of the loss, until the next step), before the first step, after the
  last. On CUDA the counter is ``torch.cuda.set_sync_debug_mode("warn")``'s warnings; on the CPU (no syncs) a
  dispatcher mode counting the calls that hand a tensor's values to the host. Three runs: bf16 AdamW
  (recipe=deit); DeiT-III's fp16 (recipe=deit3, GradScaler) with NaN gradients at step 3 and a finite loss (the
  scaler's overflow), whose weights, EMA and optimizer state right after it must equal those right before it (a run
  stopped there), bit for bit, and which must go on to its 20 steps; the same with NaN images at step 3 (a NaN
  loss): the same states unchanged, and the run stopped as diverged at that step.
- ``compile``: trainer.compile=true with compile_mode=reduce-overhead and accum_steps=2 runs, or is refused in one
  line by the config check (which of the two is recorded).
- ``prefetch``: data.pipeline=device on a small JPEG folder, the next batch finished ahead and not, bit-equal weights.
"""
from __future__ import annotations

import copy
import inspect
import tempfile
import traceback
import warnings
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import torch

from bench.host_reads import HostReads

__all__ = ["sync_row", "compile_row", "prefetch_row"]

LOOP_STEPS, LOG_EVERY, NAN_STEP = 20, 10, 3  # NAN_STEP counts from 1, as the log's steps do


@contextmanager
def _sync_counter(device: torch.device, host_resident: Callable[[torch.Tensor], bool] = lambda t: False
                  ) -> Iterator[Callable[[], int]]:
    """A running count of host syncs (see the module's docstring), read by calling what this yields. On the CPU,
    reads of the tensors ``host_resident`` names are left out: they live in host memory on a GPU too (timm's Lamb's
    step count), where reading them is no sync."""
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            before = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield lambda: sum("synchroniz" in str(w.message) for w in caught)
            finally:
                torch.cuda.set_sync_debug_mode(before)
    else:
        with HostReads(skip=host_resident) as reads:
            yield lambda: reads.count


def _compose(overrides: list[str]) -> Any:
    from bench.gpu_recipe import _compose as compose

    return compose(overrides)


def _loop_overrides(device: torch.device, recipe: str, precision: str, steps: int = LOOP_STEPS,
                    every: int = LOG_EVERY) -> list[str]:
    # DeiT-III's table has no row for ViT-pico's size: its base row's values
    sized = ["recipe.lr=3e-3", "recipe.drop_path=0.2", "recipe.img_size=32"] if recipe == "deit3" else []
    return [f"recipe={recipe}", *sized, "model=vit_pico", "data=fake", "data.img_size=32", "data.batch_size=8",
            "data.num_classes=10", f"data.fake_train_size={8 * steps}", "data.fake_val_size=8",
            "data.num_workers=0", "trainer.epochs=1", f"trainer.max_steps={steps}",
            f"trainer.log_every_n_steps={every}", f"trainer.precision={precision}",
            f"trainer.device={device.type}", "diagnostics=disabled"]


def _state(run: Any) -> dict[str, Any]:
    """Copies of the weights, the EMA's and the optimizer's state (on the device: no host read)."""
    parts = run.stateful() if callable(run.stateful) else run.stateful  # a property today
    ema = parts.get("ema")
    return {"model": {k: v.detach().clone() for k, v in parts["model"].state_dict().items()},
            "ema": {k: v.detach().clone() for k, v in ema.state_dict().items()} if ema is not None else None,
            "optimizer": copy.deepcopy(parts["optimizer"].state_dict()["state"])}


def _equal(a: Any, b: Any) -> bool:
    """Bit for bit (NaN equal to NaN): tensors, and dicts / lists of them."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and bool(
            (a.view(-1) == b.view(-1)).logical_or(a.isnan().view(-1) & b.isnan().view(-1)).all()) if a.numel() else True
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def _poison_gradients(run: Any) -> Callable[[], None]:
    """Make the next step's gradients NaN with a finite loss (fp16's overflow: the GradScaler's case): a hook on
    the scaled loss the step backpropagates. Returns the undo."""
    scaler = run.scaler
    scale = scaler.scale

    def poisoned(outputs: Any) -> Any:
        scaled = scale(outputs)
        scaled.register_hook(lambda g: torch.full_like(g, float("nan")))
        poisoned.used = True
        return scaled

    poisoned.used = False
    scaler.scale = poisoned
    return lambda: (vars(scaler).pop("scale", None), poisoned.used)[1]


def _run_counting(overrides: list[str], device: torch.device, fault: str | None) -> dict[str, Any]:
    """fit with the syncs counted per phase; ``fault`` ("nan_grads": NaN gradients, a finite loss; "nan_images":
    NaN images, so a NaN loss) at step :data:`NAN_STEP`, with the states just before and after it."""
    from quest.train import fit
    from quest.train.trainer import Run
    from quest.train.update import decided_on_host

    original = Run.train_step
    signature = inspect.signature(original)
    # in_steps_between_logs: inside a step that logs nothing (the check); between_steps: from a step's end to the
    # next step's start (the loop's code and, on the CPU, the loader's work on the host) after a step that logged
    # nothing; at_log_steps: a step that logs, and what follows it until the next step
    phases = {"before_first_step": 0, "in_steps_between_logs": 0, "between_steps": 0, "at_log_steps": 0,
              "after_last_step": 0}
    seen: dict[str, Any] = {"steps": 0, "mark": 0, "last_log": False, "states": {}, "injected": False,
                            "optimizer": None, "decided_on_host": 0, "unlogged": 0}

    def host_resident(tensor: torch.Tensor) -> bool:  # a param group's step count (timm's Lamb: a CPU tensor)
        optimizer = seen["optimizer"]
        return optimizer is not None and any(group.get("step") is tensor for group in optimizer.param_groups)

    def train_step(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        bound = signature.bind(self, *args, **kwargs)
        logged = bound.arguments.get("log", True)
        now = count()
        where = "before_first_step" if seen["steps"] == 0 else "at_log_steps" if seen["last_log"] else "between_steps"
        phases[where] += now - seen["mark"]
        seen["steps"] += 1
        seen["optimizer"] = self.parts.optimizer
        # the stated exception (docs/training.md): under fp16 an optimizer that counts on the host reads its skip
        seen["decided_on_host"] = int(decided_on_host(self.parts.optimizer, self.scaler.is_enabled()))
        seen["unlogged"] += not logged
        here = fault is not None and seen["steps"] == NAN_STEP
        undo = None
        if here:  # the states and the fault are made outside the count: they are this check's, not the loop's
            if fault == "nan_images":
                bound.arguments["batches"] = [(torch.full_like(images, float("nan")), targets)
                                              for images, targets in bound.arguments["batches"]]
                seen["injected"] = True
            else:
                undo = _poison_gradients(self)
            seen["states"]["before"] = _state(self)
            now = count()
        try:
            out = original(*bound.args, **bound.kwargs)
        finally:
            if undo is not None:
                seen["injected"] = undo()
        after = count()
        phases["at_log_steps" if logged else "in_steps_between_logs"] += after - now
        if here:
            seen["states"]["after"] = _state(self)
        seen["mark"], seen["last_log"] = count(), logged
        return out

    cfg = _compose(overrides)
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        count = stack.enter_context(_sync_counter(device, host_resident))
        stack.enter_context(mock.patch.object(Run, "train_step", train_step))
        summary = fit(cfg, Path(tmp) / "run")
        phases["after_last_step"] = count() - seen["mark"]
    row = {"steps": seen["steps"], "status": summary.get("status"), "syncs": phases,
           # one read of the skip decision per step where the optimizer counts on the host under fp16 (deit3's Lamb)
           "expected_between_logs": seen["unlogged"] * seen["decided_on_host"],
           "counter": "torch.cuda.set_sync_debug_mode('warn') warnings" if device.type == "cuda" else
           "host reads (a dispatcher mode: item, tolist, cpu, bool, float, ..., _local_scalar_dense)",
           "diverged_at_step": summary.get("diverged_at_step"), "divergence_reason": summary.get("divergence_reason")}
    if fault is not None:
        states = seen["states"]
        row["fault_injected"] = seen["injected"]
        if "after" in states:
            before, after = states["before"], states["after"]
            row["unchanged_by_nan_step"] = {key: None if before[key] is None else _equal(before[key], after[key])
                                            for key in ("model", "ema", "optimizer")}
        else:
            row["unchanged_by_nan_step"] = {"model": False, "ema": False, "optimizer": False}
    return row


#: the loop rows: recipe, precision, fault at step NAN_STEP
LOOP_RUNS = {"bf16_adamw": ("deit", "bf16", None), "fp16_nan_grads": ("deit3", "fp16", "nan_grads"),
             "fp16_nan_loss": ("deit3", "fp16", "nan_images")}


def sync_row(device: torch.device, which: str, steps: int = LOOP_STEPS, every: int = LOG_EVERY) -> dict[str, Any]:
    """``which`` (:data:`LOOP_RUNS`): "bf16_adamw" (recipe=deit, bf16); "fp16_nan_grads" (recipe=deit3, fp16, NaN
    gradients at step 3 with a finite loss: the scaler's overflow, its update skipped, the run goes on);
    "fp16_nan_loss" (the same with NaN images at step 3, so a NaN loss: its update skipped, and the run stops as
    diverged at that step when the check is next read). ``steps`` with a log every ``every`` (the CPU smoke runs
    fewer)."""
    recipe, precision, fault = LOOP_RUNS[which]
    overrides = _loop_overrides(device, recipe, precision, steps, every)
    row: dict[str, Any] = {"check": f"host_syncs {which}", "overrides": overrides,
                           "nan_step": NAN_STEP if fault else None}
    try:
        row.update(_run_counting(overrides, device, fault))
    except Exception as exc:
        return {**row, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:500],
                "traceback": traceback.format_exc()[-1500:]}
    # on the CPU the loader's host work between steps reads values (no sync there): only the steps count
    between = row["syncs"]["in_steps_between_logs"] + (row["syncs"]["between_steps"] if device.type == "cuda" else 0)
    if fault == "nan_images":  # stopped as diverged, naming the NaN step (counted from 1, as everywhere)
        ended = row["status"] == "diverged" and row["diverged_at_step"] == NAN_STEP
    else:
        ended = row["steps"] == steps and row["status"] in ("stopped", "completed")
    ok = between == row["expected_between_logs"] and ended
    if fault is not None:
        ok = ok and row["fault_injected"] and all(v is not False for v in row["unchanged_by_nan_step"].values())
    return {**row, "ok": ok}


def compile_row(device: torch.device, compile_backend: str) -> dict[str, Any]:
    """trainer.compile=true, compile_mode=reduce-overhead, accum_steps=2, four steps: ``ran`` (the run's status)
    or ``refused`` (the config check's one line); a failure otherwise."""
    overrides = [*_loop_overrides(device, "light", "bf16" if device.type == "cuda" else "fp32"),
                 "trainer.compile=true", "trainer.compile_mode=reduce-overhead", "trainer.accum_steps=2",
                 f"trainer.compile_backend={compile_backend}", "trainer.max_steps=4", "trainer.log_every_n_steps=2"]
    row: dict[str, Any] = {"check": "compile reduce-overhead accum_steps=2", "overrides": overrides}
    from quest.train import fit
    from quest.train.checks import check_train_config

    try:
        cfg = _compose(overrides)
        check_train_config(cfg)
    except Exception as exc:
        line = str(exc).strip()
        # refused by the config check, before any work: what the check is for (its message names the keys)
        return {**row, "outcome": "refused", "message": line[:600], "ok": "trainer." in line}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            summary = fit(cfg, Path(tmp) / "run")
    except Exception as exc:
        return {**row, "outcome": "failed", "message": f"{type(exc).__name__}: {exc}"[:400],
                "traceback": traceback.format_exc()[-1500:], "ok": False}
    status = summary.get("status")
    return {**row, "outcome": "ran", "status": status, "ok": status in ("stopped", "completed")}


def _jpeg_folder(root: Path) -> Path:
    from bench.data_inputs import make_jpegs

    for split, count in (("train", 8), ("val", 4)):
        for c in range(2):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            make_jpegs(folder, count, seed=10 * c + len(split), size=(48, 40))
    return root


def prefetch_row(device: torch.device) -> dict[str, Any]:
    """data.pipeline=device trained four steps with the next batch finished ahead and without: the same weights
    bit for bit. Ahead or not is quest.data.pipelines.prefetch.finish_ahead's ``ahead`` (its default: on CUDA only), set
    for each run where train.py calls it."""
    from quest.run.checkpoint import load_checkpoint
    from quest.train import fit, trainer

    row: dict[str, Any] = {"check": "prefetch on/off, data.pipeline=device"}
    try:
        from quest.data.pipelines.prefetch import finish_ahead
    except ImportError as exc:
        return {**row, "ok": None, "note": f"not available: {exc}"}
    weights = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            data = _jpeg_folder(Path(tmp) / "data")
            overrides = ["data=imagefolder", f"data.root={data}", "data.num_classes=2", "data.img_size=16",
                         "data.batch_size=4", "data.num_workers=0", "data.pipeline=device", "model=vit_pico",
                         "recipe=light", "recipe.reprob=0.25", "trainer.epochs=1", "trainer.max_steps=4",
                         "trainer.log_every_n_steps=2", f"trainer.device={device.type}", "diagnostics=disabled"]
            row["overrides"] = overrides
            for ahead in (True, False):
                with mock.patch.object(trainer, "finish_ahead",
                                       lambda *a, _ahead=ahead, **k: finish_ahead(*a, **{**k, "ahead": _ahead})):
                    summary = fit(_compose(overrides), Path(tmp) / f"ahead_{ahead}")
                row[f"status_ahead_{ahead}"] = summary.get("status")
                weights[ahead] = load_checkpoint(Path(tmp) / f"ahead_{ahead}" / "checkpoints" / "last.pt")["model"]
    except Exception as exc:
        return {**row, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:500],
                "traceback": traceback.format_exc()[-1500:]}
    row["bit_equal"] = _equal(weights[True], weights[False])
    row["ok"] = row["bit_equal"] and all(row[f"status_ahead_{a}"] in ("stopped", "completed") for a in (True, False))
    return row

