"""A new evaluation is one module and one suite file: the worked example of docs/evaluation.md ("Adding an
evaluation"), written to a temporary folder outside quest/, registers itself with its own settings dataclass, is
typed and checked like the built-in sections, and runs through run_evaluation and eval.py."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from quest.config.checks import ConfigError
from quest.evaluation import (
    EVALUATIONS,
    eval_settings_schema,
    register_eval_configs,
    register_evaluation,
    run_evaluation,
    unregister_evaluation,
)
from quest.evaluation.registry import MODULES_ENV

from ..eval_helpers import write_image
from ..helpers import CONFIGS, ROOT
from ..warm import run_app

DOC = ROOT / "docs" / "evaluation.md"
MODEL = ["model=vit_pico", "attention=quest", "data=digits"]  # a random-init 10-class model on 16 px inputs


def doc_file(name: str) -> str:
    """The fenced block after ``<!-- test_eval_plugins: name -->`` in docs/evaluation.md."""
    match = re.search(rf"<!-- test_eval_plugins: {re.escape(name)} -->\n```[a-z]*\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/evaluation.md has no example {name}"
    return match.group(1)


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The documented module (my_evals/topk_folder.py) and suite file (my_configs/eval/topk_folder.yaml)."""
    package = tmp_path / "plugin" / "my_evals"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "topk_folder.py").write_text(doc_file("my_evals/topk_folder.py"))
    configs = tmp_path / "my_configs" / "eval"
    configs.mkdir(parents=True)
    (configs / "topk_folder.yaml").write_text(doc_file("my_configs/eval/topk_folder.yaml"))
    monkeypatch.syspath_prepend(str(tmp_path / "plugin"))
    register_eval_configs(["my_evals.topk_folder"])  # imports it (it registers itself), stores the schema
    yield {"module": sys.modules["my_evals.topk_folder"], "configs": configs.parent, "path": tmp_path / "plugin"}
    unregister_evaluation("topk_folder")
    for name in ("my_evals.topk_folder", "my_evals"):
        sys.modules.pop(name, None)
    register_eval_configs()  # the schema without it again


@pytest.fixture
def folder(tmp_path) -> Path:
    """12 images in <root>/<class index>/<image>, classes 0..9."""
    for i in range(12):
        write_image(tmp_path / "folder" / str(i % 10) / f"{i}.png", 40 * (i % 10), size=20)
    return tmp_path / "folder"


def plugin_cfg(plugin, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("eval", overrides=[f"hydra.searchpath=[file://{plugin['configs']}]", "eval=topk_folder",
                                          *overrides])


def test_the_module_registers_its_evaluation_and_its_settings(plugin):
    assert EVALUATIONS["topk_folder"] is plugin["module"].topk_folder
    schema = eval_settings_schema()
    assert schema.__dataclass_fields__["topk_folder"].type is plugin["module"].TopKFolderConfig
    cfg = plugin_cfg(plugin, *MODEL)
    assert cfg.eval.name == "topk_folder" and list(cfg.eval.run) == ["topk_folder"]
    assert list(cfg.eval.topk_folder.ks) == [1, 5] and cfg.eval.topk_folder.root is None
    assert cfg.eval.adversarial.pgd.steps == 20  # the built-in sections are all still there


def test_it_runs_through_run_evaluation(plugin, folder, tmp_path):
    cfg = plugin_cfg(plugin, *MODEL, f"eval.topk_folder.root={folder}", "eval.topk_folder.ks=[1,3,10]")
    report = run_evaluation(cfg, tmp_path / "out")
    result = report["results"]["topk_folder"]
    assert result["n"] == 12 and result["top10"] == 100.0  # every one of the 10 classes is in a top-10
    assert 0 <= result["top1"] <= result["top3"] <= 100 and result["root"] == str(folder)
    rows = (tmp_path / "out" / "eval_results.csv").read_text().splitlines()
    assert "topk_folder,top10,100.0" in rows and "topk_folder,n,12" in rows
    assert "## topk_folder" in (tmp_path / "out" / "eval_results.md").read_text()
    assert report["inputs"] == {"eval.topk_folder.root": str(folder)}  # its declared input, recorded
    # checked before the suite's first evaluation: clean never starts when the folder is missing
    cfg = plugin_cfg(plugin, *MODEL, "eval.run=[clean,topk_folder]", f"eval.topk_folder.root={tmp_path / 'none'}")
    with pytest.raises(FileNotFoundError, match=f"eval.topk_folder.root={tmp_path / 'none'} is not a directory"):
        run_evaluation(cfg, tmp_path / "missing")
    assert not (tmp_path / "missing" / "eval_results.json").exists()


def test_its_section_is_typed_and_checked_like_the_built_in_ones(plugin, tmp_path):
    with pytest.raises(ConfigCompositionException, match="eval.topk_folder.kz"):
        plugin_cfg(plugin, *MODEL, "eval.topk_folder.kz=[1]")
    with pytest.raises(ConfigError, match=r"eval\.topk_folder\.kss: not a key of eval\.topk_folder; did you mean "
                                          r"eval\.topk_folder\.ks\?"):
        run_evaluation(plugin_cfg(plugin, *MODEL, "+eval.topk_folder.kss=1"), tmp_path)
    with pytest.raises(ConfigError, match=r"eval\.topk_folder\.ks must be a list of positive integers, got \[0\]"):
        run_evaluation(plugin_cfg(plugin, *MODEL, "eval.topk_folder.ks=[0]"), tmp_path)


@pytest.mark.slow
def test_eval_py_imports_it_from_quest_eval_modules(plugin, folder, tmp_path):
    env = {**os.environ, MODULES_ENV: "my_evals.topk_folder",
           "PYTHONPATH": os.pathsep.join([str(plugin["path"]), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "cli"
    # eval.py's argv forked from the warm zygote (tests/warm.py), which has imported no evaluation: the command
    # imports the plugin from its own environment (QUEST_EVAL_MODULES, PYTHONPATH), as a fresh interpreter does
    proc = run_app("eval.py", f"hydra.searchpath=[file://{plugin['configs']}]", *MODEL, "eval=topk_folder",
                   f"eval.topk_folder.root={folder}", "eval.topk_folder.ks=[10]", f"hydra.run.dir={out}", cwd=ROOT,
                   env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "eval_results.json").read_text())
    assert report["results"]["topk_folder"]["top10"] == 100.0 and report["results"]["topk_folder"]["n"] == 12


def test_registration_refuses_eval_keys_and_a_second_owner():
    with pytest.raises(ValueError, match="not one of eval's own keys"):
        register_evaluation("batch_size")(lambda run, section: {})
    with pytest.raises(ValueError, match="registered twice: by quest.evaluation.suites.classification and by"):
        register_evaluation("clean")(lambda run, section: {})
    assert "clean" in EVALUATIONS
