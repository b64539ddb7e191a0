"""quest on a torch older than the newest (quest.runtime.versions): the APIs a newer torch added have stand-ins that
compute the same, and a feature that needs a newer torch is refused in one line naming the release, before any
change."""
from __future__ import annotations

import pytest
import torch

import quest.runtime.versions as versions
from quest.config.checks import ConfigError
from quest.runtime.errors import is_user_error
from quest.train.checks import check_train_config

from ..helpers import FAST, compose_cfg


def _grads(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in ((3, 4), (5,), (2, 2, 2))]


def test_parse_version_reads_the_release_without_local_tags():
    assert versions.parse_version("2.4.1+cu121") == (2, 4, 1)
    assert versions.parse_version("2.15.0a0+git1234") == (2, 15, 0)
    assert versions.parse_version("3.6") == (3, 6, 0)


@pytest.mark.parametrize("torch_has_it", [True, False], ids=["torch's", "stand-in"])
def test_total_norm_and_clipping_equal_the_formula(torch_has_it, monkeypatch):
    """Where torch lacks get_total_norm / clip_grads_with_norm_ (before 2.6), the stand-ins give the 2-norm of all
    gradients together and scale them by min(1, max_norm / (norm + 1e-6)): against that formula in float64."""
    if not torch_has_it:
        monkeypatch.delattr(torch.nn.utils, "get_total_norm", raising=False)
        monkeypatch.delattr(torch.nn.utils, "clip_grads_with_norm_", raising=False)
    grads = _grads()
    want = torch.cat([g.flatten() for g in grads]).pow(2).sum().sqrt()
    norm = versions.total_norm(grads)
    torch.testing.assert_close(norm.double(), want)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    versions.clip_grads_with_norm_(params, 1.0, norm)
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, g * (1.0 / (want + 1e-6)))
    for p, g in zip(params, grads):  # a max_norm above the norm leaves the gradients as they were
        p.grad = g.clone()
    versions.clip_grads_with_norm_(params, float(want) * 2, norm)
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, g)


def test_is_exporting_is_false_outside_export_without_torchs_probe(monkeypatch):
    assert versions.is_exporting() is False
    monkeypatch.delattr(torch.compiler, "is_exporting", raising=False)
    assert versions.is_exporting() is False


def test_a_feature_needing_a_newer_torch_is_refused_in_one_line(monkeypatch):
    assert versions.missing(versions.FSDP) is None or versions.TORCH_VERSION < versions.FEATURES[versions.FSDP]
    monkeypatch.setattr(versions, "TORCH_VERSION", (2, 4, 1))
    message = versions.missing(versions.FSDP)
    assert message == f"{versions.FSDP} needs torch>=2.6.0; this environment has torch {torch.__version__}"
    with pytest.raises(versions.NewerTorchNeeded) as raised:
        versions.require(versions.ONNX_EXPORT)
    assert is_user_error(raised.value) and "\n" not in str(raised.value)
    assert str(raised.value).startswith("quest-export --onnx (torch.onnx.export(dynamo=True)) needs torch>=2.6.0")


def test_fsdp_on_an_older_torch_is_refused_by_the_config_checks(monkeypatch):
    monkeypatch.setattr(versions, "TORCH_VERSION", (2, 4, 1))
    with pytest.raises(ConfigError, match=r"trainer.strategy cannot be fsdp here: .*needs torch>=2.6.0; this "
                                          r"environment has torch .*\(use ddp, or a newer torch\), got 'fsdp'"):
        check_train_config(compose_cfg(*FAST, "trainer.strategy=fsdp", "recipe.ema=false"))


@pytest.mark.parametrize("release, compiled", [((2, 8, 0), False), ((2, 13, 9), False), ((2, 14, 0), True)])
def test_the_toy_study_trains_eagerly_where_its_compiled_engine_is_not_trusted(release, compiled, monkeypatch,
                                                                                caplog):
    """Below torch 2.14 the compiled engine's runs did not end where the eager ones do (tests/toy/test_toy.py): the
    checked config the study runs and records says compile=false, and one warning names the release it needs."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from quest.toy.config import register_toy_config
    from quest.toy.study import check_study

    from ..helpers import CONFIGS

    register_toy_config()
    with initialize_config_dir(config_dir=str(CONFIGS / "toy"), version_base="1.3"):
        cfg = OmegaConf.to_container(compose(config_name="toy", overrides=["grid=quick", "device=cpu"]), resolve=True)
    assert cfg["compile"] is True  # the default
    monkeypatch.setattr(versions, "TORCH_VERSION", release)
    checked = check_study(cfg)
    assert checked["compile"] is compiled and cfg["compile"] is True  # the caller's config untouched
    warned = [r.getMessage() for r in caplog.records if "compiled engine" in r.getMessage()]
    assert warned == ([] if compiled else [f"{versions.TOY_COMPILED} needs torch>=2.14.0; this environment has torch "
                                           f"{torch.__version__}: the study trains with the eager engine "
                                           "(compile=false)"])
