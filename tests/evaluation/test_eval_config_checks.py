"""eval.py refuses unknown keys (also added with + or ++) and bad values at start, before any data or model is
loaded, naming each key, its value and what is allowed."""
from __future__ import annotations

import dataclasses
import re
import typing

import pytest

import quest.evaluation.runner as runner
from quest.config.checks import ConfigError
from quest.evaluation import run_evaluation
from quest.evaluation.checks import check_eval_config
from quest.evaluation.config import EvalConfig
from quest.evaluation.registry import evaluators, load_evaluations

from ..helpers import CONFIGS
from .test_eval_cli import eval_cfg

BASE = ["model=vit_pico", "attention=quest"]


def _sections(schema: type = EvalConfig, prefix: str = "") -> list[str]:
    """Every config node the schema types with a dataclass (the top level is '')."""
    out = [prefix]
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        child = hints[f.name]
        child = child if dataclasses.is_dataclass(child) else next(
            (a for a in typing.get_args(child) if dataclasses.is_dataclass(a)), None)
        if child is not None:
            out += _sections(child, f"{prefix}{f.name}.")
    return out


SECTIONS = _sections()


@pytest.fixture(autouse=True)
def _nothing_is_loaded(monkeypatch):
    """A config problem must stop the run before a model, a data set or a process group is touched."""
    def refuse(*args, **kwargs):
        raise AssertionError("loaded something before checking the config")

    monkeypatch.setattr(runner, "load_target", refuse)
    monkeypatch.setattr(runner, "init_distributed", refuse)


def test_the_sections_cover_the_schema():
    assert {"", "model.", "attention.", "data.", "logger.", "eval.", "eval.roots.", "eval.imagenet_val.",
            "eval.adversarial.", "eval.adversarial.pgd.", "eval.adversarial.autoattack."} <= set(SECTIONS)
    assert len(SECTIONS) >= 20


@pytest.mark.parametrize("plus", ["+", "++"])
@pytest.mark.parametrize("section", SECTIONS)
def test_an_added_unknown_key_is_refused_in_every_section(tmp_path, section, plus):
    cfg = eval_cfg(*BASE, "eval=digits_robustness", f"{plus}{section}bogus=1")
    with pytest.raises(ConfigError, match=rf"{section.replace('.', '[.]')}bogus: not a key of"):
        run_evaluation(cfg, tmp_path)


def test_a_misspelt_added_key_gets_a_suggestion(tmp_path):
    cfg = eval_cfg(*BASE, "+eval.adversarial.pgd.stepz=3")
    with pytest.raises(ConfigError, match=r"eval\.adversarial\.pgd\.stepz.*did you mean eval\.adversarial\.pgd\.steps"):
        run_evaluation(cfg, tmp_path)


def test_free_form_attention_options_are_not_key_checked():
    # attention.options are the formulation's constructor arguments, checked where the layer is built
    check_eval_config(eval_cfg(*BASE, "+attention.options.learnable_scale=true"), runner.EVALUATIONS)


# what a suite cannot run without and only the user can give (the command line of its config's header)
USER_GIVEN = {"imagenet_explain": ["eval.explain.boxes=/datasets/imagenet/LOC_val_solution.csv"]}


@pytest.mark.parametrize("suite", sorted(p.stem for p in (CONFIGS / "eval").glob("*.yaml")))
def test_every_suite_passes_the_checks(suite):
    check_eval_config(eval_cfg(*BASE, f"eval={suite}", *USER_GIVEN.get(suite, [])), runner.EVALUATIONS)


load_evaluations()  # the built-in evaluations, as eval.py registers them
REGISTERED = sorted(n for n, e in evaluators().items() if e.module.startswith("quest."))  # not a test's own


@pytest.mark.parametrize("name", REGISTERED)
def test_every_registered_evaluation_alone_passes_the_checks(name):
    """Derived from the evaluation registry: a new built-in evaluation is checked here without being listed."""
    check_eval_config(eval_cfg(*BASE, "eval=clean", f"eval.run=[{name}]"), runner.EVALUATIONS)


def test_every_registered_evaluation_is_run_by_a_suite_config():
    suites = sorted(p.stem for p in (CONFIGS / "eval").glob("*.yaml"))
    run = {name for suite in suites for name in eval_cfg(*BASE, f"eval={suite}", *USER_GIVEN.get(suite, [])).eval.run}
    assert set(REGISTERED) <= run, f"no configs/eval/*.yaml runs {sorted(set(REGISTERED) - run)}"


