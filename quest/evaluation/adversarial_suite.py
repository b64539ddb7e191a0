"""Adversarial robustness: clean and adversarial top-1 and NLL under FGSM, PGD, SPSA and AutoAttack.

Two evaluations share this code: ``adversarial`` (defaults: the sound protocol, [0, 1] pixels with the
normalisation inside the model, the data set's labels, elliptical layers as trained) and ``adversarial_paper``
(defaults: QUEST Tables 3/4 as the Elliptical-attention code ran them: the normalised tensor, the model's
predictions as labels except for AutoAttack, the median estimator, cleverhans' SPSA). Every setting of either is
selectable (``space``, ``labels``, ``elliptical_estimator``, ``spsa.estimate_at``, ...), every result says which
ran, with eps in both units, and lists where the settings differ from the authors'. Accuracy is always measured
against the data set's labels, from integer counts (:class:`.metrics.Counts`).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, Dataset, Subset

from quest.data import collate_skipping_bad

from . import attacks as A
from .attack_space import AttackSpace
from .checks import ATTACKS, LABELS
from .config import paper_adversarial_config
from .dataset_eval import val_split
from .estimator import attack_time_estimator
from .imagenet_data import ImageList
from .imagenet_suites import require_imagenet_classifier, val_samples
from .metrics import Counts, EvalRun, evenly_spaced, fixed_subset
from .transforms import describe, pixel_transform

log = logging.getLogger("quest.eval")

__all__ = ["ATTACKS", "adversarial", "adversarial_paper", "attack_labels"]

_LABEL_TEXT = {"ground_truth": "ground truth (the data set's labels)",
               "predicted": "the model's clean predictions (accuracy still against the data set's labels)"}


def _key(attack: str, eps: float) -> str:
    return f"{attack}@{eps:.6g}"


def attack_labels(mode: str, attack: str) -> str:
    """The labels ``attack`` is run with under ``labels: mode``: ground_truth or predicted. ``paper`` is what the
    authors' engine.py passes: nothing to cleverhans' FGSM / PGD and to their SPSA (which then use the model's
    predictions), the data set's targets to AutoAttack's run_standard_evaluation."""
    if mode not in LABELS:
        raise ValueError(f"labels must be one of {LABELS}, got {mode!r}")
    if mode == "paper":
        return "ground_truth" if attack == "autoattack" else "predicted"
    return mode


class _Meter:
    """Clean and attacked counts (top-1 / top-5 / NLL) of one attack's samples and the largest l_inf perturbation
    in the attack space and in pixels; counts are summed and maxima maxed over processes."""

    def __init__(self) -> None:
        self.clean, self.adv = Counts(), Counts()
        self.max_linf, self.max_linf_pixel = 0.0, 0.0

    def update(self, clean_logits: torch.Tensor, logits: torch.Tensor, y: torch.Tensor, delta: torch.Tensor | None,
               delta_pixels: torch.Tensor | None) -> None:
        self.clean.update(clean_logits, y)
        self.adv.update(logits, y)
        if delta is not None:
            self.max_linf = max(self.max_linf, delta.abs().max().item())
            self.max_linf_pixel = max(self.max_linf_pixel, delta_pixels.abs().max().item())

    def compute(self, run: EvalRun) -> dict[str, Any]:
        linf = torch.tensor([self.max_linf, self.max_linf_pixel], dtype=torch.float64, device=run.device)
        if run.dist.distributed:
            dist.all_reduce(linf, op=dist.ReduceOp.MAX)
        clean, adv = self.clean.reduced(run.dist).summary(), self.adv.reduced(run.dist).summary()
        return {"top1": adv["top1"], "top5": adv["top5"], "nll": adv["nll"], "correct": adv["correct"],
                "clean_top1": clean["top1"], "clean_top5": clean["top5"], "clean_nll": clean["nll"],
                "clean_correct": clean["correct"], "n": adv["n"], "max_linf": linf[0].item(),
                "max_linf_pixel_x255": 255 * linf[1].item()}


def _check(section: Any, name: str) -> None:
    unknown = [a for a in section.attacks if a not in ATTACKS]
    if unknown:
        raise ValueError(f"unknown attacks {unknown}; eval.{name}.attacks takes {list(ATTACKS)}")
    if section.labels not in LABELS:
        raise ValueError(f"eval.{name}.labels must be one of {LABELS}, got {section.labels!r}")
    for attack in section.attacks:
        eps = list(section[attack].eps)
        if any(e < 0 for e in eps) or len({_key(attack, e) for e in eps}) != len(eps):
            raise ValueError(f"eval.{name}.{attack}.eps must be distinct values >= 0, got {eps}")


def _run_attack(name: str, section: Any, model, x, y, eps: float, indices, batch_size: int, clip):
    cfg, seed = section[name], section.seed
    if name == "fgsm":
        return A.fgsm(model, x, y, eps, clip), None
    if name == "pgd":
        return A.pgd(model, x, y, eps, cfg.steps, cfg.step_size * eps, cfg.random_start, seed, indices, clip), None
    if name == "spsa":
        return A.spsa(model, x, y, eps, cfg.lr, cfg.delta, cfg.nb_sample, cfg.nb_iter, cfg.max_batch_size, seed,
                      indices, clip, cfg.random_start, cfg.estimate_at), None
    return A.autoattack(model, x, y, eps, cfg.version, cfg.norm, seed, batch_size)


def _clipping(space: AttackSpace, attack: str) -> str:
    if attack == "autoattack":
        return ("[0, 1] pixels (pyautoattack)" if space.name == "pixel" else
                "[0, 1] on the normalised tensor (pyautoattack clamps every iterate, as the authors' bundled copy)")
    return "[0, 1] pixels" if space.clip is not None else "none (unbounded by the image)"


# settings compared with the authors' protocol (paper_adversarial_config) in every result
_PROTOCOL_KEYS = ("space", "labels", "elliptical_estimator", "fgsm.eps", "pgd.eps", "pgd.steps", "pgd.step_size",
                  "pgd.random_start", "spsa.eps", "spsa.lr", "spsa.delta", "spsa.nb_sample", "spsa.nb_iter",
                  "spsa.random_start", "spsa.estimate_at", "autoattack.eps", "autoattack.version")


def _differences(section: Any) -> list[str]:
    """Where this section's protocol differs from the authors' (empty: theirs)."""
    paper = OmegaConf.structured(paper_adversarial_config())
    out = []
    for key in _PROTOCOL_KEYS:
        attack = key.split(".")[0]
        if attack in ATTACKS and attack not in section.attacks:
            continue
        mine, theirs = OmegaConf.select(section, key), OmegaConf.select(paper, key)
        mine = list(mine) if OmegaConf.is_list(mine) else mine
        theirs = list(theirs) if OmegaConf.is_list(theirs) else theirs
        if mine != theirs:
            out.append(f"{key}: {mine} (authors: {theirs})")
    return out


def _spsa_text(cfg: Any) -> str:
    start = "a uniform start in the eps-ball" if cfg.random_start else "no random start"
    point = ("x + perturbation" if cfg.estimate_at == "iterate" else
             "2x, where cleverhans' torch SPSA (and the authors' copy) estimates it (cleverhans issue #1249)")
    return f"Rademacher directions per element, {start}, gradient estimated at {point}"


def _protocol(section: Any, space: AttackSpace, libraries: dict[str, str],
              estimator: dict[str, Any]) -> dict[str, Any]:
    return {
        "space": space.describe(), "space_name": space.name,
        "labels": {a: _LABEL_TEXT[attack_labels(section.labels, a)] for a in section.attacks},
        "clipping": {a: _clipping(space, a) for a in section.attacks},
        "elliptical_estimator": estimator,
        "spsa": _spsa_text(section.spsa),
        "model_mode": "eval", "norm": "Linf", "libraries": libraries,
        "scoring": "fp32 forward of the attacked inputs (the authors scored under CUDA fp16 autocast)",
        "differs_from_authors": _differences(section),
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


def _val_set(run: EvalRun, section: Any, transform: Callable, name: str) -> Dataset:
    """The images attacked: the configured data set's val split, or ImageNet val from eval.roots.val."""
    if section.source == "imagenet_val":
        require_imagenet_classifier(run, f"eval.{name}.source=imagenet_val")
        return ImageList(val_samples(run), transform)
    if section.source != "data":
        raise ValueError(f"eval.{name}.source must be data or imagenet_val, got {section.source!r}")
    return val_split(run, transform, name)


