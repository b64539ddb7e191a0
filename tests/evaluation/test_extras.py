"""Optional packages: each suite names the extras it lacks before any work (a missing one must not cost the results
of the evaluations before it)."""
from __future__ import annotations

import sys

import pytest
from hydra import compose, initialize_config_dir

from quest.evaluation import register_eval_configs, run_evaluation
from quest.runtime.extras import MissingExtra, missing, require_all

from ..helpers import CONFIGS

register_eval_configs()


def _eval_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="eval", overrides=list(overrides))


def test_require_all_lists_every_missing_module_and_the_extras(monkeypatch):
    monkeypatch.setitem(sys.modules, "no_such_a", None)
    needs = [("no_such_a", "eval", "thing A"), ("json", "eval", "json"), ("no_such_b_xyz", "report", "figure B"),
             ("no_such_a", "eval", "thing A")]
    assert missing(needs) == [("no_such_a", "eval", "thing A"), ("no_such_b_xyz", "report", "figure B")]
    with pytest.raises(MissingExtra) as err:
        require_all(needs, "eval=x")
    text = str(err.value)
    assert text.startswith("eval=x needs optional packages")
    assert "thing A needs 'no_such_a'" in text and "figure B needs 'no_such_b_xyz'" in text and "json" not in text
    assert "pip install 'quest[eval,report]'" in text
    require_all([("json", "eval", "json")], "eval=x")  # all there: nothing raised


def test_the_default_suite_names_its_extras_before_any_work(monkeypatch, tmp_path):
    # as on a plain install without [eval]: the corruptions and AutoAttack packages cannot be imported
    for module in ("imagecorruptions", "pyautoattack"):
        monkeypatch.setitem(sys.modules, module, None)
    import quest.evaluation.runner as runner

    def no_work(*args, **kwargs):
        raise AssertionError("the model was loaded before the extras were checked")

    monkeypatch.setattr(runner, "load_target", no_work)
    cfg = _eval_cfg("model=vit_pico", "attention=standard")  # the default suite: digits_robustness
    assert list(cfg.eval.run) == ["clean", "corruptions", "adversarial"]
    with pytest.raises(MissingExtra) as err:
        run_evaluation(cfg, tmp_path / "out")
    text = str(err.value)
    assert "eval=digits_robustness needs" in text and "pip install 'quest[eval]'" in text
    assert "the ImageNet-C corruptions needs 'imagecorruptions'" in text
    assert "the autoattack attack needs 'pyautoattack'" in text
    assert not (tmp_path / "out").exists()


def test_a_suite_asks_only_for_what_its_settings_use(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pyautoattack", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    from quest.evaluation.runner import check_extras

    cfg = _eval_cfg("model=vit_pico", "attention=standard", "eval.adversarial.attacks=[fgsm,pgd]")
    check_extras(cfg.eval, ["clean", "adversarial"])  # no AutoAttack: nothing missing
    with pytest.raises(MissingExtra, match=r"autoattack attack needs 'pyautoattack'"):
        check_extras(_eval_cfg("model=vit_pico", "attention=standard").eval, ["clean", "adversarial"])
    explain = _eval_cfg("model=vit_pico", "attention=standard", "eval=explain")
    with pytest.raises(MissingExtra, match=r"explanation figure \(explain.png\) needs 'matplotlib'.*quest\[report\]"):
        check_extras(explain.eval, ["explain"])
    check_extras(_eval_cfg("model=vit_pico", "attention=standard", "eval=explain", "eval.explain.figure_images=0").eval,
                 ["explain"])


def test_corruptions_import_through_require(monkeypatch):
    # the corruption functions themselves also name the extra (a caller that skips the suite's check)
    from quest.evaluation import corruption_fns

    monkeypatch.setitem(sys.modules, "imagecorruptions", None)
    monkeypatch.setitem(sys.modules, "imagecorruptions.corruptions", None)
    corruption_fns._ic.cache_clear()
    try:
        with pytest.raises(MissingExtra, match=r"ImageNet-C corruptions needs .*pip install 'quest\[eval\]'"):
            corruption_fns._ic()
    finally:
        corruption_fns._ic.cache_clear()
