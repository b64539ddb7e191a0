"""Attacks lower the accuracy of a trained model, respect their budget, change nothing at eps 0; the suite attacks the
space, with the labels and the elliptical estimator it is told (checked against FGSM and models written or built
independently here) and states its protocol."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchvision import transforms as T

from quest.data.sets.digits import DigitsDataset
from quest.evaluation import attacks as A
from quest.evaluation.adversarial_protocol import score_precision_used, scoring_text
from quest.evaluation.attack_space import AttackSpace
from quest.evaluation.context import evenly_spaced
from quest.evaluation.estimator import attack_time_estimator, elliptical_layers
from quest.evaluation.suites.adversarial import adversarial, adversarial_paper, attack_labels
from quest.evaluation.transforms import Normalized
from quest.models import create_model

from ..eval_helpers import digits_target, linear_digits_model, make_run, oracle_target, settings, write_wnid_tree

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
        "spsa": A.spsa(model, x, y, eps, lr=0.01, delta=0.01, nb_sample=128, nb_iter=20, max_batch_size=4096, seed=0,
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
    fgsm = result["fgsm@0.05"]
    assert fgsm["space"] == "pixel" and fgsm["labels"] == "ground_truth" and fgsm["clipping"] == "[0, 1] pixels"
    assert fgsm["eps_pixel"] == {"0": 0.05, "1": 0.05, "2": 0.05}
    assert fgsm["eps_normalized"] == pytest.approx({"0": 0.1, "1": 0.1, "2": 0.1})  # std 0.5
    assert fgsm["max_linf_pixel_x255"] == pytest.approx(255 * fgsm["max_linf"])
    protocol = result["protocol"]
    assert "pixels" in protocol["space"] and "inside the attacked model" in protocol["space"]
    assert protocol["labels"]["pgd"].startswith("ground truth") and protocol["model_mode"] == "eval"
    assert "own implementation" in protocol["libraries"]["pgd"] and "cleverhans" in protocol["libraries"]["spsa"]
    assert "space: pixel (authors: normalized)" in protocol["differs_from_authors"]
    assert result["elliptical_estimator"] is None and protocol["elliptical_estimator"]["layers"] == 0


def _digits_val() -> tuple[torch.Tensor, torch.Tensor]:
    ds = DigitsDataset("val", transform=PIXELS)
    return torch.stack([ds[i][0] for i in range(len(ds))]), torch.tensor(ds.targets)


def _fgsm_normalised(model, z, labels, eps):
    """FGSM written out on the normalised tensor, no clipping (cleverhans' fast_gradient_method, norm inf)."""
    z = z.clone().requires_grad_(True)
    F.cross_entropy(model(z), labels).backward()
    return z + eps * z.grad.sign()


@pytest.mark.parametrize("labels", ["ground_truth", "predicted"])
def test_normalized_space_attacks_the_normalised_tensor(labels):
    eps = 0.04
    cfg = settings(adversarial__attacks=["fgsm"], adversarial__space="normalized", adversarial__labels=labels,
                   adversarial__fgsm__eps=[eps])
    model = linear_digits_model(seed=3)
    result = adversarial(make_run(digits_target(model), cfg), cfg.adversarial)
    x, y = _digits_val()
    z = (x - 0.5) / 0.5
    with torch.no_grad():
        clean = model(z)
    target = y if labels == "ground_truth" else clean.argmax(1)
    z_adv = _fgsm_normalised(model, z, target, eps)
    with torch.no_grad():
        expected = int((model(z_adv).argmax(1) == y).sum())
    got = result[f"fgsm@{eps:g}"]
    assert got["n"] == len(y) and got["correct"] == expected and got["labels"] == labels
    assert got["clean_correct"] == int((clean.argmax(1) == y).sum())
    assert got["space"] == "normalized" and got["clipping"].startswith("none")
    assert got["eps_normalized"] == {"0": eps, "1": eps, "2": eps} and got["eps_pixel"] == pytest.approx(
        {"0": eps * 0.5, "1": eps * 0.5, "2": eps * 0.5})
    assert got["max_linf"] == pytest.approx(eps, rel=1e-5)  # float32 inputs
    assert got["max_linf_pixel_x255"] == pytest.approx(255 * eps * 0.5, rel=1e-5)
    assert (z_adv.detach() * 0.5 + 0.5).min() < 0  # unclipped: the attacked image leaves [0, 1] somewhere


def test_attack_space_units_per_channel():
    space = AttackSpace("normalized", (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    units = space.eps_units(1 / 255)
    assert units["eps_pixel_x255"] == pytest.approx({"0": 0.229, "1": 0.224, "2": 0.225})  # about 0.23/255
    assert units["eps_normalized"] == pytest.approx({"0": 1 / 255, "1": 1 / 255, "2": 1 / 255})
    assert space.clip is None and AttackSpace("pixel", (0.5,), (0.5,)).clip == (0.0, 1.0)
    x = torch.rand(2, 3, 4, 4)
    torch.testing.assert_close(space.to_pixels(space.encode(x)), x)
    torch.testing.assert_close(space.encode(x)[:, 1], (x[:, 1] - 0.456) / 0.224)


def test_paper_labels_are_predictions_except_for_autoattack():
    table = {"fgsm": "predicted", "pgd": "predicted", "spsa": "predicted", "autoattack": "ground_truth"}
    assert {a: attack_labels("paper", a) for a in table} == table
    assert {attack_labels("ground_truth", a) for a in table} == {"ground_truth"}
    cfg = settings(adversarial__max_samples=4, adversarial__attacks=["fgsm", "autoattack"],
                   adversarial__labels="paper", adversarial__autoattack__eps=[0.3])
    result = adversarial(make_run(digits_target(linear_digits_model()), cfg), cfg.adversarial)
    assert result["fgsm@0.00392157"]["labels"] == "predicted" and result["autoattack@0.3"]["labels"] == "ground_truth"
    assert "clean predictions" in result["protocol"]["labels"]["fgsm"]
    assert result["protocol"]["labels"]["autoattack"].startswith("ground truth")


def test_paper_section_is_the_authors_protocol():
    cfg = settings(adversarial_paper__max_samples=4, adversarial_paper__attacks=["fgsm", "pgd", "spsa"],
                   adversarial_paper__spsa__max_samples=1, adversarial_paper__spsa__nb_iter=1)
    section = cfg.adversarial_paper
    assert (section.space, section.labels, section.elliptical_estimator) == ("normalized", "paper", "median")
    assert section.spsa.estimate_at == "cleverhans_torch" and section.spsa.random_start
    assert list(section.fgsm.eps) == list(section.pgd.eps) == list(section.autoattack.eps) == [1 / 255]
    assert list(section.spsa.eps) == [0.1] and (section.pgd.steps, section.pgd.step_size) == (20, 0.15)
    result = adversarial_paper(make_run(digits_target(linear_digits_model()), cfg), section)
    # on the CPU the authors' fp16 autocast scoring is not used (slow there): said in the differences and labels
    assert result["protocol"]["differs_from_authors"] == [
        "spsa.nb_iter: 1 (authors: 40)",
        "score_precision: fp16 asked, fp32 used on cpu (authors: fp16 autocast on CUDA)"]
    assert result["spsa@0.1"]["space"] == "normalized" and "2x" in result["protocol"]["spsa"]
    assert result["spsa@0.1"]["scoring"] == result["clean"]["scoring"] == "fp32 (fp16 asked, cpu)"
    assert result["protocol"]["score_precision"] == "fp32" and "slow" in result["protocol"]["scoring"]


def test_score_precision_is_fp16_autocast_on_cuda_only():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert score_precision_used("fp16", cuda) == "fp16"  # the authors' engine.py: torch.cuda.amp.autocast()
    assert score_precision_used("fp16", cpu) == "fp32"
    assert score_precision_used("fp32", cuda) == "fp32"
    assert scoring_text("fp16", "fp16", cuda).startswith("fp16 autocast")
    with pytest.raises(ValueError, match="score_precision must be one of"):
        score_precision_used("bf16", cpu)
    cfg = settings()
    assert (cfg.adversarial.score_precision, cfg.adversarial_paper.score_precision) == ("fp32", "fp16")


@pytest.mark.numerics
def test_fp16_scoring_is_the_authors_autocast_forward(monkeypatch):
    """fp16 scoring, forced on the CPU here (the suite uses it on CUDA only): the clean and the attacked images
    scored as the authors' engine.py does (``with autocast(): output = model(images)``, written out below), the
    attack itself in fp32. At eps 0 the attacked images are the clean ones."""
    import quest.evaluation.suites.adversarial as suite

    monkeypatch.setattr(suite, "score_precision_used", lambda asked, device: asked)
    model = linear_digits_model()
    cfg = settings(adversarial_paper__max_samples=60, adversarial_paper__attacks=["fgsm"],
                   adversarial_paper__fgsm__eps=[0.0])
    result = adversarial_paper(make_run(digits_target(model), cfg), cfg.adversarial_paper)
    x, y = _digits_val()
    chosen = torch.tensor(evenly_spaced(len(y), 60))
    z, y = (x[chosen] - 0.5) / 0.5, y[chosen]
    with torch.no_grad():
        with torch.autocast(device_type="cpu", dtype=torch.float16):
            half = model(z)
        full = model(z)
    assert half.dtype == torch.float16
    nll16 = F.cross_entropy(half.double(), y).item()
    nll32 = F.cross_entropy(full.double(), y).item()
    assert abs(nll16 - nll32) > 1e-5  # the two precisions are told apart by the NLL
    for numbers in (result["clean"], result["fgsm@0"]):
        assert numbers["correct"] == int((half.argmax(1) == y).sum()) and numbers["n"] == 60
        assert numbers["nll"] == pytest.approx(nll16, rel=1e-6, abs=0)
    assert result["fgsm@0"]["clean_nll"] == pytest.approx(nll16, rel=1e-6, abs=0)
    assert result["fgsm@0"]["scoring"] == "fp16" and result["protocol"]["score_precision"] == "fp16"
    assert not any("score_precision" in d for d in result["protocol"]["differs_from_authors"])


def _elliptical_digits_model():
    torch.manual_seed(0)
    model = create_model("vit_pico_patch4_16", attention="elliptical", depth=3, num_classes=10).eval()
    with torch.no_grad():  # off the init, so that m differs visibly between mean and median
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def test_attack_time_estimator_is_set_on_the_layers_and_restored():
    model = _elliptical_digits_model()
    x = torch.randn(4, 3, 16, 16)
    layers = elliptical_layers(model)
    with torch.no_grad():
        before = model(x)
    with attack_time_estimator(model, "median") as info:
        assert {layer.estimator for layer in layers} == {"median"}
        assert {layer.options["estimator"] for layer in layers} == {"mean"}  # how it was trained: untouched
        with torch.no_grad():
            during = model(x)
    assert info == {"used": "median", "as_trained": ["mean"], "layers": 3, "overridden": True}
    assert {layer.estimator for layer in layers} == {"mean"}
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, atol=0, rtol=0)
    # the median model, built independently with the option set at construction, gives the same outputs
    median = create_model("vit_pico_patch4_16", attention="elliptical", attention_options={"estimator": "median"},
                          depth=3, num_classes=10).eval()
    median.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(during, median(x))
        assert not torch.allclose(during, before)


def test_suite_attacks_and_scores_with_the_attack_time_estimator():
    model = _elliptical_digits_model()
    cfg = settings(adversarial__max_samples=30, adversarial__attacks=["fgsm"], adversarial__fgsm__eps=[0.0],
                   adversarial__elliptical_estimator="median")
    result = adversarial(make_run(digits_target(model), cfg), cfg.adversarial)
    median = create_model("vit_pico_patch4_16", attention="elliptical", attention_options={"estimator": "median"},
                          depth=3, num_classes=10).eval()
    median.load_state_dict(model.state_dict())
    x, y = _digits_val()
    chosen = torch.tensor(evenly_spaced(len(y), 30))
    with torch.no_grad():
        expected = int((median((x[chosen] - 0.5) / 0.5).argmax(1) == y[chosen]).sum())
    assert result["clean"]["correct"] == expected and result["elliptical_estimator"] == "median"
    assert result["protocol"]["elliptical_estimator"]["as_trained"] == ["mean"]
    # the clean column twice: at the attack-time estimator, and as trained (the paper tables' clean accuracy)
    with torch.no_grad():
        trained = int((model((x[chosen] - 0.5) / 0.5).argmax(1) == y[chosen]).sum())
    assert result["clean_as_trained"]["correct"] == trained and result["clean_as_trained"]["n"] == 30
    assert result["clean"]["elliptical_estimator"] == "median (attack time)"
    assert result["clean_as_trained"]["elliptical_estimator"] == "mean (as trained)"
    with torch.no_grad():  # the two differ on this model, so the test tells them apart
        outputs = model((x[chosen] - 0.5) / 0.5), median((x[chosen] - 0.5) / 0.5)
    assert not torch.allclose(*outputs)
    assert result["clean_as_trained"]["nll"] != result["clean"]["nll"]
    assert {layer.estimator for layer in elliptical_layers(model)} == {"mean"}  # restored


def test_bad_settings():
    from omegaconf import OmegaConf

    for key, value, message in (("adversarial.attacks", ["cw"], "unknown attacks"),
                                ("adversarial.labels", "true", "labels must be one of"),
                                ("adversarial.fgsm.eps", [0.1, 0.1], "distinct"),
                                ("adversarial.space", "lab", "attack space must be one of"),
                                ("adversarial.elliptical_estimator", "mode", "estimator must be null or one of")):
        bad = settings(adversarial__max_samples=6, adversarial__attacks=["fgsm"])
        OmegaConf.update(bad, key, value, merge=False)
        with pytest.raises(ValueError, match=message):
            adversarial(make_run(digits_target(linear_digits_model()), bad), bad.adversarial)


def test_imagenet_val_source_attacks_the_wnid_tree(tmp_path):
    # 4 images of ImageNet val, one showing the wrong class: labels from the sorted wnids, as imagenet_val
    write_wnid_tree(tmp_path / "val", [(3, 3, "a.JPEG"), (3, 4, "b.JPEG"), (500, 500, "c.JPEG"), (999, 999, "d.JPEG")])
    cfg = settings(roots__val=str(tmp_path / "val"), adversarial_paper__attacks=["fgsm"],
                   adversarial_paper__fgsm__eps=[0.0], adversarial_paper__source="imagenet_val")
    result = adversarial_paper(make_run(oracle_target(), cfg), cfg.adversarial_paper)
    assert result["clean"]["correct"] == 3 and result["clean"]["n"] == 4 and result["clean"]["top1"] == 75.0
    assert result["fgsm@0"]["correct"] == 3 and result["data"].startswith("imagenet val")


@pytest.mark.numerics
@pytest.mark.cuda  # tests/conftest.py: only under QUEST_TEST_GPU=1, on a machine with CUDA
def test_adversarial_paper_scores_under_fp16_autocast_on_cuda():
    """On CUDA, adversarial_paper at its defaults scores as the authors' engine.py (``torch.cuda.amp.autocast()``
    around the forward), written out here. The one setting that differs from the authors' protocol (the subset
    aside, which it does not list) is the eps chosen here, 0, so that the attacked score is the clean one: the
    protocol says so, and says nothing of the precision."""
    from quest.runtime.distributed import DistContext

    cuda = torch.device("cuda", 0)
    model = linear_digits_model().to(cuda)
    cfg = settings(adversarial_paper__max_samples=60, adversarial_paper__attacks=["fgsm"],
                   adversarial_paper__fgsm__eps=[0.0])
    result = adversarial_paper(make_run(digits_target(model), cfg, DistContext(device=cuda)), cfg.adversarial_paper)
    x, y = _digits_val()
    chosen = torch.tensor(evenly_spaced(len(y), 60))
    z, y = ((x[chosen] - 0.5) / 0.5).to(cuda), y[chosen].to(cuda)
    with torch.no_grad():
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            half = model(z)
        full = model(z)
    assert half.dtype == torch.float16
    nll16 = F.cross_entropy(half.double(), y).item()
    assert abs(nll16 - F.cross_entropy(full.double(), y).item()) > 1e-6  # the precisions are told apart
    for numbers in (result["clean"], result["fgsm@0"]):
        assert numbers["correct"] == int((half.argmax(1) == y).sum())
        assert numbers["nll"] == pytest.approx(nll16, rel=1e-6, abs=0)
    assert result["fgsm@0"]["scoring"] == "fp16" and result["protocol"]["score_precision"] == "fp16"
    authors_eps = [1 / 255]  # FGSM's eps in the authors' protocol, in normalised units
    assert result["protocol"]["differs_from_authors"] == [f"fgsm.eps: [0.0] (authors: {authors_eps})"]