@pytest.mark.parametrize("suite", sorted(USER_GIVEN))
def test_a_suite_without_its_user_given_values_names_them(suite):
    with pytest.raises(ConfigError) as err:
        check_eval_config(eval_cfg(*BASE, f"eval={suite}"), runner.EVALUATIONS)
    for value in USER_GIVEN[suite]:
        assert value.split("=")[0] in str(err.value)


BAD_VALUES = [  # (override, key, the value as the message shows it, what is allowed)
    ("eval.batch_size=0", "eval.batch_size", "0", "an integer in 1..65536"),
    ("eval.batch_size=100000000000000000000", "eval.batch_size", "100000000000000000000", "an integer in 1..65536"),
    ("eval.num_workers=-1", "eval.num_workers", "-1", "an integer in 0.."),
    ("eval.num_workers=1000000000000", "eval.num_workers", "1000000000000", "an integer in 0.."),  # as data.num_workers
    ("eval.torch_threads=0", "eval.torch_threads", "0", "an integer in 1.."),
    ("eval.torch_threads=1000000000000", "eval.torch_threads", "1000000000000", "an integer in 1.."),
    ("eval.device=gpu", "eval.device", "'gpu'", "auto, cpu, cuda or cuda:N"),
    ("eval.precision=fp8", "eval.precision", "'fp8'", "one of fp32, bf16, fp16"),
    ("eval.crop_pct=0", "eval.crop_pct", "0.0", "in [0.1, 1]"),
    ("eval.crop_pct=0.002", "eval.crop_pct", "0.002", "in [0.1, 1]"),  # a resize to 500x the crop's side
    ("eval.crop_pct=1.2", "eval.crop_pct", "1.2", "in [0.1, 1]"),
    ("eval.interpolation=random", "eval.interpolation", "'random'", "one of nearest, bilinear, bicubic"),
    ("eval.log_every_n=-2", "eval.log_every_n", "-2", "an integer in 0..2**31-1 (0: off)"),
    ("eval.log_every_s=-1", "eval.log_every_s", "-1.0", "in [0, 86400] seconds (0: off)"),
    ("eval.log_every_s=1e9", "eval.log_every_s", "1000000000.0", "in [0, 86400] seconds (0: off)"),
    ("eval.clean.max_samples=0", "eval.clean.max_samples", "0", "an integer in 1..2**31-1"),
    ("eval.clean.max_samples=100000000000000000000", "eval.clean.max_samples", "100000000000000000000",
     "an integer in 1..2**31-1"),
    ("eval.corruptions.severities=[0,3]", "eval.corruptions.severities", "[0, 3]", "a list of distinct severities"),
    ("eval.imagenet_c.severities=[1,1]", "eval.imagenet_c.severities", "[1, 1]", "a list of distinct severities"),
    ("eval.corruptions.corruptions=[fogg]", "eval.corruptions.corruptions", "['fogg']",
     "a list of distinct standard corruptions from gaussian_noise"),
    ("eval.corruptions.extra_corruptions=[fog]", "eval.corruptions.extra_corruptions", "['fog']",
     "a list of distinct extra corruptions from speckle_noise"),
    ("eval.corruptions.seed=-1", "eval.corruptions.seed", "-1", "an integer in 0..2**32-1"),
    ("eval.imagenet_v2.variants=[matched]", "eval.imagenet_v2.variants", "['matched']",
     "a list of distinct variants from matched-frequency, threshold0.7, top-images"),
    ("eval.adversarial.attacks=[fgsm,cw]", "eval.adversarial.attacks", "['fgsm', 'cw']",
     "a list of distinct attacks from fgsm, pgd, spsa, autoattack"),
    ("eval.adversarial.labels=pred", "eval.adversarial.labels", "'pred'", "one of ground_truth, predicted, paper"),
    ("eval.adversarial.space=lab", "eval.adversarial.space", "'lab'", "one of pixel, normalized"),
    ("eval.adversarial.elliptical_estimator=mode", "eval.adversarial.elliptical_estimator", "'mode'",
     "one of mean, median"),
    ("eval.adversarial.spsa.estimate_at=x", "eval.adversarial.spsa.estimate_at", "'x'",
     "one of iterate, cleverhans_torch"),
    ("eval.adversarial_paper.space=lab", "eval.adversarial_paper.space", "'lab'", "one of pixel, normalized"),
    ("eval.adversarial.source=train", "eval.adversarial.source", "'train'", "one of data, imagenet_val"),
    ("eval.adversarial_paper.spsa.nb_iter=0", "eval.adversarial_paper.spsa.nb_iter", "0", "an integer in 1..100000"),
    ("eval.adversarial.batch_size=0", "eval.adversarial.batch_size", "0", "an integer in 1..65536"),
    ("eval.adversarial.fgsm.eps=[-0.1]", "eval.adversarial.fgsm.eps", "[-0.1]", "a list of distinct budgets in [0, 1]"),
    ("eval.adversarial.pgd.eps=[8]", "eval.adversarial.pgd.eps", "[8.0]", "a list of distinct budgets in [0, 1]"),
    ("eval.adversarial.pgd.steps=0", "eval.adversarial.pgd.steps", "0", "an integer in 1..100000"),
    ("eval.adversarial.pgd.steps=1000000", "eval.adversarial.pgd.steps", "1000000", "an integer in 1..100000"),
    ("eval.adversarial.pgd.step_size=0", "eval.adversarial.pgd.step_size", "0.0", "in (0, 1] (a fraction of eps)"),
    ("eval.adversarial.spsa.nb_sample=0", "eval.adversarial.spsa.nb_sample", "0", "an integer in 1..100000"),
    ("eval.adversarial.spsa.lr=-1", "eval.adversarial.spsa.lr", "-1.0", "in (0, 1]"),
    ("eval.adversarial.spsa.delta=5", "eval.adversarial.spsa.delta", "5.0", "in (0, 1]"),
    ("eval.adversarial.spsa.max_samples=0", "eval.adversarial.spsa.max_samples", "0", "an integer in 1..2**31-1"),
    ("eval.adversarial.autoattack.version=fast", "eval.adversarial.autoattack.version", "'fast'",
     "one of standard, plus, rand"),
    ("eval.adversarial.autoattack.norm=L2", "eval.adversarial.autoattack.norm", "'L2'", "Linf"),
    ("eval.run=[clean,clean]", "eval.run", "['clean', 'clean']", "a list of distinct evaluations from"),
    ("eval.run=[clean,imagenet_x]", "eval.run", "['clean', 'imagenet_x']", "a list of distinct evaluations"),
]


