"""ImageNet val / v2 / ReaL / A / R on tiny fixtures in the real layouts, with a model whose predictions are known,
so every accuracy is exact and known in advance."""
from __future__ import annotations

import json

import pytest

from quest.evaluation.imagenet_data import subset_classes
from quest.evaluation.suites.classification import imagenet_a, imagenet_r, imagenet_v2, imagenet_val
from quest.evaluation.suites.imagenet_real import imagenet_real

from ..eval_helpers import PixelCodeModel, make_run, oracle_target, settings, wnid, write_image, write_wnid_tree


def test_val_labels_are_positions_in_the_1000_sorted_wnids(tmp_path):
    # three of the 1000 classes; the folder order among them must not become the label
    write_wnid_tree(tmp_path / "val", [(0, 0, "a.JPEG"), (0, 0, "b.JPEG"), (500, 500, "c.JPEG"),
                                       (999, 999, "d.JPEG"), (999, 7, "e.JPEG")])  # e: predicted 7, label 999
    run = make_run(oracle_target(), settings(roots__val=str(tmp_path / "val")))
    result = imagenet_val(run, None)
    assert result["top1"] == pytest.approx(80.0) and result["n"] == 5 and result["classes_present"] == 3
    # e's top-5 is [7, 0, 1, 2, 3]: 999 is not in it either
    assert result["top5"] == pytest.approx(80.0)


def _v2_fixture(root):
    # folders '0', '1', '2', '10', '999': string sorting would order them 0, 1, 10, 2, 999
    files = {"0": [0, 0], "1": [1, 1], "2": [2, 2], "10": [10, 2], "999": [999, 999]}  # one '10' image shows a 2
    for variant in ("matched-frequency", "threshold0.7", "top-images"):
        for folder, encoded in files.items():
            for i, c in enumerate(encoded):
                write_image(root / f"imagenetv2-{variant}-format-val" / folder / f"{i}.jpeg", c)
    return root


def test_v2_labels_are_int_folder_names(tmp_path):
    run = make_run(oracle_target(), settings(roots__v2=str(_v2_fixture(tmp_path))))
    result = imagenet_v2(run, run.settings.imagenet_v2)
    for variant in ("matched-frequency", "threshold0.7", "top-images"):
        # 9 of 10 right; a string-sorted ImageFolder (labels 0..4 by '0','1','10','2','999') would get 3 of 10
        assert result[variant]["top1"] == pytest.approx(90.0), variant
        assert result[variant]["n"] == 10


def test_real_uses_the_label_sets_and_skips_empty_ones(tmp_path):
    root = tmp_path / "val"
    encoded = {1: 5, 2: 6, 3: 7, 4: 8, 5: 500, 6: 9}  # file index -> class shown (= top-1 prediction)
    folders = {1: 5, 2: 6, 3: 7, 4: 8, 5: 500, 6: 9}
    for i, c in encoded.items():
        write_image(root / wnid(folders[i]) / f"ILSVRC2012_val_{i:08d}.JPEG", c)
    real = [[5], [], [7, 300], [], [1], [42]]  # 4 scored; right: 1, 3; file 5's label 1 is in its top-5 [500,0,1,2,3]
    real_json = tmp_path / "real.json"
    real_json.write_text(json.dumps(real))
    run = make_run(oracle_target(), settings(roots__val=str(root), imagenet_real__real_json=str(real_json)))
    result = imagenet_real(run, run.settings.imagenet_real)
    assert result["n"] == 4 and result["excluded_empty"] == 2
    assert result["top1"] == pytest.approx(50.0)  # files 1 and 3 of the 4 scored
    assert result["top5"] == pytest.approx(75.0)  # and file 5


def test_real_flat_layout_and_mismatched_json_is_an_error(tmp_path):
    for i in (1, 2):
        write_image(tmp_path / "flat" / f"ILSVRC2012_val_{i:08d}.JPEG", 3)
    (tmp_path / "real.json").write_text(json.dumps([[3], [4]]))
    run = make_run(oracle_target(), settings(roots__real=str(tmp_path / "flat"),
                                             imagenet_real__real_json=str(tmp_path / "real.json")))
    assert imagenet_real(run, run.settings.imagenet_real)["top1"] == pytest.approx(50.0)
    (tmp_path / "real.json").write_text(json.dumps([[3], [4], [5]]))
    with pytest.raises(ValueError, match="lists 3 images but .* holds 2"):
        imagenet_real(run, run.settings.imagenet_real)


@pytest.mark.parametrize("which, suite", [("a", imagenet_a), ("r", imagenet_r)])
def test_a_and_r_mask_the_logits_to_their_200_classes(tmp_path, which, suite):
    indices, wnids = subset_classes(which)
    outside = next(i for i in range(1000) if i not in indices)
    first, second, last = indices[0], indices[1], indices[199]
    # folder = wnid; shown class = the model's best in-subset class; one image shows the wrong subset class
    write_wnid_tree(tmp_path / which, [(first, first, "1.jpg"), (second, second, "2.jpg"),
                                       (last, last, "3.jpg"), (last, first, "4.jpg")])
    write_wnid_tree(tmp_path / "val", [(first, first, "v1.JPEG"), (last, second, "v2.JPEG"),
                                       (outside, outside, "v3.JPEG")])  # v3: not one of the 200, left out
    # the largest 1000-way logit is always `outside`: unmasked, every prediction would be wrong
    model = PixelCodeModel(distractor=outside)
    run = make_run(oracle_target(model), settings(**{f"roots__{which}": str(tmp_path / which),
                                                     "roots__val": str(tmp_path / "val")}))
    result = suite(run, run.settings[f"imagenet_{which}"])
    assert result["top1"] == pytest.approx(75.0) and result["n"] == 4
    assert result["imagenet200_clean"]["top1"] == pytest.approx(50.0)
    assert result["imagenet200_clean"]["n"] == 2


def test_subset_targets_follow_sorted_wnids():
    for which in ("a", "r"):
        indices, wnids = subset_classes(which)
        assert list(wnids) == sorted(wnids) and list(indices) == sorted(indices)
        assert [wnid(i) for i in indices] == list(wnids)
