"""data.pipeline: the uint8 training inputs (split, device) against timm's transform (docs/data.md, "Training input
pipelines"): the same decoded pixels, the same crop and flip draws, the same normalisation and erasing, the config
checks, and runs that train, record their pipeline and resume exactly. RandAugment on the device has its own tests
(tests/data/test_device_augment.py)."""
from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from PIL import Image
from timm.data import create_transform
from torchvision.io import read_file
from torchvision.transforms.v2 import functional as F

from quest.config.checks import ConfigError
from quest.data.pipelines.tensor_input import CropFlip, DeviceFinish, collate_bytes, decode_rgb
from quest.run.checkpoint import load_checkpoint
from quest.runtime import plugins
from quest.runtime.errors import is_user_error
from quest.train import fit
from quest.train.checks import check_train_config

from ..helpers import FAST, compose_cfg


def _photo(width: int, height: int, seed: int) -> Image.Image:
    """Smooth gradients, edges and fine noise: what JPEG and resampling kernels see in photographs."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([np.sin(xx / rng.uniform(8, 40) + rng.uniform(0, 6)) * 90 + 128 for _ in range(3)], -1)
    base[: height // 2, : width // 3] = rng.uniform(0, 255, 3)  # a flat block with hard edges
    base += rng.normal(0, 20, size=base.shape)
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))


def _encoded(img: Image.Image, fmt: str, **kwargs) -> torch.Tensor:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


@pytest.mark.parametrize("mode, fmt", [
    ("RGB", "JPEG"), ("L", "JPEG"), ("CMYK", "JPEG"), ("RGBA", "PNG"), ("P", "PNG"), ("RGB", "BMP"), ("RGB", "TIFF")])
def test_torchvision_decoding_gives_pil_s_pixels(mode, fmt):
    """The split pipeline decodes with torchvision (libjpeg-turbo), PIL for the formats it lacks (BMP, TIFF); the
    timm pipeline with PIL. Identical pixels for every kind here, CMYK JPEGs (as PIL writes them: Adobe-inverted)
    included."""
    img = _photo(64, 48, 0).convert(mode)
    encoded = _encoded(img, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    ours = decode_rgb(encoded)
    reference = F.pil_to_tensor(Image.open(io.BytesIO(encoded.numpy().tobytes())).convert("RGB"))
    assert ours.dtype == torch.uint8 and ours.shape == reference.shape
    assert torch.equal(ours, reference)


def test_an_undecodable_file_is_named_as_corrupt():
    from quest.data import CorruptImageError

    with pytest.raises(CorruptImageError, match="cannot decode an image of 17 bytes"):
        decode_rgb(torch.frombuffer(bytearray(b"not a jpeg at all"), dtype=torch.uint8))


def _timm_crop_flip(size: int, scale, ratio, hflip: float):
    """timm's own first two training steps (RandomResizedCropAndInterpolation, RandomHorizontalFlip)."""
    tf = create_transform(size, is_training=True, scale=scale, ratio=ratio, hflip=hflip, color_jitter=None,
                          interpolation="bicubic")
    return type(tf)(tf.transforms[: 2 if hflip > 0 else 1])


