"""Adversarial robustness: clean and adversarial top-1 and NLL under FGSM, PGD, SPSA and AutoAttack.

Two evaluations share this code: ``adversarial`` (defaults: the sound protocol, [0, 1] pixels with the
normalisation inside the model, the data set's labels, elliptical layers as trained) and ``adversarial_paper``
(defaults: QUEST Tables 3/4 as the Elliptical-attention code ran them: the normalised tensor, the model's
predictions as labels except for AutoAttack, the median estimator, cleverhans' SPSA, scoring under fp16 autocast on
CUDA). Every setting of either is selectable (``space``, ``labels``, ``elliptical_estimator``, ``score_precision``,
``spsa.estimate_at``, ...), every result says which ran, with eps in both units, and lists where the settings
differ from the authors'. With an attack-time estimator override, the clean numbers come twice: ``clean`` at the
attack-time estimator and ``clean_as_trained`` (the model as trained: the paper tables' clean accuracy). Accuracy
is always measured against the data set's labels, from integer counts (:class:`quest.train.counts.Counts`). The
settings and their meaning: quest.evaluation.adversarial_protocol.
"""
from __future__ import annotations

import dataclasses
import time
from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from .. import attacks as A
from ..adversarial_protocol import (
    AdversarialConfig,
    attack_labels,
    budget_key,
    check_section,
    clipping,
    paper_adversarial_config,
    protocol,
    score_precision_used,
)
from ..attack_space import AttackSpace
from ..context import Counts, EvalRun, evenly_spaced, fixed_subset, shard_batches
from ..estimator import attack_time_estimator
from ..imagenet_data import ImageList
from ..inputs import Input, data_input
from ..kinds import register_evaluation
from ..progress import Inner
from ..transforms import describe, pixel_transform
from .classification import require_imagenet_classifier, val_input, val_samples, val_split

__all__ = ["adversarial", "adversarial_paper", "attack_labels"]


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


def _run_attack(name: str, section: Any, model, x, y, eps: float, indices, batch_size: int, clip, inner: Inner):
    cfg, seed = section[name], section.seed
    if name == "fgsm":
        return A.fgsm(model, x, y, eps, clip), None
    if name == "pgd":
        return A.pgd(model, x, y, eps, cfg.steps, cfg.step_size * eps, cfg.random_start, seed, indices, clip,
                     inner), None
    if name == "spsa":
        return A.spsa(model, x, y, eps, cfg.lr, cfg.delta, cfg.nb_sample, cfg.nb_iter, cfg.max_batch_size, seed,
                      indices, clip, cfg.random_start, cfg.estimate_at, inner), None
    inner.counted = 0  # forwards of this batch's call
    return A.autoattack(model, x, y, eps, cfg.version, cfg.norm, seed, batch_size, inner.count)


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


