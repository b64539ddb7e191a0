"""Tar shards (data=imagenet_wds, quest/data/shards.py) on fixture shards written here: every sample once per epoch
over W ranks x K loader workers, the order a function of (seed, epoch), exact mid-epoch resume, validation without
padding, bad input named, the ImageFolder converter, and training through ``fit`` with resume."""
from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import torch
from PIL import Image
from torchvision.transforms import Compose, PILToTensor, RandomResizedCrop

from quest.data import CorruptImageError, collate_skipping_bad
from quest.data.shard_index import ShardError, count_samples, expand_braces, resolve_shards
from quest.data.shards import WdsDataset, build_shards, shard_loaders
from quest.run.checkpoint import load_checkpoint
from quest.tools.make_shards import main
from quest.train import fit
from quest.train.checks import ConfigError, check_train_config

from ..helpers import compose_cfg

TRAIN_LENGTHS = (7, 5, 9, 3, 6, 1, 8)  # 39 samples in unequal shards
VAL_LENGTHS = (4, 3, 5)  # 12


def _png(k: int, size: int = 8) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (k * 5 % 256, k * 11 % 256, 255 - k % 256)).save(buf, "PNG")
    return buf.getvalue()


def _add(tar: tarfile.TarFile, name: str, payload: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    tar.addfile(info, io.BytesIO(payload))


def write_shards(root: Path, split: str, lengths, num_classes: int = 3, info: bool = True,
                 members=lambda key, k: {f"{key}.png": _png(k), f"{key}.cls": str(k % 3).encode()}) -> list[str]:
    """Shards toy-<split>-NNNN.tar of ``lengths`` samples, keys <split>NNNN in write order; listed in _info.json."""
    root.mkdir(parents=True, exist_ok=True)
    names, keys, k = [], [], 0
    for i, n in enumerate(lengths):
        names.append(f"toy-{split}-{i:04d}.tar")
        with tarfile.open(root / names[-1], "w") as tar:
            for _ in range(n):
                keys.append(f"{split}{k:04d}")
                for name, payload in members(keys[-1], k).items():
                    _add(tar, name, payload)
                k += 1
    if info:
        path = root / "_info.json"
        data = json.loads(path.read_text()) if path.is_file() else {"splits": {}, "num_classes": num_classes}
        data["splits"][split] = {"name": split, "num_samples": sum(lengths), "filenames": names,
                                 "shard_lengths": list(lengths)}
        path.write_text(json.dumps(data))
    return keys


@pytest.fixture
def shards(tmp_path) -> tuple[Path, list[str], list[str]]:
    root = tmp_path / "wds"
    return root, write_shards(root, "train", TRAIN_LENGTHS), write_shards(root, "validation", VAL_LENGTHS)


def _train_set(root: Path, window: int = 4, transform=None) -> WdsDataset:
    return WdsDataset(resolve_shards(root, "train"), train=True, num_classes=3, shuffle_window=window,
                      transform=transform)


def _rank_sequence(ds: WdsDataset, num_workers: int) -> list[str]:
    """A rank's sample keys in the order its DataLoader returns them: batch i from worker i % K (round robin)."""
    per_worker = [ds.worker_keys(p, num_workers) for p in range(num_workers)]
    b, out, i = ds.batch_size, [], 0
    while any(per_worker):
        chunk = per_worker[i % num_workers][:b]
        per_worker[i % num_workers] = per_worker[i % num_workers][b:]
        out += chunk
        i += 1
    return out


def test_every_training_sample_once_per_epoch_over_ranks_and_workers(shards):
    root, keys, _ = shards
    ds, n = _train_set(root), len(keys)
    for world in (1, 2, 3, 4):
        for batch in (1, 2, 3):
            steps = n // (world * batch)
            ranks = []
            for rank in range(world):
                ds.distribute(rank, world, batch, seed=0)
                single = _rank_sequence(ds, 1)
                assert len(single) == steps * batch  # every rank the same number of full batches (DDP lockstep)
                for workers in (2, 3, 5):
                    parts = [ds.worker_keys(p, workers) for p in range(workers)]
                    assert sorted(sum(parts, [])) == sorted(single)  # workers split the rank's share
                    assert _rank_sequence(ds, workers) == single  # the order does not depend on the worker count
                ranks.append(single)
            seen = sum(ranks, [])
            assert len(seen) == len(set(seen)) == world * steps * batch  # no sample twice
            assert set(seen) <= set(keys) and n - len(seen) < world * batch  # only the documented remainder lost


def test_the_order_is_a_function_of_seed_and_epoch_and_changes_every_epoch(shards):
    root, keys, _ = shards
    orders = {}
    for seed in (0, 1):
        for epoch in range(6):
            ds = _train_set(root)  # a fresh object every time: nothing carried over
            ds.distribute(0, 2, 4, seed=seed)
            ds.set_epoch(epoch)
            orders[seed, epoch] = ds.worker_keys(0, 1)
            other = _train_set(root)
            other.distribute(0, 2, 4, seed=seed)
            other.set_epoch(epoch)
            assert other.worker_keys(0, 1) == orders[seed, epoch]
    assert len({tuple(o) for o in orders.values()}) == len(orders)  # every (seed, epoch) its own order
    # the dropped remainder moves with the shard order: over a few epochs both ranks see every sample
    seen = set()
    for epoch in range(6):
        for rank in (0, 1):
            ds = _train_set(root)
            ds.distribute(rank, 2, 4)
            ds.set_epoch(epoch)
            seen |= set(ds.worker_keys(0, 1))
    assert seen == set(keys)
    # windows mix samples of different shards (keys are numbered in shard order)
    assert orders[0, 0] != sorted(orders[0, 0])


def test_a_resumed_epoch_skips_exactly_the_consumed_batches(shards):
    root, _, _ = shards
    ds = _train_set(root)
    for rank in (0, 1):
        ds.distribute(rank, 2, 3, seed=5)
        ds.set_epoch(2)
        full = _rank_sequence(ds, 1)
        for consumed in range(ds.num_batches + 1):
            ds.set_epoch(2, start=consumed * 3)
            for workers in (1, 2, 3):
                assert _rank_sequence(ds, workers) == full[consumed * 3:], (rank, consumed, workers)
    with pytest.raises(ValueError, match="batch boundary"):
        ds.set_epoch(0, start=4)


def test_validation_every_sample_once_in_order_without_padding(shards):
    root, _, val_keys = shards
    ds = WdsDataset(resolve_shards(root, "validation"), train=False, num_classes=3)
    for world in (1, 2, 3, 5, 13):
        for batch in (1, 2, 5):
            for workers in (1, 2, 3):
                shares = []
                for rank in range(world):
                    ds.distribute(rank, world, batch)
                    shares.append(_rank_sequence(ds, workers))
                    assert ds.num_batches == -(-len(shares[-1]) // batch)
                assert sum(shares, []) == val_keys  # each once, nothing padded, nothing dropped
                assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_loaders_with_persistent_workers_match_one_process_and_resume(shards):
    root, keys, val_keys = shards
    crop = Compose([RandomResizedCrop(4), PILToTensor()])  # random: augmentation must be reproducible too

    def batches(num_workers: int, epochs, start: int = 0):
        train, val = shard_loaders(_train_set(root, transform=crop), WdsDataset(
            resolve_shards(root, "validation"), train=False, num_classes=3, transform=PILToTensor()),
            rank=0, world_size=1, batch_size=3, eval_batch_size=5, seed=0, num_workers=num_workers,
            persistent_workers=num_workers > 0, collate_fn=collate_skipping_bad)
        assert len(train) == 13 and len(train.sampler.sampler) == 39 and len(val) == 3
        assert len(train.dataset) == 39 and len(val.dataset) == 12  # split sizes for the run's data fingerprint
        out = []
        for epoch in epochs:
            train.sampler.set_epoch(epoch, start=start)
            out.append(list(train))
        out.append(list(val))
        return out

    inline, workers = batches(0, [0, 1]), batches(2, [0, 1])
    for a, b in zip(inline, workers):  # same targets in the same order with 0 and 2 workers
        assert [t.tolist() for _, t, _ in a] == [t.tolist() for _, t, _ in b]
    assert sum(len(t) for _, t, _ in inline[-1]) == 12
    fresh = batches(2, [1])  # workers started at epoch 1: the same crops as workers that lived through epoch 0
    assert all(torch.equal(x[0], y[0]) for x, y in zip(fresh[0], workers[1])) and len(fresh[0]) == 13
    resumed = batches(2, [1], start=3 * 4)
    assert [t.tolist() for _, t, _ in resumed[0]] == [t.tolist() for _, t, _ in workers[1][4:]]


# --- bad input -------------------------------------------------------------------------------------------------
def test_missing_shards_and_splits_are_named(shards, tmp_path):
    root, _, _ = shards
    with pytest.raises(FileNotFoundError, match=r"4 of the 4 shards .*nope-0\.tar"):
        resolve_shards(root, "nope-{0..3}.tar")
    with pytest.raises(FileNotFoundError, match=r"no shard under .* matches 'nope-\*\.tar'"):
        resolve_shards(root, "nope-*.tar")
    with pytest.raises(FileNotFoundError, match=r"split 'val'.*_info\.json has the splits \['train', 'validation'\]"):
        resolve_shards(root, "val")
    (root / "toy-train-0003.tar").unlink()
    with pytest.raises(FileNotFoundError, match=r"1 of the 7 shards .*toy-train-0003\.tar"):
        resolve_shards(root, "train")
    assert expand_braces("a-{0000..0002}-{x,y}.tar") == [
        "a-0000-x.tar", "a-0000-y.tar", "a-0001-x.tar", "a-0001-y.tar", "a-0002-x.tar", "a-0002-y.tar"]


def test_empty_shards_are_named(tmp_path):
    root = tmp_path / "wds"
    write_shards(root, "train", (2, 2))
    (root / "toy-train-0001.tar").write_bytes(b"")
    with pytest.raises(ShardError, match=r"empty shard .*toy-train-0001\.tar \(0 bytes\)"):
        resolve_shards(root, "train")
    with tarfile.open(root / "toy-train-0001.tar", "w"):
        pass  # a valid tar without members
    assert count_samples(root / "toy-train-0001.tar") == 0
    # _info.json says 2, the file holds none: found when it is read, naming it
    ds = WdsDataset(resolve_shards(root, "train"), train=False, num_classes=3)
    with pytest.raises(ShardError, match=r"toy-train-0001\.tar ends after 0 samples, but its stated length is 2"):
        ds.worker_keys(0, 1)
    (root / "_info.json").unlink()  # counted at start instead: refused up front
    with pytest.raises(ShardError, match=r"empty shard .*toy-train-0001\.tar: it holds no samples"):
        resolve_shards(root, "toy-train-{0000..0001}.tar", count=True)


def test_a_sample_without_cls_or_image_is_named(tmp_path):
    def members(key, k):
        files = {f"{key}.png": _png(k), f"{key}.cls": b"1"}
        if k == 3:
            del files[f"{key}.cls"]
        if k == 5:
            files = {f"{key}.cls": b"1", f"{key}.txt": b"x"}
        return files

    root = tmp_path / "wds"
    write_shards(root, "train", (3, 3), members=members)
    ds = WdsDataset(resolve_shards(root, "train"), train=False, num_classes=3)
    with pytest.raises(ShardError, match=r"toy-train-0001\.tar: sample 'train0003' has no \.cls file"):
        list(ds)
    ds.distribute(5, 6, 1)  # rank 5 of 6 reads sample 5 alone
    with pytest.raises(ShardError, match=r"toy-train-0001\.tar: sample 'train0005' has no image .*\['cls', 'txt'\]"):
        ds.worker_keys(0, 1)


def test_bad_class_index_and_unreadable_image(tmp_path):
    root = tmp_path / "wds"
    write_shards(root, "train", (2,), members=lambda key, k: {f"{key}.png": _png(k) if k else b"not a png",
                                                               f"{key}.cls": b"7" if k else b"0"})
    ds = WdsDataset(resolve_shards(root, "train"), train=False, num_classes=3)
    with pytest.raises(CorruptImageError, match=r"cannot read image .*toy-train-0000\.tar:train0000\.png"):
        list(ds)
    ds.bad_images = "skip"
    with pytest.raises(ShardError, match=r"toy-train-0000\.tar: train0001\.cls is class 7, outside 0\.\.2"):
        list(ds)


def test_sample_counts_from_info_or_num_samples_else_a_clear_error(tmp_path):
    root = tmp_path / "wds"
    write_shards(root, "train", (3, 4), info=False)
    write_shards(root, "validation", (2,), info=False)
    cfg = compose_cfg("data=imagenet_wds", f"data.root={root}", "data.num_classes=3")
    with pytest.raises(ShardError, match=r"sample counts of split 'toy-train-\{0000\.\.0001\}\.tar' .* unknown.*"
                                         r"python -m quest\.tools\.make_shards index.*data\.num_samples="):
        build_shards(compose_cfg(*_cfg_args(root), "data.train_split='toy-train-{0000..0001}.tar'").data, "train", None)
    with pytest.raises(FileNotFoundError, match=r"no shards for split 'train': .* has no _info\.json"):
        build_shards(cfg.data, "train", None)
    split = ["data.train_split='toy-train-{0000..0001}.tar'", "data.val_split=toy-validation-0000.tar"]
    counted = build_shards(compose_cfg(*_cfg_args(root), *split, "data.num_samples=7").data, "train", None)
    assert len(counted) == 7 and [s.length for s in counted.shards] == [3, 4]
    with pytest.raises(ShardError, match=r"hold 7 samples, but data\.num_samples=8"):
        build_shards(compose_cfg(*_cfg_args(root), *split, "data.num_samples=8").data, "train", None)
    main(["index", str(root), "train=toy-train-{0000..0001}.tar", "validation=toy-validation-*.tar"])
    info = json.loads((root / "_info.json").read_text())
    assert info["splits"]["train"]["shard_lengths"] == [3, 4] and info["splits"]["validation"]["num_samples"] == 2
    assert len(build_shards(cfg.data, "train", None)) == 7 and len(build_shards(cfg.data, "val", None)) == 2


def _cfg_args(root: Path, *more: str) -> list[str]:
    return ["data=imagenet_wds", f"data.root={root}", "data.num_classes=3", "data.img_size=16", "data.batch_size=4",
            "data.num_workers=0", "model=vit_pico", "recipe=light", "trainer.epochs=2", "trainer.log_every_n_steps=1",
            *more]


def test_config_checks_for_shards(shards):
    root, _, _ = shards
    with pytest.raises(ConfigError, match=r"data\.num_classes must be 3: .*_info\.json"):
        check_train_config(compose_cfg(*_cfg_args(root), "data.num_classes=5"))
    with pytest.raises(ConfigError) as err:
        check_train_config(compose_cfg(*_cfg_args(root), "data.subset_fraction=0.5", "recipe.repeated_aug=3",
                                          "data.shuffle_window=0"))
    for line in ("data.subset_fraction must be 1 with tar shards", "recipe.repeated_aug must be 0 with tar shards",
                 "data.shuffle_window must be a positive integer"):
        assert line in str(err.value)


# --- converter ---------------------------------------------------------------------------------------------------
def test_image_folder_converts_to_shards_that_read_back(tmp_path):
    src = tmp_path / "folder"
    expected = {}
    for split, count in (("train", 5), ("val", 2)):
        for c in ("cat", "dog", "emu"):
            (src / split / c).mkdir(parents=True)
            for i in range(count):
                name = f"{c}.{i}.PNG" if i == 0 else f"{c}{i}.jpeg"
                img = Image.new("RGB", (6, 6), (i * 40, 0, 0))
                img.save(src / split / c / name, "PNG" if name.endswith("PNG") else "JPEG")
                expected[split, f"{c}/{name.rsplit('.', 1)[0].replace('.', '_')}"] = ("cat", "dog", "emu").index(c)
    out = tmp_path / "wds"
    main(["convert", str(src), str(out), "--name", "toy", "--shard-size", "4"])
    info = json.loads((out / "_info.json").read_text())
    assert info["classes"] == ["cat", "dog", "emu"] and info["num_classes"] == 3
    assert info["splits"]["train"]["filenames"] == [f"toy-train-{i:04d}.tar" for i in range(4)]
    assert info["splits"]["train"]["shard_lengths"] == [4, 4, 4, 3]
    assert info["splits"]["validation"]["num_samples"] == 6
    cfg = compose_cfg(*_cfg_args(out))
    check_train_config(cfg)  # the class count from _info.json matches
    for split, name in (("train", "train"), ("val", "validation")):
        ds = build_shards(cfg.data, split, None)
        ds.distribute(0, 1, 1)
        got = {(split, raw.key): int(raw.cls) for raw in ds._raw_samples(0, 1)}
        assert got == {k: v for k, v in expected.items() if k[0] == split}
        assert ds.classes == ["cat", "dog", "emu"]
        assert all(ds._decode(raw)[0].size == (6, 6) for raw in ds._raw_samples(0, 1))


# --- training ----------------------------------------------------------------------------------------------------
def _weights(run_dir: Path) -> dict:
    return load_checkpoint(run_dir / "checkpoints" / "last.pt")


@pytest.mark.parametrize("stop_at", [4, 9])  # mid-epoch (9 steps an epoch: 39 // 4), and at the epoch boundary
def test_training_on_shards_resumes_exactly(shards, tmp_path, stop_at):
    root, _, _ = shards
    args = _cfg_args(root, "data.shuffle_window=8")
    straight = fit(compose_cfg(*args), tmp_path / "straight")
    assert straight["status"] == "completed" and straight["step"] == 18
    first = fit(compose_cfg(*args, f"trainer.max_steps={stop_at}"), tmp_path / "resumed")
    assert first["status"] == "stopped" and first["step"] == stop_at
    assert _weights(tmp_path / "resumed")["state"]["micro_in_epoch"] == stop_at  # batches of epoch 0 consumed
    second = fit(compose_cfg(*args), tmp_path / "resumed")
    assert second["resumed"] and second["status"] == "completed" and second["step"] == 18
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "resumed")
    for part in ("model", "ema"):
        for key, value in a[part].items():
            torch.testing.assert_close(b[part][key], value, atol=0, rtol=0, msg=f"{part}.{key}")
    assert a["data"] == {"train_size": 39, "val_size": 12, "classes": None, "storage": None, "files_sha256": None}


@pytest.mark.slow
@pytest.mark.xdist_group("machine")  # two ranks on a 2-core machine
def test_two_process_training_on_shards_resumes_exactly_and_validates_every_sample_once(shards, tmp_path):
    from quest.data import build_transforms
    from quest.data.shards import WdsLoader
    from quest.train.builders import build_model
    from quest.train.validation import evaluate

    from ..train.test_distributed import _run

    root, _, _ = shards
    args = _cfg_args(root, "data.eval_batch_size=5")  # 39 // (2 x 4) = 4 steps an epoch; validation 6 + 6 images
    _run([*args, f"hydra.run.dir={tmp_path / 'straight'}"], tmp_path, nproc=2)
    _run([*args, "trainer.max_steps=3", f"hydra.run.dir={tmp_path / 'resumed'}"], tmp_path, nproc=2)
    _run([*args, f"hydra.run.dir={tmp_path / 'resumed'}"], tmp_path, nproc=2)
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "resumed")
    assert a["state"]["step"] == b["state"]["step"] == 8
    for part in ("model", "ema"):
        for key, value in a[part].items():
            torch.testing.assert_close(b[part][key], value, atol=0, rtol=0, msg=f"{part}.{key}")
    # one process evaluating the final weights over all 12 validation images gives the 2-process numbers
    cfg = compose_cfg(*args)
    model = build_model(cfg)
    model.load_state_dict(a["model"])
    val = build_shards(cfg.data, "val", build_transforms(cfg.recipe, cfg.data, 16)[1])
    val.distribute(0, 1, 5)
    one = evaluate(model, WdsLoader(val, collate_fn=collate_skipping_bad), torch.device("cpu"), 3)
    two = json.loads((tmp_path / "straight" / "summary.json").read_text())
    assert one["val/top1"] == pytest.approx(two["val/top1"], abs=1e-9)
    assert one["val/loss"] == pytest.approx(two["val/loss"], abs=1e-5)