def _line_of(message: str, key: str) -> str:
    lines = [line for line in message.splitlines() if re.match(rf"\s*{re.escape(key)}\b(?![.])", line)]
    assert len(lines) == 1, message
    return lines[0]


@pytest.mark.parametrize("override, key, value, allowed", BAD_VALUES)
def test_a_bad_value_is_named_with_what_is_allowed(tmp_path, override, key, value, allowed):
    with pytest.raises(ConfigError) as info:
        run_evaluation(eval_cfg(*BASE, "eval=digits_robustness", override), tmp_path)
    line = _line_of(str(info.value), key)
    assert f"must be {allowed}" in line
    assert f"{key}={value}" in line or line.endswith(f"got {value}")  # quest.config.checks.Checks's two layouts
    assert len(str(info.value).splitlines()) == 2  # the header and this one problem: the defaults are all valid


def test_fp16_needs_cuda(tmp_path):
    with pytest.raises(ConfigError) as info:
        run_evaluation(eval_cfg(*BASE, "eval.device=cpu", "eval.precision=fp16"), tmp_path)
    assert "must be bf16 or fp32 without CUDA (eval.device=cpu)" in _line_of(str(info.value), "eval.precision")


def test_every_bad_value_at_once_before_the_checkpoint_is_read(tmp_path):
    missing = tmp_path / "no_such.pt"  # would be a FileNotFoundError if anything were loaded first
    cfg = eval_cfg(f"checkpoint={missing}", "eval.batch_size=-3", "eval.adversarial.pgd.steps=0",
                   "eval.adversarial.labels=pred")
    with pytest.raises(ConfigError) as info:
        run_evaluation(cfg, tmp_path)
    for key, value in (("eval.batch_size", "-3"), ("eval.adversarial.pgd.steps", "0"),
                       ("eval.adversarial.labels", "'pred'")):
        assert value in _line_of(str(info.value), key)
