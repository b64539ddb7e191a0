"""trainer.compile (docs/training.md, "Compile"): the model and the loss compiled as one module, the mode passed to
torch.compile, CUDA-graph modes refused where the step cannot use them, bad values refused before any work. The
compiled step is traced with the aot_eager backend (dynamo and AOTAutograd, no inductor code generation: inductor
compiles every formulation in tests/models/test_models.py and tests/attention/test_elliptical.py)."""
from __future__ import annotations

import pytest
import torch

from quest.config.checks import ConfigError
from quest.runtime.distributed import DistContext
from quest.train.builders import ModelLoss, train_module
from quest.train.checks import check_compile_mode, check_train_config
from quest.train.trainer import Run

from ..helpers import FAST, compose_cfg


def _batch(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g))]


def test_the_compiled_step_trains_the_model_and_loss_as_the_eager_one(tmp_path):
    runs = [Run(compose_cfg(*FAST, "recipe.ema=false", *extra), tmp_path / str(i), {}, DistContext())
            for i, extra in enumerate(([], ["trainer.compile=true", "trainer.compile_backend=aot_eager"]))]
    eager, compiled = runs
    assert isinstance(compiled.train_model, torch._dynamo.eval_frame.OptimizedModule)
    assert isinstance(compiled.train_model._orig_mod, ModelLoss)  # the loss inside the compiled graph
    assert compiled.train_model._orig_mod.model is compiled.model  # the run's model: saved, evaluated, EMA'd
    compiled.model.load_state_dict(eager.model.state_dict())
    for seed in range(2):
        a, b = (torch.manual_seed(seed) and run.train_step(_batch(seed)) for run in runs)  # the same drop path
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-4)
    weights = dict(eager.model.named_parameters())
    for name, value in compiled.model.named_parameters():
        torch.testing.assert_close(value, weights[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode, passed", [("default", None), ("max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs"),
                                          ("max-autotune", "max-autotune")])
def test_the_mode_reaches_torch_compile(monkeypatch, mode, passed):
    seen = {}

    def compile_(module, **kwargs):
        seen.update(kwargs)
        return module

    monkeypatch.setattr(torch, "compile", compile_)
    trainer = compose_cfg("trainer.compile=true", f"trainer.compile_mode={mode}").trainer
    module = train_module(torch.nn.Linear(2, 2), torch.nn.CrossEntropyLoss(), trainer, DistContext())
    assert isinstance(module, ModelLoss) and seen == {"backend": "inductor", "mode": passed}


@pytest.mark.parametrize("overrides, match", [
    (["trainer.compile_mode=turbo"], r"trainer.compile_mode must be one of default, max-autotune, "
                                     r"max-autotune-no-cudagraphs, reduce-overhead, got 'turbo'"),
    (["trainer.compile_backend=tvm"], r"trainer.compile_backend must be one of inductor, aot_eager, eager"),
    (["trainer.compile_mode=max-autotune", "trainer.compile_backend=aot_eager"],
     r"trainer.compile_mode must be default unless trainer.compile_backend=inductor"),
    (["trainer.compile=true", "trainer.compile_mode=reduce-overhead", "trainer.device=cpu"],
     r"trainer.compile_mode needs a CUDA device for its CUDA graphs"),
    (["trainer.compile=true", "trainer.compile_mode=max-autotune", "trainer.strategy=fsdp", "recipe.ema=false"],
     r"trainer.compile_mode captures CUDA graphs, which quest does not combine with several processes"),
])
def test_bad_compile_settings_are_refused_before_any_work(overrides, match):
    with pytest.raises(ConfigError, match=match):
        check_train_config(compose_cfg(*FAST, *overrides))


def test_cuda_graph_modes_are_refused_where_the_run_turns_out_unable_to_use_them():
    """trainer.device=auto: the device and the process count are known only when the run starts (Run, before it
    builds anything)."""
    trainer = compose_cfg("trainer.compile=true", "trainer.compile_mode=reduce-overhead").trainer
    with pytest.raises(ConfigError, match=r"trainer.compile_mode=reduce-overhead needs a CUDA device"):
        check_compile_mode(trainer, DistContext())
    two_gpus = DistContext(rank=0, world_size=2, device=torch.device("cuda", 0))
    with pytest.raises(ConfigError, match=r"trainer.compile_mode=reduce-overhead captures CUDA graphs.*DDP"):
        check_compile_mode(trainer, two_gpus)
    check_compile_mode(trainer, DistContext(device=torch.device("cuda", 0)))  # one GPU: allowed
    autotune = compose_cfg("trainer.compile=true", "trainer.compile_mode=max-autotune").trainer
    check_compile_mode(autotune, DistContext())  # the CPU's kernels are autotuned; inductor skips the graphs
    with pytest.raises(ConfigError, match=r"max-autotune captures CUDA graphs"):
        check_compile_mode(autotune, two_gpus)