@pytest.mark.parametrize("batched", [False, True], ids=["per_image", "batched"])
@pytest.mark.parametrize("size, source, scale, ratio, hflip", [
    (224, (500, 375), (0.08, 1.0), (3 / 4, 4 / 3), 0.5),  # DeiT on ImageNet-sized photographs: downscaling
    (16, (8, 8), (0.7, 1.0), (0.85, 1.18), 0.0),  # the light recipe on the 8 x 8 digits: upscaling
])
def test_crop_and_flip_draw_timm_s_parameters_and_give_its_pixels(size, source, scale, ratio, hflip, batched):
    """Under the same seeds, CropFlip makes timm's draws (the crop from python's random through timm's get_params,
    the flip from torch's RNG) and the same pixels up to the resampling: PIL's antialiased bicubic against
    torchvision's on uint8 tensors. PIL rounds (and clips) to uint8 between its horizontal and vertical passes,
    torch does not, so the two part most where a hard edge makes the kernel overshoot. Measured on 40 crops of
    500 x 375 photographs with a hard-edged block: mean 0.024 levels, at least 99.90% of each crop's pixels within 1
    level, at most 9 at an edge; on the 8 x 8 digits at most 1 level. The batched crop of data.pipeline=device
    (CropFlip.batch, rounding between its passes as PIL does): mean 0.020, at most 9; on the digits at most 1."""
    timm_tf, ours = _timm_crop_flip(size, scale, ratio, hflip), CropFlip(size, scale, ratio, "bicubic", hflip)
    means, within_one, worst = [], [], 0
    for seed in range(40):
        img = _photo(*source, seed % 4)
        random.seed(seed), torch.manual_seed(seed)
        expected = F.pil_to_tensor(timm_tf(img))
        random.seed(seed), torch.manual_seed(seed)
        got = ours.batch([F.pil_to_tensor(img)])[0] if batched else ours(F.pil_to_tensor(img))
        diff = (got.int() - expected.int()).abs()
        means.append(diff.float().mean().item())
        within_one.append((diff <= 1).float().mean().item())
        worst = max(worst, diff.max().item())
    assert np.mean(means) < 0.05 and min(within_one) > 0.998 and worst <= (16 if size == 224 else 1), (
        np.mean(means), min(within_one), worst)
    # the comparison sees a different draw: the next seed's crop is far from this one's
    random.seed(1), torch.manual_seed(1)
    other = ours(F.pil_to_tensor(_photo(*source, 0)))
    random.seed(0), torch.manual_seed(0)
    assert (other.int() - F.pil_to_tensor(timm_tf(_photo(*source, 0))).int()).abs().float().mean() > 2


def _recipe(**kwargs):
    base = dict(auto_augment=None, reprob=0.25, remode="pixel", recount=1, train_interpolation="bicubic",
                scale=[0.08, 1.0], ratio=[0.75, 1.3333333333], hflip=0.5, color_jitter=None)
    return OmegaConf.create({**base, **kwargs})


