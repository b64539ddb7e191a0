"""The settings of an adversarial evaluation and what they mean: the config sections of ``adversarial`` and
``adversarial_paper`` (every setting of either can be set on the other) with what each value may be, and the protocol text
each result carries (the space, labels and clipping of each attack in words, and where the settings differ from the
authors' protocol of QUEST Tables 3/4, :func:`paper_adversarial_config`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
from omegaconf import OmegaConf

from quest.attention.elliptical import ESTIMATORS
from quest.store.records import bounded, described, listed, one_of

from .attack_space import SPACES, AttackSpace
from .settings import BATCH_SIZE, EVAL_SEED, ITERATIONS, SAMPLE_COUNT
from .spsa import ESTIMATE_AT as SPSA_ESTIMATE_AT

__all__ = ["ATTACKS", "LABELS", "SOURCES", "AUTOATTACK_VERSIONS", "SCORE_PRECISIONS", "AdversarialConfig",
           "FGSMConfig", "PGDConfig", "SPSAConfig", "AutoAttackConfig", "paper_adversarial_config",
           "attack_labels", "clipping", "protocol", "budget_key", "check_section", "score_precision_used",
           "scoring_text"]

ATTACKS = ("fgsm", "pgd", "spsa", "autoattack")
# paper: the model's predictions for FGSM, PGD and SPSA, the data set's labels for AutoAttack (the authors' code)
LABELS = ("ground_truth", "predicted", "paper")
SOURCES = ("data", "imagenet_val")
# the forward that scores the clean and attacked images: fp32, or fp16 autocast as the authors' engine.py (CUDA only)
SCORE_PRECISIONS = ("fp32", "fp16")
# pyautoattack's versions; 'custom' needs an attack list this config does not expose
AUTOATTACK_VERSIONS = ("standard", "plus", "rand")
ONE_OVER_255 = 1.0 / 255.0
# pixel space: an l_inf budget above 1 means nothing (every image is already within 1 of every other); in normalised
# units 1 is about a quarter of the pixel range, far beyond any budget in use
BUDGETS = {**bounded(0, 1), **listed(distinct=True), **described(
    "a list of distinct budgets in [0, 1] (units of the section's space: pixel 1/255 = one grey level, or normalised)")}


@dataclass
class FGSMConfig:
    """FGSM: one signed-gradient step."""

    # L-inf radii, each a result (1/255 = 0.00392)
    eps: List[float] = field(default_factory=lambda: [ONE_OVER_255], metadata=BUDGETS)
    # None: adversarial.max_samples; else a smaller evenly spaced subset
    max_samples: Optional[int] = field(default=None, metadata=SAMPLE_COUNT)


@dataclass
class PGDConfig:
    """PGD: projected gradient descent in the eps-ball."""

    # L-inf radii, each a result (1/255 = 0.00392)
    eps: List[float] = field(default_factory=lambda: [ONE_OVER_255], metadata=BUDGETS)
    steps: int = field(default=20, metadata=ITERATIONS)  # PGD iterations
    # a fraction of eps (Elliptical-attention protocol: 0.15 * eps)
    step_size: float = field(default=0.15, metadata=bounded(0, 1, open_low=True, **described(
        "in (0, 1] (a fraction of eps)")))
    random_start: bool = True  # start from a uniform point in the eps-ball
    # None: adversarial.max_samples; else a smaller evenly spaced subset
    max_samples: Optional[int] = field(default=None, metadata=SAMPLE_COUNT)


@dataclass
class SPSAConfig:
    """SPSA: a gradient-free attack (gradient estimated by random perturbations)."""

    eps: List[float] = field(default_factory=lambda: [0.1], metadata=BUDGETS)  # L-inf radii, each a result
    lr: float = field(default=0.01, metadata=bounded(0, 1, open_low=True))  # Adam
    delta: float = field(default=0.01, metadata=bounded(0, 1, open_low=True))  # finite-difference perturbation size
    nb_sample: int = field(default=128, metadata=ITERATIONS)  # perturbations per gradient estimate
    nb_iter: int = field(default=40, metadata=ITERATIONS)  # SPSA iterations
    random_start: bool = True  # uniform in the eps-ball, as cleverhans' SPSA (the authors' code) starts
    # iterate: the gradient estimated at x + perturbation (the algorithm); cleverhans_torch: at 2x, where cleverhans'
    # torch SPSA and the authors' copy of it estimate it (quest/evaluation/spsa.py)
    estimate_at: str = field(default="iterate", metadata=one_of(*SPSA_ESTIMATE_AT))
    max_batch_size: int = field(default=256, metadata=BATCH_SIZE)  # model inputs per forward while estimating the gradient
    # None: adversarial.max_samples; else a smaller evenly spaced subset
    max_samples: Optional[int] = field(default=None, metadata=SAMPLE_COUNT)


@dataclass
class AutoAttackConfig:
    """AutoAttack (the autoattack package): an ensemble of parameter-free attacks."""

    # L-inf radii, each a result (1/255 = 0.00392)
    eps: List[float] = field(default_factory=lambda: [ONE_OVER_255], metadata=BUDGETS)
    # APGD-CE, APGD-T (9 targets), FAB-T (9 targets), Square (5000 queries)
    version: str = field(default="standard", metadata=one_of(*AUTOATTACK_VERSIONS))
    # the threat model: the suite reports l_inf budgets and the largest l_inf perturbation applied, for every attack
    norm: str = field(default="Linf", metadata=one_of("Linf", **described(
        "Linf (the suite's budgets and its max_linf are l_inf)")))
    # None: adversarial.max_samples; else a smaller evenly spaced subset
    max_samples: Optional[int] = field(default=None, metadata=SAMPLE_COUNT)


@dataclass
class AdversarialConfig:
    """Adversarial attacks on the val split: which attacks, on which images, in which space."""

    # attacks run, in order: fgsm | pgd | spsa | autoattack
    attacks: List[str] = field(default_factory=lambda: ["fgsm", "pgd", "spsa", "autoattack"], metadata={
        **one_of(*ATTACKS), **listed(distinct=True), **described(f"a list of distinct attacks from {', '.join(ATTACKS)}")})
    # pixel: [0, 1] images, normalisation inside the model (sound); normalized: the tensor after mean/std, eps in
    # normalised units, FGSM/PGD/SPSA unclipped (the Elliptical-attention code's convention, QUEST Tables 3/4)
    space: str = field(default="pixel", metadata=one_of(*SPACES))
    # data: the configured data set's val split (the checkpoint's data, or data=<name>); imagenet_val: eval.roots.val
    # in ImageNet's layout, labels from the sorted wnids (as the imagenet_val evaluation)
    source: str = field(default="data", metadata=one_of(*SOURCES))
    # ground_truth: the data set's labels (sound); predicted: the clean predictions; paper: predicted for FGSM, PGD
    # and SPSA, ground truth for AutoAttack (the authors' scripts). Accuracy is always against the data set's labels.
    labels: str = field(default="ground_truth", metadata=one_of(*LABELS))
    # estimator of elliptical layers while attacked and scored: None = as trained; mean | median (the authors
    # attacked with --grad-median)
    elliptical_estimator: Optional[str] = field(default=None, metadata=one_of(*ESTIMATORS))
    # the forward that scores clean and attacked images (the attacks always run in fp32): fp32 | fp16 (autocast, as
    # the authors' engine.py; CUDA only: on CPU, where fp16 autocast is slow, it scores in fp32 and says so)
    score_precision: str = field(default="fp32", metadata=one_of(*SCORE_PRECISIONS))
    # None: the whole val split; else an evenly spaced fixed subset
    max_samples: Optional[int] = field(default=None, metadata=SAMPLE_COUNT)
    batch_size: Optional[int] = field(default=None, metadata=BATCH_SIZE)  # None: eval.batch_size
    seed: int = field(default=0, metadata=EVAL_SEED)  # seed of the attacks' randomness
    fgsm: FGSMConfig = field(default_factory=FGSMConfig)
    pgd: PGDConfig = field(default_factory=PGDConfig)
    spsa: SPSAConfig = field(default_factory=SPSAConfig)
    autoattack: AutoAttackConfig = field(default_factory=AutoAttackConfig)


def paper_adversarial_config() -> AdversarialConfig:
    """QUEST Tables 3/4 as the Elliptical-attention code ran them (KurtPask/Elliptical-Attention @ 5ae39ee,
    ImageAttack/: engine.py, spsa.py, Scripts/run_{fgm,pgd,spsa,auto}.sh; docs/evaluation.md has the table): the
    normalised tensor, eps 1/255 (0.1 for SPSA) in normalised units, predicted labels except AutoAttack, the median
    estimator, SPSA's gradient where cleverhans' torch code estimates it, attacked images scored under fp16 autocast
    (on CUDA)."""
    cfg = AdversarialConfig(space="normalized", labels="paper", elliptical_estimator="median", score_precision="fp16")
    cfg.spsa.estimate_at = "cleverhans_torch"
    return cfg


_LABEL_TEXT = {"ground_truth": "ground truth (the data set's labels)",
               "predicted": "the model's clean predictions (accuracy still against the data set's labels)"}


def budget_key(attack: str, eps: float) -> str:
    """How a budget is named in results: ``pgd@0.00392157``."""
    return f"{attack}@{eps:.6g}"


def check_section(section: Any, name: str) -> None:
    """The settings an adversarial evaluation cannot run with, when it is called directly (eval.py checked them
    all at start)."""
    unknown = [a for a in section.attacks if a not in ATTACKS]
    if unknown:
        raise ValueError(f"unknown attacks {unknown}; eval.{name}.attacks takes {list(ATTACKS)}")
    if section.labels not in LABELS:
        raise ValueError(f"eval.{name}.labels must be one of {LABELS}, got {section.labels!r}")
    if section.score_precision not in SCORE_PRECISIONS:
        raise ValueError(f"eval.{name}.score_precision must be one of {SCORE_PRECISIONS}, got "
                         f"{section.score_precision!r}")
    for attack in section.attacks:
        eps = list(section[attack].eps)
        if any(e < 0 for e in eps) or len({budget_key(attack, e) for e in eps}) != len(eps):
            raise ValueError(f"eval.{name}.{attack}.eps must be distinct values >= 0, got {eps}")


def attack_labels(mode: str, attack: str) -> str:
    """The labels ``attack`` is run with under ``labels: mode``: ground_truth or predicted. ``paper`` is what the
    authors' engine.py passes: nothing to cleverhans' FGSM / PGD and to their SPSA (which then use the model's
    predictions), the data set's targets to AutoAttack's run_standard_evaluation."""
    if mode not in LABELS:
        raise ValueError(f"labels must be one of {LABELS}, got {mode!r}")
    if mode == "paper":
        return "ground_truth" if attack == "autoattack" else "predicted"
    return mode


def clipping(space: AttackSpace, attack: str) -> str:
    if attack == "autoattack":
        return ("[0, 1] pixels (pyautoattack)" if space.name == "pixel" else
                "[0, 1] on the normalised tensor (pyautoattack clamps every iterate, as the authors' bundled copy)")
    return "[0, 1] pixels" if space.clip is not None else "none (unbounded by the image)"


def score_precision_used(asked: str, device: torch.device) -> str:
    """The precision the clean and attacked images are scored in: fp16 autocast only where asked and on CUDA (the
    authors' engine.py runs ``torch.cuda.amp.autocast()``); on other devices fp32 (fp16 autocast on CPU is slow)."""
    if asked not in SCORE_PRECISIONS:
        raise ValueError(f"score_precision must be one of {SCORE_PRECISIONS}, got {asked!r}")
    return "fp16" if asked == "fp16" and torch.device(device).type == "cuda" else "fp32"


def scoring_text(asked: str, used: str, device: torch.device) -> str:
    """What scored the images, in words (every adversarial result carries it)."""
    if used == "fp16":
        return "fp16 autocast forward of the clean and attacked images (the authors' engine.py); attacks in fp32"
    if asked == "fp16":
        return (f"fp32 forward of the clean and attacked images: fp16 autocast (the authors') was asked, but the "
                f"device is {torch.device(device).type}, where fp16 autocast is slow; on CUDA it would be fp16")
    return "fp32 forward of the clean and attacked images (the authors scored under CUDA fp16 autocast)"


# settings compared with the authors' protocol (paper_adversarial_config) in every result
_PROTOCOL_KEYS = ("space", "labels", "elliptical_estimator", "score_precision", "fgsm.eps", "pgd.eps", "pgd.steps",
                  "pgd.step_size", "pgd.random_start", "spsa.eps", "spsa.lr", "spsa.delta", "spsa.nb_sample", "spsa.nb_iter",
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


def protocol(section: Any, space: AttackSpace, libraries: dict[str, str], estimator: dict[str, Any],
             device: torch.device, used: str) -> dict[str, Any]:
    """The protocol of one result, in words: space, labels and clipping per attack, the SPSA variant, the libraries,
    the scoring precision (``used``: :func:`score_precision_used`), and where the settings (and the precision
    actually used) differ from the authors'."""
    differences = _differences(section)
    if section.score_precision == "fp16" and used != "fp16":
        differences.append(f"score_precision: fp16 asked, {used} used on {torch.device(device).type} "
                           "(authors: fp16 autocast on CUDA)")
    return {
        "space": space.describe(), "space_name": space.name,
        "labels": {a: _LABEL_TEXT[attack_labels(section.labels, a)] for a in section.attacks},
        "clipping": {a: clipping(space, a) for a in section.attacks},
        "elliptical_estimator": estimator,
        "spsa": _spsa_text(section.spsa),
        "model_mode": "eval", "norm": "Linf", "libraries": libraries,
        "scoring": scoring_text(section.score_precision, used, device), "score_precision": used,
        "differs_from_authors": differences,
        "settings": {a: OmegaConf.to_container(section[a], resolve=True) for a in section.attacks},
    }
