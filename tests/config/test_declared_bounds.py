"""What a config value may be is declared once, on its schema field (quest.config.schema, quest.data.config and each
data set's settings, eval.py's settings and every evaluation's section, the toy study's config), with the metadata
quest's records use; the config checks refuse what breaks a declaration.

The properties run over every declared field of train.py's, eval.py's and the toy study's composed configs, found
from the declarations themselves, so a new key is covered without a new test: a value just outside its range (the
next float past a closed end, the end itself where it is open, one past an integer's end), or not among its choices,
or not of its form, or a list of the wrong length or with a repeated entry, is refused by the command's own check in
one line that names the key; values drawn inside are accepted by the declaration checker. Every float, declared or
not, must be finite. Then the relations between keys, which no single field declares.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import typing
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import DictConfig, OmegaConf

from quest.config.checks import ConfigError, declared_problems
from quest.config.schema import TrainConfig
from quest.evaluation.checks import check_eval_config
from quest.evaluation.config import eval_config_schema, register_eval_configs
from quest.evaluation.registry import EVALUATIONS
from quest.toy.checks import check_toy_config
from quest.toy.config import ToyConfig, register_toy_config
from quest.train.checks import check_train_config

from ..helpers import CONFIGS, compose_cfg, eval_cfg

register_eval_configs()  # eval.py does this before composing
register_toy_config()  # python -m quest.toy does this before composing
with initialize_config_dir(config_dir=str(CONFIGS / "toy"), version_base="1.3"):
    TOY = compose(config_name="toy", overrides=["grid=quick"])


def _check_toy(cfg: DictConfig) -> None:
    check_toy_config(OmegaConf.to_container(cfg, resolve=True))


def _check_eval(cfg: DictConfig) -> None:
    check_eval_config(cfg, EVALUATIONS)


#: name -> (a composed config whose values all pass, its schema, the command's own check). The data sets with
#: options of their own are composed too, so that their settings' declarations are covered.
CONFIGS_CHECKED: dict[str, tuple[DictConfig, type, Any]] = {
    "train": (compose_cfg(), TrainConfig, check_train_config),
    "train-fake": (compose_cfg("data=fake"), TrainConfig, check_train_config),
    "train-canvas": (compose_cfg("data=digits_canvas"), TrainConfig, check_train_config),
    "train-shards": (compose_cfg("data=imagenet_wds", "data.root=/nowhere"), TrainConfig, check_train_config),
    "eval": (eval_cfg("checkpoint=/nonexistent/last.pt"), eval_config_schema(), _check_eval),
    "toy": (TOY, ToyConfig, _check_toy),
}
_DECLARING = ("bounds", "choices", "pattern", "length")


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """The hint without None, and whether None was an option."""
    args = typing.get_args(hint)
    if type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return hint, False


def _fields(node: DictConfig, schema: type, prefix: str = "") -> list[tuple[str, Any, dataclasses.Field]]:
    """(key, type, field) of every leaf field of ``schema`` present in ``node``, descending into nested dataclasses
    (a node's own type where it is a subclass: a data set's settings)."""
    hints = typing.get_type_hints(schema)
    found = []
    for f in dataclasses.fields(schema):
        if f.name not in node or OmegaConf.is_missing(node, f.name):
            continue
        hint, _ = _unwrap(hints[f.name])
        value = node[f.name]
        if dataclasses.is_dataclass(hint) and isinstance(value, DictConfig):
            own = OmegaConf.get_type(value)
            found += _fields(value, own if dataclasses.is_dataclass(own) else hint, f"{prefix}{f.name}.")
        else:
            found.append((prefix + f.name, hints[f.name], f))
    return found


def _each_key_once(fields: list[tuple]) -> list[tuple]:
    """One row per key (train.py's keys appear in every train config; the data sets' own in theirs)."""
    seen: set[tuple[str, str]] = set()
    rows = []
    for row in fields:
        command = row[0].split("-")[0]
        if (command, row[1]) not in seen:
            seen.add((command, row[1]))
            rows.append(row)
    return rows


DECLARED = _each_key_once([(name, key, hint, f) for name, (cfg, schema, _) in CONFIGS_CHECKED.items()
                           for key, hint, f in _fields(cfg, schema) if any(k in f.metadata for k in _DECLARING)])
FLOATS = _each_key_once([(name, key, hint) for name, (cfg, schema, _) in CONFIGS_CHECKED.items()
                         for key, hint, _ in _fields(cfg, schema)
                         if float in (_unwrap(hint)[0], *typing.get_args(_unwrap(hint)[0]))])


def test_the_properties_cover_every_group_and_the_keys_the_issues_name():
    keys = {key for _, key, _, _ in DECLARED}
    assert {"data.mean", "data.std", "recipe.hflip", "recipe.mixup_prob", "model.img_size", "data.img_size",
            "trainer.device", "recipe.sched", "attention.fused", "diagnostics.num_samples"} <= keys
    assert "logger.wandb" not in keys  # a bool's type is its whole range
    for group in ("model.", "attention.", "data.", "recipe.", "trainer.", "diagnostics.", "eval.", "data.canvas.",
                  "eval.adversarial.pgd.", "grid.", "study.stop."):
        assert any(key.startswith(group) for key in keys), group


def _ends(f: dataclasses.Field) -> tuple[Any, Any, bool, bool]:
    low, high = (end() if callable(end) else end for end in f.metadata.get("bounds", (None, None)))
    return (low, high, *f.metadata.get("open", (False, False)))


def _number(kind: Any, f: dataclasses.Field) -> st.SearchStrategy:
    """A number inside the field's range (a far end stands in for a missing one)."""
    low, high, open_low, open_high = _ends(f)
    if kind is int:
        low = -10**6 if low is None else low + open_low
        return st.integers(low, (low + 10**6 if high is None else high - open_high))
    low = -1e6 if low is None else low
    return st.floats(low, low + 1e6 if high is None else high, exclude_min=open_low and f.metadata.get(
        "bounds", (None,))[0] is not None, exclude_max=open_high, allow_nan=False, allow_infinity=False)


