"""Adversarial robustness: clean and adversarial top-1 and NLL under FGSM, PGD, SPSA and AutoAttack.

The sound protocol of evaluation.md: attacks in [0, 1] pixel space with the normalisation inside the model, the
model in eval mode, the data set's labels. Accuracy is always measured against the data set's labels; with
``labels: predicted`` the attacks (only) use the model's clean predictions, as the Elliptical-attention code did.
"""
from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, Dataset, Subset
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from quest.data import collate_skipping_bad

from . import attacks as A
from .checks import ATTACKS, LABELS
from .dataset_eval import val_split
from .metrics import EvalRun, evenly_spaced, fixed_subset
from .transforms import Normalized, describe, pixel_transform

log = logging.getLogger("quest.eval")

__all__ = ["ATTACKS", "adversarial"]



def _key(attack: str, eps: float) -> str:
    return f"{attack}@{eps:.6g}"


class _Meter:
    """Micro top-1 (percent) and mean NLL of clean and attacked inputs on one attack's samples, and the largest l_inf
    perturbation; states are summed / maxed over processes."""

    def __init__(self, num_classes: int, device: torch.device):
        make_top1 = partial(MulticlassAccuracy, num_classes=num_classes, top_k=1, average="micro")
        self.top1, self.clean_top1 = make_top1().to(device), make_top1().to(device)
        self.nll, self.clean_nll = MeanMetric().to(device), MeanMetric().to(device)
        self.max_linf, self.n = 0.0, 0

    def update(self, clean_logits: torch.Tensor, logits: torch.Tensor, y: torch.Tensor, x_adv: torch.Tensor | None,
               x: torch.Tensor) -> None:
        for top1, nll, out in ((self.clean_top1, self.clean_nll, clean_logits), (self.top1, self.nll, logits)):
            top1.update(out.float(), y)
            nll.update(F.cross_entropy(out.float(), y, reduction="none"))
        self.n += len(y)
        if x_adv is not None:
            self.max_linf = max(self.max_linf, (x_adv - x).abs().max().item())

    def compute(self, distributed: bool, device: torch.device) -> dict[str, float]:
        stats = torch.tensor([self.max_linf, self.n], dtype=torch.float64, device=device)
        if distributed:
            linf, n = stats.clone(), stats.clone()
            dist.all_reduce(linf, op=dist.ReduceOp.MAX)
            dist.all_reduce(n, op=dist.ReduceOp.SUM)
            stats = torch.stack([linf[0], n[1]])
        return {"top1": 100.0 * self.top1.compute().item(), "nll": self.nll.compute().item(),
                "clean_top1": 100.0 * self.clean_top1.compute().item(), "clean_nll": self.clean_nll.compute().item(),
                "max_linf": stats[0].item(), "n": int(stats[1].item())}


def _check(section: Any) -> None:
    unknown = [a for a in section.attacks if a not in ATTACKS]
    if unknown:
        raise ValueError(f"unknown attacks {unknown}; eval.adversarial.attacks takes {list(ATTACKS)}")
    if section.labels not in LABELS:
        raise ValueError(f"eval.adversarial.labels must be one of {LABELS}, got {section.labels!r}")
    for attack in section.attacks:
        eps = list(section[attack].eps)
        if any(e < 0 for e in eps) or len({_key(attack, e) for e in eps}) != len(eps):
            raise ValueError(f"eval.adversarial.{attack}.eps must be distinct values >= 0, got {eps}")


def _run_attack(name: str, section: Any, model, x, y, eps: float, indices, batch_size: int):
    cfg, seed = section[name], section.seed
    if name == "fgsm":
        return A.fgsm(model, x, y, eps), None
    if name == "pgd":
        return A.pgd(model, x, y, eps, cfg.steps, cfg.step_size * eps, cfg.random_start, seed, indices), None
    if name == "spsa":
        return A.spsa(model, x, y, eps, cfg.lr, cfg.delta, cfg.nb_sample, cfg.nb_iter, cfg.max_batch_size, seed,
                      indices), None
    return A.autoattack(model, x, y, eps, cfg.version, cfg.norm, seed, batch_size)


def _protocol(run: EvalRun, section: Any, libraries: dict[str, str]) -> dict[str, Any]:
    t = run.target
    return {
        "space": f"[0, 1] pixels after the eval resize/crop; normalisation (mean={list(t.mean)}, std={list(t.std)}) "
                 "inside the attacked model, so eps is in pixel units (1/255 = one grey level)",
        "labels": ("ground truth (the data set's labels)" if section.labels == "ground_truth"
                   else "the model's clean predictions (accuracy still against the data set's labels)"),
        "model_mode": "eval", "norm": "Linf", "libraries": libraries,
        "not_the_elliptical_convention": "the Elliptical-attention code attacked already-normalised tensors (eps in "
                                         "normalised units, about 0.23/255 in pixels) with predicted labels",
        "settings": {a: OmegaConf.to_container(section[a], resolve=True) for a in section.attacks},
    }


