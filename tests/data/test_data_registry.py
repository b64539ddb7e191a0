"""Data sets as plugins (quest/data/registry.py): each registered data set has its yaml and its typed settings, an
option of another data set or a misspelt one is refused naming it, a data config stored by the flat DataConfig of
earlier quest still composes, validates, builds the same samples and resumes, and the example of docs/data.md
("Adding a data set") trains as written."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from torchvision.datasets import FakeData

from quest.data import DataConfig, build_dataset, get_dataset, list_datasets
from quest.data.registry import FLAT_KEYS, register_data_configs, unregister_dataset, upgrade_data_config
from quest.data.sets.digits_canvas import DigitsCanvasDataset
from quest.data.sets.fake import FakeImages
from quest.data.shard_index import resolve_shards
from quest.data.shards import WdsDataset
from quest.run.directory import check_resume, config_differences
from quest.train.checks import ConfigError, check_train_config

from ..helpers import CONFIGS, ROOT, compose_cfg, flat_data_config
from ..warm import run_app
from .test_data_shards import TRAIN_LENGTHS, VAL_LENGTHS, write_shards

DOC = ROOT / "docs" / "data.md"
#: the data sets of configs/data/ (wds is registered as the same module as imagenet_wds, without a yaml of its own)
WITH_YAML = [name for name in list_datasets() if (CONFIGS / "data" / f"{name}.yaml").is_file()]


def test_the_flat_keys_are_the_shared_keys_and_every_data_sets_own():
    """FLAT_KEYS (what upgrade_data_config may drop) is exactly the old flat node's keys: the shared ones plus the
    options of the built-in data sets, so nothing a data set reads is ever dropped and nothing else is kept."""
    assert set(flat_data_config()) == FLAT_KEYS
    own = {f.name for name in list_datasets() for f in dataclasses.fields(get_dataset(name).settings)}
    assert {f.name for f in dataclasses.fields(DataConfig)} | own >= FLAT_KEYS


@pytest.mark.parametrize("name", list_datasets())
def test_every_data_set_has_typed_settings_and_a_yaml_naming_them(name):
    entry = get_dataset(name)
    assert issubclass(entry.settings, DataConfig)
    if name not in WITH_YAML:
        assert name == "wds" and entry.build is get_dataset("imagenet_wds").build
        return
    defaults = OmegaConf.load(CONFIGS / "data" / f"{name}.yaml").defaults
    assert list(defaults)[0] == f"{name}_schema"
    cfg = compose_cfg(f"data={name}", "data.root=/nowhere", "data.num_classes=3")
    assert OmegaConf.get_type(cfg.data) is entry.settings
    # every key of the data node is a field of its settings, and every field is there
    assert set(cfg.data) == {f.name for f in dataclasses.fields(entry.settings)}


def test_an_option_of_another_data_set_or_a_misspelt_one_is_refused_naming_it():
    with pytest.raises(ConfigCompositionException, match="fake_train_size"):
        compose_cfg("data=digits", "data.fake_train_size=8")
    with pytest.raises(ConfigError, match=r"data\.fake_train_size: not a key of data.*did you mean"):
        check_train_config(compose_cfg("data=digits", "+data.fake_train_size=8"))
    with pytest.raises(ConfigCompositionException, match="sise"):
        compose_cfg("data=digits_canvas", "data.canvas.sise=8")
    # the data set's own value checks, with the shared ones, all at once
    with pytest.raises(ConfigError) as err:
        check_train_config(compose_cfg("data=digits_canvas", "data.canvas.scale_min=30", "data.val_fraction=1.5",
                                          "data.batch_size=0"))
    text = str(err.value)
    assert "data.canvas.scale_max must satisfy 8 <= scale_min (30) <= scale_max <= size (32)" in text
    assert "data.val_fraction" in text and "data.batch_size must be a positive integer" in text
    with pytest.raises(ConfigError, match=r"data\.fake_train_size must be a positive integer, got 0"):
        check_train_config(compose_cfg("data=fake", "data.fake_train_size=0"))
    with pytest.raises(ConfigError, match=r"data\.shuffle_window must be a positive integer, got 0"):
        check_train_config(compose_cfg("data=imagenet_wds", "data.root=/nowhere", "data.shuffle_window=0"))


@pytest.fixture
def shards(tmp_path) -> Path:
    root = tmp_path / "wds"
    write_shards(root, "train", TRAIN_LENGTHS)
    write_shards(root, "validation", VAL_LENGTHS)
    return root


def _stored(name: str, shards_root: Path) -> dict:
    """Stored data configs of today's three kinds, each with non-default values of its own options."""
    return {
        "digits_canvas": flat_data_config(name="digits_canvas", val_fraction=0.25, split_seed=1,
                               canvas={"size": 40, "scale_min": 10, "scale_max": 20, "clutter": 2, "noise": 0.1,
                                       "copies": 1, "seed": 3}),
        "fake": flat_data_config(name="fake", batch_size=16, mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225],
                      fake_train_size=24, fake_val_size=8),
        "imagenet_wds": flat_data_config(name="imagenet_wds", root=str(shards_root), num_classes=3, img_size=16, batch_size=4,
                              val_split="validation", shuffle_window=4, mean=[0.485, 0.456, 0.406],
                              std=[0.229, 0.224, 0.225]),
    }[name]


