"""Foreign weights in eval.py: the class count from the weights, classes matched by name, every mismatch a message
(no raw size mismatch), a non-ViT model refused saying what quest supports; an exported run evaluated from its
folder gives the run's own numbers."""
from __future__ import annotations

import pytest
import timm
import torch

from quest.evaluation import register_eval_configs, run_evaluation
from quest.evaluation.foreign import ClassOrder, class_order
from quest.tools.export import export_run
from tests.evaluation.test_eval_cli import eval_cfg
from tests.interop_helpers import CLASSES, make_image_folder, train_tiny_run

register_eval_configs()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("foreign")
    data = make_image_folder(base / "data")
    run = train_tiny_run(data, base / "run")
    return data, run, export_run(run, base / "export", "ema")


def _clean(tmp_path, *overrides):
    return run_evaluation(eval_cfg(*overrides, "eval=clean"), tmp_path / "out")


def _top1(result) -> float:
    found = [v for k, v in _flat(result) if k.endswith("top1")]
    assert found, result
    return found[0]


def _flat(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flat(v, f"{prefix}/{k}")
    else:
        yield prefix, obj


def test_an_exported_folder_evaluates_as_its_checkpoint(setup, tmp_path):
    data, run, export = setup
    data_args = ["data=imagefolder", f"data.root={data}", "data.num_classes=3", "data.num_workers=0"]
    from_folder = _clean(tmp_path / "a", "model=vit_pico", "attention=quest", f"weights=local-dir:{export}",
                         *data_args)
    from_checkpoint = _clean(tmp_path / "b", f"checkpoint={run / 'checkpoints' / 'last.pt'}", "eval.use_ema=true",
                             *data_args)
    assert _top1(from_folder) == _top1(from_checkpoint)


def test_the_wrong_attention_for_an_export_is_refused(setup, tmp_path):
    data, _, export = setup
    with pytest.raises(ValueError, match="trained with 'quest' attention, not attention=standard"):
        _clean(tmp_path, "model=vit_pico", "attention=standard", f"weights=local-dir:{export}")


def test_the_class_count_comes_from_the_weights(setup, tmp_path):
    data, _, _ = setup
    weights = tmp_path / "pico10.pth"
    torch.save(timm.create_model("vit_pico_patch4_16", num_classes=3).state_dict(), weights)
    # no data= given: the class count is the weights' (it was 1000, and a raw size mismatch, before)
    cfg = eval_cfg("model=vit_pico", "attention=standard", f"weights={weights}", "eval=clean",
                   "data=imagefolder", f"data.root={data}", "data.num_classes=3", "data.num_workers=0")
    run_evaluation(cfg, tmp_path / "ok")
    with pytest.raises(ValueError, match="classify 3 classes but data=imagefolder has data.num_classes=10"):
        _clean(tmp_path, "model=vit_pico", "attention=standard", f"weights={weights}", "data=imagefolder",
               f"data.root={data}", "data.num_classes=10")
    with pytest.raises(ValueError, match="model.kwargs.num_classes: the class count comes from weights="):
        _clean(tmp_path, "model=vit_pico", "attention=standard", f"weights={weights}", "+model.kwargs.num_classes=3")


def test_weights_of_another_model_get_a_message_not_a_size_mismatch(tmp_path):
    weights = tmp_path / "nano.pth"
    torch.save(timm.create_model("vit_nano_patch4_32", num_classes=3).state_dict(), weights)
    with pytest.raises(ValueError, match=r"weights \(for vit_pico_patch4_16 with standard attention\) do not fit the "
                                         r"model: .*another model"):
        _clean(tmp_path, "model=vit_pico", "attention=standard", f"weights={weights}")


def test_a_model_that_is_not_a_vit_is_refused_saying_what_quest_supports(tmp_path):
    with pytest.raises(ValueError, match=r"'resnet50' is not a Vision Transformer .*vit_\*, deit_\*"):
        _clean(tmp_path, "model.name=resnet50", "attention=quest")  # what eval.py makes of model=resnet50


def test_classes_are_matched_by_name():
    assert class_order(list(CLASSES), list(CLASSES), "w", "d") is None
    order = class_order(["dog", "eel", "cat"], list(CLASSES), "w", "d")
    assert order == [2, 0, 1]
    logits = torch.tensor([[10.0, 20.0, 30.0]])  # the model's outputs for dog, eel, cat
    reordered = ClassOrder(torch.nn.Identity(), order)(logits)
    assert reordered.tolist() == [[30.0, 10.0, 20.0]]  # cat, dog, eel: the data set's order
    with pytest.raises(ValueError, match=r"has classes the model .* was not trained on: \['fox'\]"):
        class_order(list(CLASSES), ["cat", "fox"], "w", "d")
