"""The spurious-correlation toy task of the QUEST paper (section 2.2 and A.3).

A sample is a sequence of ``seq_len`` tokens, each ``real_dim`` real values followed by a ``num_classes`` one-hot
"answer" part. The label is the one-hot at the answer location L ~ round(N(pos_mean, pos_std)). The real part of the
answer token is drawn from N(0, Sigma) (Sigma = S S^T, S standard normal) for an unbiased sample, and from
N(b, biased_var * I) for a biased one, with one bias vector b ~ N(0, Sigma) shared by all biased samples of a data
realisation; every other token's real part is N(0, I). Whether a sample is biased is Bernoulli(biased_fraction).

What the paper leaves open is a field of :class:`ToyDataConfig` (defaults and reasons: docs/results.md): sequence
length, set sizes and the test set's share of biased samples (default 0: a model that only learned the shortcut b
must fall back to the position prior there, which is the paper's "biased" outcome, train 50-80% / test 20-40%).
L is rounded to the nearest position (A.3's "most frequent position about 20% of the time" holds for rounding).
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from quest.config.checks import allowed_words
from quest.store.records import bounded, described, fits_declaration

__all__ = ["MAX_SAMPLES", "MAX_WIDTH", "MAX_DATA_VALUES", "DATA_VALUES_WORDS", "sample_count", "data_values",
           "ToyDataConfig", "ToySplit", "ToyData", "make_toy_data"]

# Every size is bounded on its field: a size beyond what torch indexes fails deep inside its sampling, after the
# study has started, and a large one allocates tensors of samples x tokens x width.
#: the most samples of a set (training, test, a batch, the probe): 128 times the largest the studies use (8,192)
MAX_SAMPLES = 2**20
#: the most tokens, real values and classes of a sample: far beyond the paper's 20 tokens of 10 + 10 values
MAX_WIDTH = 1024
#: the most numbers a data realisation may hold (:func:`data_values`): 4 GiB of float32, where the bounds of its
#: fields alone would allow terabytes
MAX_DATA_VALUES = 2**30
#: what :func:`data_values` counts, in a refusal's words
DATA_VALUES_WORDS = "(train_size + test_size) x seq_len x (real_dim + num_classes)"


def sample_count(low: int = 1, words: str = "samples") -> dict[str, Any]:
    """Field metadata of a number of samples: ``low``..:data:`MAX_SAMPLES`."""
    return bounded(low, MAX_SAMPLES, **described(f"an integer in {low}..{MAX_SAMPLES} ({words})"))


def _width(words: str) -> dict[str, Any]:
    return bounded(1, MAX_WIDTH, **described(f"an integer in 1..{MAX_WIDTH} ({words})"))


def data_values(data: Mapping[str, Any], train_size: int | None = None) -> int:
    """The numbers of one data realisation of the data config ``data`` (its fields; ``train_size`` in place of its
    own): what :data:`MAX_DATA_VALUES` bounds."""
    n = data["train_size"] if train_size is None else train_size
    return (n + data["test_size"]) * data["seq_len"] * (data["real_dim"] + data["num_classes"])


@dataclass
class ToyDataConfig:
    """The synthetic data set of section 2.2 / A.3: sequences whose label is carried at a random position, and in
    the biased samples also by a shortcut in the last token."""

    seq_len: int = field(default=20, metadata=_width("data tokens"))  # data tokens; the model adds a [CLS] token
    real_dim: int = field(default=10, metadata=_width("real values per token"))  # real values per token (A.3)
    num_classes: int = field(default=10, metadata=_width("classes"))  # classes, one-hot after each token's values
    train_size: int = field(default=768, metadata=sample_count())  # training samples (A.3: 768)
    test_size: int = field(default=1024, metadata=sample_count())  # test samples, drawn without the shortcut
    pos_mean: float = 10.0  # mu_l (A.3): any position, the draws are clamped to the sequence
    pos_std: float = field(default=2.0, metadata=bounded(0, open_low=True))  # sigma_l (A.3)
    biased_fraction: float = field(default=0.5, metadata=bounded(0, 1))  # p of the Bernoulli u (section 2.2)
    biased_var: float = field(default=0.1, metadata=bounded(0))  # x_L ~ N(b, biased_var * I) for a biased sample
    # biased share of the test set (0: the test set carries no shortcut)
    test_biased_fraction: float = field(default=0.0, metadata=bounded(0, 1))

    def __post_init__(self) -> None:
        """Refuse a value outside its declared range when built in code (the toy study's config is checked before)."""
        hints = typing.get_type_hints(ToyDataConfig)
        for f in dataclasses.fields(self):
            if not fits_declaration(getattr(self, f.name), hints[f.name], f.metadata):
                raise ValueError(f"toy data: {f.name} must be {allowed_words(hints[f.name], f.metadata)}, got "
                                 f"{getattr(self, f.name)!r}")
        values = data_values(dataclasses.asdict(self))
        if values > MAX_DATA_VALUES:
            raise ValueError(f"toy data: {DATA_VALUES_WORDS} is {values:,}, more than {MAX_DATA_VALUES:,}")

    @property
    def dim(self) -> int:
        """Token width (the model's width too, as in A.3)."""
        return self.real_dim + self.num_classes


@dataclass
class ToySplit:
    x: torch.Tensor  # (n, seq_len, dim) float32
    y: torch.Tensor  # (n,) int64 labels
    answer_pos: torch.Tensor  # (n,) int64 L
    biased: torch.Tensor  # (n,) bool u


@dataclass
class ToyData:
    train: ToySplit
    test: ToySplit
    bias: torch.Tensor  # (real_dim,) the shared b
    sigma_factor: torch.Tensor  # (real_dim, real_dim) S, Sigma = S S^T


def _sample(cfg: ToyDataConfig, n: int, biased_fraction: float, bias: torch.Tensor, s: torch.Tensor,
            g: torch.Generator) -> ToySplit:
    d = cfg.real_dim
    # Int(N(mu, sigma)): rounded to the nearest position, clipped into the sequence (A.3; P(L = 10) ~ 0.2)
    pos = torch.round(cfg.pos_mean + cfg.pos_std * torch.randn(n, generator=g)).long().clamp_(0, cfg.seq_len - 1)
    biased = torch.rand(n, generator=g) < biased_fraction
    real = torch.randn(n, cfg.seq_len, d, generator=g)
    unbiased_answer = torch.randn(n, d, generator=g) @ s.T  # N(0, S S^T)
    biased_answer = bias + math.sqrt(cfg.biased_var) * torch.randn(n, d, generator=g)
    rows = torch.arange(n)
    real[rows, pos] = torch.where(biased[:, None], biased_answer, unbiased_answer)
    answers = torch.randint(cfg.num_classes, (n, cfg.seq_len), generator=g)
    x = torch.cat([real, F.one_hot(answers, cfg.num_classes).float()], dim=-1)
    return ToySplit(x=x, y=answers[rows, pos], answer_pos=pos, biased=biased)


def make_toy_data(cfg: ToyDataConfig, seed: int) -> ToyData:
    """One data realisation: S, b, a training set and a test set, all from ``seed``."""
    g = torch.Generator().manual_seed(int(seed))
    s = torch.randn(cfg.real_dim, cfg.real_dim, generator=g)
    bias = s @ torch.randn(cfg.real_dim, generator=g)  # b ~ N(0, Sigma)
    train = _sample(cfg, cfg.train_size, cfg.biased_fraction, bias, s, g)
    test = _sample(cfg, cfg.test_size, cfg.test_biased_fraction, bias, s, g)
    return ToyData(train=train, test=test, bias=bias, sigma_factor=s)
