"""--help of quest-train / quest-eval (the app's own config groups, every key described) and tab completion that
does not import torch."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from quest import cli
from quest.config.help import field_doc, key_docs

ROOT = Path(__file__).resolve().parents[2]
TRAIN_GROUPS = ["model", "attention", "data", "recipe", "trainer", "logger", "diagnostics", "experiment"]
EVAL_GROUPS = ["eval", "model", "attention", "data", "logger"]
NOT_EVAL_GROUPS = ["trainer", "recipe", "diagnostics", "experiment"]


def _schemas():
    from quest.config.schema import TrainConfig
    from quest.evaluation.config import eval_config_schema
    from quest.toy.config import ToyConfig

    return {"train": TrainConfig, "eval": eval_config_schema(), "toy": ToyConfig}


@pytest.mark.parametrize("app", ["train", "eval", "toy"])
def test_every_schema_key_has_a_description(app):
    """A key added to the schema (or to an evaluation's settings) without a comment or metadata doc fails here."""
    keys = list(key_docs(_schemas()[app]))
    assert len(keys) > 50
    # a key with only its declared bounds says what it may be, not what it is
    undocumented = [key for key, _, doc in keys if not doc.strip() or doc.startswith("must be")]
    assert not undocumented, f"schema keys without a description (a trailing comment or metadata doc): {undocumented}"


def test_description_sources_and_a_missing_one(tmp_path, monkeypatch):
    """Where a description comes from, in order, and that a field with none reads as undocumented (so the test
    above can fail)."""
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
        {"train": cli.train, "eval": cli.evaluate, "toy": cli.toy}[app]()
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


# One interpreter for many fresh starts: the driver imports only what an "import" step names, and runs each case in
# a child forked from that state, so a case sees the sys.modules an interpreter of its own would have (plus what was
# imported before it was forked, which the case's own checks see too) without paying Python's start and the shared
# imports once per case. Children run side by side; the driver waits for all and reports each exit status.
_DRIVER = textwrap.dedent("""
    import json, os, sys, traceback
    steps, folder = json.loads(sys.argv[1]), sys.argv[2]
    children = {}
    for number, (kind, name, code) in enumerate(steps):
        if kind == "import":
            exec(code, {})
            continue
        paths = [os.path.join(folder, f"{number}{suffix}") for suffix in (".out", ".err")]
        for path in paths:
            open(path, "w").close()  # there to read even if the case dies before writing
        pid = os.fork()
        if pid == 0:
            for fd, path in zip((1, 2), paths):
                os.dup2(os.open(path, os.O_WRONLY), fd)
            status = 0
            try:
                exec(compile(code, name, "exec"), {"__name__": "__main__"})
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            except BaseException:
                traceback.print_exc()
                status = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        children[name] = (number, pid)
    print(json.dumps({name: [number, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])]
                      for name, (number, pid) in children.items()}))
""")


def _fresh_cases(steps: list[tuple[str, str, str]], folder: Path) -> dict[str, subprocess.CompletedProcess]:
    """Each ("case", name, code) step of ``steps`` as if run by ``python -c code`` in the checkout, all in one
    interpreter (see _DRIVER); ("import", "", code) steps run in the driver itself, before the cases after them."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    driver = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(steps), str(folder)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert driver.returncode == 0, driver.stderr[-3000:]
    return {name: subprocess.CompletedProcess([name], code, (folder / f"{number}.out").read_text(),
                                              (folder / f"{number}.err").read_text())
            for name, (number, code) in json.loads(driver.stdout.strip().splitlines()[-1]).items()}


COMPLETIONS = [
    ("train", "mod", "model="),
    ("train", "trainer.ep", "trainer.epochs="),
    ("eval", "eval=digits_r", "eval=digits_robustness"),
    ("eval", "eval.adversarial.sp", "eval.adversarial.spsa."),
    ("eval", "eval.roots.v", "eval.roots.val="),
]


def _completion_code(app: str, line: str) -> str:
    """The app's bash completion query (what Hydra's installed completion runs on a TAB), then whether torch or timm
    got imported."""
    return textwrap.dedent(f"""
        import contextlib, io, os, runpy, sys
        os.environ["COMP_LINE"] = "python {app}.py {line}"
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


