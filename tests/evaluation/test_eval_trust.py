"""Checkpoints are data: a string read from a checkpoint never names code that gets imported. An import-path
attention stored in a checkpoint's config is imported only when the user names it (``attention=<path>``) or trusts
the checkpoint (``trust_code=true``); every entry point that reads a stored config is covered, and a module that
writes a marker file on import shows whether it was imported."""
from __future__ import annotations

import importlib
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from quest.evaluation import register_eval_configs, run_evaluation
from quest.evaluation.target import check_stored_code
from quest.run.checkpoint import load_checkpoint, save_checkpoint
from quest.train import fit

from ..helpers import ROOT, compose_cfg, eval_cfg
from ..warm import run_app

register_eval_configs()

# A module that leaves a trace when imported: a QUEST attention under another name, so a trusted model builds.
MODULE = textwrap.dedent('''
    import os, pathlib
    pathlib.Path(os.environ["QUEST_TEST_MARKER"]).write_text(__name__)
    from quest.attention import QuestAttention

    class Attn(QuestAttention):
        pass
''')
DIGITS = ["data=digits", "model=vit_pico", "recipe=light", "data.batch_size=32", "trainer.epochs=1",
          "trainer.max_steps=2", "trainer.log_every_n_steps=1"]


@pytest.fixture(scope="module")
def quest_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("run")
    fit(compose_cfg(*DIGITS, "attention=quest"), run)
    return run


@pytest.fixture()
def marked(tmp_path, monkeypatch, quest_run):
    """(module name, marker path, a copy of the run whose checkpoint's config names <module>:Attn)."""
    name = f"markmod_{tmp_path.name.replace('-', '_')[-24:]}"
    code = tmp_path / "code"
    code.mkdir()
    (code / f"{name}.py").write_text(MODULE)
    marker = tmp_path / "imported"
    monkeypatch.setenv("QUEST_TEST_MARKER", str(marker))
    monkeypatch.syspath_prepend(str(code))
    run = tmp_path / "run"
    shutil.copytree(quest_run, run, ignore=shutil.ignore_patterns("eval"))
    for ckpt in (run / "checkpoints").glob("*.pt"):
        state = load_checkpoint(ckpt)
        state["config"]["attention"]["name"] = f"{name}:Attn"
        state["meta"]["attention"] = f"{name}:Attn"
        save_checkpoint(ckpt, {k: v for k, v in state.items() if k != "format"})
    yield name, marker, run, code
    sys.modules.pop(name, None)


@pytest.mark.parametrize("extra, allowed", [
    ([], False),
    (["trust_code=false"], False),
    (["trust_code=true"], True),
    (["attention=path", "attention.name={name}:Attn"], True),  # attention=<path> as the command line rewrites it
    (["attention=path", "attention.name={name}:Other"], False),  # another path is not the one the checkpoint names
])
def test_eval_imports_a_stored_attention_only_when_asked(marked, tmp_path, extra, allowed):
    name, marker, run, _ = marked
    overrides = [f"checkpoint={run / 'checkpoints' / 'last.pt'}", "eval=clean", "eval.clean.max_samples=20",
                 *(e.format(name=name) for e in extra)]
    if allowed:
        report = run_evaluation(eval_cfg(*overrides), tmp_path / "out")
        assert marker.read_text() == name and report["target"]["attention"] == f"{name}:Attn"
        assert report["status"] == "complete"
        return
    with pytest.raises(ValueError, match=rf"stores attention.name='{name}:Attn', an import path: .*import the "
                                         rf"module '{name}'.*attention={name}:Attn \(or trust_code=true\)"
                                         if "Other" not in str(extra) else "was trained with attention"):
        run_evaluation(eval_cfg(*overrides), tmp_path / "out")
    assert not marker.exists() and name not in sys.modules
    assert not (tmp_path / "out" / "eval_results.json").exists()


