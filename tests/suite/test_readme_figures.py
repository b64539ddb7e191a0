"""The README's and docs/getting-started.md's figures for ``python train.py`` are what the command gives: the default
run, trained here in process from the same config, rounded as the documents print it (its threads come from its
config, so the figures hold beside other jobs: tests/train/test_threads.py)."""
from __future__ import annotations

import re

import pytest

from quest.train import fit

from ..helpers import ROOT, compose_cfg

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _said(path: str) -> tuple[str, str]:
    text = " ".join((ROOT / path).read_text().split())
    found = re.search(r"(\d+\.\d)% validation top-1 \(EMA (\d+\.\d)%", text)
    assert found, f"{path} no longer says the default run's figures as this test reads them"
    return found[1], found[2]


def test_the_default_runs_figures_are_the_documents(tmp_path):
    said = {path: _said(path) for path in ("README.md", "docs/getting-started.md")}
    summary = fit(compose_cfg(), tmp_path / "run")  # python train.py's config, no override
    got = (f"{summary['val/top1']:.1f}", f"{summary['val_ema/top1']:.1f}")
    assert summary["status"] == "completed"
    assert all(figures == got for figures in said.values()), (said, got)