def _element(kind: Any, f: dataclasses.Field) -> st.SearchStrategy:
    if "choices" in f.metadata:
        return st.sampled_from(f.metadata["choices"])
    if "pattern" in f.metadata:
        return st.from_regex(f.metadata["pattern"][0], fullmatch=True)
    return _number(kind, f)


def _inside(hint: Any, f: dataclasses.Field) -> st.SearchStrategy:
    kind, _ = _unwrap(hint)
    if typing.get_origin(kind) is not list:
        return _element(kind, f)
    length, min_length, distinct = f.metadata.get("length", (None, 0, False))
    sizes = (length, length) if length is not None else (max(min_length, 1), 3)
    item = typing.get_args(kind)[0]
    if "choices" in f.metadata:
        sizes = (sizes[0], min(sizes[1], len(f.metadata["choices"])))
    return st.lists(_element(item, f), min_size=sizes[0], max_size=sizes[1], unique=distinct)


def _outside_numbers(kind: Any, f: dataclasses.Field) -> list[Any]:
    """The values just past each end of the field's range."""
    low, high, open_low, open_high = _ends(f)
    found = []
    if low is not None:
        found.append(low if open_low else (low - 1 if kind is int else math.nextafter(low, -math.inf)))
    if high is not None:
        found.append(high if open_high else (high + 1 if kind is int else math.nextafter(high, math.inf)))
    elif kind is int:  # an integer without a declared end still ends at 64 bits, as torch and numpy count
        found.append(2**63)
    return [float(v) if kind is float else v for v in found]


