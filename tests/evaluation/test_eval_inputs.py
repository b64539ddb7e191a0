"""A suite checks every data root it will read before any work: a matrix over the ImageNet suites x each root they
read x {missing, empty, class folders without images, an unreadable class folder} fails naming the path, with no
evaluation started (no eval_results.json). The results record every root read; data.* overrides are applied or
refused, and command-line keys the suite would not read are refused."""
from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from quest.config.checks import ConfigError
from quest.evaluation import register_eval_configs, run_evaluation
from quest.evaluation.imagenet_data import subset_classes
from quest.train import fit

from ..eval_helpers import wnid, write_image
from ..helpers import compose_cfg, eval_cfg

register_eval_configs()

MODEL = ["model=vit_pico", "attention=quest"]  # random init, 1000 classes, 16 px: fast
GRID = ["eval.imagenet_c.corruptions=[fog]", "eval.imagenet_c.extra_corruptions=[]", "eval.imagenet_c.severities=[1,2]"]
READS = {"imagenet_val": ["val"], "imagenet_v2": ["v2"], "imagenet_real": ["val"], "imagenet_a": ["a", "val"],
         "imagenet_r": ["r", "val"], "imagenet_c": ["c", "val"],
         "imagenet_suite": ["val", "v2", "a", "r", "c"]}
BREAKS = ("missing", "empty", "no_images", "unreadable")



def imagenet_roots(base: Path) -> dict[str, Path]:
    """Tiny copies of every ImageNet test set in its real layout; returns root key -> path (and the ReaL json)."""
    val = base / "val"
    for i, c in enumerate((0, 1, 2)):
        write_image(val / wnid(c) / f"ILSVRC2012_val_{i + 1:08d}.JPEG", c)
    for variant in ("matched-frequency", "threshold0.7", "top-images"):
        for c in (3, 10):
            write_image(base / "v2" / f"imagenetv2-{variant}-format-val" / str(c) / "a.jpeg", c)
    for key in ("a", "r"):
        column, name = subset_classes(key)[0][0], subset_classes(key)[1][0]
        write_image(base / key / name / "x.jpg", column)
    for severity in (1, 2):
        write_image(base / "c" / "fog" / str(severity) / wnid(5) / "y.JPEG", 5)
    (base / "real.json").write_text(json.dumps([[0], [1], []]))
    return {"val": val, "v2": base / "v2", "a": base / "a", "r": base / "r", "c": base / "c"}


def suite_args(roots: dict[str, Path], suite: str, base: Path) -> list[str]:
    args = [*MODEL, f"eval={suite}", *(f"eval.roots.{k}={v}" for k, v in roots.items() if k in READS[suite])]
    if suite in ("imagenet_c", "imagenet_suite"):
        args += GRID
    if suite in ("imagenet_real", "imagenet_suite"):
        args.append(f"eval.imagenet_real.real_json={base / 'real.json'}")
    return args


@pytest.fixture()
def loaders(monkeypatch) -> list:
    """Every data loader the evaluations make (the first step of any work) is recorded here."""
    import quest.evaluation.context as context

    made, real = [], context.make_loader
    monkeypatch.setattr(context, "make_loader", lambda *a, **k: made.append(a[1]) or real(*a, **k))
    return made


def deepest_class_folder(root: Path) -> Path:
    return sorted(p.parent for p in root.rglob("*") if p.is_file())[0]


def unreadable(folder: Path, monkeypatch) -> None:
    """No permission on ``folder``: chmod 000, and for root (who reads it anyway) os.access says so too."""
    folder.chmod(0)
    if os.geteuid() == 0:
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: False if Path(p) == folder else real(p, mode, *a,
                                                                                                       **k))


def breakage(root: Path, how: str, monkeypatch) -> Path:
    """Break ``root`` as ``how``; return the path the error must name."""
    if how == "missing":
        shutil.rmtree(root)
        return root
    if how == "empty":
        shutil.rmtree(root)
        root.mkdir()
        return root
    folder = deepest_class_folder(root)
    if how == "no_images":
        for image in folder.parent.parent.rglob("*") if root.name == "c" else root.rglob("*"):
            if image.is_file():
                image.unlink()
        return folder.parent if root.name == "c" else root
    unreadable(folder, monkeypatch)
    return folder