def _scorer(model, precision: str, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """The forward that scores images: fp32, or under fp16 autocast as the authors' engine.py
    (``torch.cuda.amp.autocast()`` around ``model(images)``); no gradient either way."""
    def score(z: torch.Tensor) -> torch.Tensor:
        cast = (torch.autocast(device_type=torch.device(device).type, dtype=torch.float16) if precision == "fp16"
                else nullcontext())
        with torch.no_grad(), cast:
            return model(z)

    return score


def _clean_pass(run: EvalRun, dataset: Dataset, space: AttackSpace, score: Callable, batch_size: int,
                label: str) -> _Meter:
    meter, running = _Meter(), _Running("clean top-1")
    for x, y, _ in shard_batches(run, dataset, range(len(dataset)), batch_size, label, running):
        logits = score(space.encode(x))
        meter.update(logits, logits, y, None, None)
        running.update(logits, y)
    return meter


def _clean_numbers(meter: _Meter, run: EvalRun, estimator: str | None, precision: str) -> dict[str, Any]:
    clean = meter.compute(run)
    return {"top1": clean["clean_top1"], "top5": clean["clean_top5"], "nll": clean["clean_nll"],
            "correct": clean["clean_correct"], "n": clean["n"], "elliptical_estimator": estimator,
            "scoring": precision}


def _data_name(run: EvalRun, section: Any) -> str:
    if section.source == "imagenet_val":
        return f"imagenet val ({run.settings.roots.val})"
    return run.target.data.name


def _inputs(run: EvalRun, section: Any, name: str = "adversarial") -> list[Input]:
    """The images attacked: ImageNet val or the configured data set's val split."""
    if section.source == "imagenet_val":  # a 1000-class ImageNet classifier too: judged with the data, up front
        found = val_input(run)

        def check() -> Any:
            require_imagenet_classifier(run, f"eval.{name}.source=imagenet_val")
            return found.check()

        return [dataclasses.replace(found, check=check)]
    return data_input(run, name)


def adversarial_needs(section: Any) -> list[tuple[str, str, str]]:
    """AutoAttack's package (the [eval] extra) when the section runs it; FGSM, PGD and SPSA are quest's own."""
    return [("pyautoattack", "eval", "the autoattack attack")] if "autoattack" in section.attacks else []


@register_evaluation("adversarial", AdversarialConfig, needs=adversarial_needs,
                     inputs=_inputs)
def adversarial(run: EvalRun, section: Any, name: str = "adversarial") -> dict[str, Any]:
    """The attacks of ``section`` (an AdversarialConfig node, ``eval.<name>``) on the configured data set."""
    check_section(section, name)
    libraries = {"fgsm": "quest (own implementation, cleverhans 4.0.0 semantics)",
                 "pgd": "quest (own implementation, cleverhans 4.0.0 semantics)",
                 "spsa": "quest (cleverhans 4.0.0 torch SPSA semantics, quest/evaluation/spsa.py)"}
    if "autoattack" in section.attacks:
        libraries["autoattack"] = A.autoattack_library()  # fails now, naming the package, rather than mid-run
    space = AttackSpace(section.space, tuple(run.target.mean), tuple(run.target.std))
    transform = pixel_transform(run.target)
    dataset, subset = fixed_subset(_val_set(run, section, transform, name), section.max_samples)
    batch_size = section.batch_size or run.settings.batch_size
    budgets = {budget_key(attack, float(eps)): (attack, float(eps)) for attack in section.attacks
               for eps in section[attack].eps}
    precision = score_precision_used(section.score_precision, run.device)
    scoring = (precision if precision == section.score_precision else
               f"{precision} ({section.score_precision} asked, {torch.device(run.device).type})")
    with attack_time_estimator(run.model, section.elliptical_estimator) as estimator:
        model = space.model(run.model).to(run.device).eval()
        score = _scorer(model, precision, run.device)
        # every meter exists on every process, even one with no samples: computing them is a collective
        meters = {key: _Meter() for key in budgets}
        seconds = {key: 0.0 for key in budgets}
        aa_settings: dict[str, Any] = {}
        clean_meter = _clean_pass(run, dataset, space, score, batch_size, f"{name} clean")
        for key, (attack, eps) in budgets.items():
            # each attack on its own evenly spaced subset (the costly ones may use fewer samples), called once per
            # batch of that subset; its clean numbers are on the same samples
            running = _Running("adv. top-1")
            chosen = evenly_spaced(len(dataset), section[attack].max_samples)
            labels_of = attack_labels(section.labels, attack)
            # one batch of SPSA or AutoAttack can take minutes: their iterations (forwards) report in between
            inner = Inner(None, "forward" if attack == "autoattack" else "iteration")
            for x, y, indices in shard_batches(run, dataset, chosen, batch_size, f"{name} {key}", running, inner):
                z = space.encode(x)
                with torch.no_grad():
                    clean_logits = model(z)  # fp32, as the attacks (cleverhans) take the predictions as labels
                labels = y if labels_of == "ground_truth" else clean_logits.argmax(1)
                clean_scored = clean_logits if precision == "fp32" else score(z)
                tic = time.perf_counter()
                z_adv, extra = _run_attack(attack, section, model, z, labels, eps, indices, batch_size, space.clip,
                                           inner)
                seconds[key] += time.perf_counter() - tic
                aa_settings.update(extra or {})
                logits = score(z_adv)
                meters[key].update(clean_scored, logits, y, z_adv - z, space.to_pixels(z_adv) - x)
                running.update(logits, y)
        used = estimator.get("used")
        result: dict[str, Any] = {"clean": _clean_numbers(
            clean_meter, run, f"{used} (attack time)" if estimator.get("overridden") else used, scoring)}
    if estimator.get("overridden") and estimator["as_trained"] != [used]:
        # the model as trained (the authors' clean accuracy in the paper's tables), beside the attack-time one
        trained = ", ".join(estimator["as_trained"])
        result["clean_as_trained"] = _clean_numbers(
            _clean_pass(run, dataset, space, score, batch_size, f"{name} clean (as trained)"), run,
            f"{trained} (as trained)", scoring)
    for key, meter in meters.items():
        attack, eps = budgets[key]
        result[key] = {"attack": attack, "space": space.name, "eps": eps, "eps_x255": eps * 255,
                       **space.eps_units(eps), "labels": attack_labels(section.labels, attack), "scoring": scoring,
                       "clipping": clipping(space, attack), **meter.compute(run), "seconds": round(seconds[key], 2)}
    result.update({"protocol": protocol(section, space, libraries, estimator, run.device, precision), "subset": subset,
                   "elliptical_estimator": estimator.get("used"), "data": _data_name(run, section),
                   "transform": describe(transform)})
    if aa_settings:
        result["protocol"]["autoattack"] = aa_settings
    return result


@register_evaluation("adversarial_paper", AdversarialConfig, default=paper_adversarial_config,
                     needs=adversarial_needs,
                     inputs=lambda run, section: _inputs(run, section, "adversarial_paper"))
def adversarial_paper(run: EvalRun, section: Any) -> dict[str, Any]:
    """``adversarial`` under ``eval.adversarial_paper``, whose defaults are the authors' protocol."""
    return adversarial(run, section, "adversarial_paper")
