"""data.draft_decode (quest/data/pipelines/draft.py; docs/data.md, "Decoding at reduced size"): the crop draws are today's,
an unreduced crop is today's pixels exactly, a reduced one differs from a full decode by a measured tolerance, the
chosen reduction never leaves the crop smaller than the output, a PNG is decoded as today, and the setting is refused
where it cannot apply."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from timm.data.transforms import RandomResizedCropAndInterpolation

from quest.config.checks import ConfigError
from quest.data import CorruptImageError, SafeImageFolder
from quest.data.pipelines.draft import DraftResizedCrop, draft_scale, open_undecoded, reduction
from quest.data.pipelines.train_input import build_train_input
from quest.train.checks import check_train_config

from ..helpers import compose_cfg

OUT = 96  # the output size: a 640 x 480 image then reduces a crop whose short side is >= 192 px to 1/2, >= 384 to 1/4
SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)


def _photo(width: int, height: int, seed: int) -> Image.Image:
    """Photograph-like content: smooth gradients and blobs, hard edges, mild sensor noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([np.sin(xx / rng.uniform(10, 40) + yy / rng.uniform(15, 60) + rng.uniform(0, 6)) * 80 + 128
                     for _ in range(3)], -1)
    for _ in range(4):  # flat blocks with hard edges
        y, x = rng.integers(0, height // 2), rng.integers(0, width // 2)
        base[y:y + height // 3, x:x + width // 4] = rng.uniform(0, 255, 3)
    base += rng.normal(0, 4, size=base.shape)
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("draft")
    paths = {"jpeg": folder / "photo.JPEG", "png": folder / "photo.png"}
    _photo(640, 480, 0).save(paths["jpeg"], quality=90)
    _photo(640, 480, 0).save(paths["png"])
    return {kind: str(path) for kind, path in paths.items()}


def _inputs(pipeline: str):
    """The DeiT recipe's training input at OUT px under ``pipeline``, with data.draft_decode off and on."""
    cfg = compose_cfg("recipe=deit", "model=vit_pico", f"data.pipeline={pipeline}", "recipe.color_jitter=null")
    today = build_train_input(cfg.recipe, cfg.data, OUT)
    cfg.data.draft_decode = True
    return today, build_train_input(cfg.recipe, cfg.data, OUT)


def _seed(seed: int) -> None:
    random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)  # timm's RandAugment draws from numpy too


def _seeds(path: str, per_kind: int = 3) -> list[tuple[int, int]]:
    """(seed, k): the first seeds whose DeiT crop of the image at ``path`` reduces to 1/2^k, ``per_kind`` of each k
    that occurs (crops too small to reduce are a minority of DeiT's draws at this size)."""
    found: dict[int, list[int]] = {}
    for seed in range(400):
        random.seed(seed)
        _, _, h, w = RandomResizedCropAndInterpolation.get_params(Image.open(path), SCALE, RATIO)
        found.setdefault(reduction(h, w, OUT, OUT), []).append(seed)
    assert set(found) == {0, 1, 2}
    return sorted((seed, k) for k, seeds in found.items() for seed in seeds[:per_kind])


def _run(train_input, path: str, seed: int):
    read = train_input.read_file or (lambda p: Image.open(p).convert("RGB"))  # timm's: the image folder's PIL
    _seed(seed)
    return train_input.transform(read(path))


@pytest.mark.parametrize("pipeline", ["timm", "split"])
def test_the_same_seeds_draw_the_same_crop_boxes_and_every_later_draw(files, pipeline, monkeypatch):
    """timm's get_params on the header's size: the same boxes in the same order, and python's, numpy's and torch's
    generators left where today's transform leaves them (so flip, RandAugment and erasing draw alike, and a resumed
    run sees the same draws)."""
    boxes: list[tuple] = []
    draw = RandomResizedCropAndInterpolation.get_params

    def recording(img, scale, ratio):
        boxes.append(draw(img, scale, ratio))
        return boxes[-1]

    monkeypatch.setattr(RandomResizedCropAndInterpolation, "get_params", staticmethod(recording))
    today, draft = _inputs(pipeline)  # split's crop keeps the get_params it was built with
    for seed, k in _seeds(files["jpeg"]):
        states = []
        for train_input in (today, draft):
            _run(train_input, files["jpeg"], seed)
            states.append((random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()))
        assert boxes[-2] == boxes[-1]
        assert states[0][0] == states[1][0] and states[0][1] == states[1][1] and torch.equal(states[0][2], states[1][2])


@pytest.mark.parametrize("pipeline", ["timm", "split"])
def test_an_unreduced_crop_is_today_s_output_exactly_and_a_reduced_one_within_the_measured_tolerance(files, pipeline):
    """k = 0: identical tensors (after the whole DeiT transform for timm, the uint8 crop for split). k > 0: the scaled
    IDCT is another low-pass filter than the antialiased resize of a full decode. On this generated photograph the
    mean difference per reduced crop measured 0.34 to 1.05 levels of 255 (uint8, before normalisation; 358 reduced
    crops of seeds 0-399), on real photographs 0.2 to 2.6 (docs/data.md). Bounded at 1.5 levels: a box moved by 8
    pixels differs here by 8 to 17 levels (100 draws: least, median), a flipped crop by 46 or more."""
    today, draft = _inputs(pipeline)
    crop = RandomResizedCropAndInterpolation(OUT, SCALE, RATIO, interpolation="bicubic")
    draft_crop = DraftResizedCrop.like(crop)
    for seed, k in _seeds(files["jpeg"]):
        got, expected = _run(draft, files["jpeg"], seed), _run(today, files["jpeg"], seed)
        if k == 0:
            assert torch.equal(got, expected)
            continue
        random.seed(seed)
        full = np.asarray(crop(Image.open(files["jpeg"]).convert("RGB")), dtype=np.float64)
        random.seed(seed)
        reduced = np.asarray(draft_crop(open_undecoded(files["jpeg"])), dtype=np.float64)
        assert reduced.shape == full.shape == (OUT, OUT, 3)
        assert 0 < np.abs(reduced - full).mean() < 1.5
        if pipeline == "split":  # its reduced crop is PIL's resize of the same box: the same pixels as timm's
            assert torch.equal(got, torch.from_numpy(reduced.astype(np.uint8)).permute(2, 0, 1)) or torch.equal(
                got, torch.from_numpy(reduced.astype(np.uint8)).permute(2, 0, 1).flip(-1))


@settings(max_examples=80, deadline=None)
@given(width=st.integers(16, 900), height=st.integers(16, 900), out=st.sampled_from([8, 32, 224]),
       seed=st.integers(0, 2**31 - 1))
def test_the_chosen_reduction_never_leaves_the_crop_below_the_output_size(width, height, out, seed):
    """Any image size and any drawn box: the box scaled to the reduced image keeps at least ``out`` pixels along
    both axes, the reduction is the largest that does (up to libjpeg's 1/8), and PIL decodes at exactly that
    factor (a request rounded up would get half of it where the size is not a multiple of 2^k)."""
    header = Image.new("RGB", (width, height))
    random.seed(seed)
    _, _, h, w = RandomResizedCropAndInterpolation.get_params(header, SCALE, RATIO)
    k = reduction(h, w, out, out)
    assert 0 <= k <= 3
    assert k == 0 or (h / 2**k >= out and w / 2**k >= out)
    assert k == 3 or h / 2 ** (k + 1) < out or w / 2 ** (k + 1) < out
    import io

    encoded = io.BytesIO()
    header.save(encoded, "JPEG")
    img = Image.open(encoded)
    assert draft_scale(img, k) == 2**k
    assert img.convert("RGB").size == (-(-width // 2**k), -(-height // 2**k))


@pytest.mark.parametrize("pipeline", ["timm", "split"])
def test_a_png_is_decoded_as_today(files, pipeline):
    """PIL has no draft for PNG: every crop, even one that would reduce a JPEG, is today's exactly."""
    today, draft = _inputs(pipeline)
    for seed, _ in _seeds(files["jpeg"], per_kind=2):
        assert torch.equal(_run(draft, files["png"], seed), _run(today, files["png"], seed))


def test_an_undecodable_file_follows_bad_images(tmp_path):
    """The header reads, the pixels do not (a truncated JPEG): decoded in the transform, the file is named
    (bad_images=error) or its sample skipped (bad_images=skip), as when the loader decodes it."""
    good = tmp_path / "train" / "n0"
    good.mkdir(parents=True)
    _photo(320, 240, 1).save(good / "a.JPEG", quality=90)
    (good / "b.JPEG").write_bytes((good / "a.JPEG").read_bytes()[:2000])
    crop = DraftResizedCrop.like(RandomResizedCropAndInterpolation(OUT, SCALE, RATIO, interpolation="bicubic"))
    ds = SafeImageFolder(tmp_path / "train", transform=crop, loader=open_undecoded)
    assert ds[0][0].size == (OUT, OUT)
    with pytest.raises(CorruptImageError, match="b.JPEG"):
        ds[1]
    ds.bad_images = "skip"
    assert ds[1] is None


@pytest.mark.parametrize("overrides, words", [
    (["data=imagefolder", "data.root=/nowhere", "data.num_classes=3", "data.pipeline=device"],
     "applies only where the loader workers decode (data.pipeline=split or timm)"),
    (["data=digits", "data.pipeline=timm"], "needs a data set that reads image files (imagefolder, imagenet)"),
    (["data=digits", "data.pipeline=split"], "data=digits hands over images already decoded"),
])
def test_the_setting_is_refused_where_it_cannot_apply(overrides, words):
    with pytest.raises(ConfigError) as err:
        check_train_config(compose_cfg(*overrides, "data.draft_decode=true"))
    assert "data.draft_decode" in str(err.value) and words in str(err.value), str(err.value)


@pytest.mark.parametrize("pipeline", ["timm", "split"])
def test_the_setting_passes_the_checks_with_image_files_where_the_workers_decode(pipeline):
    """What is left is the data itself (/nowhere does not exist)."""
    cfg = compose_cfg("data=imagefolder", "data.root=/nowhere", "data.num_classes=3", f"data.pipeline={pipeline}",
                      "data.draft_decode=true", "recipe.color_jitter=null")
    with pytest.raises(FileNotFoundError, match="/nowhere"):
        check_train_config(cfg)


def test_a_run_with_the_setting_trains_and_records_it(tmp_path: Path):
    from quest.train import fit

    from .test_train_input import FOLDER, _folder

    data = _folder(tmp_path / "data")
    summary = fit(compose_cfg(*FOLDER, f"data.root={data}", "data.draft_decode=true", "trainer.epochs=1"),
                  tmp_path / "run")
    assert summary["status"] == "completed" and "data.draft_decode" in summary["train_input"]


def test_the_setting_names_the_run_is_kept_on_resume_and_is_left_out_of_evaluation_fingerprints(tmp_path):
    """Its pixels differ, so it is part of the run: in the directory's name, a resume may not change it; a config
    stored before the key existed reads as off. The val split is decoded as before: not in an evaluation's
    fingerprint."""
    from omegaconf import OmegaConf

    from quest.data.config import DataConfig, training_only_keys
    from quest.run.directory import check_resume

    from ..run.test_runs import _run_dir_name

    assert _run_dir_name("data.draft_decode=true") == "runs/digits/vit_pico-quest-light-seed0-data.draft_decode_true"
    assert "draft_decode" in training_only_keys(DataConfig)
    off, on = (OmegaConf.to_container(compose_cfg(f"data.draft_decode={v}"), resolve=True) for v in ("false", "true"))
    with pytest.raises(ConfigError, match="data.draft_decode"):
        check_resume(off, on, tmp_path)
    before = {**off, "data": {k: v for k, v in off["data"].items() if k != "draft_decode"}}
    assert check_resume(before, off, tmp_path) == []
