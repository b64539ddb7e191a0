"""Classification counts that are exact: correct top-1 / top-5 and samples as integers, the cross-entropy summed
in float64, added over batches and processes, turned into percentages once (``100 * correct / n`` in float64).

torchmetrics' accuracy is a float32 ratio, off by up to 3e-6 points (1 of 3 gives 33.33333432674408). The counts
accumulate on the device and are read once, at the end, so a pass over the data makes no host sync per batch.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from quest.runtime.distributed import DistContext

__all__ = ["Counts", "percent", "error_fraction"]


def percent(correct: int, total: int) -> float:
    """100 * correct / total as the float64 nearest to the exact ratio (one rounding: 100 * correct is an exact
    integer)."""
    if total <= 0:
        raise ValueError(f"a percentage of {total} samples")
    return 100 * int(correct) / int(total)


def error_fraction(correct: int, total: int) -> Fraction:
    """The exact error (total - correct) / total; corruption means and mCE are taken on these, rounded once."""
    return Fraction(int(total) - int(correct), int(total))


class Counts:
    """Samples, correct top-1 and top-5 predictions and the summed cross-entropy of one pass. With fewer than 5
    classes "top-5" is the top-``num_classes``."""

    def __init__(self, n: int = 0, top1: int = 0, top5: int = 0, nll_sum: float = 0.0):
        self._ints: torch.Tensor | None = None  # (n, top1, top5) int64 on the logits' device
        self._nll: torch.Tensor | None = None  # float64
        self._host = (int(n), int(top1), int(top5), float(nll_sum))

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        logits = logits.float()
        k = min(5, logits.shape[1])
        batch = torch.stack([
            torch.tensor(len(targets), device=logits.device),
            (logits.argmax(dim=1) == targets).sum(),
            (logits.topk(k, dim=1).indices == targets[:, None]).any(dim=1).sum(),
        ]).to(torch.int64)
        nll = F.cross_entropy(logits, targets, reduction="sum").double()
        self._ints = batch if self._ints is None else self._ints + batch
        self._nll = nll if self._nll is None else self._nll + nll

    def _values(self) -> tuple[int, int, int, float]:
        n, top1, top5, nll = self._host
        if self._ints is not None:
            dn, d1, d5 = (int(v) for v in self._ints.tolist())  # the one host sync of the pass
            n, top1, top5, nll = n + dn, top1 + d1, top5 + d5, nll + float(self._nll.item())
        return n, top1, top5, nll

    @property
    def n(self) -> int:
        return self._values()[0]

    @property
    def top1(self) -> int:
        return self._values()[1]

    @property
    def top5(self) -> int:
        return self._values()[2]

    @property
    def nll_sum(self) -> float:
        return self._values()[3]

    def reduced(self, ctx: DistContext) -> "Counts":
        """The counts summed over all processes (a collective: every process must call it)."""
        n, top1, top5, nll = self._values()
        if not ctx.distributed:
            return Counts(n, top1, top5, nll)
        ints = torch.tensor([n, top1, top5], dtype=torch.int64, device=ctx.device)
        nll_t = torch.tensor([nll], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(ints)
        dist.all_reduce(nll_t)
        n, top1, top5 = (int(v) for v in ints.tolist())
        return Counts(n, top1, top5, float(nll_t.item()))

    def summary(self) -> dict[str, Any]:
        """top-1 / top-5 percentages from the counts, the mean NLL, and the counts themselves."""
        n, top1, top5, nll = self._values()
        if n == 0:
            raise ValueError("no samples were evaluated")
        return {"top1": percent(top1, n), "top5": percent(top5, n), "nll": nll / n,
                "correct": top1, "top5_correct": top5, "n": n}
