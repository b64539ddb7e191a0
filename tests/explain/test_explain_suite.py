"""eval=explain end to end: the digits_canvas data set and its boxes, a real checkpoint's maps, metrics, files and
figures; ImageNet val with its boxes in both on-disk layouts, scored against metrics computed by hand here."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from quest.data import DigitsCanvasDataset
from quest.evaluation import register_eval_configs, run_evaluation
from quest.train import fit

from ..helpers import TickingClock, compose_cfg, eval_cfg

register_eval_configs()



# --- the data set ---------------------------------------------------------------------------------------------------
def test_canvas_samples_are_deterministic_and_their_boxes_tight():
    a, b = DigitsCanvasDataset("val", seed=3), DigitsCanvasDataset("val", seed=3)
    assert [np.asarray(b[i][0]).tolist() for i in (5, 1)] == [np.asarray(a[i][0]).tolist() for i in (5, 1)]
    assert not np.array_equal(np.asarray(a[0][0]), np.asarray(DigitsCanvasDataset("val", seed=4)[0][0]))
    clean = DigitsCanvasDataset("train", clutter=0, noise=0.0, copies=2)
    cluttered = DigitsCanvasDataset("train", clutter=3, noise=0.0, copies=2)
    for i in range(0, 40, 3):
        ink = np.asarray(clean[i][0])[..., 0] > 0
        rows, cols = np.nonzero(ink)
        x0, y0, x1, y1 = clean.boxes(i)[0]
        assert (x0, y0, x1, y1) == (cols.min(), rows.min(), cols.max(), rows.max())  # the digit's ink, exactly
        # clutter never touches the digit's box (nor its one-pixel margin)
        box = (slice(max(y0 - 1, 0), y1 + 2), slice(max(x0 - 1, 0), x1 + 2))
        np.testing.assert_array_equal(np.asarray(cluttered[i][0])[box], np.asarray(clean[i][0])[box])
    assert clean[0][1] == clean[1][1] and len(clean) == 2 * len(DigitsCanvasDataset("train"))
    with pytest.raises(ValueError, match="scale_min <= scale_max <= size"):
        DigitsCanvasDataset("val", size=16, scale_max=20)


@pytest.fixture(scope="module")
def canvas_run(tmp_path_factory) -> Path:
    # a folder of its own around the run: the report below reads every run under the run's parent
    run_dir = tmp_path_factory.mktemp("canvas") / "run"
    fit(compose_cfg("data=digits_canvas", "model=vit_pico", "model.img_size=32", "data.batch_size=64",
                    "trainer.epochs=1", "trainer.max_steps=6"), run_dir)
    return run_dir


def test_explain_suite_writes_metrics_maps_and_a_figure(canvas_run, tmp_path, caplog):
    from quest.report import build_report, load_runs

    ckpt = canvas_run / "checkpoints" / "last.pt"
    out = canvas_run / "eval" / "explain" / "last-model"
    caplog.set_level(logging.INFO, logger="quest.eval")
    report = run_evaluation(eval_cfg(f"checkpoint={ckpt}", "eval=explain", "eval.explain.max_samples=40",
                                     "eval.explain.figure_images=3"), out)
    e = report["results"]["explain"]
    assert e["images"] == 40 and e["scored"] == 40 - e["misclassified"]
    # the console's done line carries each method's mIoU (a fraction, not a percentage)
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("explain done in ")]
    assert len(done) == 1 and done[0].endswith(": " + ", ".join(f"{m} miou {e[m]['miou']:.3f}"
                                                                for m in ("attention", "rollout", "agcam")))
    for method in ("attention", "rollout", "agcam"):
        assert all(0 <= e[method][k] <= 1 for k in ("pixel_acc", "miou", "dice", "precision", "recall"))
    saved = torch.load(out / "explain_maps.pt", weights_only=True)
    from quest.evaluation.context import evenly_spaced

    assert saved["indices"] == evenly_spaced(360, 40)[:3] and saved["maps"]["agcam"].shape == (3, 32, 32)
    assert saved["agcam_gradient"] == "detached" and e["protocol"]["agcam_gradient"].startswith("detached:")
    assert (out / "explain.png").stat().st_size > 5000
    assert json.loads((out / "eval_results.json").read_text())["results"]["explain"]["protocol"]["threshold"]
    metrics = load_runs([canvas_run.parent])[0].metrics
    assert "explain/agcam/miou" in metrics and "explain/rollout/dice" in metrics  # quest.report's columns
    from quest.report.plot import main

    assert main(["explain", str(canvas_run), str(canvas_run), "--out", str(tmp_path / "cmp.png")]) == 0
    assert build_report(load_runs([canvas_run.parent])).rows


def test_explain_refuses_a_data_set_without_boxes(tmp_path):
    run_dir = tmp_path / "run"
    fit(compose_cfg("data=fake", "data.img_size=16", "data.fake_train_size=32", "data.fake_val_size=16",
                    "data.batch_size=16", "model=vit_pico", "trainer.epochs=1"), run_dir)
    with pytest.raises(ValueError, match="has no bounding boxes; use data=digits_canvas"):
        run_evaluation(eval_cfg(f"checkpoint={run_dir / 'checkpoints' / 'last.pt'}", "eval=explain"), tmp_path / "e")


# --- ImageNet val with boxes, both layouts, against a hand computation -------------------------------------------
IMAGES = {  # image id -> (wnid, (width, height), boxes in original pixels)
    "ILSVRC2012_val_00000001": ("n01440764", (50, 40), [(10, 5, 29, 24)]),
    "ILSVRC2012_val_00000002": ("n01443537", (30, 60), [(0, 0, 14, 29), (20, 40, 29, 59)]),
}


def _voc(wnid: str, size: tuple[int, int], boxes) -> str:
    objects = "".join(f"<object><name>{wnid}</name><bndbox><xmin>{a}</xmin><ymin>{b}</ymin><xmax>{c}</xmax>"
                      f"<ymax>{d}</ymax></bndbox></object>" for a, b, c, d in boxes)
    return f"<annotation><size><width>{size[0]}</width><height>{size[1]}</height></size>{objects}</annotation>"


def _imagenet_fixture(root: Path) -> tuple[Path, Path, Path]:
    val, xml = root / "val", root / "bbox_val"
    xml.mkdir(parents=True)
    lines = ["ImageId,PredictionString"]
    for image_id, (wnid, size, boxes) in IMAGES.items():
        (val / wnid).mkdir(parents=True)
        Image.new("RGB", size, (120, 60, 30)).save(val / wnid / f"{image_id}.JPEG")
        (xml / f"{image_id}.xml").write_text(_voc(wnid, size, boxes))
        lines.append(f"{image_id}," + " ".join(f"{wnid} {a} {b} {c} {d}" for a, b, c, d in boxes))
    csv_path = root / "LOC_val_solution.csv"
    csv_path.write_text("\n".join(lines) + "\n")
    return val, xml, csv_path


def _hand_scores(s: int, square: tuple[int, int, int, int]) -> dict[str, float]:
    """The authors' metrics by hand for a map that is 1 inside ``square`` (x0, y0, x1, y1 of the input, exclusive
    ends), their Resize((s, s)) box mapping int(x / w * s), inclusive box filling, eps 1e-5, mean over images."""
    eps, totals = 1e-5, {"pixel_acc": 0.0, "miou": 0.0, "dice": 0.0}
    for _, size, boxes in IMAGES.values():
        pred = np.zeros((s, s))
        pred[square[1]:square[3] + 1, square[0]:square[2] + 1] = 1  # its region's box: (x0, y0, x1, y1), inclusive
        true = np.zeros((s, s))
        for a, b, c, d in boxes:
            w, h = size
            true[int(b / h * s):int(d / h * s) + 1, int(a / w * s):int(c / w * s) + 1] = 1
        tp, fp = (pred * true).sum(), (pred * (1 - true)).sum()
        fn, tn = ((1 - pred) * true).sum(), ((1 - pred) * (1 - true)).sum()
        totals["pixel_acc"] += (tp + tn + eps) / (s * s + eps)
        totals["miou"] += (tp + eps) / (tp + fp + fn + eps)
        totals["dice"] += (2 * tp + eps) / (2 * tp + fp + fn + eps)
    return {k: v / len(IMAGES) for k, v in totals.items()}


@pytest.mark.parametrize("layout", ["xml", "csv"])
def test_imagenet_boxes_in_both_layouts_score_as_computed_by_hand(tmp_path, monkeypatch, layout):
    import quest.explain.scoring as scoring

    val, xml, csv_path = _imagenet_fixture(tmp_path)
    s, square = 16, (2, 3, 9, 11)

    def known_maps(model, images, methods, target=None, agcam_gradient="detached"):  # known metrics: 1 on the square
        m = torch.zeros(images.shape[0], s, s)
        m[:, square[1]:square[3], square[0]:square[2]] = 1.0
        return {name: m for name in methods}

    monkeypatch.setattr(scoring, "normalised_maps", known_maps)
    boxes = xml if layout == "xml" else csv_path
    report = run_evaluation(eval_cfg("model=vit_pico", "attention=quest", "eval=imagenet_explain",
                                     f"eval.roots.val={val}", f"eval.explain.boxes={boxes}", "eval.explain.classes=label",
                                     "eval.explain.skip_wrong=false", "eval.explain.figure_images=0",
                                     "eval.explain.methods=[agcam]"), tmp_path / "out")
    got = report["results"]["explain"]["agcam"]
    # the region of the map above 0.5 spans x 2..8, y 3..10; its box is one past its last pixel, filled inclusive
    expected = _hand_scores(s, (square[0], square[1], square[2], square[3]))
    assert got["n"] == 2
    for key in ("pixel_acc", "miou", "dice"):
        assert got[key] == pytest.approx(expected[key], rel=1e-9), key


@pytest.mark.numerics
@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_imagenet_squash_is_the_authors_resize(tmp_path, monkeypatch, interpolation):
    """imagenet_explain feeds the model the image squashed to S x S as the AG-CAM authors' localization.py:
    torchvision's Resize((S, S)) with its default interpolation (bilinear, PIL's resampling for a PIL image), then
    ToTensor and Normalize; bicubic as the option. The reference: PIL's resize written out here."""
    import quest.explain.scoring as scoring

    val, xml, _ = _imagenet_fixture(tmp_path)
    rng = np.random.default_rng(0)
    paths = sorted(val.rglob("*.JPEG"))
    for path in paths:  # texture, so that the resampling filter matters; PNG bytes under the JPEG name: lossless
        with Image.open(path) as img:
            size = img.size
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path, format="PNG")
    seen = []

    def capture(model, images, methods, target=None, agcam_gradient="detached"):
        seen.append(images.cpu())
        return {name: torch.zeros(images.shape[0], *images.shape[-2:]) for name in methods}

    monkeypatch.setattr(scoring, "normalised_maps", capture)
    report = run_evaluation(eval_cfg("model=vit_pico", "attention=quest", "eval=imagenet_explain",
                                     f"eval.roots.val={val}", f"eval.explain.boxes={xml}",
                                     f"eval.explain.squash_interpolation={interpolation}", "eval.explain.figure_images=0",
                                     "eval.explain.skip_wrong=false", "eval.explain.batch_size=2"), tmp_path / "out")
    e = report["results"]["explain"]
    mean, std = (torch.tensor(report["target"][k]).view(3, 1, 1) for k in ("mean", "std"))
    resample = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}[interpolation]
    for path, got in zip(paths, torch.cat(seen)):
        with Image.open(path) as img:
            ref = np.asarray(img.convert("RGB").resize((16, 16), resample), dtype=np.float64) / 255
        ref = torch.from_numpy(ref).permute(2, 0, 1).float()
        torch.testing.assert_close(got * std + mean, ref, atol=1e-6, rtol=0)
    authors = interpolation == "bilinear"
    assert ("bilinear (the authors'" in e["protocol"]["geometry"]) == authors
    assert interpolation in e["protocol"]["geometry"]
    assert e["protocol"]["agcam_gradient"].startswith("detached:")  # the authors' AG-CAM, the config's default