class _Batches:
    """(images, labels, data-set indices) of this process's share of ``indices`` (every r-th of W: each sample on
    exactly one process, none padded), in order; progress lines name the pass ``what`` and end with ``extra()``."""

    def __init__(self, run: EvalRun, dataset: Dataset, indices: list[int], batch_size: int, what: str,
                 extra: Callable[[], str] | None = None):
        self.run, self.extra = run, extra
        self.shard = indices[run.dist.rank::run.dist.world_size]
        self.loader = DataLoader(Subset(dataset, self.shard), batch_size=batch_size, shuffle=False,
                                 num_workers=run.settings.num_workers, collate_fn=collate_skipping_bad)
        self.progress = run.progress(what, len(self.loader), len(self.shard))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[int]]]:
        done = 0
        for images, targets, skipped in self.loader:
            if skipped:
                raise RuntimeError("adversarial evaluation cannot skip unreadable images (sample seeds follow "
                                   "indices)")
            yield images.to(self.run.device), targets.to(self.run.device), self.shard[done:done + len(targets)]
            done += len(targets)
            self.progress.update(len(targets), self.extra or "")


class _Running:
    """Top-1 (percent) so far on this process's samples, for progress lines (the reported numbers come from the
    meters, summed over processes)."""

    def __init__(self, label: str):
        self.label, self.correct, self.n = label, 0, 0

    def update(self, logits: torch.Tensor, y: torch.Tensor) -> None:
        self.correct += int((logits.argmax(1) == y).sum().item())
        self.n += len(y)

    def __call__(self) -> str:
        return f"{self.label} {100 * self.correct / max(self.n, 1):.2f}%"


def adversarial(run: EvalRun, section: Any) -> dict[str, Any]:
    _check(section)
    libraries = {"fgsm": "quest (own implementation)", "pgd": "quest (own implementation)",
                 "spsa": "quest (port of advertorch's SPSA, as shipped by torchattacks 3.5.1)"}
    if "autoattack" in section.attacks:
        libraries["autoattack"] = A.autoattack_library()  # fails now, naming the package, rather than mid-run
    transform = pixel_transform(run.target)
    dataset, subset = fixed_subset(val_split(run, transform, "adversarial"), section.max_samples)
    model = Normalized(run.model, run.target.mean, run.target.std).to(run.device).eval()
    batch_size = section.batch_size or run.settings.batch_size
    num_classes, device = run.target.num_classes, run.device
    budgets = {_key(name, float(eps)): (name, float(eps)) for name in section.attacks for eps in section[name].eps}
    # every meter exists on every process, even one with no samples: computing them is a collective
    clean_meter = _Meter(num_classes, device)
    meters = {key: _Meter(num_classes, device) for key in budgets}
    seconds = {key: 0.0 for key in budgets}
    aa_settings: dict[str, Any] = {}
    running = _Running("clean top-1")
    for x, y, _ in _Batches(run, dataset, list(range(len(dataset))), batch_size, "adversarial clean", running):
        with torch.no_grad():
            logits = model(x)
        clean_meter.update(logits, logits, y, None, x)
        running.update(logits, y)
    for key, (name, eps) in budgets.items():
        # each attack on its own evenly spaced subset (the costly ones may use fewer samples), called once per batch
        # of that subset; its clean numbers are on the same samples
        running = _Running("adv. top-1")
        chosen = evenly_spaced(len(dataset), section[name].max_samples)
        for x, y, indices in _Batches(run, dataset, chosen, batch_size, f"adversarial {key}", running):
            with torch.no_grad():
                clean_logits = model(x)
            labels = y if section.labels == "ground_truth" else clean_logits.argmax(1)
            tic = time.perf_counter()
            x_adv, extra = _run_attack(name, section, model, x, labels, eps, indices, batch_size)
            seconds[key] += time.perf_counter() - tic
            aa_settings.update(extra or {})
            with torch.no_grad():
                logits = model(x_adv)
            meters[key].update(clean_logits, logits, y, x_adv, x)
            running.update(logits, y)
    clean = clean_meter.compute(run.dist.distributed, device)
    result: dict[str, Any] = {"clean": {k: clean[k] for k in ("top1", "nll", "n")}}
    for key, meter in meters.items():
        name, eps = budgets[key]
        result[key] = {"attack": name, "eps": eps, "eps_x255": eps * 255,
                       **meter.compute(run.dist.distributed, device), "seconds": round(seconds[key], 2)}
    result.update({"protocol": _protocol(run, section, libraries), "subset": subset,
                   "data": run.target.data.name, "transform": describe(transform)})
    if aa_settings:
        result["protocol"]["autoattack"] = aa_settings
    return result