CASES = [(suite, key, how) for suite, keys in READS.items() for key in keys for how in BREAKS]


@pytest.mark.parametrize("suite, key, how", CASES, ids=[f"{s}-{k}-{h}" for s, k, h in CASES])
def test_every_root_a_suite_reads_is_checked_before_any_work(tmp_path, monkeypatch, loaders, suite, key, how):
    roots = imagenet_roots(tmp_path / "data")
    named = breakage(roots[key], how, monkeypatch)
    out = tmp_path / "out"
    try:
        with pytest.raises((FileNotFoundError, PermissionError, ValueError)) as info:
            run_evaluation(eval_cfg(*suite_args(roots, suite, tmp_path / "data")), out)
    finally:
        for p in (tmp_path / "data").rglob("*"):
            if p.is_dir():
                p.chmod(stat.S_IRWXU)
    message = str(info.value)
    assert str(named) in message, message
    if how == "unreadable":
        assert "permission denied" in message and "read and execute (r-x) permission" in message
    assert not (out / "eval_results.json").exists() and loaders == []  # no evaluation started


def test_the_issue_examples(tmp_path, loaders):
    """imagenet_suite with an empty v2 root fails before imagenet_val runs; imagenet_c with one empty severity
    folder fails before any cell."""
    roots = imagenet_roots(tmp_path / "data")
    shutil.rmtree(roots["v2"])
    roots["v2"].mkdir()
    with pytest.raises(FileNotFoundError, match=rf"{roots['v2']}"):
        run_evaluation(eval_cfg(*suite_args(roots, "imagenet_suite", tmp_path / "data")), tmp_path / "suite")
    assert not (tmp_path / "suite" / "eval_results.json").exists() and loaders == []
    roots = imagenet_roots(tmp_path / "data2")
    shutil.rmtree(roots["c"] / "fog" / "2" / wnid(5))
    with pytest.raises(FileNotFoundError, match=rf"{roots['c'] / 'fog' / '2'} has no class folders"):
        run_evaluation(eval_cfg(*suite_args(roots, "imagenet_c", tmp_path / "data2")), tmp_path / "c")
    assert not (tmp_path / "c" / "eval_results.json").exists() and loaders == []


def test_intact_roots_run_and_are_recorded(tmp_path, loaders):
    roots = imagenet_roots(tmp_path / "data")
    report = run_evaluation(eval_cfg(*suite_args(roots, "imagenet_suite", tmp_path / "data")), tmp_path / "out")
    assert report["status"] == "complete"
    assert report["inputs"] == {f"eval.roots.{k}": str(roots[k]) for k in ("val", "v2", "a", "r", "c")}
    assert report["results"]["imagenet_val"]["n"] == 3 and report["results"]["imagenet_c"]["error"]["fog"]
    assert len(loaders) >= 9  # the spy sees the work: val, 3 v2 variants, ReaL, A, R (+ their val subsets), 2 cells


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory):
    """A short training run on a two-class image folder, and a second folder of the same classes."""
    base = tmp_path_factory.mktemp("folders")
    for root, per_class in ((base / "a", 3), (base / "b", 5)):
        for split in ("train", "val"):
            for c, name in enumerate(("cat", "dog")):
                for i in range(per_class):
                    write_image(root / split / name / f"{i}.png", 100 * c + i, size=16)
    run = base / "run"
    fit(compose_cfg("data=imagefolder", f"data.root={base / 'a'}", "data.num_classes=2", "model=vit_pico",
                    "recipe=light", "data.batch_size=4", "data.num_workers=0", "trainer.epochs=1", "trainer.max_steps=1"),
        run)
    return base, run / "checkpoints" / "last.pt"


def test_data_root_without_data_is_applied_to_the_checkpoint(folder_run, tmp_path):
    base, ckpt = folder_run
    own = run_evaluation(eval_cfg(f"checkpoint={ckpt}", "eval=clean"), tmp_path / "own")
    other = run_evaluation(eval_cfg(f"checkpoint={ckpt}", "eval=clean", f"data.root={base / 'b'}"), tmp_path / "b")
    assert own["results"]["clean"]["n"] == 6 and other["results"]["clean"]["n"] == 10  # the root scored
    assert other["inputs"] == {"data.root": str(base / "b" / "val")}
    assert other["target"]["data_overrides"] == {"root": str(base / "b")}