def _samples(ds, n: int) -> list[np.ndarray]:
    return [np.asarray(ds[i][0]) for i in range(n)]


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 6), image_size=st.tuples(st.sampled_from([1, 3]), st.integers(1, 9), st.integers(1, 9)),
       num_classes=st.integers(1, 1000), offset=st.sampled_from([0, 1, 10**6, 2**31]))
def test_fake_images_are_torchvisions_and_leave_torchs_random_state_alone(size, image_size, num_classes, offset):
    """data=fake's images and labels are torchvision's FakeData's, bit for bit, for any size, image shape, class
    count and offset, drawn without seeding torch's global generator: torchvision's does for every image, which in a
    process where CUDA has started reseeds CUDA's generators (dropout's and drop path's on the GPU) at every read."""
    built = FakeImages(size, image_size, num_classes, random_offset=offset)
    expected = FakeData(size, image_size, num_classes, random_offset=offset)
    with pytest.MonkeyPatch.context() as patch:
        for seeds in ("torch.manual_seed", "torch.random.manual_seed", "torch.cuda.manual_seed_all"):
            patch.setattr(seeds, lambda *a, **k: pytest.fail("data=fake seeded torch's global generator"))
        state = torch.random.get_rng_state()
        samples, labels = [built[i] for i in range(size)], built.targets
        assert torch.equal(torch.random.get_rng_state(), state)
    for (image, label), (want_image, want_label) in zip(samples, (expected[i] for i in range(size))):
        np.testing.assert_array_equal(np.asarray(image), np.asarray(want_image))
        assert label == want_label
    assert labels == [label for _, label in samples]
    with pytest.raises(IndexError, match="out of range"):
        built[size]


def test_fake_splits_are_torchvisions_at_their_offsets():
    """data=fake's train split is torchvision's FakeData at offset 0, its val split at offset 10**6."""
    data = compose_cfg("data=fake", "data.img_size=8", "data.fake_train_size=12", "data.fake_val_size=5").data
    for split, offset, size in (("train", 0, 12), ("val", 10**6, 5)):
        built, expected = build_dataset(data, split, None), FakeData(size, (3, 8, 8), 10, random_offset=offset)
        assert len(built) == size and built.targets == [expected[i][1] for i in range(size)]
        np.testing.assert_array_equal(np.asarray(built[size - 1][0]), np.asarray(expected[size - 1][0]))


