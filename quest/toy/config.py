"""Typed config of the toy study (configs/toy/toy.yaml), registered in Hydra's ConfigStore as ``toy_schema``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from hydra.core.config_store import ConfigStore

from .data import ToyDataConfig

__all__ = ["GridConfig", "ToyModelConfig", "ToyTrainConfig", "OutcomeRules", "ToyConfig", "register_toy_config"]


@dataclass
class GridConfig:
    name: str = "full"
    lrs: List[float] = field(default_factory=list)
    weight_decays: List[float] = field(default_factory=list)
    data_seeds: List[int] = field(default_factory=list)
    init_seeds: List[int] = field(default_factory=list)


@dataclass
class ToyModelConfig:
    mlp_hidden: int = 20  # A.3: the MLP hidden layer has the embedding width
    embed_init_std: float = 0.02  # positional embedding ~ truncated N(0, std) as in timm's ViT; [CLS] starts at 0


@dataclass
class ToyTrainConfig:
    epochs: int = 50
    batch_size: int = 32
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # torch.optim.AdamW defaults
    eps: float = 1e-8


@dataclass
class OutcomeRules:
    """Thresholds (fractions) of the paper's three outcomes (section 2.2, A.4); chance is 1 / num_classes = 0.1.

    correct: train and test >= correct_min (paper: both > 90%). degenerate: train <= degenerate_train_max and test
    <= degenerate_test_max (paper: "both at random chance"; a run that memorised a few training samples, train
    0.2-0.3, still counts). biased: train >= biased_train_min and test <= biased_test_max (paper: train 50-80%, test
    20-40%, the gap coming from the shortcut b that the test set lacks). Anything else is "other". Outcomes are
    derived from the stored accuracies whenever results are aggregated, so changing a rule needs no retraining.
    """

    correct_min: float = 0.9
    degenerate_train_max: float = 0.3
    degenerate_test_max: float = 0.2
    biased_train_min: float = 0.45
    biased_test_max: float = 0.45


@dataclass
class ToyConfig:
    grid: GridConfig = field(default_factory=GridConfig)
    data: ToyDataConfig = field(default_factory=ToyDataConfig)
    model: ToyModelConfig = field(default_factory=ToyModelConfig)
    train: ToyTrainConfig = field(default_factory=ToyTrainConfig)
    outcome: OutcomeRules = field(default_factory=OutcomeRules)
    attentions: List[str] = field(default_factory=list)
    compile: bool = True  # torch.compile the batched training step (about 2x on CPU for the full grid)
    threads: Optional[int] = None  # torch intra-op threads; None: torch's default
    probe_size: int = 256  # training samples whose key norms are recorded after every epoch (Figure 4)
    out_dir: Optional[str] = None  # None: Hydra's run directory


def register_toy_config() -> None:
    ConfigStore.instance().store(name="toy_schema", node=ToyConfig)