def test_eval_py_refuses_without_importing(marked, tmp_path):
    """The command line, with the module importable (PYTHONPATH): a message, no import, no traceback. eval.py's argv
    forked from the warm zygote (tests/warm.py) proves this as well as a fresh interpreter: the marker module is new
    to this test, so no preloaded import can stand in for it, only an import by the command writes the marker, and
    the second command (the module named) shows it importable from the command's PYTHONPATH."""
    name, marker, run, code = marked
    env = {"PYTHONPATH": f"{ROOT}:{code}", "QUEST_TEST_MARKER": str(marker), "WANDB_MODE": "offline",
           "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    base = [f"checkpoint={run / 'checkpoints' / 'last.pt'}", "eval=clean", "eval.clean.max_samples=20"]
    out = run_app("eval.py", *base, f"hydra.run.dir={tmp_path / 'a'}", cwd=ROOT, env=env, timeout=600)
    assert out.returncode != 0 and not marker.exists(), out.stderr[-2000:]
    assert f"attention={name}:Attn (or trust_code=true)" in out.stderr and "Traceback" not in out.stderr
    out = run_app("eval.py", *base, f"attention={name}:Attn", f"hydra.run.dir={tmp_path / 'b'}", cwd=ROOT, env=env,
                  timeout=600)
    assert out.returncode == 0 and marker.read_text() == name, out.stderr[-2000:]


@pytest.mark.parametrize("resume", ["auto", "path", "init_from"])
def test_train_never_imports_what_a_stored_config_names(marked, tmp_path, resume):
    """train.py reads a stored config on resume (auto: the run's last.pt; trainer.resume=<path>) and weights from
    trainer.init_from: the model is built from the command line's config, the stored one only compared."""
    name, marker, run, _ = marked
    last = run / "checkpoints" / "last.pt"
    where = {"auto": (run, []), "path": (tmp_path / "new", [f"trainer.resume={last}"]),
             "init_from": (tmp_path / "new", [f"trainer.init_from={last}"])}[resume]
    try:
        fit(compose_cfg(*DIGITS, "attention=quest", *where[1]), where[0])
    except ValueError:
        pass  # a refused resume (another attention) is fine; an import is not
    assert not marker.exists() and name not in sys.modules


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(module=st.from_regex(r"[a-z][a-z0-9_]{0,10}(\.[a-z][a-z0-9_]{0,10}){0,2}", fullmatch=True),
       cls=st.from_regex(r"[A-Z][A-Za-z0-9_]{0,10}", fullmatch=True),
       trust=st.booleans(), named=st.booleans())
def test_any_import_path_in_a_stored_config_is_refused_unless_asked(tmp_path, monkeypatch, module, cls, trust, named):
    """Property: for any module path and class name, check_stored_code lets it through only with trust_code or the
    same path named, and refusing never imports (the module writes a marker on import)."""
    root = tmp_path / f"c{abs(hash((module, cls))) % 10**8}"
    top = f"mk{abs(hash(module)) % 10**6}_{module.split('.')[0]}"
    path = ".".join([top, *module.split(".")[1:]])
    folder = root
    for part in path.split("."):
        folder = folder / part
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").write_text(f"import pathlib\npathlib.Path({str(root / 'marker')!r}).touch()\n")
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    stored = OmegaConf.create({"attention": {"name": f"{path}:{cls}"}})
    cfg = OmegaConf.create({"trust_code": trust, "attention": {"name": f"{path}:{cls}" if named else None}})
    if trust or named:
        check_stored_code(stored, cfg, tmp_path / "x.pt")
    else:
        with pytest.raises(ValueError, match=f"attention={path}:{cls}"):
            check_stored_code(stored, cfg, tmp_path / "x.pt")
    assert not (root / "marker").exists()  # checking imports nothing; building the model is what imports
    assert top not in sys.modules


def test_the_trust_flag_is_recorded_in_the_schema():
    assert eval_cfg("eval=clean").trust_code is False
    with pytest.raises(Exception, match="trust_code"):
        eval_cfg("eval=clean", "trust_code=maybe")