@pytest.fixture(scope="module")
def completions(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every query of COMPLETIONS, each in a fresh process forked from an interpreter that imported only what a TAB
    imports first (quest_cli and quest.cli: what train.py and eval.py import), so "imported: []" still covers it."""
    steps = [("import", "", "import quest_cli, quest.cli")]
    steps += [("case", f"{app} {line}", _completion_code(app, line)) for app, line, _ in COMPLETIONS]
    return _fresh_cases(steps, tmp_path_factory.mktemp("completion"))


@pytest.mark.process  # a TAB starts a Python of its own: what it imports is the point
@pytest.mark.parametrize("app,line,expected", COMPLETIONS)
def test_tab_completion_answers_without_importing_torch(completions, app, line, expected):
    result = completions[f"{app} {line}"]
    assert result.returncode == 0, result.stderr[-3000:]
    answer, imported = result.stdout.strip().rsplit("\n", 1)
    assert expected in answer.split(), answer
    assert imported == "imported: []", imported


@pytest.mark.process  # what the first import of a process registers: only a fresh sys.modules shows it
def test_import_quest_registers_with_timm_without_an_import_hook(tmp_path):
    """`import quest` registers quest's attn_layer names and quest_vit with timm at once (whichever of quest and timm
    comes first, and when the first import is a sub-package), without a finder on sys.meta_path; the commands'
    entry module (quest_cli) defers it to the first model built, so that their --help imports no torch."""
    no_hook = ("\nassert not [f for f in sys.meta_path if type(f).__module__.startswith('quest')], sys.meta_path\n"
               "assert 'quest.models' in sys.modules\n")
    checks = {
        "import quest": "import sys, quest" + no_hook,
        "timm first": "import sys, timm, quest" + no_hook,
        "quest.attention": "import sys, quest.attention" + no_hook,
        "quest.models": "import sys, quest.models" + no_hook,
        "quest.train": "import sys, quest.train" + no_hook,
        "a command builds a model": "import sys, quest_cli, quest\nassert 'timm' not in sys.modules\n"
                                    "import quest.models" + no_hook,
    }
    tail = ("\nfrom quest.attention.timm_names import timm_attention_table\n"
            "assert 'quest' in timm_attention_table()\n"
            "import timm\nm = timm.create_model('vit_pico_patch4_16', attn_layer='qknorm', num_classes=3)\n"
            "print(type(m.blocks[0].attn).__name__)\n")
    # the commands' deferral without torch is checked in a child forked before anything is imported. The cases are
    # about the order of quest and timm only, so they are forked after the driver imported what timm imports from
    # other packages (torch, torchvision, sympy, wandb, ...: most of the seconds), but neither timm nor quest.
    preload = "import sys, torch, torchvision, huggingface_hub, safetensors.torch, sympy\n"
    if importlib.util.find_spec("wandb"):  # timm imports it when installed (quest[wandb])
        preload += "import wandb\n"
    steps = [("case", "no torch", "import sys, quest_cli, quest, quest.cli, quest.config.help\n"
                                  "assert 'torch' not in sys.modules, 'a command imported torch before its model'"),
             ("import", "", preload + "assert not {'timm', 'quest'} & set(sys.modules), sorted(sys.modules)")]
    steps += [("case", name, head + tail) for name, head in checks.items()]
    results = _fresh_cases(steps, tmp_path)
    assert len(results) == 7
    for name, result in results.items():
        assert result.returncode == 0, (name, result.stderr[-3000:])
        assert name == "no torch" or "QKNorm" in result.stdout, (name, result.stdout)


def test_quest_toy_help_is_its_own_page_not_hydras(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["quest-toy", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        cli.toy()
    text = capsys.readouterr().out
    assert exit_info.value.code == 0 and text.startswith("quest-toy: ") and "powered by Hydra" not in text
    assert _listed_groups(text) == ["grid", "study"]
    printed = _described_keys(text)
    assert all(key in printed for key, _, _ in key_docs(_schemas()["toy"]))