def _data_name(run: EvalRun, section: Any) -> str:
    if section.source == "imagenet_val":
        return f"imagenet val ({run.settings.roots.val})"
    return run.target.data.name


def adversarial(run: EvalRun, section: Any, name: str = "adversarial") -> dict[str, Any]:
    """The attacks of ``section`` (an AdversarialConfig node, ``eval.<name>``) on the configured data set."""
    _check(section, name)
    libraries = {"fgsm": "quest (own implementation, cleverhans 4.0.0 semantics)",
                 "pgd": "quest (own implementation, cleverhans 4.0.0 semantics)",
                 "spsa": "quest (cleverhans 4.0.0 torch SPSA semantics, quest/evaluation/spsa.py)"}
    if "autoattack" in section.attacks:
        libraries["autoattack"] = A.autoattack_library()  # fails now, naming the package, rather than mid-run
    space = AttackSpace(section.space, tuple(run.target.mean), tuple(run.target.std))
    transform = pixel_transform(run.target)
    dataset, subset = fixed_subset(_val_set(run, section, transform, name), section.max_samples)
    batch_size = section.batch_size or run.settings.batch_size
    budgets = {_key(attack, float(eps)): (attack, float(eps)) for attack in section.attacks
               for eps in section[attack].eps}
    with attack_time_estimator(run.model, section.elliptical_estimator) as estimator:
        model = space.model(run.model).to(run.device).eval()
        # every meter exists on every process, even one with no samples: computing them is a collective
        clean_meter = _Meter()
        meters = {key: _Meter() for key in budgets}
        seconds = {key: 0.0 for key in budgets}
        aa_settings: dict[str, Any] = {}
        running = _Running("clean top-1")
        for x, y, _ in _Batches(run, dataset, list(range(len(dataset))), batch_size, f"{name} clean", running):
            with torch.no_grad():
                logits = model(space.encode(x))
            clean_meter.update(logits, logits, y, None, None)
            running.update(logits, y)
        for key, (attack, eps) in budgets.items():
            # each attack on its own evenly spaced subset (the costly ones may use fewer samples), called once per
            # batch of that subset; its clean numbers are on the same samples
            running = _Running("adv. top-1")
            chosen = evenly_spaced(len(dataset), section[attack].max_samples)
            labels_of = attack_labels(section.labels, attack)
            for x, y, indices in _Batches(run, dataset, chosen, batch_size, f"{name} {key}", running):
                z = space.encode(x)
                with torch.no_grad():
                    clean_logits = model(z)
                labels = y if labels_of == "ground_truth" else clean_logits.argmax(1)
                tic = time.perf_counter()
                z_adv, extra = _run_attack(attack, section, model, z, labels, eps, indices, batch_size, space.clip)
                seconds[key] += time.perf_counter() - tic
                aa_settings.update(extra or {})
                with torch.no_grad():
                    logits = model(z_adv)
                meters[key].update(clean_logits, logits, y, z_adv - z, space.to_pixels(z_adv) - x)
                running.update(logits, y)
        clean = clean_meter.compute(run)
    result: dict[str, Any] = {"clean": {"top1": clean["clean_top1"], "top5": clean["clean_top5"],
                                        "nll": clean["clean_nll"], "correct": clean["clean_correct"],
                                        "n": clean["n"]}}
    for key, meter in meters.items():
        attack, eps = budgets[key]
        result[key] = {"attack": attack, "space": space.name, "eps": eps, "eps_x255": eps * 255,
                       **space.eps_units(eps), "labels": attack_labels(section.labels, attack),
                       "clipping": _clipping(space, attack), **meter.compute(run), "seconds": round(seconds[key], 2)}
    result.update({"protocol": _protocol(section, space, libraries, estimator), "subset": subset,
                   "elliptical_estimator": estimator.get("used"), "data": _data_name(run, section),
                   "transform": describe(transform)})
    if aa_settings:
        result["protocol"]["autoattack"] = aa_settings
    return result


def adversarial_paper(run: EvalRun, section: Any) -> dict[str, Any]:
    """``adversarial`` under ``eval.adversarial_paper``, whose defaults are the authors' protocol."""
    return adversarial(run, section, "adversarial_paper")
