"""Attacks lower the accuracy of a trained model, respect their budget, change nothing at eps 0; the suite states its
protocol (library, labels, space)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchvision import transforms as T

from quest.data.digits import DigitsDataset
from quest.evaluation import attacks as A
from quest.evaluation.adversarial_suite import adversarial
from quest.evaluation.transforms import Normalized

from .eval_helpers import digits_target, linear_digits_model, make_run, settings

PIXELS = T.Compose([T.Resize(16, interpolation=T.InterpolationMode.BICUBIC), T.ToTensor()])


@pytest.fixture(scope="module")
def trained():
    """A logistic-regression classifier of the digits, trained in a second: (normalising model, x, y) on val."""
    def tensors(split):
        ds = DigitsDataset(split, transform=PIXELS)
        return torch.stack([ds[i][0] for i in range(len(ds))]), torch.tensor(ds.targets)

    torch.manual_seed(0)
    x_train, y_train = tensors("train")
    linear = linear_digits_model()
    model = Normalized(linear, (0.5,) * 3, (0.5,) * 3)
    opt = torch.optim.Adam(linear.parameters(), lr=0.01)
    for _ in range(150):
        opt.zero_grad()
        F.cross_entropy(model(x_train), y_train).backward()
        opt.step()
    model.eval()
    x, y = tensors("val")
    return model, x[:48], y[:48]


def _accuracy(model, x, y) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def test_attacks_lower_accuracy_within_budget(trained):
    model, x, y = trained
    clean = _accuracy(model, x, y)
    assert clean > 0.9
    eps = 0.1
    adv = {
        "fgsm": A.fgsm(model, x, y, eps),
        "pgd": A.pgd(model, x, y, eps, steps=10, step_size=0.15 * eps, random_start=True, seed=0, indices=range(48)),
        "spsa": A.spsa(model, x, y, eps, lr=0.01, delta=0.01, nb_sample=32, nb_iter=20, max_batch_size=4096, seed=0,
                       indices=range(48)),
    }
    for name, x_adv in adv.items():
        assert (x_adv - x).abs().max() <= eps + 1e-6, name
        assert x_adv.min() >= 0 and x_adv.max() <= 1, name
        assert _accuracy(model, x_adv, y) < clean - 0.3, name
    assert _accuracy(model, adv["pgd"], y) <= _accuracy(model, adv["fgsm"], y)


def test_autoattack_standard_lowers_accuracy_with_9_targets(trained):
    model, x, y = trained
    # at eps 0.3 APGD-CE already succeeds everywhere, so the slow FAB-T and Square stages are skipped
    x_adv, info = A.autoattack(model, x[:16], y[:16], eps=0.3, version="standard", norm="Linf", seed=0, batch_size=16)
    assert (x_adv - x[:16]).abs().max() <= 0.3 + 1e-6
    assert _accuracy(model, x_adv, y[:16]) == 0.0
    assert info["attacks"] == ["apgd-ce", "apgd-t", "fab-t", "square"]
    assert info["apgd_t_targets"] == 9 and info["fab_t_targets"] == 9 and info["square_queries"] == 5000


def test_eps_zero_changes_nothing(trained):
    model, x, y = trained
    torch.testing.assert_close(A.fgsm(model, x, y, 0.0), x, atol=0, rtol=0)
    torch.testing.assert_close(A.pgd(model, x, y, 0.0, 5, 0.0, True, 0, range(48)), x, atol=0, rtol=0)
    torch.testing.assert_close(A.spsa(model, x, y, 0.0, 0.01, 0.01, 8, 2, 4096, 0, range(48)), x, atol=0, rtol=0)


def test_random_start_is_per_sample(trained):
    model, x, y = trained
    full = A.pgd(model, x, y, 0.05, 0, 0.0, True, seed=3, indices=range(48))  # 0 steps: the random start itself
    half = A.pgd(model, x[10:20], y[10:20], 0.05, 0, 0.0, True, seed=3, indices=range(10, 20))
    torch.testing.assert_close(full[10:20], half)


def test_suite_reports_protocol_and_per_attack_subsets():
    cfg = settings(adversarial__max_samples=20, batch_size=8, adversarial__attacks=["fgsm", "pgd", "spsa"],
                   adversarial__fgsm__eps=[0.0, 0.05], adversarial__pgd__steps=3,
                   adversarial__spsa__max_samples=4, adversarial__spsa__nb_iter=2, adversarial__spsa__nb_sample=4)
    model = linear_digits_model()
    result = adversarial(make_run(digits_target(model), cfg), cfg.adversarial)
    assert model.training is False  # attacked in eval mode
    assert result["clean"]["n"] == 20 and result["subset"]["samples"] == 20
    assert set(k for k in result if "@" in k) == {"fgsm@0", "fgsm@0.05", "pgd@0.00392157", "spsa@0.1"}
    assert result["fgsm@0"]["top1"] == result["fgsm@0"]["clean_top1"] == result["clean"]["top1"]
    assert result["fgsm@0"]["max_linf"] == 0.0 and result["fgsm@0.05"]["max_linf"] <= 0.05 + 1e-6
    assert result["spsa@0.1"]["n"] == 4 and result["pgd@0.00392157"]["n"] == 20
    protocol = result["protocol"]
    assert "pixels" in protocol["space"] and "inside the attacked model" in protocol["space"]
    assert protocol["labels"].startswith("ground truth") and protocol["model_mode"] == "eval"
    assert "own implementation" in protocol["libraries"]["pgd"] and "advertorch" in protocol["libraries"]["spsa"]


def test_predicted_labels_and_bad_settings():
    cfg = settings(adversarial__max_samples=6, adversarial__attacks=["fgsm"], adversarial__labels="predicted")
    result = adversarial(make_run(digits_target(linear_digits_model()), cfg), cfg.adversarial)
    assert "clean predictions" in result["protocol"]["labels"]
    for key, value, message in (("adversarial.attacks", ["cw"], "unknown attacks"),
                                ("adversarial.labels", "true", "labels must be one of"),
                                ("adversarial.fgsm.eps", [0.1, 0.1], "distinct")):
        bad = settings(adversarial__max_samples=6, adversarial__attacks=["fgsm"])
        from omegaconf import OmegaConf

        OmegaConf.update(bad, key, value, merge=False)
        with pytest.raises(ValueError, match=message):
            adversarial(make_run(digits_target(linear_digits_model()), bad), bad.adversarial)
