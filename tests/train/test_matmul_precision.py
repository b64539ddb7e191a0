"""trainer.matmul_precision (docs/training.md, "Float32 matmul precision"): the level torch runs float32 matmuls and
cuDNN convolutions at, set at every start (a process's earlier run does not leak into the next), recorded in
run.json as torch reports it, checked before any work, and part of the run's identity (a resume may not change it)."""
from __future__ import annotations

import json

import pytest
import torch

from quest.train import fit
from quest.train.compute import set_matmul_precision

from ..helpers import FAST, compose_cfg


@pytest.fixture(autouse=True)
def _torch_defaults_restored():
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(before[0])
    torch.backends.cudnn.allow_tf32 = before[1]


@pytest.mark.parametrize("level, tf32", [("highest", False), ("high", True), ("medium", True)])
def test_each_level_sets_matmuls_and_convolutions_together(level, tf32):
    ran = set_matmul_precision(level)
    # torch's own getters, not quest's bookkeeping: what kernels will be chosen by
    assert torch.get_float32_matmul_precision() == level
    assert torch.backends.cuda.matmul.allow_tf32 is tf32 and torch.backends.cudnn.allow_tf32 is tf32
    assert ran == {"float32_matmul_precision": level, "cuda_matmul_allow_tf32": tf32, "cudnn_allow_tf32": tf32}


def test_an_unknown_level_is_refused_before_the_run_directory_is_made(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match=r"trainer\.matmul_precision.*one of highest, high, medium"):
        fit(compose_cfg(*FAST, "trainer.matmul_precision=tf32"), run_dir)
    assert not run_dir.exists()


def test_each_start_sets_and_records_the_level_it_ran_with(tmp_path):
    torch.set_float32_matmul_precision("medium")  # what an earlier run in this process (a sweep, a test) left
    fit(compose_cfg(*FAST, "trainer.max_steps=1"), tmp_path / "default")
    history = json.loads((tmp_path / "default" / "run.json").read_text())["history"]
    assert history[-1]["ran"]["float32_matmul_precision"] == "highest"
    assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32

    fit(compose_cfg(*FAST, "trainer.max_steps=1", "trainer.matmul_precision=high"), tmp_path / "tf32")
    record = json.loads((tmp_path / "tf32" / "run.json").read_text())
    assert record["config"]["trainer"]["matmul_precision"] == "high"
    assert record["history"][-1]["ran"] == {"float32_matmul_precision": "high", "cuda_matmul_allow_tf32": True,
                                            "cudnn_allow_tf32": True, "torch_threads": 1}  # a CPU preset's one
    # the level changes the numbers on a GPU: resuming the run at another level is refused, naming the key
    with pytest.raises(ValueError, match=r"trainer\.matmul_precision: 'high' -> 'highest'"):
        fit(compose_cfg(*FAST, "trainer.max_steps=2"), tmp_path / "tf32")