DATA = OmegaConf.create({"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]})


def _erased(after: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Where erasing wrote: a normal draw equal to the pixel it replaced has probability 0."""
    return after != before


@pytest.mark.parametrize("remode", ["pixel", "const", "rand"])
def test_the_device_s_normalisation_and_erasing_equal_timm_s_per_image_steps(remode):
    """Normalise + erasing on the uint8 batch against timm's ToTensor, Normalize and RandomErasing applied image by
    image (what timm's create_transform does in a worker), under the same seeds: the same boxes (timm's draws from
    python's random, in timm's order), bit for bit the same pixels outside them and, for const, inside. The fill of
    pixel and rand is drawn for the whole batch in one call, so its values are other N(0, 1) draws than timm's
    per-box calls: inside the boxes, per-pixel noise (pixel) or one colour per box and channel (rand)."""
    images = [_photo(32, 32, s) for s in range(12)]
    timm_tf = create_transform(32, is_training=True, re_prob=0.5, re_mode=remode, interpolation="bicubic",
                               color_jitter=None, hflip=0.0, mean=DATA.mean, std=DATA.std)
    after_crop = type(timm_tf)(timm_tf.transforms[1:])  # ToTensor, Normalize, RandomErasing
    clean = torch.stack([type(timm_tf)(timm_tf.transforms[1:3])(img) for img in images])
    random.seed(3), torch.manual_seed(3)
    expected = torch.stack([after_crop(img) for img in images])
    finish = DeviceFinish(_recipe(reprob=0.5, remode=remode), DATA, 32)
    random.seed(3), torch.manual_seed(3)
    got = finish(torch.stack([F.pil_to_tensor(img) for img in images]), torch.device("cpu"))
    mask = _erased(got, clean)
    assert torch.equal(mask, _erased(expected, clean)) and mask.any()
    assert torch.equal(got[~mask], clean[~mask])
    if remode == "const":
        assert torch.equal(got, expected)
    elif remode == "pixel":  # some thousands of erased values: N(0, 1) within a few standard errors
        values = got[mask]
        assert values.numel() > 2000 and abs(values.mean()) < 0.1 and abs(values.std() - 1) < 0.1
    else:
        for i, c in mask.any(dim=(2, 3)).nonzero().tolist():  # one value per erased box and channel
            assert got[i, c][mask[i, c]].unique().numel() == 1
    erased = (got != finish(torch.stack([F.pil_to_tensor(img) for img in images]), torch.device("cpu")))
    assert erased.any()  # another draw erases elsewhere: the comparison above could fail


@pytest.mark.parametrize("remode, count", [("const", 3), ("pixel", 3)])
def test_batched_erasing_draws_timm_s_boxes_with_several_per_image(remode, count):
    """recount > 1: timm draws a number of boxes per image, each of a share of the area, and a later box overwrites
    an earlier one where they overlap; the batched erasing finds the same boxes (const: the same pixels)."""
    from timm.data.random_erasing import RandomErasing

    from quest.data.pipelines.batch_input import BatchErasing

    batch = torch.randn(16, 3, 24, 24)
    random.seed(7), torch.manual_seed(7)
    expected = RandomErasing(0.9, mode=remode, max_count=count, device="cpu")(batch.clone())
    random.seed(7), torch.manual_seed(7)
    got = BatchErasing(0.9, remode, count)(batch.clone())
    assert torch.equal(_erased(got, batch), _erased(expected, batch))
    assert remode != "const" or torch.equal(got, expected)


def test_device_pipeline_decodes_crops_and_finishes_like_split():
    """data.pipeline=device does on the device, per batch, what split does image by image in the worker: the same
    draws under the same seeds, and so the same batch up to the crop's resampling (the batched resampler against
    torchvision's on one image: at most 2 levels apart, 99% of the pixels equal); exactly split's batch when
    split's crops are resampled by the batched resampler too."""
    images = [_photo(80 + 3 * s, 60 - 2 * s, s) for s in range(6)]
    encoded = [_encoded(img, "JPEG", quality=90) for img in images]
    recipe = _recipe(reprob=0.25)
    crop = CropFlip(32, recipe.scale, recipe.ratio, "bicubic", 0.5)
    random.seed(5), torch.manual_seed(5)
    split = DeviceFinish(recipe, DATA, 32)(torch.stack([crop(decode_rgb(e)) for e in encoded]), torch.device("cpu"))
    random.seed(5), torch.manual_seed(5)
    batched_split = DeviceFinish(recipe, DATA, 32)(crop.batch([decode_rgb(e) for e in encoded]), torch.device("cpu"))
    random.seed(5), torch.manual_seed(5)
    batch, targets, skipped = collate_bytes([(e, i) for i, e in enumerate(encoded)] + [None])
    device = DeviceFinish(recipe, DATA, 32, crop=crop)(batch, torch.device("cpu"))
    assert torch.equal(device, batched_split) and targets.tolist() == list(range(6)) and skipped == 1
    levels = ((device - split) * torch.tensor(DATA.std).view(1, 3, 1, 1) * 255).abs().round()
    assert levels.max() <= 2 and (levels == 0).float().mean() > 0.99, (levels.max(), (levels == 0).float().mean())


@pytest.mark.parametrize("overrides, key, words", [
    (["data.pipeline=device"], "data.pipeline", "needs a data set that reads image files (imagefolder, imagenet)"),
    (["data.pipeline=gpu"], "data.pipeline", "must be one of device, split, timm"),
    (["data.pipeline=split", "recipe.auto_augment=3a"], "recipe.auto_augment", "must be a RandAugment policy"),
    (["data.pipeline=split", "recipe.color_jitter=0.4"], "recipe.color_jitter", "must be null"),
    (["data.pipeline=split", "recipe.train_interpolation=random"], "recipe.train_interpolation", "must be one of"),
    (["data.pipeline=split", "recipe.auto_augment=rand-m9-t3a"], "recipe.auto_augment", "GaussianBlur"),
    (["data.pipeline=device", "data=imagefolder", "data.root=/nowhere", "data.num_classes=3",
      "recipe.auto_augment=rand-m9-mstd0.5-inc1", "recipe.train_interpolation=nearest"],
     "recipe.train_interpolation", "must be bicubic or bilinear"),
])
def test_a_pipeline_that_cannot_follow_the_config_is_refused_naming_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        check_train_config(compose_cfg(*overrides))
    assert key in str(err.value) and words in str(err.value), str(err.value)


def test_the_paper_s_recipes_keep_timm_s_pipeline_and_rand_augment_passes_the_checks():
    cfg = compose_cfg("recipe=deit", "model=vit_pico")
    assert cfg.data.pipeline == "timm"
    check_train_config(compose_cfg("recipe=deit", "model=vit_pico", "data.pipeline=split"))  # colour jitter off: RA


def _folder(root: Path) -> Path:
    """3 classes x 10 photographs (JPEG; one PNG per class, which the device's decoder reads too)."""
    for split in ("train", "val"):
        for c in range(3):
            d = root / split / f"n0000000{c}"
            d.mkdir(parents=True)
            for i in range(10):
                img = _photo(40 + 4 * i, 30 + 2 * c, 10 * c + i)
                img.save(d / (f"img{i}.png" if i == 0 else f"img{i}.JPEG"), **({} if i == 0 else {"quality": 90}))
    return root


FOLDER = ["data=imagefolder", "data.num_classes=3", "data.img_size=16", "data.batch_size=6", "data.num_workers=0",
          "model=vit_pico",
          "recipe=light", "recipe.hflip=0.5", "recipe.reprob=0.25", "trainer.epochs=2", "trainer.log_every_n_steps=1"]


@pytest.mark.parametrize("pipeline", ["split", "device", "timm"])
def test_each_pipeline_trains_on_an_image_folder_records_itself_and_resumes_exactly(tmp_path, pipeline):
    data = _folder(tmp_path / "data")
    args = [*FOLDER, f"data.root={data}", f"data.pipeline={pipeline}"]
    summary = fit(compose_cfg(*args), tmp_path / "straight")
    assert summary["status"] == "completed" and summary["train_input"].startswith(f"{pipeline}: ")
    assert pipeline == "timm" or "RandomErasing p=0.25" in summary["train_input"]
    fit(compose_cfg(*args, "trainer.max_steps=7"), tmp_path / "resumed")  # stops mid-epoch 2 (5 steps an epoch)
    fit(compose_cfg(*args), tmp_path / "resumed")
    a, b = (load_checkpoint(tmp_path / d / "checkpoints" / "last.pt") for d in ("straight", "resumed"))
    for key, value in a["model"].items():
        torch.testing.assert_close(b["model"][key], value, atol=0, rtol=0, msg=key)


def test_split_trains_on_in_memory_data_and_skips_unreadable_files_as_timm_does(tmp_path):
    summary = fit(compose_cfg(*FAST, "data.pipeline=split", "recipe.reprob=0.25"), tmp_path / "fake")
    assert summary["status"] == "completed" and summary["train_input"].startswith("split: ")
    data = _folder(tmp_path / "data")
    (data / "train" / "n00000001" / "broken.JPEG").write_bytes(b"not a jpeg at all")
    summary = fit(compose_cfg(*FOLDER, f"data.root={data}", "data.pipeline=split", "data.preflight=false",
                              "data.bad_images=skip", "data.max_skipped_fraction=0.1"), tmp_path / "skip")
    assert summary["status"] == "completed" and 1 <= summary["skipped_images"]["train"] <= 2


def test_the_pipeline_names_the_run_directory_and_is_left_out_of_evaluation_fingerprints():
    from quest.data.config import DataConfig, training_only_keys

    assert "pipeline" in training_only_keys(DataConfig)  # the val split an evaluation scores is the same
    from ..run.test_runs import _run_dir_name

    assert _run_dir_name("data.pipeline=split") == "runs/digits/vit_pico-quest-light-seed0-pipeline_split"
    assert _run_dir_name() == "runs/digits/vit_pico-quest-light-seed0"


def test_reading_a_file_is_the_pipeline_s_choice(tmp_path):
    """An image folder reads files the way the training input asks (TrainInput.read_file, passed explicitly to the
    data set): torchvision's decoder (split), the bytes (device), PIL otherwise (timm, and every val split)."""
    from quest.data import build_dataset
    from quest.data.pipelines.train_input import build_train_input

    data = _folder(tmp_path / "data")
    cfg = compose_cfg(*FOLDER, f"data.root={data}", "data.preflight=false")
    path = str(data / "train" / "n00000000" / "img1.JPEG")
    for name in ("split", "device"):
        cfg.data.pipeline = name
        train_input = build_train_input(cfg.recipe, cfg.data, 16)
        expected = F.pil_to_tensor(Image.open(path).convert("RGB")) if name == "split" else read_file(path)
        assert torch.equal(train_input.read_file(path), expected)
        ds = build_dataset(cfg.data, "train", None, train_input.read_file)  # the folder reads with it
        assert torch.equal(ds.loader(path), expected)
    cfg.data.pipeline = "timm"
    assert build_train_input(cfg.recipe, cfg.data, 16).read_file is None
    assert build_dataset(cfg.data, "train", None).loader.__name__ == "default_loader"  # torchvision's PIL reader


def test_the_commands_of_the_docs_pass_every_config_check():
    """docs/data.md's data.pipeline commands compose and pass every value check; what is left is the data itself
    (here: /datasets/imagenet does not exist)."""
    from ..helpers import ROOT

    text = (ROOT / "docs" / "data.md").read_text()
    section = text[text.index("## Training input pipelines"):text.index("### RandAugment on the device")]
    commands = [line.split()[2:] for line in section.splitlines() if line.strip().startswith("python train.py")]
    assert len(commands) == 4  # split, device, data.draft_decode, a capped copy
    for overrides in commands:
        cfg = compose_cfg(*overrides)
        with pytest.raises(FileNotFoundError, match="/datasets/imagenet"):
            check_train_config(cfg)


@settings(max_examples=60, deadline=None)
@given(width=st.integers(1, 300), height=st.integers(1, 300), size=st.sampled_from([8, 16, 24]),
       seed=st.integers(0, 2**31 - 1), lo=st.floats(0.01, 1.0), spread=st.floats(1.0, 3.0))
def test_crop_and_flip_follow_timm_on_any_image_size(width, height, size, seed, lo, spread):
    """Any image shape (1-pixel strips, images smaller than the output, extreme aspect ratios that send timm's draw to
    its central-crop fallback) and any scale / ratio range: the same draws as timm's, hence the same flip and the
    same crop box, within the resampling difference measured above."""
    scale, ratio = (lo, 1.0), (1 / spread, spread)
    timm_tf, ours = _timm_crop_flip(size, scale, ratio, 0.5), CropFlip(size, scale, ratio, "bicubic", 0.5)
    img = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))
    random.seed(seed)
    assume(min(ours.get_params(img, scale, ratio)[2:]) >= 1)  # a few-pixel image can draw an empty box (timm too)
    random.seed(seed), torch.manual_seed(seed)
    expected = F.pil_to_tensor(timm_tf(img))
    state = random.getstate()
    random.seed(seed), torch.manual_seed(seed)
    got = ours(F.pil_to_tensor(img))
    assert random.getstate() == state  # the same number of draws from python's RNG
    assert got.shape == expected.shape == (3, size, size) and got.dtype == torch.uint8
    # uniform noise is the resampler's worst case (every pixel an edge; worst mean of 1,500 random cases: 0.48
    # levels): a mean within 1.5 levels still tells a
    # different crop or flip apart (those differ by tens of levels on noise)
    assert (got.int() - expected.int()).abs().float().mean() < 1.5


def test_a_pipeline_of_one_s_own_is_one_module_named_in_quest_pipeline_modules(tmp_path, monkeypatch):
    """As a data set or an evaluation of one's own: the module registers itself when the registry loads, and a run
    names it with data.pipeline=<name>."""
    import quest.data.pipelines.kinds as kinds
    import quest.data.pipelines.train_input as registry

    (tmp_path / "my_pipeline.py").write_text(
        "from quest.data.pipelines.train_input import register_train_input, get_train_input\n"
        "@register_train_input('mine', 'the timm pipeline under another name')\n"
        "def build(recipe, data, img_size):\n"
        "    return get_train_input('timm').build(recipe, data, img_size)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(registry.MODULES_ENV, "my_pipeline")
    monkeypatch.setattr(plugins, "LOADED", set())
    monkeypatch.setattr(kinds, "_REGISTRY", dict(kinds.registered()))  # the test's registration goes with it
    assert "mine" in registry.list_train_inputs()
    summary = fit(compose_cfg(*FAST, "trainer.max_steps=1", "data.pipeline=mine"), tmp_path / "run")
    assert summary["status"] == "stopped" and summary["train_input"].startswith("timm: PIL decode")
    monkeypatch.setenv(registry.MODULES_ENV, "no_such_pipeline_module")
    monkeypatch.setattr(plugins, "LOADED", set())
    with pytest.raises(ImportError, match="QUEST_PIPELINE_MODULES names .* 'no_such_pipeline_module'") as refused:
        registry.list_train_inputs()
    assert is_user_error(refused.value)  # a typo of the user's: one line, not a bug's traceback
