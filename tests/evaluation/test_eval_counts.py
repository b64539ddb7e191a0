"""Every reported accuracy is 100 * correct / total from integer counts, the float64 nearest to the exact ratio:
checked against fractions worked out here, on counts where torchmetrics' float32 ratio is off."""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from torchmetrics.classification import MulticlassAccuracy

from quest.evaluation.context import Counts, percent
from quest.evaluation.suites.adversarial import adversarial
from quest.evaluation.suites.classification import imagenet_val

from ..eval_helpers import digits_target, linear_digits_model, make_run, oracle_target, settings, write_wnid_tree

# (correct, total) whose float32 ratio x 100 is not the nearest float64 to the exact percentage
COUNTS = [(1, 3), (2, 3), (7, 9), (1, 7), (45_678, 50_000), (33_333, 46_837)]


def _torchmetrics_percent(correct: int, total: int) -> float:
    """What the suites reported before: torchmetrics' micro accuracy (a float32 ratio) times 100."""
    metric = MulticlassAccuracy(num_classes=2, top_k=1, average="micro")
    preds = torch.tensor([0] * correct + [1] * (total - correct))
    metric.update(preds, torch.zeros(total, dtype=torch.long))
    return 100.0 * metric.compute().item()


@pytest.mark.parametrize("correct, total", COUNTS)
def test_percent_is_the_exact_ratio_rounded_once(correct, total):
    exact = float(Fraction(100 * correct, total))
    assert percent(correct, total) == exact
    assert _torchmetrics_percent(correct, total) != exact  # the float32 ratio, off in the 7th digit or so
    assert abs(_torchmetrics_percent(correct, total) - exact) < 1e-5


def test_counts_add_integers_over_batches():
    counts = Counts()
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 1.0, 2.0]])
    counts.update(logits, torch.tensor([0, 0, 0]))  # only the first right; all three in the top-3 ("top-5")
    counts.update(logits[:1], torch.tensor([1]))
    out = counts.summary()
    assert (out["correct"], out["top5_correct"], out["n"]) == (1, 4, 4)
    assert out["top1"] == 25.0 and out["top5"] == 100.0
    nll = torch.nn.functional.cross_entropy(torch.cat([logits, logits[:1]]), torch.tensor([0, 0, 0, 1])).item()
    assert out["nll"] == pytest.approx(nll, rel=1e-6)
    with pytest.raises(ValueError, match="no samples"):
        Counts().summary()


def test_imagenet_val_top1_is_exact(tmp_path):
    # 3 images, one right: 100/3 exactly as float64 (torchmetrics gave 33.33333432674408)
    write_wnid_tree(tmp_path / "val", [(1, 1, "a.JPEG"), (2, 5, "b.JPEG"), (3, 5, "c.JPEG")])
    result = imagenet_val(make_run(oracle_target(), settings(roots__val=str(tmp_path / "val"))), None)
    assert result["top1"] == 100 / 3 == float(Fraction(100, 3)) and result["correct"] == 1 and result["n"] == 3


def test_adversarial_numbers_are_exact():
    cfg = settings(adversarial__max_samples=7, adversarial__attacks=["fgsm"], adversarial__fgsm__eps=[0.05])
    result = adversarial(make_run(digits_target(linear_digits_model()), cfg), cfg.adversarial)
    for numbers in (result["clean"], result["fgsm@0.05"]):
        assert numbers["n"] == 7
        assert numbers["top1"] == float(Fraction(100 * numbers["correct"], 7))
    assert result["fgsm@0.05"]["clean_top1"] == float(Fraction(100 * result["fgsm@0.05"]["clean_correct"], 7))
