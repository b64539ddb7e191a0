"""Every command of docs/interop.md, run as written, in order, in a folder holding a small trained run runs/my_run and
an image folder data/, offline: the timm/DeiT weights the fine-tuning command names come from a Hugging Face cache
made here. Only the Hub upload block is not run.

bash blocks go through bash (its quoting, line continuations, -euo pipefail), with each quest console script a
function that records the argv bash built; each recorded command then runs as the app its script runs
(pyproject.toml [project.scripts]), forked from the warm zygote (tests/warm.py), or as the real console script where
only a new interpreter reads what the command needs (_needs_its_own_interpreter). python blocks run in this process,
which imported quest, as the page says they may ("in any process that imported quest")."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import timm
from safetensors.torch import save_file

from tests.interop_helpers import make_image_folder, train_tiny_run
from tests.warm import APPS, run_app

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "interop.md"
BLOCK = re.compile(r"```(bash|python)\n(.*?)```", re.S)
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]  # quest-train -> quest_cli:train
#: each console script's warm app: the APPS entry that runs the same function
WARM = {script: app for script, target in SCRIPTS.items() for app, (module, function) in APPS.items()
        if target == f"{module}:{function}"}
WEIGHT_FILES = (".pth", ".pt", ".bin", ".safetensors")


def doc_blocks() -> list[tuple[str, str]]:
    return [(lang, body) for lang, body in BLOCK.findall(DOC.read_text()) if "upload_folder" not in body]


def _fake_hub_cache(cache: Path, repo: str, model_name: str) -> None:
    """The layout huggingface_hub reads offline: refs/main -> snapshots/<revision>/model.safetensors."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    revision = "0" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(revision)
    snapshot = folder / "snapshots" / revision
    snapshot.mkdir(parents=True)
    state = timm.create_model(model_name).state_dict()  # random weights with DeiT-Ti's shapes and 1000 classes
    save_file({k: v.contiguous() for k, v in state.items()}, str(snapshot / "model.safetensors"))


def _env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # the console scripts as pyproject.toml declares them, for a checkout whose install predates quest-export
    for script, target in SCRIPTS.items():
        module, function = target.split(":")
        (bin_dir / script).write_text(f"#!{sys.executable}\nfrom {module} import {function}\n{function}()\n")
        (bin_dir / script).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
            "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
            "HF_HUB_CACHE": str(tmp_path / "hub"), "HYDRA_FULL_ERROR": "1"}


def _recorded_commands(body: str, work: Path, env: dict[str, str], record: Path) -> list[list[str]]:
    """The quest commands of a bash block, as bash expands them (each console script a function writing its argv,
    count first, NUL-separated). A block whose other shell commands used a quest command's output would see it
    missing here and fail: such a block would need its commands run for real inside bash."""
    record.write_bytes(b"")
    functions = "".join(f'{script}() {{ printf "%s\\0" "$#" {script} "$@" >> "$QUEST_DOC_COMMANDS"; }}\n'
                        for script in SCRIPTS)
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", functions + body], cwd=work,
                            env={**env, "QUEST_DOC_COMMANDS": str(record)}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"bash could not run the block:\n{body}\n--- stderr ---\n{result.stderr[-3000:]}"
    fields, commands = record.read_bytes().decode().split("\0")[:-1], []
    while fields:
        count = int(fields[0])
        commands.append(fields[1:2 + count])
        fields = fields[2 + count:]
    return commands


def _needs_its_own_interpreter(args: list[str]) -> bool:
    """Weights named by a timm tag or a Hub repository (not local-dir:, not a file) are read from the Hugging Face
    cache, whose folder huggingface_hub takes from HF_HUB_CACHE when it is imported. The warm zygote imported it
    with the test session's environment, so only a new interpreter reads this test's cache."""
    for arg in args:
        key, _, value = arg.partition("=")
        if key in ("model.pretrained", "weights") and value and not value.startswith("local-dir:") \
                and not value.endswith(WEIGHT_FILES):
            return True
    return False


def _run(command: list[str], work: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    script, *args = command
    if _needs_its_own_interpreter(args):
        return subprocess.run([script, *args], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    return run_app(WARM[script], *args, cwd=work, env=env, timeout=600)


def test_docs_have_the_commands_the_issue_asks_for():
    text = " ".join(body for _, body in BLOCK.findall(DOC.read_text()))
    for needed in ("quest-export", "local-dir:export", "upload_folder", "model.pretrained=deit_tiny_patch16_224",
                   "quest-eval model=", "resolve_data_config"):
        assert needed in text, needed
    assert "docs/interop.md" in (ROOT / "README.md").read_text()


def test_every_console_script_has_its_warm_app():
    assert sorted(WARM) == sorted(SCRIPTS)


@pytest.mark.slow
@pytest.mark.process  # the fine-tuning from a timm tag reads a Hub cache only a new interpreter finds (see above)
def test_every_command_in_docs_interop_runs_as_written(tmp_path, capsys):
    work = tmp_path / "work"
    data = make_image_folder(work / "data")
    train_tiny_run(data, work / "runs" / "my_run")
    _fake_hub_cache(tmp_path / "hub", "timm/deit_tiny_patch16_224.fb_in1k", "deit_tiny_patch16_224")
    env = _env(tmp_path)
    for lang, body in doc_blocks():
        if lang == "python":
            with contextlib.chdir(work):  # the block's relative paths (local-dir:export), as in a shell in work/
                exec(compile(body, f"{DOC.name} block", "exec"), {"__name__": "__main__"})  # noqa: S102
            continue
        commands = _recorded_commands(body, work, env, tmp_path / "commands")
        assert commands, f"a bash block without a quest command:\n{body}"
        for command in commands:
            result = _run(command, work, env)
            assert result.returncode == 0, f"failed: {command}\n--- stderr ---\n{result.stderr[-3000:]}"
    # the load block's print: quest's attention, and the run's mean and crop_pct (interop_helpers.train_tiny_run)
    assert "QuestAttention [0.5, 0.5, 0.5] 0.875" in capsys.readouterr().out.splitlines()
    config = json.loads((work / "export" / "config.json").read_text())
    assert config["architecture"] == "quest_vit.quest"
    summary = json.loads((work / "runs" / "deit_tiny_quest" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["attention"] == "quest"
    assert json.loads((work / "runs" / "from_export" / "summary.json").read_text())["attention"] == "qknorm"
    assert shutil.which("bash")
