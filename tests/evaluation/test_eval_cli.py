"""eval.py end to end on a checkpoint from a short real training run; config and input errors are clear."""
from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException

from quest.evaluation import register_eval_configs, rewrite_model_override, run_evaluation
from quest.run.checkpoint import load_checkpoint
from quest.train import fit

from ..helpers import CONFIGS, ROOT, compose_cfg, eval_cfg
from ..warm import run_app

register_eval_configs()

# the digits suite with sample counts for a test (the protocol settings stay)
SMALL = ["eval.clean.max_samples=40", "eval.corruptions.max_samples=6", "eval.corruptions.corruptions=[fog,glass_blur]",
         "eval.corruptions.extra_corruptions=[spatter]", "eval.corruptions.severities=[1,5]",
         "eval.adversarial.max_samples=8", "eval.adversarial.spsa.max_samples=2", "eval.adversarial.spsa.nb_iter=2",
         "eval.adversarial.spsa.nb_sample=4", "eval.adversarial.autoattack.max_samples=2",
         "eval.adversarial.autoattack.eps=[0.3]"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A real (short) training run on the digits: 1 epoch capped at 4 steps."""
    run_dir = tmp_path_factory.mktemp("run")
    fit(compose_cfg("data=digits", "model=vit_pico", "recipe=light", "data.batch_size=32", "trainer.epochs=1",
                    "trainer.max_steps=4", "trainer.log_every_n_steps=1"), run_dir)
    return run_dir


@pytest.mark.slow
def test_eval_py_writes_json_csv_md_beside_the_run(trained_run):
    ckpt = trained_run / "checkpoints" / "last.pt"
    # eval.py's argv forked from the warm zygote (tests/warm.py): the command line and what it writes are the point
    proc = run_app("eval.py", f"checkpoint={ckpt}", "eval=digits_robustness", "logger=wandb", *SMALL, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = trained_run / "eval" / "digits_robustness" / "last-model"
    report = json.loads((out / "eval_results.json").read_text())
    assert report["evaluations"] == ["clean", "corruptions", "adversarial"]
    assert report["target"]["checkpoint"] == str(ckpt) and report["target"]["weights"] == "model"
    assert report["target"]["checkpoint_file"] == "last.pt" and report["target"]["evaluated"] == "last-model"
    assert report["target"]["model"] == "vit_pico_patch4_16" and report["target"]["data"] == "digits"
    results = report["results"]
    assert results["clean"]["n"] == 40 and 0 <= results["clean"]["top1"] <= 100
    assert set(results["corruptions"]["error"]) == {"fog", "glass_blur", "spatter"}
    adv = results["adversarial"]
    assert {"fgsm@0.00392157", "pgd@0.00392157", "spsa@0.1", "autoattack@0.3"} <= set(adv)
    assert adv["autoattack@0.3"]["n"] == 2 and "pyautoattack" in adv["protocol"]["libraries"]["autoattack"]
    rows = list(csv.DictReader((out / "eval_results.csv").open()))
    assert {"evaluation", "metric", "value"} == set(rows[0])
    assert any(r["evaluation"] == "adversarial" and r["metric"] == "pgd@0.00392157/top1" for r in rows)
    md = (out / "eval_results.md").read_text()
    assert "## corruptions" in md and "| fgsm |" in md and "glass_blur" in md
    assert list((out / "wandb").glob("offline-run-*")), "an offline wandb run in the eval directory"

    # the same suite on best.pt's EMA weights goes to its own directory and leaves last.pt's results alone
    best = trained_run / "checkpoints" / "best.pt"  # the 4-step run never validated: a copy stands in for it
    shutil.copyfile(ckpt, best)
    before = (out / "eval_results.json").read_bytes()
    proc = run_app("eval.py", f"checkpoint={best}", "eval=digits_robustness", "eval.run=[clean]", "eval.use_ema=true",
                   SMALL[0], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ema = json.loads((trained_run / "eval" / "digits_robustness" / "best-ema" / "eval_results.json").read_text())
    assert ema["target"]["checkpoint"] == str(best) and ema["target"]["weights"] == "ema"
    assert ema["target"]["evaluated"] == "best-ema" and ema["evaluations"] == ["clean"]
    assert (out / "eval_results.json").read_bytes() == before


@pytest.mark.slow
def test_ema_and_model_mode_give_consistent_numbers(trained_run, tmp_path):
    ckpt = trained_run / "checkpoints" / "last.pt"
    plain = run_evaluation(eval_cfg(f"checkpoint={ckpt}", "eval=clean"), tmp_path / "plain")
    ema = run_evaluation(eval_cfg(f"checkpoint={ckpt}", "eval=clean", "eval.use_ema=true"), tmp_path / "ema")
    assert ema["target"]["weights"] == "ema" and plain["target"]["weights"] == "model"
    stored = load_checkpoint(ckpt)
    torch.save(stored["model"], tmp_path / "weights.pt")
    timm_mode = run_evaluation(eval_cfg("model.name=vit_pico_patch4_16", "model.img_size=16", "attention=quest",
                                        "data=digits", f"weights={tmp_path / 'weights.pt'}", "eval=clean"),
                               tmp_path / "timm")
    assert timm_mode["target"]["source"] == "timm" and timm_mode["target"]["evaluated"] == "weights"
    assert plain["target"]["evaluated"] == "last-model" and ema["target"]["evaluated"] == "last-ema"
    for key in ("top1", "top5", "nll", "n"):
        assert timm_mode["results"]["clean"][key] == pytest.approx(plain["results"]["clean"][key]), key
    assert (tmp_path / "timm" / "eval_results.json").is_file()


@pytest.mark.parametrize("overrides, expected", [
    (["checkpoint=/runs/digits/x/checkpoints/last.pt", "eval=imagenet_v2"],
     "/runs/digits/x/eval/imagenet_v2/last-model"),
    (["checkpoint=/runs/digits/x/checkpoints/last.pt", "eval=digits_robustness", "eval.use_ema=true"],
     "/runs/digits/x/eval/digits_robustness/last-ema"),
    (["checkpoint=/runs/digits/x/checkpoints/best.pt", "eval=clean"], "/runs/digits/x/eval/clean/best-model"),
    (["checkpoint=/runs/digits/x/checkpoints/best.pt", "eval=clean", "eval.use_ema=true"],
     "/runs/digits/x/eval/clean/best-ema"),
    (["checkpoint=/elsewhere/step1000.pt", "eval=clean"], "/elsewhere/eval/clean/step1000-model"),
    (["model=vit_pico", "attention=quest", "eval=clean"], "outputs/eval/vit_pico_patch4_16-quest/clean/random-init"),
    (["model=vit_pico", "attention=quest", "weights=/w/deit_pico.pth", "eval=clean"],
     "outputs/eval/vit_pico_patch4_16-quest/clean/deit_pico"),
])
def test_default_run_dir_names_the_checkpoint_and_the_weights(overrides, expected):
    assert eval_cfg(*overrides, hydra=True).hydra.run.dir == expected


def test_last_best_and_ema_never_share_a_directory():
    dirs = {eval_cfg(f"checkpoint=/r/checkpoints/{f}", "eval=clean", f"eval.use_ema={ema}", hydra=True).hydra.run.dir
            for f in ("last.pt", "best.pt") for ema in ("false", "true")}
    assert len(dirs) == 4 and all(d.startswith("/r/eval/clean/") for d in dirs)


def test_every_suite_composes_with_its_evaluations():
    from quest.evaluation import EVALUATIONS

    for path in sorted((CONFIGS / "eval").glob("*.yaml")):
        cfg = eval_cfg(f"eval={path.stem}")
        assert cfg.eval.name == path.stem and set(cfg.eval.run) <= set(EVALUATIONS), path.stem
    suite = eval_cfg("eval=imagenet_suite").eval
    assert list(suite.run) == ["imagenet_val", "imagenet_v2", "imagenet_real", "imagenet_a", "imagenet_r", "imagenet_c"]
    digits = eval_cfg("eval=digits_robustness").eval
    assert digits.adversarial.pgd.steps == 20 and digits.adversarial.pgd.step_size == 0.15
    assert digits.adversarial.spsa.nb_sample == 128 and digits.adversarial.spsa.nb_iter == 40
    assert digits.adversarial.autoattack.version == "standard" and digits.adversarial.labels == "ground_truth"
    assert digits.adversarial.space == "pixel" and digits.adversarial.elliptical_estimator is None
    assert digits.adversarial.spsa.estimate_at == "iterate" and digits.adversarial.spsa.random_start
    # the paper's protocol (Tables 3/4): the ImageNet suite and the digits twin
    for name in ("adversarial_paper", "imagenet_adversarial_paper", "digits_adversarial"):
        paper = eval_cfg(f"eval={name}").eval
        assert "adversarial_paper" in paper.run, name
        section = paper.adversarial_paper
        assert (section.space, section.labels, section.elliptical_estimator) == ("normalized", "paper", "median")
        assert section.spsa.estimate_at == "cleverhans_torch" and list(section.spsa.eps) == [0.1]
        assert list(section.fgsm.eps) == list(section.pgd.eps) == list(section.autoattack.eps) == [1 / 255]
    assert list(eval_cfg("eval=digits_adversarial").eval.run) == ["clean", "adversarial_paper", "adversarial"]
    assert eval_cfg("eval=imagenet_adversarial_paper").eval.adversarial_paper.source == "imagenet_val"
    assert eval_cfg("eval=digits_adversarial").eval.adversarial.space == "pixel"


def test_misspelt_keys_fail_naming_the_key():
    with pytest.raises(ConfigCompositionException, match="eval.adversarial.pgd.stepz"):
        eval_cfg("eval.adversarial.pgd.stepz=3")
    with pytest.raises(ConfigCompositionException, match="eval.roots.v3"):
        eval_cfg("eval.roots.v3=/x")


def test_model_override_takes_any_timm_name():
    argv = ["eval.py", "model=vit_pico", "model=deit_tiny_patch16_224", "model=not_a_model", "attention=quest"]
    assert rewrite_model_override(argv) == ["eval.py", "model=vit_pico", "model.name=deit_tiny_patch16_224",
                                            "model=not_a_model", "attention=quest"]


def test_not_a_quest_checkpoint_is_a_clear_error(tmp_path):
    torch.save({"weight": torch.zeros(2)}, tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="is a plain state_dict .*: pass it as weights=.* with model=<timm name> "
                                         "attention=<name>"):
        run_evaluation(eval_cfg(f"checkpoint={tmp_path / 'plain.pt'}", "eval=clean"), tmp_path / "out")
    (tmp_path / "text.pt").write_text("hello")
    with pytest.raises(ValueError, match="is not a torch checkpoint file: it looks like a text file"):
        run_evaluation(eval_cfg(f"checkpoint={tmp_path / 'text.pt'}", "eval=clean"), tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run_evaluation(eval_cfg(f"checkpoint={tmp_path / 'missing.pt'}", "eval=clean"), tmp_path / "out")


def test_conflicting_or_missing_model_arguments(tmp_path):
    with pytest.raises(ValueError, match="do not also pass"):
        run_evaluation(eval_cfg("checkpoint=/x.pt", "model=vit_pico", "eval=clean"), tmp_path)
    with pytest.raises(ValueError, match="nothing to evaluate"):
        run_evaluation(eval_cfg("eval=clean"), tmp_path)
    with pytest.raises(ValueError, match="needs attention="):
        run_evaluation(eval_cfg("model=vit_pico", "eval=clean"), tmp_path)
    with pytest.raises(ValueError, match=r"eval\.run.*must be a list of distinct evaluations.*'imagenet_x'"):
        run_evaluation(eval_cfg("model=vit_pico", "attention=quest", "eval.run=[clean,imagenet_x]"), tmp_path)


@pytest.mark.parametrize("suite, key, layout", [
    ("imagenet_v2", "v2", "imagenetv2-<variant>-format-val/<class index 0..999>"),
    ("imagenet_val", "val", "<wnid>/<image>.JPEG"),
    ("imagenet_a", "a", "200 wnid folders"),
    ("imagenet_c", "c", "<corruption>/<severity 1..5>/<wnid>"),
])
def test_missing_root_names_the_path_and_the_layout(tmp_path, suite, key, layout):
    base = ["model=vit_tiny", "attention=standard", f"eval={suite}"]
    with pytest.raises(FileNotFoundError, match=f"eval.roots.{key}=") as info:
        run_evaluation(eval_cfg(*base), tmp_path)
    assert layout in str(info.value)
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as info:
        run_evaluation(eval_cfg(*base, f"eval.roots.{key}={missing}"), tmp_path)
    assert str(missing) in str(info.value) and layout in str(info.value)


def test_a_sharded_data_set_is_refused_with_the_way_out():
    from torch.utils.data import IterableDataset

    from quest.evaluation.context import EvalRun, make_loader
    from quest.runtime.distributed import DistContext

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(())

    run = EvalRun(None, DistContext(), eval_cfg("eval=clean").eval, None)
    with pytest.raises(ValueError, match="sharded \\(WebDataset\\).*data=imagenet"):
        make_loader(run, Stream())


@pytest.mark.parametrize("override", ["model.img_size=32", "model.layer_scale_init=0.1", "+model.kwargs.depth=2",
                                      "model.pretrained=deit_tiny_patch16_224.fb_in1k",
                                      "model.pretrained_download=true", "+attention.options.eps=0.1"])
def test_a_model_key_that_cannot_apply_to_a_checkpoint_is_refused_naming_it(override, tmp_path):
    """checkpoint= rebuilds the model from its own config: every model.* / attention.* value set beside it would be
    dropped without a word, so each is refused by name (before the checkpoint is even opened)."""
    key = override.lstrip("+").split("=")[0]
    with pytest.raises(ValueError, match=rf"do not also pass {re.escape(key)}"):
        run_evaluation(eval_cfg("checkpoint=/x.pt", override, "eval=clean"), tmp_path)
