"""Training-time validation counts exactly: top-1 / top-5 from integer counts in float64, the NLL in float64."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from quest.train.validation import evaluate


class Fixed(nn.Module):
    """Returns the logits stored for each input index (the input is the index)."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.register_buffer("logits", logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits[x.long()]


def test_one_of_three_is_the_exact_float64_percentage():
    logits = torch.tensor([[5.0, 0.5, 0.4, 0.3, 0.2, 0.1], [0.5, 0.4, 5.0, 0.3, 0.2, 0.1],
                           [0.5, 0.4, 0.3, 0.2, 0.1, 5.0]])  # no ties: the top-5 is unambiguous
    targets = torch.tensor([0, 1, 1])  # first right; second wrong (class 1 ranks 2nd); third wrong, 1 in its top-5
    loader = [(torch.arange(3), targets, 0)]  # (images, targets, skipped) as the training loaders yield
    out = evaluate(Fixed(logits), loader, torch.device("cpu"), num_classes=6, prefix="")
    assert out["top1"] == 100 / 3 == 33.333333333333336  # torchmetrics' float32 ratio: 33.33333432674408
    assert out["top5"] == 100.0
    nll = [-(row.log_softmax(0)[t]).item() for row, t in zip(logits.double(), targets)]
    assert math.isclose(out["loss"], sum(nll) / 3, rel_tol=1e-7)


def test_counts_add_exactly_over_batches_of_any_size():
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(1000, 10, generator=g), torch.randint(0, 10, (1000,), generator=g)
    expected = 100 * int((logits.argmax(1) == targets).sum()) / 1000
    for batch in (1, 7, 1000):
        loader = [(torch.arange(i, min(i + batch, 1000)), targets[i:i + batch], 0) for i in range(0, 1000, batch)]
        assert evaluate(Fixed(logits), loader, torch.device("cpu"), num_classes=10, prefix="")["top1"] == expected