def test_an_explain_batch_reports_each_methods_maps_by_time_and_changes_no_number(tmp_path, monkeypatch, caplog):
    """Inside a batch, each method's maps are a step of the batch's progress (quest.evaluation.progress.Inner): a
    line when eval.log_every_s has passed, with the fraction of the batch done in the ETA. The clock ticks one second
    at each reading, so time decides nothing."""
    val, xml, _ = _imagenet_fixture(tmp_path)

    def explain_both(every_s: int) -> tuple[dict, list[str]]:
        caplog.clear()
        torch.manual_seed(0)  # the same randomly initialised model each time
        report = run_evaluation(eval_cfg("model=vit_pico", "attention=quest", "eval=imagenet_explain",
                                         f"eval.roots.val={val}", f"eval.explain.boxes={xml}",
                                         "eval.explain.figure_images=0", "eval.explain.skip_wrong=false",
                                         "eval.explain.batch_size=1", f"eval.log_every_s={every_s}"),
                                tmp_path / f"out{every_s}")
        return report["results"]["explain"], [r.getMessage() for r in caplog.records if r.name == "quest.eval"]

    caplog.set_level(logging.INFO, logger="quest.eval")
    quiet, quiet_lines = explain_both(0)
    monkeypatch.setattr("quest.evaluation.progress.monotonic", TickingClock())
    followed, lines = explain_both(3)
    assert {m: followed[m] for m in ("attention", "rollout", "agcam")} == {
        m: quiet[m] for m in ("attention", "rollout", "agcam")}
    assert not [m for m in quiet_lines if ", method " in m]  # by time only: none with the time rule off
    # one reading when the pass starts, one per method, one at each batch's end: 3 s after each line is the
    # third method of the batch under way, and the batch then ends (its own line, the first and the last)
    assert [m for m in lines if m.startswith("explain: ")] == [
        "explain: batch 1/2, method 3/3, agcam maps, elapsed 3.0 s, ETA 3.0 s",
        "explain: batch 1/2, 1/2 samples, elapsed 4.0 s, ETA 4.0 s",
        "explain: batch 2/2, method 3/3, agcam maps, elapsed 7.0 s, ETA 0.0 s",
        "explain: batch 2/2, 2/2 samples, elapsed 8.0 s, ETA 0.0 s"]