@pytest.mark.parametrize("name", ["digits_canvas", "fake", "imagenet_wds"])
def test_a_stored_flat_data_config_composes_validates_builds_the_same_samples_and_resumes(name, shards):
    stored = _stored(name, shards)
    settings = get_dataset(name).settings
    data = OmegaConf.merge(OmegaConf.structured(settings), upgrade_data_config(stored))  # typed: no unknown key
    assert {k: v for k, v in OmegaConf.to_container(data).items() if k in stored} == \
        {k: v for k, v in stored.items() if k in data}  # what it keeps, unchanged
    cfg = compose_cfg(f"data={name}", "data.root=/x" if name == "imagenet_wds" else "data.batch_size=64")
    cfg.data = data
    check_train_config(cfg)
    if name == "digits_canvas":  # the samples of the dataset class given the stored values directly
        c = stored["canvas"]
        for split, copies in (("train", 1), ("val", 1)):
            expected = DigitsCanvasDataset(split, size=40, scale_min=10, scale_max=20, clutter=2, noise=0.1,
                                           copies=copies, seed=3, val_fraction=0.25, split_seed=1)
            built = build_dataset(data, split, None)
            assert len(built) == len(expected) and built.boxes_frame == (c["size"],) * 2
            for a, b in zip(_samples(built, 5), _samples(expected, 5)):
                np.testing.assert_array_equal(a, b)
    elif name == "fake":
        for split, size, offset in (("train", 24, 0), ("val", 8, 10**6)):
            expected = FakeData(size, (3, 32, 32), 10, random_offset=offset)
            built = build_dataset(data, split, None)
            assert len(built) == size
            for a, b in zip(_samples(built, size), _samples(expected, size)):
                np.testing.assert_array_equal(a, b)
    else:  # the shards in the same order as a WdsDataset given the stored window directly
        built = build_dataset(data, "train", None)
        expected = WdsDataset(resolve_shards(shards, "train"), train=True, num_classes=3, shuffle_window=4)
        for ds in (built, expected):
            ds.distribute(0, 1, 4, seed=0)
        assert built.worker_keys(0, 1) == expected.worker_keys(0, 1) and len(built.worker_keys(0, 1)) == 36
    # a resume compares the stored config with the command line's: the other data sets' keys are no difference
    old = {**OmegaConf.to_container(cfg, resolve=True), "data": stored}
    assert config_differences(old, OmegaConf.to_container(cfg, resolve=True)) == []
    check_resume(old, OmegaConf.to_container(cfg, resolve=True), Path("/run"))


def test_a_stored_option_that_changed_is_still_a_difference():
    cfg = OmegaConf.to_container(compose_cfg("data=digits_canvas"), resolve=True)
    old = {**cfg, "data": flat_data_config(name="digits_canvas", canvas={**flat_data_config()["canvas"], "copies": 3})}
    assert [(d.key, d.stored, d.new) for d in config_differences(old, cfg)] == [("data.canvas.copies", 3, 2)]
    with pytest.raises(ConfigError, match="data.canvas.copies: 3 -> 2"):
        check_resume(old, cfg, Path("/run"))


def doc_block(name: str) -> str:
    """The fenced block after ``<!-- test_data_registry: name -->`` in docs/data.md."""
    match = re.search(rf"<!-- test_data_registry: {re.escape(name)} -->\n```[a-z]*\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/data.md has no block {name}"
    return match.group(1)


@pytest.fixture
def example(tmp_path, monkeypatch):
    """docs/data.md's two files, written as they are there: my_data/stripes.py and my_configs/data/stripes.yaml."""
    (tmp_path / "my_data").mkdir()
    (tmp_path / "my_data" / "stripes.py").write_text(doc_block("my_data/stripes.py"))
    (tmp_path / "my_configs" / "data").mkdir(parents=True)
    (tmp_path / "my_configs" / "data" / "stripes.yaml").write_text(doc_block("my_configs/data/stripes.yaml"))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    unregister_dataset("stripes")
    sys.modules.pop("my_data.stripes", None)
    sys.modules.pop("my_data", None)


def test_the_documented_example_registers_composes_and_builds(example):
    import importlib

    module = importlib.import_module("my_data.stripes")
    register_data_configs()
    assert "stripes" in list_datasets() and get_dataset("stripes").settings is module.StripesData
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=[f"hydra.searchpath=[file://{example / 'my_configs'}]", "data=stripes",
                                          "data.width=2"])
        with pytest.raises(ConfigCompositionException, match="widht"):
            compose("train", overrides=[f"hydra.searchpath=[file://{example / 'my_configs'}]", "data=stripes",
                                        "data.widht=2"])
    check_train_config(cfg)
    train = build_dataset(cfg.data, "train", None)
    assert len(train) == 64 and train.targets[:4] == [0, 1, 0, 1]
    for i in range(4):  # class 0: every row constant (horizontal stripes); class 1: every column constant
        image = np.asarray(train[i][0])[..., 0].astype(int)
        constant_rows = (image == image[:, :1]).all()
        assert constant_rows == (train[i][1] == 0) and set(np.unique(image)) == {0, 255}
    cfg.data.width = 0
    with pytest.raises(ConfigError, match=r"data\.width must be a positive integer, got 0"):
        check_train_config(cfg)


