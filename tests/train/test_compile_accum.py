"""CUDA-graph compile modes with gradient accumulation (docs/training.md, "Compile"): refused before any work, naming
both keys, wherever the run would capture CUDA graphs; allowed where it would not (one micro-batch per step, the
modes without graphs, max-autotune on the CPU)."""
from __future__ import annotations

import pytest
import torch

from quest.runtime.distributed import DistContext
from quest.train.checks import ConfigError, check_compile_mode, check_train_config

from ..helpers import FAST, compose_cfg

_GPU = DistContext(device=torch.device("cuda", 0))


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_modes_with_accumulation_are_refused_naming_both_keys(mode):
    overrides = [*FAST, "trainer.compile=true", f"trainer.compile_mode={mode}", "trainer.accum_steps=2"]
    with pytest.raises(ConfigError, match=r"trainer.compile_mode captures CUDA graphs, which quest does not combine "
                                          r"with trainer.accum_steps=2"):
        check_train_config(compose_cfg(*overrides, "trainer.device=cuda"))
    # trainer.device=auto: decided when the run starts, on the device it found
    trainer = compose_cfg(*overrides).trainer
    with pytest.raises(ConfigError, match=rf"^trainer.compile_mode={mode} captures CUDA graphs, which quest does not "
                                          r"combine with trainer.accum_steps=2 .*trainer.accum_steps=1$"):
        check_compile_mode(trainer, _GPU)


def test_what_captures_no_graph_or_replays_once_per_step_is_allowed():
    accumulating = [*FAST, "trainer.compile=true", "trainer.accum_steps=4"]
    check_compile_mode(compose_cfg(*accumulating, "trainer.compile_mode=max-autotune-no-cudagraphs").trainer, _GPU)
    check_compile_mode(compose_cfg(*accumulating, "trainer.compile_mode=default").trainer, _GPU)
    # the CPU: max-autotune autotunes its kernels and captures no graph
    check_compile_mode(compose_cfg(*accumulating, "trainer.compile_mode=max-autotune").trainer, DistContext())
    check_train_config(compose_cfg(*accumulating, "trainer.compile_mode=max-autotune", "trainer.device=cpu"))
    one_micro_batch = compose_cfg(*FAST, "trainer.compile=true", "trainer.compile_mode=reduce-overhead")
    check_compile_mode(one_micro_batch.trainer, _GPU)
