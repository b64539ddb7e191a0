"""Typed config of the toy study (configs/toy/toy.yaml), registered in Hydra's ConfigStore as ``toy_schema``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from hydra.core.config_store import ConfigStore

from quest.config.checks import DEVICE, process_count
from quest.config.run_names import register_resolvers
from quest.store.records import SEED_RANGE, bounded, described, listed, one_of

from .data import MAX_SAMPLES, ToyDataConfig, sample_count

#: numpy's and torch's seeds
_SEEDS = {**bounded(*SEED_RANGE), **listed(min_length=1),
          **described(f"a non-empty list of integers in 0..{2**32 - 1} (2**32 - 1)")}
_FRACTION = bounded(0, 1)
#: a [low, high] range of accuracies; low <= high is a relation, checked by quest.toy.checks
_RANGE = {**bounded(0, 1), **listed(2), **described("[low, high] with 0 <= low <= high <= 1")}
# The bounds of what allocates or loops (sizes, widths, epochs) stop a value that would run out of memory or time, or
# out of what torch can index, before the study starts; the data's sizes: quest.toy.data.
#: the most epochs: 200 times the paper's 50
MAX_EPOCHS = 10_000
#: the widest MLP hidden layer: 200 times A.3's 20
MAX_HIDDEN = 4096
#: the most runs per compiled call (more than a chunk has: all of them), bounded as every integer of the config is
MAX_RUNS_PER_CALL = 2**20

__all__ = ["GridConfig", "ToyModelConfig", "ToyTrainConfig", "OutcomeRules", "PaperOutcomeRules", "VariantConfig",
           "StopRule", "StudyConfig", "ToyConfig", "register_toy_config"]


@dataclass
class GridConfig:
    """The hyperparameter grid every formulation is trained on: each learning rate x weight decay x data seed x
    initialisation seed is one run (configs/toy/grid/)."""

    name: str = "full"  # the grid's name (configs/toy/grid/*.yaml): a free name
    # AdamW learning rates
    lrs: List[float] = field(default_factory=list, metadata={**bounded(0, open_low=True), **listed(min_length=1)})
    # AdamW weight decays
    weight_decays: List[float] = field(default_factory=list, metadata={**bounded(0), **listed(min_length=1)})
    data_seeds: List[int] = field(default_factory=list, metadata=_SEEDS)  # seeds of the data set's draw
    init_seeds: List[int] = field(default_factory=list, metadata=_SEEDS)  # seeds of the model's initial weights


@dataclass
class ToyModelConfig:
    """The one-layer transformer of A.3 (embedding, one attention layer of the formulation, an MLP, a [CLS] head)."""

    mlp_hidden: int = field(default=20, metadata=bounded(1, MAX_HIDDEN))  # A.3: the MLP hidden layer has the embedding width
    # positional embedding ~ truncated N(0, std) as in timm's ViT; [CLS] starts at 0
    embed_init_std: float = field(default=0.02, metadata=bounded(0))


@dataclass
class ToyTrainConfig:
    """AdamW on the training set, full epochs, as A.3."""

    epochs: int = field(default=50, metadata=bounded(1, MAX_EPOCHS))  # passes over the training set (A.3: 50)
    # a batch larger than the training set is the whole set
    batch_size: int = field(default=32, metadata=sample_count())
    # torch.optim.AdamW defaults
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999], metadata={**bounded(0, 1, open_high=True),
                                                                                **listed(2)})
    eps: float = field(default=1e-8, metadata=bounded(0, open_low=True))  # AdamW's epsilon


@dataclass
class OutcomeRules:
    """This project's partition of runs into the paper's outcomes (fractions; chance is 1 / num_classes = 0.1).

    correct: train and test >= correct_min (paper: both > 90%). degenerate: train <= degenerate_train_max and test
    <= degenerate_test_max (paper: "both at random chance"; a run that memorised a few training samples, train
    0.2-0.3, still counts). biased: train >= biased_train_min and test <= biased_test_max (paper: train 50-80%, test
    20-40%, the gap coming from the shortcut b that the test set lacks). Anything else is "other". Outcomes are
    derived from the stored accuracies whenever results are aggregated, so changing a rule needs no retraining.
    """

    correct_min: float = field(default=0.9, metadata=_FRACTION)  # correct: train and test at least this
    degenerate_train_max: float = field(default=0.3, metadata=_FRACTION)  # degenerate: train at most this
    degenerate_test_max: float = field(default=0.2, metadata=_FRACTION)  # degenerate: and test at most this
    biased_train_min: float = field(default=0.45, metadata=_FRACTION)  # biased: train at least this
    biased_test_max: float = field(default=0.45, metadata=_FRACTION)  # biased: and test at most this


@dataclass
class PaperOutcomeRules:
    """The paper's own ranges (section 2.2, A.4), reported beside :class:`OutcomeRules`; they leave gaps ("other").

    correct: train and test > 90%. biased: train 50-80% and test 20-40%. degenerate: "both training and test
    accuracy are random chance", read as both <= chance_max (chance 10%; 15% is 5 standard errors of a 1,024-sample
    test accuracy above it).
    """

    correct_above: float = field(default=0.9, metadata=_FRACTION)  # correct: train and test above this
    biased_train: List[float] = field(default_factory=lambda: [0.5, 0.8], metadata=_RANGE)  # biased: train in it
    biased_test: List[float] = field(default_factory=lambda: [0.2, 0.4], metadata=_RANGE)  # biased: and test in it
    chance_max: float = field(default=0.15, metadata=_FRACTION)  # degenerate: train and test at most this


@dataclass
class VariantConfig:
    """A formulation with some of its parameters set or frozen, e.g. QKNorm with its scale fixed at 1 / sqrt(d):
    ``{attention: qknorm, param_init: {attn.qk_scale: 0.2236}, frozen: [attn.qk_scale]}``. Usable wherever an
    attention name is (``attentions``, ``study.scale_variants``)."""

    attention: str = "???"  # a formulation's name: checked against the registry by quest.toy.study
    param_init: Dict[str, float] = field(default_factory=dict)  # parameter name -> constant it starts at
    # parameters never updated (no gradient step, no weight decay): names of the formulation's parameters
    frozen: List[str] = field(default_factory=list)
    label: str = ""  # how figures and tables name it: free text


@dataclass
class StopRule:
    """When the success rates have stopped changing with the training-set size (fixed before the sensitivity run,
    docs/results.md): the smallest size n such that, for every formulation of ``cfg.attentions``, the success rate at
    the next size up differs from that at n by at most ``min_points`` percentage points or by at most ``z`` standard
    errors of the difference of two binomial proportions (pooled), i.e. within the noise of the runs measured."""

    min_points: float = field(default=5.0, metadata=bounded(0))  # percentage points that count as no change
    z: float = field(default=2.0, metadata=bounded(0))  # standard errors that count as no change


@dataclass
class StudyConfig:
    """``grid``: train ``grid`` for every formulation (the paper's study). ``sensitivity``: train ``grid`` (a reduced
    one) for every formulation and training-set size in ``train_sizes``, evaluate on test sets with every biased
    fraction in ``test_biased_fractions``, compare QKNorm's scale choices ``scale_variants`` and both outcome rule
    sets; one CSV, one figure, and the training-set size :class:`StopRule` picks."""

    name: str = field(default="grid", metadata=one_of("grid", "sensitivity"))  # which study (configs/toy/study/)
    # sensitivity: the training-set sizes tried
    train_sizes: List[int] = field(default_factory=list, metadata={**sample_count(), **described(
        f"a list of integers in 1..{MAX_SAMPLES} (training-set sizes)")})
    # sensitivity: the biased shares of the test sets every model is evaluated on
    test_biased_fractions: List[float] = field(default_factory=list, metadata=bounded(0, 1, **described(
        "a list of fractions in [0, 1]")))
    scale_variants: List[str] = field(default_factory=list)  # names of variants: checked by quest.toy.study
    stop: StopRule = field(default_factory=StopRule)


@dataclass
class ToyConfig:
    grid: GridConfig = field(default_factory=GridConfig)
    data: ToyDataConfig = field(default_factory=ToyDataConfig)
    model: ToyModelConfig = field(default_factory=ToyModelConfig)
    train: ToyTrainConfig = field(default_factory=ToyTrainConfig)
    outcome: OutcomeRules = field(default_factory=OutcomeRules)
    paper_outcome: PaperOutcomeRules = field(default_factory=PaperOutcomeRules)
    study: StudyConfig = field(default_factory=StudyConfig)
    variants: Dict[str, VariantConfig] = field(default_factory=dict)
    attentions: List[str] = field(default_factory=list)  # formulations' names: checked by quest.toy.study
    compile: bool = True  # torch.compile the training step (forward, backward, AdamW) of each tile of runs
    # where the runs train: auto (the CPU, with a process per core, also on a GPU machine: these models are too small
    # for a GPU to pay; quest.toy.compiled.resolve_toy_device), cpu, cuda, cuda:1, ...
    device: str = field(default="auto", metadata=DEVICE)
    # Worker processes training chunks side by side, each with `threads` threads; None: one per CPU core on a CPU
    # (processes scale better than threads for these small kernels, and do not stall when the cores are shared),
    # 1 on a GPU.
    workers: Optional[int] = field(default=None, metadata=process_count())
    # torch intra-op threads per worker (they multiply with workers); None: 1 with several workers, else torch's
    threads: Optional[int] = field(default=None, metadata=process_count())
    # runs per compiled call; None: 50 on a CPU (cache-sized), all on a GPU; more than a chunk's runs: all of them
    runs_per_call: Optional[int] = field(default=None, metadata=bounded(1, MAX_RUNS_PER_CALL))
    # training samples whose key norms are recorded after every epoch (Figure 4); 0: none; more than the training set:
    # all of it
    probe_size: int = field(default=256, metadata=sample_count(0, "0: no key norms recorded"))
    out_dir: Optional[str] = None  # a path; None: Hydra's run directory
    # seconds between a chunk's progress lines (epoch e/E, elapsed, ETA, chunk k/K); 0: only the line at its end
    log_every_s: float = field(default=10.0, metadata=bounded(0, **described(">= 0 seconds (0: off)")))


def register_toy_config() -> None:
    """``toy_schema`` in Hydra's ConfigStore, and ``${quest_sweep_name:}``, the folder of a sweep's record."""
    ConfigStore.instance().store(name="toy_schema", node=ToyConfig)
    register_resolvers()