@pytest.mark.slow
def test_the_documented_command_trains_two_steps_and_refuses_a_typo(example):
    command = doc_block("command").strip()
    env_part, _, rest = command.partition(" python ")
    env = dict(item.split("=", 1) for item in env_part.split())
    assert "QUEST_DATA_MODULES" in env and "PYTHONPATH" in env
    args = [a.replace("$PWD", str(example)).strip('"') for a in rest.split()[1:]]  # after /path/to/quest/train.py
    # the command's own environment (the data set's module named in QUEST_DATA_MODULES, found through PYTHONPATH=.),
    # in a process forked from the warm zygote, which never loaded the data sets nor imported my_data: both happen in
    # the command's process, as in a new interpreter
    environ = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **env}
    run = run_app("train.py", *args, cwd=example, env=environ, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    runs = list((example / "runs" / "stripes").glob("*/summary.json"))
    assert len(runs) == 1
    summary = json.loads(runs[0].read_text())
    assert summary["status"] == "stopped" and summary["step"] == 2  # trainer.max_steps=2
    checkpoint = torch.load(runs[0].parent / "checkpoints" / "last.pt", weights_only=True)
    assert checkpoint["config"]["data"]["width"] == 2 and checkpoint["config"]["data"]["name"] == "stripes"
    typo = run_app("train.py", *[a.replace("data.width", "data.widht") for a in args], cwd=example, env=environ,
                   timeout=900)
    assert typo.returncode != 0 and "data has no key 'widht'; did you mean data.width=2?" in typo.stderr


@pytest.mark.parametrize("name", list_datasets())
def test_every_own_key_of_a_data_set_is_described_by_help(name):
    from quest.config.help import app_help, data_set_keys

    settings = get_dataset(name).settings
    docs = list(data_set_keys(settings))
    own = {f.name for f in dataclasses.fields(settings)} - {f.name for f in dataclasses.fields(DataConfig)}
    assert {key.split(".")[1] for key, _, _ in docs} == own
    assert all(doc for _, _, doc in docs), [key for key, _, doc in docs if not doc]
    text = app_help("quest-train", "", {"data": list_datasets()}, DataConfig)
    section = text.split(f"  data={name}\n", 1)[1].split("\n  data=", 1)[0]
    assert all(f" {key.rsplit('.', 1)[1]} " in section for key, _, _ in docs)


def test_the_command_line_check_reads_data_keys_by_the_chosen_or_default_data_set():
    from quest.cli import config_root
    from quest.config.hydra_store import register_configs
    from quest.config.overrides import app_groups, default_options, override_problems
    from quest.config.schema import TrainConfig

    register_configs()
    groups, defaults = app_groups(config_root(), "train"), default_options(config_root(), "train")
    assert defaults["data"] == "digits" and not any(o.endswith("_schema") for o in groups["data"])

    def problems(*args):
        return override_problems(list(args), TrainConfig, groups, defaults)

    assert problems("data=fake", "data.fake_train_size=8") == problems("data=digits_canvas", "data.canvas.copies=1") == []
    assert problems("data.val_fraction=0.3") == []  # digits, the default, has it
    [fake] = problems("data=fake", "data.fake_train_sise=8")
    assert "data has no key 'fake_train_sise'; did you mean data.fake_train_size=8?" in fake
    [other] = problems("data.fake_train_size=8")  # an option of fake, with the default digits
    assert "data has no key 'fake_train_size'" in other and "val_fraction" in other
    [nested] = problems("data=digits_canvas", "data.canvas.sise=3")
    assert "data.canvas has no key 'sise'; did you mean data.canvas.size=3?" in nested


def test_a_run_whose_checkpoint_stores_the_flat_data_config_resumes_exactly(tmp_path):
    """A run stopped by the earlier quest (its last.pt and run.json hold the flat data node: every data set's keys)
    resumes under the registered data sets and ends with the weights of a run never stopped."""
    from quest.run.checkpoint import load_checkpoint
    from quest.train import fit

    from ..helpers import FAST

    fit(compose_cfg(*FAST), tmp_path / "straight")
    first = fit(compose_cfg(*FAST, "trainer.max_steps=3"), tmp_path / "resumed")
    assert first["status"] == "stopped" and first["step"] == 3
    path = tmp_path / "resumed" / "checkpoints" / "last.pt"
    raw = torch.load(path, weights_only=True)
    own = raw["config"]["data"]
    assert "canvas" not in own and own["fake_train_size"] == 64  # what this quest stores: fake's keys only
    raw["config"]["data"] = flat_data_config(**{k: v for k, v in own.items()})  # as the earlier quest stored it
    torch.save(raw, path)
    record = json.loads((tmp_path / "resumed" / "run.json").read_text())
    record["config"]["data"] = raw["config"]["data"]
    (tmp_path / "resumed" / "run.json").write_text(json.dumps(record))
    second = fit(compose_cfg(*FAST), tmp_path / "resumed")
    assert second["resumed"] and second["status"] == "completed" and second["step"] == 8
    a, b = (load_checkpoint(tmp_path / run / "checkpoints" / "last.pt") for run in ("straight", "resumed"))
    for key, value in a["model"].items():
        torch.testing.assert_close(b["model"][key], value, atol=0, rtol=0, msg=key)


def test_eval_without_data_takes_any_data_sets_key_for_the_checkpoints_config_and_refuses_others():
    from quest.evaluation import register_eval_configs
    from quest.evaluation.target import data_overrides, data_was_chosen

    from ..helpers import eval_cfg

    register_eval_configs()
    cfg = eval_cfg("data.val_fraction=0.3", "data.canvas.copies=1", "data.root=/x")
    assert not data_was_chosen(cfg)
    assert data_overrides(cfg) == {"val_fraction": 0.3, "canvas": {**flat_data_config()["canvas"], "copies": 1}, "root": "/x"}
    assert data_overrides(eval_cfg()) == {}  # the keys' defaults are no override
    with pytest.raises(ConfigCompositionException, match="val_fractoin"):
        eval_cfg("data.val_fractoin=0.3")
    chosen = eval_cfg("data=fake", "data.fake_train_size=8")
    assert data_was_chosen(chosen) and OmegaConf.get_type(chosen.data) is get_dataset("fake").settings
    with pytest.raises(ConfigCompositionException, match="val_fraction"):
        eval_cfg("data=fake", "data.val_fraction=0.3")


def test_the_training_only_keys_are_those_evaluation_fingerprints_always_left_out():
    """The keys an evaluation's fingerprint leaves out come from the data sets' TRAINING_ONLY fields now; written out
    here is the list quest's evaluation held before, so that results directories written then keep their
    fingerprints (a rerun of the same evaluation is recognised, not refused as other settings)."""
    from quest.data.registry import training_only_data_keys

    before = {"batch_size", "eval_batch_size", "num_workers", "pin_memory", "download", "subset_fraction",
              "subset_seed", "fake_train_size", "train_split", "shuffle_window", "num_samples"}
    # added since, each a key no config written before holds (so no stored fingerprint changes): data.pipeline, where
    # the training transform runs, and data.draft_decode, how its crops are decoded (the val split an evaluation
    # scores is read the same way whatever they are)
    assert training_only_data_keys() == before | {"pipeline", "draft_decode"}