def _outside(hint: Any, f: dataclasses.Field, draw: Any) -> Any:
    kind, _ = _unwrap(hint)
    is_list = typing.get_origin(kind) is list
    item = typing.get_args(kind)[0] if is_list else kind
    wrong: list[Any] = []
    if "bounds" in f.metadata:
        wrong += _outside_numbers(item, f)
    if "choices" in f.metadata:
        wrong.append(draw(st.text(min_size=1, max_size=8).filter(lambda t: t not in f.metadata["choices"])))
    if "pattern" in f.metadata:
        wrong.append(draw(st.text(max_size=8).filter(lambda t: not f.metadata["pattern"][0].fullmatch(t))))
    if not is_list:
        return draw(st.sampled_from(wrong))
    good = draw(_inside(hint, f))
    length, _, distinct = f.metadata.get("length", (None, 0, False))
    lists = [good[:i] + [w] + good[i + 1:] for w in wrong for i in range(len(good))]
    if length is not None:
        lists.append(good + good[:1])  # one too many
    if distinct:
        lists.append(good + good[:1] if length is None else good[:-1] + good[:1])  # an entry twice
    return draw(st.sampled_from(lists))


def _set(cfg: DictConfig, key: str, value: Any) -> DictConfig:
    cfg = copy.deepcopy(cfg)
    OmegaConf.update(cfg, key, value, merge=False)  # the structured schema types it, as Hydra does an override
    return cfg


def _lines_naming(message: str, key: str) -> list[str]:
    return [line for line in message.splitlines() if line.startswith(f"  {key} ")]


@pytest.mark.parametrize("name, key, hint, f", DECLARED, ids=[f"{n}:{k}" for n, k, _, _ in DECLARED])
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_a_value_outside_its_declaration_is_refused_in_one_line_naming_its_key(name, key, hint, f, data):
    cfg, _, check = CONFIGS_CHECKED[name]
    bad = _outside(hint, f, data.draw)
    with pytest.raises(ConfigError) as info:
        check(_set(cfg, key, bad))
    lines = _lines_naming(str(info.value), key)
    assert len(lines) == 1 and " must be " in lines[0] and lines[0].endswith(f"got {bad!r}"), (bad, str(info.value))


@pytest.mark.parametrize("name, key, hint, f", DECLARED, ids=[f"{n}:{k}" for n, k, _, _ in DECLARED])
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_a_value_inside_its_declaration_is_accepted(name, key, hint, f, data):
    cfg, schema, _ = CONFIGS_CHECKED[name]
    good = data.draw(_inside(hint, f))
    problems = declared_problems(_set(cfg, key, good), schema)
    assert not [p for p in problems if p.startswith(f"  {key} ")], (good, problems)


@pytest.mark.parametrize("name, key, hint", FLOATS, ids=[f"{n}:{k}" for n, k, _ in FLOATS])
@settings(max_examples=3, deadline=None)
@given(bad=st.sampled_from([math.nan, math.inf, -math.inf]), position=st.integers(0, 2))
def test_a_non_finite_value_of_any_float_is_refused_naming_its_key(name, key, hint, bad, position):
    cfg, _, check = CONFIGS_CHECKED[name]
    if typing.get_origin(_unwrap(hint)[0]) is list:  # one element non-finite, the others the default's or 0.5
        current = OmegaConf.select(cfg, key)
        values = list(current) if current else [0.5, 0.5]
        values[position % len(values)] = bad
        bad = values
    with pytest.raises(ConfigError) as info:
        check(_set(cfg, key, bad))
    assert len(_lines_naming(str(info.value), key)) == 1, str(info.value)
    assert f"  {key} must be a finite number (not nan, inf or -inf)" in str(info.value)


def test_the_schema_s_fused_modes_are_the_kernels_own():
    from quest.attention.fused_check import MODES
    from quest.config.schema import FUSED_MODES

    assert FUSED_MODES == MODES


def test_every_default_passes_its_declarations():
    for name, (cfg, schema, check) in CONFIGS_CHECKED.items():
        assert declared_problems(cfg, schema) == [], name
    check_train_config(compose_cfg())


