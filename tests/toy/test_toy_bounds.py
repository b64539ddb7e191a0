"""The toy study's config is bounded above wherever a value allocates or loops: every integer field of
:class:`~quest.toy.config.ToyConfig` (sizes, widths, epochs, seeds, counts) declares an upper bound on its field, a
value past it (just past, and far past what torch can index) is refused by the config check naming the key and the
bound, the bound itself is accepted, and the data a config makes is bounded as a whole (its fields' product).
A refused study changes nothing: not even its folder is made."""
from __future__ import annotations

import dataclasses
import typing

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from quest.config.checks import ConfigError, dataclass_of
from quest.store.records import bound_ends, unwrap_optional
from quest.toy.checks import check_toy_config
from quest.toy.config import ToyConfig, register_toy_config
from quest.toy.data import MAX_DATA_VALUES, MAX_SAMPLES, ToyDataConfig
from quest.toy.study import run_study

from ..helpers import CONFIGS


def _cfg(*overrides: str) -> dict:
    register_toy_config()
    with initialize_config_dir(config_dir=str(CONFIGS / "toy"), version_base="1.3"):
        return OmegaConf.to_container(compose(config_name="toy", overrides=["grid=quick", *overrides]), resolve=True)


def _integer_fields(schema: type, prefix: str = "") -> list[tuple[str, bool, dict]]:
    """(key, whether a list, metadata) of every integer field under ``schema``."""
    hints, found = typing.get_type_hints(schema), []
    for f in dataclasses.fields(schema):
        hint = unwrap_optional(hints[f.name])
        nested = dataclass_of(hint)
        if nested is not None and typing.get_origin(hint) is not dict:
            found += _integer_fields(nested, f"{prefix}{f.name}.")
        elif hint is int or (typing.get_origin(hint) is list and typing.get_args(hint) == (int,)):
            found.append((f"{prefix}{f.name}", hint is not int, dict(f.metadata)))
    return found


INTEGERS = _integer_fields(ToyConfig)
KEYS = [key for key, _, _ in INTEGERS]


def _high(key: str) -> int:
    return bound_ends(next(m for k, _, m in INTEGERS if k == key)["bounds"])[1]


def _with(cfg: dict, key: str, number: int) -> dict:
    is_list = next(many for k, many, _ in INTEGERS if k == key)
    *parents, leaf = key.split(".")
    node = cfg
    for part in parents:
        node = node[part]
    node[leaf] = [number] if is_list else number
    return cfg


def test_every_integer_of_the_config_is_bounded_above():
    assert {"data.train_size", "data.test_size", "data.seq_len", "data.real_dim", "data.num_classes",
            "model.mlp_hidden", "train.epochs", "train.batch_size", "probe_size", "study.train_sizes",
            "runs_per_call", "workers", "threads", "grid.data_seeds", "grid.init_seeds"} <= set(KEYS)
    unbounded = [key for key, _, metadata in INTEGERS if bound_ends(metadata.get("bounds", (None, None)))[1] is None]
    assert unbounded == []


@pytest.mark.parametrize("past", [1, 10**20], ids=["just past", "past int64"])
@pytest.mark.parametrize("key", KEYS)
def test_a_value_past_its_upper_bound_is_refused_naming_the_key_and_the_bound(key, past):
    high = _high(key)
    with pytest.raises(ConfigError) as info:
        check_toy_config(_with(_cfg(), key, high + past))
    lines = [line for line in str(info.value).splitlines() if line.startswith(f"  {key} must be")]
    assert len(lines) == 1 and str(high) in lines[0], str(info.value)


@pytest.mark.parametrize("key", KEYS)
def test_the_upper_bound_itself_is_accepted(key):
    check_toy_config(_with(_cfg(), key, _high(key)))


@pytest.mark.parametrize("study, key, got", [
    ((), "data.train_size", MAX_SAMPLES),
    (("study=sensitivity", f"study.train_sizes=[64,{MAX_SAMPLES}]"), "study.train_sizes", [64, MAX_SAMPLES])])
def test_data_too_large_as_a_whole_is_refused_naming_the_size(study, key, got):
    """Each field within its bound, their product (1,024 tokens of 2,048 values for a million samples) is not."""
    cfg = _cfg(*study, f"data.train_size={MAX_SAMPLES}", "data.seq_len=1024", "data.real_dim=1024",
               "data.num_classes=1024")
    with pytest.raises(ConfigError) as info:
        check_toy_config(cfg)
    values = (MAX_SAMPLES + 512) * 1024 * 2048
    assert str(info.value).splitlines()[1:] == [
        f"  {key} must keep a data realisation within {MAX_DATA_VALUES:,} numbers, (train_size + test_size) x seq_len x "
        f"(real_dim + num_classes) (here {values:,}), got {got!r}"]
    with pytest.raises(ValueError, match="more than 1,073,741,824"):
        ToyDataConfig(train_size=MAX_SAMPLES, seq_len=1024, real_dim=1024, num_classes=1024)


def test_a_study_past_a_bound_is_refused_before_its_folder_is_made(tmp_path):
    with pytest.raises(ConfigError, match=rf"data\.train_size must be an integer in 1\.\.{MAX_SAMPLES}"):
        run_study(_cfg("data.train_size=99999999999999999999", "workers=1", "compile=false"), tmp_path / "toy")
    assert not (tmp_path / "toy").exists()