def test_a_permission_denied_class_folder_names_the_path_and_the_permission(folder_run, tmp_path, monkeypatch):
    base, ckpt = folder_run
    copy = tmp_path / "copy"
    shutil.copytree(base / "a", copy)
    unreadable(copy / "val" / "dog", monkeypatch)
    try:
        with pytest.raises(PermissionError, match=rf"cannot read {copy / 'val' / 'dog'}: permission denied .*read "
                                                  r"and execute \(r-x\) permission"):
            run_evaluation(eval_cfg(*MODEL, "data=imagefolder", f"data.root={copy}", "data.num_classes=2",
                                    "eval=clean"), tmp_path / "out")
    finally:
        (copy / "val" / "dog").chmod(stat.S_IRWXU)


@pytest.mark.parametrize("args, message", [
    (["checkpoint={ckpt}", "eval=clean", "data.root=/elsewhere"], "data.root=/elsewhere would be ignored: the "
                                                                  "checkpoint's data set digits is built in"),
    ([*MODEL, "eval=imagenet_val", "data.root=/elsewhere"], "data.root=/elsewhere would be ignored: a timm model"),
    ([*MODEL, "eval=imagenet_val", "data.mean=[0.5,0.5,0.5]"], r"data.mean=\[0.5, 0.5, 0.5\] would be ignored"),
])
def test_a_data_override_that_would_be_ignored_is_refused(tmp_path, args, message):
    fit_dir = tmp_path / "run"
    if any("{ckpt}" in a for a in args):
        fit(compose_cfg("data=digits", "model=vit_pico", "recipe=light", "trainer.epochs=1", "trainer.max_steps=1"),
            fit_dir)
    args = [a.format(ckpt=fit_dir / "checkpoints" / "last.pt") for a in args]
    with pytest.raises(ValueError, match=message):
        run_evaluation(eval_cfg(*args), tmp_path / "out")


@pytest.mark.parametrize("extra, ignored", [
    (["eval.roots.v2=/x"], "no evaluation of eval.run=['imagenet_val'] reads eval.roots.v2"),
    (["eval.imagenet_c.severities=[1]"], "does not run imagenet_c"),
    (["+eval.roots.a=/y", "eval.clean.max_samples=3"], "reads eval.roots.a"),
])
def test_command_line_keys_the_suite_would_not_read_are_refused(tmp_path, extra, ignored):
    roots = imagenet_roots(tmp_path / "data")
    args = [*MODEL, "eval=imagenet_val", f"eval.roots.val={roots['val']}", *extra]
    with pytest.raises(ConfigError, match=ignored.replace("[", r"\[").replace("]", r"\]")):
        run_evaluation(eval_cfg(*args), tmp_path / "out", overrides=args)
    assert not (tmp_path / "out" / "eval_results.json").exists()
    # a root the suite does read (ImageNet-A's clean subset reads val) is fine
    args = [*MODEL, "eval=imagenet_a", f"eval.roots.a={roots['a']}", f"eval.roots.val={roots['val']}"]
    assert run_evaluation(eval_cfg(*args), tmp_path / "a", overrides=args)["status"] == "complete"


@pytest.mark.parametrize("content, message", [
    ("[[0], [1", "is not valid JSON"),
    ("{\"a\": 1}", "holds a JSON dict, not a list of label lists"),
    ("[0, 1, 2]", "holds a JSON list, not a list of label lists"),
])
def test_a_malformed_real_json_names_the_file_before_any_work(tmp_path, loaders, content, message):
    roots = imagenet_roots(tmp_path / "data")
    (tmp_path / "data" / "real.json").write_text(content)
    with pytest.raises(ValueError, match=rf"real_json {tmp_path / 'data' / 'real.json'} {message}"):
        run_evaluation(eval_cfg(*suite_args(roots, "imagenet_suite", tmp_path / "data")), tmp_path / "out")
    assert loaders == []