def test_the_figures_maps_are_told_method_by_method(tmp_path, monkeypatch, caplog):
    """The figure's maps (computed after the scored batches, as long as one batch of its images) have a progress of
    their own: the first and the last method at least, more by eval.log_every_s. One tick of the clock per reading."""
    val, xml, _ = _imagenet_fixture(tmp_path)
    caplog.set_level(logging.INFO, logger="quest.eval")
    monkeypatch.setattr("quest.evaluation.progress.monotonic", TickingClock())
    report = run_evaluation(eval_cfg("model=vit_pico", "attention=quest", "eval=imagenet_explain",
                                     f"eval.roots.val={val}", f"eval.explain.boxes={xml}",
                                     "eval.explain.figure_images=2", "eval.explain.skip_wrong=false",
                                     "eval.log_every_s=0"), tmp_path / "out")
    assert Path(report["results"]["explain"]["figure"]).is_file()
    lines = [r.getMessage() for r in caplog.records if r.name == "quest.eval" and r.getMessage().startswith(
        "explain figure: ")]
    assert lines == ["explain figure: method 1/3, elapsed 1.0 s, ETA 2.0 s, attention maps of 2 image(s)",
                     "explain figure: method 3/3, elapsed 3.0 s, ETA 0.0 s, agcam maps of 2 image(s)"]
