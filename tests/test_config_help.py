"""--help of quest-train / quest-eval (the app's own config groups, every key described) and tab completion that
does not import torch."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from quest import cli
from quest.config_help import field_doc, key_docs

ROOT = Path(__file__).resolve().parents[1]
TRAIN_GROUPS = ["model", "attention", "data", "recipe", "trainer", "logger", "diagnostics", "experiment"]
EVAL_GROUPS = ["eval", "model", "attention", "data", "logger"]
NOT_EVAL_GROUPS = ["trainer", "recipe", "diagnostics", "experiment"]


def _schemas():
    from quest.evaluation.config import eval_config_schema
    from quest.schema import TrainConfig

    return {"train": TrainConfig, "eval": eval_config_schema()}


@pytest.mark.parametrize("app", ["train", "eval"])
def test_every_schema_key_has_a_description(app):
    """A key added to the schema (or to an evaluation's settings) without a comment or metadata doc fails here."""
    keys = list(key_docs(_schemas()[app]))
    assert len(keys) > 50
    undocumented = [key for key, _, doc in keys if not doc.strip()]
    assert not undocumented, f"schema keys without a description (a trailing comment or metadata doc): {undocumented}"


def test_description_sources_and_a_missing_one(tmp_path, monkeypatch):
    """Where a description comes from, in order, and that a field with none reads as undocumented (so the test
    above can fail)."""
    import importlib.util

    path = tmp_path / "probe_schema_for_help.py"
    path.write_text(textwrap.dedent('''
        from dataclasses import dataclass, field

        @dataclass
        class Inner:
            """Inner settings: the class docstring describes the field holding it."""

            depth: int = 2  # how deep
            # the width, in units,
            # said over two lines
            width: int = 3

        @dataclass
        class Probe:
            inner: Inner = field(default_factory=Inner)
            documented: int = field(default=1, metadata={"doc": "from metadata"})
            undocumented: int = 0

            other: int = 4  # trailing wins
    '''))
    spec = importlib.util.spec_from_file_location("probe_schema_for_help", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "probe_schema_for_help", module)
    spec.loader.exec_module(module)
    probe = module.Probe
    docs = {key: doc for key, _, doc in key_docs(probe)}
    assert docs == {
        "inner": "Inner settings: the class docstring describes the field holding it.",
        "inner.depth": "how deep",
        "inner.width": "the width, in units, said over two lines",
        "documented": "from metadata",
        "undocumented": "",
        "other": "trailing wins",
    }
    assert dataclasses.is_dataclass(probe) and field_doc(probe, "undocumented") == ""


def _help(monkeypatch, capsys, app) -> str:
    monkeypatch.setattr(sys, "argv", [f"{app}.py", "model=vit_tiny", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        {"train": cli.train, "eval": cli.evaluate}[app]()
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def _listed_groups(text: str) -> list[str]:
    block = text.split("Config groups", 1)[1].split("\nKeys", 1)[0]
    return [m.group(1) for m in re.finditer(r"^  (\S+) {2,}", block, re.M)]


def _described_keys(text: str) -> dict[str, str]:
    """Top-level and nested keys as printed (indented names), each with the text after its default."""
    block = text.split("\nKeys", 1)[1]
    found: dict[str, str] = {}
    path: list[str] = []
    for line in block.splitlines():
        m = re.match(r"^(  (?:  )*)(\w+)(?: +\[(.*))?$", line)
        if not m or line.startswith(" " * 29):
            continue
        depth = len(m.group(1)) // 2 - 1
        path = path[:depth] + [m.group(2)]
        found[".".join(path)] = m.group(3) or ""
    return found


@pytest.mark.parametrize("app", ["train", "eval"])
def test_help_lists_the_apps_own_groups_and_describes_every_key(monkeypatch, capsys, app):
    text = _help(monkeypatch, capsys, app)
    assert text.startswith(f"quest-{app}: ")
    groups = _listed_groups(text)
    assert groups == (TRAIN_GROUPS if app == "train" else EVAL_GROUPS)
    assert not any(g.startswith("toy") for g in groups)
    if app == "eval":
        assert not set(NOT_EVAL_GROUPS) & set(groups)
        assert "eval.adversarial.spsa.nb_sample" in _described_keys(text)
    assert "vit_pico" in text.split("\nKeys", 1)[0]  # the options of a group
    printed = _described_keys(text)
    for key, _, doc in key_docs(_schemas()[app]):
        assert key in printed, f"{key} missing from --help"
        first_word = doc.split()[0]
        assert first_word in printed[key] or len(printed[key]) < 90, (key, printed[key], doc)
    assert "batch_size" in text and "per process" in text
    assert "toy" not in _listed_groups(text)


def _completion(app: str, line: str) -> subprocess.CompletedProcess:
    """The app's bash completion query (what Hydra's installed completion runs on a TAB), in a fresh process that
    then says whether torch or timm got imported."""
    code = textwrap.dedent(f"""
        import contextlib, io, runpy, sys
        sys.argv = ["{app}.py", "-sc", "query=bash"]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                runpy.run_path("{app}.py", run_name="__main__")
            except SystemExit as exc:
                assert not exc.code, exc.code
        print(out.getvalue().strip())
        print("imported:", sorted(m for m in ("torch", "timm", "torchvision") if m in sys.modules))
    """)
    env = {**os.environ, "COMP_LINE": f"python {app}.py {line}", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("app,line,expected", [
    ("train", "mod", "model="),
    ("train", "trainer.ep", "trainer.epochs="),
    ("eval", "eval=digits_r", "eval=digits_robustness"),
    ("eval", "eval.adversarial.sp", "eval.adversarial.spsa."),
    ("eval", "eval.roots.v", "eval.roots.val="),
])
def test_tab_completion_answers_without_importing_torch(app, line, expected):
    result = _completion(app, line)
    assert result.returncode == 0, result.stderr[-3000:]
    answer, imported = result.stdout.strip().rsplit("\n", 1)
    assert expected in answer.split(), answer
    assert imported == "imported: []", imported


def test_import_quest_registers_with_timm_when_timm_is_imported():
    """`import quest` imports no torch; importing timm afterwards (or before) registers quest's attn_layer names and
    quest_vit, also when the first import is a sub-package that imports timm itself."""
    checks = {
        "import quest": "import sys, quest; assert 'torch' not in sys.modules; import timm",
        "timm first": "import timm, quest",
        "quest.attention": "import quest.attention, timm",
        "quest.models": "import quest.models, timm",
        "quest.engine": "import quest.engine, timm",
    }
    tail = ("\nimport sys\nfrom quest.attention.timm_names import timm_attention_table\n"
            "assert 'quest' in timm_attention_table()\nassert 'quest.models' in sys.modules\n"
            "import timm\nm = timm.create_model('vit_pico_patch4_16', attn_layer='qknorm', num_classes=3)\n"
            "print(type(m.blocks[0].attn).__name__)\n")
    for name, head in checks.items():
        result = subprocess.run([sys.executable, "-c", head + tail], cwd=ROOT, capture_output=True, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
        assert result.returncode == 0, (name, result.stderr[-3000:])
        assert "QKNorm" in result.stdout, (name, result.stdout)
