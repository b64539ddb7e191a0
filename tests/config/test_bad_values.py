"""Every key of train.py's, eval.py's and the toy study's configs x a generated bad value (hypothesis): the value is
refused before any work by a user error (quest/runtime/errors.py prints it as one line, no traceback) that names the key, or
it is accepted and then the run ends as a run does (completed, or a user error), never with a bug's traceback. The
checks, for every key: in-process, the value set on the composed config as Hydra would, then checked. That such a
refusal reaches the user as one line, exit 1, before any change, through each command's entry point, is the refusal
contract's (tests/runtime/test_refusal_contract.py, with the issue's examples: recipe.lr=-1, data.batch_size=0, ...)."""
from __future__ import annotations

import copy
import itertools
import logging
import math

import pytest
from hydra import compose, initialize_config_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from quest.evaluation.checks import check_eval_config
from quest.evaluation.config import register_eval_configs
from quest.evaluation.registry import EVALUATIONS
from quest.runtime.errors import is_user_error
from quest.toy.checks import check_toy_config
from quest.toy.config import register_toy_config
from quest.train import fit
from quest.train.checks import check_train_config

from ..helpers import CONFIGS, FAST, compose_cfg, eval_cfg


def _leaf_keys(node, prefix: str = "") -> list[str]:
    keys = []
    for name in node.keys():
        child = node._get_node(name)
        keys += _leaf_keys(child, f"{prefix}{name}.") if OmegaConf.is_dict(child) else [f"{prefix}{name}"]
    return keys


# random erasing and mixup on: a value of theirs (recipe.recount, recipe.mixup_prob, ...) is then used by the run,
# where a base config with the feature off would accept any value and never run it
TRAIN = compose_cfg(*FAST, "trainer.max_steps=1", "trainer.eval_every_n_epochs=1", "recipe.reprob=0.25",
                    "recipe.mixup=0.8")
register_eval_configs()  # eval.py does this before composing
EVAL = eval_cfg("checkpoint=/nonexistent/last.pt")
register_toy_config()  # python -m quest.toy does this before composing
with initialize_config_dir(config_dir=str(CONFIGS / "toy"), version_base="1.3"):
    TOY = compose(config_name="toy", overrides=["grid=quick"])

# what a user can type: a word, any integer (0, negative, a typo's 10**12), any float (nan, inf), a boolean, null,
# a list
BAD = st.one_of(st.text(max_size=6), st.integers(-10**13, 10**13), st.sampled_from([0, -1, 10**12]),
                st.floats(allow_nan=True, allow_infinity=True, width=32), st.booleans(), st.none(),
                st.lists(st.integers(-3, 3), max_size=3))


def _set(cfg, key: str, value) -> None:
    OmegaConf.update(cfg, key, value, merge=False)  # the structured schema checks the type, as it does for Hydra


def _refused_naming(exc: BaseException, key: str, value) -> None:
    assert is_user_error(exc), f"{key}={value!r} raised a bug: {type(exc).__name__}: {exc}"
    text = str(exc)
    leaf = key.rsplit(".", 1)[-1]
    assert key in text or leaf in text, f"{key}={value!r} was refused without naming the key: {text}"


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(_leaf_keys(TRAIN)), value=BAD)
def test_a_bad_train_value_is_refused_naming_its_key_or_the_run_ends_as_runs_do(key, value, tmp_path_factory):
    cfg = copy.deepcopy(TRAIN)
    try:
        _set(cfg, key, value)
        check_train_config(cfg)
    except Exception as exc:  # noqa: BLE001 (the property: every exception here is a user error)
        _refused_naming(exc, key, value)
        return
    if _same_as_default(key, value):
        return  # nothing new to run
    logging.disable(logging.WARNING)
    try:
        summary = fit(cfg, tmp_path_factory.mktemp("run"))
    except Exception as exc:  # noqa: BLE001
        assert is_user_error(exc), f"{key}={value!r} passed the checks, then the run raised a bug: {exc!r}"
    else:
        assert summary["status"] in ("completed", "stopped", "diverged", "bad_data"), summary["status"]
    finally:
        logging.disable(logging.NOTSET)


