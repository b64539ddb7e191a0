"""quest installs beside the torch an environment already has: ``pip install -e .`` into a venv holding the floor's
torch and torchvision (constraints-floor.txt) keeps them, because pyproject.toml's lower bounds admit them.

Runs where ``QUEST_FLOOR_VENV`` names such a venv (.ci/run's floor phase makes one; a multi-GB install is no part of
a test): skipped otherwise, saying so."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ..helpers import ROOT

FLOOR_VENV = os.environ.get("QUEST_FLOOR_VENV")


def _pinned(name: str) -> str:
    """The version constraints-floor.txt pins ``name`` to."""
    for line in (ROOT / "constraints-floor.txt").read_text().splitlines():
        if line.lower().startswith(f"{name}=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError(f"constraints-floor.txt pins no {name}")


def _installed(python: Path, name: str) -> str:
    out = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.process  # pip, and the venv's own interpreter reading what it holds
@pytest.mark.skipif(not FLOOR_VENV, reason="QUEST_FLOOR_VENV names no venv holding the floor's torch "
                    "(.ci/run's floor phase sets it)")
def test_installing_quest_keeps_the_floor_torch_an_environment_already_has():
    python = Path(FLOOR_VENV) / "bin" / "python"
    before = {name: _installed(python, name) for name in ("torch", "torchvision")}
    assert before == {name: _pinned(name) for name in before}, "the venv does not hold the floor's torch"
    out = subprocess.run([str(python), "-m", "pip", "install", "-e", str(ROOT)], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert {name: _installed(python, name) for name in before} == before, out.stdout[-2000:]
    assert "Uninstalling torch" not in out.stdout