def test_every_bad_value_of_a_command_line_is_reported_at_once_in_schema_order():
    with pytest.raises(ConfigError) as info:
        check_train_config(compose_cfg("recipe.hflip=1.5", "data.mean=[123.7,116.3,103.5]", "trainer.device=gpu",
                                       "model.img_size=100000", "data.num_workers=-1"))
    assert str(info.value).splitlines()[1:] == [
        "  model.img_size must be an integer in 1..4096 (pixels) (or null), got 100000",
        f"  data.num_workers must be an integer in 0..{max(64, 4 * len(__import__('os').sched_getaffinity(0)))} (at "
        "most 4 per CPU this process may use, or 64), got -1",
        "  data.mean must be three values in [0, 1] (R, G, B; pixels are in [0, 1] when normalised: 0.485, not "
        "123.7), got [123.7, 116.3, 103.5]",
        "  recipe.hflip must be in [0, 1], got 1.5",
        "  trainer.device must be auto, cpu, cuda or cuda:N, got 'gpu'",
    ]


# --- relations between keys: valid one by one, refused together --------------------------------------------------

@pytest.mark.parametrize("overrides, line", [
    (["recipe.scale=[0.9,0.5]"], "  recipe.scale must be [min, max] with 0 < min <= max <= 1, got [0.9, 0.5]"),
    (["recipe.ratio=[2.0,0.5]"], "  recipe.ratio must be [min, max] with 0 < min <= max, got [2.0, 0.5]"),
    (["recipe.lr=null", "recipe.base_lr=null"], "  recipe.lr must be set, or recipe.base_lr (scaled by the global "
                                                "batch), got None"),
    (["data=fake", "data.img_size=null"], "  data.img_size must be set with data=fake (a positive integer: the "
                                          "generated images' side), got None"),
    (["data=digits_canvas", "data.canvas.scale_min=30"], "  data.canvas.scale_max must satisfy 8 <= scale_min (30) "
                                                         "<= scale_max <= size (32), got 22"),
])
def test_a_relation_between_train_keys_is_refused_naming_the_key(overrides, line):
    with pytest.raises(ConfigError) as info:
        check_train_config(compose_cfg(*overrides))
    assert line in str(info.value).splitlines(), str(info.value)


def test_the_scale_relation_waits_for_the_values_alone():
    """A list refused by its declaration is not judged again by the relation: one line for the key."""
    with pytest.raises(ConfigError) as info:
        check_train_config(compose_cfg("recipe.scale=[1.5,0.5]"))
    assert _lines_naming(str(info.value), "recipe.scale") == [
        "  recipe.scale must be [min, max] with 0 < min <= max <= 1, got [1.5, 0.5]"]


@pytest.mark.parametrize("key", ["paper_outcome.biased_train", "paper_outcome.biased_test"])
def test_a_toy_range_must_run_from_low_to_high(key):
    cfg = OmegaConf.to_container(TOY, resolve=True)
    section, leaf = key.split(".")
    cfg[section][leaf] = [0.8, 0.5]
    with pytest.raises(ConfigError) as info:
        check_toy_config(cfg)
    assert str(info.value).splitlines()[1:] == [f"  {key} must be [low, high] with 0 <= low <= high <= 1, got [0.8, 0.5]"]


def test_a_toy_variant_s_starting_value_must_be_a_finite_number():
    """A variant's parameter names hold dots (attn.qk_scale): the entry is named in brackets."""
    cfg = OmegaConf.to_container(TOY, resolve=True)
    cfg["variants"]["qknorm_fixed"]["param_init"]["attn.qk_scale"] = float("nan")
    with pytest.raises(ConfigError, match=r"(?m)^  variants\.qknorm_fixed\.param_init\[attn\.qk_scale\] must be a "
                                          r"finite number \(not nan, inf or -inf\), got nan$"):
        check_toy_config(cfg)