def _same_as_default(key: str, value) -> bool:
    default = OmegaConf.select(TRAIN, key)
    try:
        return default == value or (isinstance(value, float) and math.isnan(value) and default != default)
    except Exception:  # noqa: BLE001 (a ListConfig against a scalar)
        return False


@settings(max_examples=400)
@given(key=st.sampled_from(_leaf_keys(EVAL)), value=BAD)
def test_a_bad_eval_value_is_refused_naming_its_key_or_accepted(key, value):
    cfg = copy.deepcopy(EVAL)
    try:
        _set(cfg, key, value)
        check_eval_config(cfg, EVALUATIONS)
    except Exception as exc:  # noqa: BLE001
        _refused_naming(exc, key, value)


@pytest.mark.parametrize("key, value, names", [
    ("attention.options.eps", "zzz", "attention.options"),  # failed inside the first forward's clamp_min
    ("attention.options.eps", -1.0, "a finite number > 0"),
    ("data.num_workers", 10**12, "data.num_workers"),  # forked until the machine ran out of memory
    ("model.img_size", 10**12, "model.img_size"),  # overflowed inside the position embedding's allocation
])
def test_values_that_used_to_crash_or_exhaust_the_machine_are_refused(key, value, names):
    cfg = copy.deepcopy(TRAIN)
    _set(cfg, key, value)
    with pytest.raises(ValueError, match=names.replace(".", r"\.")):
        check_train_config(cfg)


@settings(max_examples=300)
@given(key=st.sampled_from([k for k in _leaf_keys(TOY) if not k.startswith("hydra.") and "param_init" not in k]),
       value=BAD)
def test_a_bad_toy_study_value_is_refused_naming_its_key_or_accepted(key, value):
    """The values only: a study trains for minutes, so what an accepted value does is left to tests/toy/test_toy.py."""
    cfg = copy.deepcopy(TOY)
    try:
        _set(cfg, key, value)
        check_toy_config(OmegaConf.to_container(cfg, resolve=True))
    except Exception as exc:  # noqa: BLE001
        _refused_naming(exc, key, value)


def test_a_variant_s_starting_value_must_be_a_number():
    """A variant's parameter names hold dots (attn.qk_scale), so the property above cannot set them as keys."""
    cfg = OmegaConf.to_container(TOY, resolve=True)
    cfg["variants"]["qknorm_fixed"]["param_init"]["attn.qk_scale"] = float("nan")
    with pytest.raises(ValueError, match=r"variants\.qknorm_fixed\.param_init\[attn\.qk_scale\] must be a finite"):
        check_toy_config(cfg)


_ARG = st.one_of(st.integers(-10**13, 10**13), st.sampled_from([0, -1, 10**12]), st.text(max_size=5))
_COPIES = itertools.count()  # a new output folder per example: an earlier example's copy is not this one's


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(option=st.sampled_from(["--short-side", "--quality", "--workers"]), value=_ARG)
def test_a_bad_data_tool_argument_is_one_error_line_or_the_copy_is_made(tmp_path, capsys, option, value):
    """The data tool's arguments, as the config keys above: refused as `quest-data ...: error: ...` with exit 2 (for
    argparse, after its usage line), or the copy is made; never a traceback, and never a fork per typo'd worker."""
    from quest.tools.data_check import main as quest_data

    from ..interop_helpers import make_image_folder

    src = tmp_path / "src"
    if not src.exists():
        make_image_folder(src, per_class=1)
    dst = tmp_path / f"dst{next(_COPIES)}"
    args = {"--short-side": "16", "--quality": "90", "--workers": "1", option: str(value)}
    try:
        code = quest_data(["cap", str(src), str(dst), "--no-progress", *itertools.chain(*args.items())])
    except SystemExit as exit_:  # argparse's refusal of an argument it cannot parse
        code = exit_.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert code in (0, 2), (code, err)
    if code == 2:
        assert ": error: " in err.strip().splitlines()[-1] and option.strip("-").split("-")[0] in err, err

