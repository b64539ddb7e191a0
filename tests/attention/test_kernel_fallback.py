"""The fused kernels on first contact with a device (quest.attention.fused_check, quest.attention.fused_launch):
every launch runs under its input's device; under ``attention.fused=auto`` a kernel that fails (an exception, a
wrong value, Triton missing) is found by its one self-check, said in ONE warning line, and the run goes on on the
PyTorch path with the same numbers and says so in its records; ``on`` refuses before anything is written; ``off``
launches nothing. The CPU stands in for a GPU: ``fused_path("auto")`` makes CPU tensors take the kernel path (the
kernels in Triton's interpreter under TRITON_INTERPRET=1), and the failures are injected by patching the launcher."""
from __future__ import annotations

import json
import logging
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import quest.attention
from quest.attention import fused, fused_check, fused_launch
from quest.attention.fused_check import triton_too_old
from quest.evaluation import register_eval_configs, run_evaluation
from quest.models.factory import create_model
from quest.report.runs import RunResult
from quest.report.tables import kernel_note
from quest.runtime.errors import is_user_error
from quest.train import fit
from tests.attention.test_fused_kernels import DEVICE, kernels
from tests.helpers import FAST, compose_cfg, eval_cfg
from tests.tree_state import tree_state
from tests.warm import run_app


def _model(attention: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model("vit_tiny_patch16_224", attention, depth=2, num_classes=5, img_size=16, patch_size=8).train()


def _step(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Logits and every gradient of one forward/backward."""
    model.zero_grad(set_to_none=True)
    out = model(torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)))
    out.logsumexp(-1).sum().backward()
    return {"logits": out.detach(), **{n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


def _fallback_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "attention.fused" in r.getMessage()]


def _no_compiler() -> None:
    raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")


def _off_by_five_percent(launch):  # noqa: ANN001, ANN202
    def wrong(*args):  # noqa: ANN002, ANN202
        first, *rest = launch(*args)
        return (first * 1.05, *rest)
    return wrong


def _inject(monkeypatch: pytest.MonkeyPatch, failure: str) -> str:
    """Make the kernels fail as ``failure`` says; returns what the warning must name."""
    if failure == "launch":
        monkeypatch.setattr(fused_launch, "_kernels", _no_compiler)
        return "Failed to find C compiler"
    if failure == "wrong":
        for name in ("l2_normalize_forward", "layer_norm_forward"):
            monkeypatch.setattr(fused_launch, name, _off_by_five_percent(getattr(fused_launch, name)))
        return "differs from its PyTorch reference"
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    monkeypatch.delitem(sys.modules, "quest.attention.triton_kernels", raising=False)
    monkeypatch.delattr(quest.attention, "triton_kernels", raising=False)
    return "triton"


@pytest.mark.parametrize("failure", ["launch", "wrong", "no_triton"])
@pytest.mark.parametrize("attention", ["quest", "qknorm_ds"])
def test_a_failing_kernel_warns_once_and_the_model_runs_the_pytorch_path(attention, failure, monkeypatch, caplog):
    model = _model(attention)
    with fused.fused_path(False):
        want = _step(model)
    cause = _inject(monkeypatch, failure)
    with fused.fused_path("auto"), caplog.at_level(logging.WARNING):
        got = [_step(model) for _ in range(2)]
        record = fused.record()
    warnings = _fallback_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert cause in warnings[0] and "the PyTorch path runs instead" in warnings[0]
    assert record["path"] == "pytorch" and cause in record["reason"], record
    assert len(record["checks"]) == 1 and not record["checks"][0]["ok"]  # one check; the device is then off
    for step in got:
        for name in want:
            assert torch.equal(step[name], want[name]), name


def test_a_passing_check_runs_the_kernels_and_is_made_once(monkeypatch):
    """A kernel that passes is checked once per (device, dtype, head width, kernel), then launched every call."""
    calls: list[tuple] = []
    real = fused_check.check_kernel

    def counted(*args):  # noqa: ANN002, ANN202
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(fused_check, "check_kernel", counted)
    launches = []
    real_forward = fused_launch.l2_normalize_forward
    monkeypatch.setattr(fused_launch, "l2_normalize_forward", lambda *a: launches.append(1) or real_forward(*a))
    model = _model("qknorm")
    with fused.fused_path("auto"):
        for _ in range(3):
            _step(model)
        record = fused.record()
    assert calls == [("l2_normalize", torch.device("cpu"), torch.float32, 64)]
    assert record["path"] == "fused" and record["checks"][0]["ok"], record
    # 2 (the check: no scale, one per head) + 3 steps x 2 layers x 2 normalisations
    assert len(launches) == 2 + 3 * 2 * 2


def test_on_stops_at_a_failing_kernel_in_one_line(monkeypatch):
    _inject(monkeypatch, "launch")
    refused = pytest.raises(fused_check.KernelUnavailable, match="^attention.fused=on: the fused l2_normalize")
    with fused.fused_path("on"), refused as err:
        _step(_model("quest"))
    assert "\n" not in str(err.value) and is_user_error(err.value)  # printed as one line, no traceback


def test_off_launches_nothing(monkeypatch):
    monkeypatch.setattr(fused_launch, "_kernels", lambda: pytest.fail("a kernel was launched"))
    monkeypatch.setattr(fused_check, "check_kernel", lambda *a: pytest.fail("a kernel was checked"))
    with fused.fused_path("off"):
        _step(_model("qknorm_ds"))
        assert fused.record()["path"] == "pytorch"


class _Recorder:
    """A stand-in for the Triton kernels module: each ``kernel[grid](...)`` records the device guard it runs in."""

    def __init__(self, guards: list) -> None:
        self.guards, self.launches = guards, []

    def __getattr__(self, name: str):  # noqa: ANN204
        def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.launches.append((name, self.guards[-1] if self.guards else None, args[0].device))
        return _Grid(launch)


class _Grid:
    def __init__(self, launch) -> None:  # noqa: ANN001
        self.launch = launch

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        return self.launch


def test_every_launch_runs_under_its_inputs_device(monkeypatch):
    """Triton launches on the current CUDA device: each launch is made inside a guard for its input's device."""
    guards: list = []

    @contextmanager
    def guard(device):  # noqa: ANN001, ANN202
        guards.append(device)
        try:
            yield
        finally:
            guards.pop()

    kernels = _Recorder(guards)
    monkeypatch.setattr(fused_launch, "device_guard", guard)
    monkeypatch.setattr(fused_launch, "_kernels", lambda: kernels)
    monkeypatch.setattr(fused_launch, "triton_runs", lambda x: True)
    x = torch.randn(2, 3, 5, 8).transpose(1, 2).contiguous().transpose(1, 2)
    g, w, mean = torch.randn_like(x), torch.ones(8), torch.zeros(2, 3, 5, 1)
    fused_launch.l2_normalize_forward(x, 1e-6, None)
    fused_launch.l2_normalize_backward(g, x, mean, None, 1e-6)
    fused_launch.layer_norm_forward(x, w, w, 1e-5)
    fused_launch.layer_norm_backward(g, x, w, mean, mean)
    fused_launch.elliptical_m(x, g, 1e-6)
    assert [k for k, _, _ in kernels.launches] == ["l2_normalize_fwd", "l2_normalize_bwd", "layer_norm_fwd",
                                                   "layer_norm_bwd", "elliptical_m"]
    assert all(guarded == device for _, guarded, device in kernels.launches), kernels.launches


def test_the_guard_makes_the_inputs_cuda_device_current():
    guard = fused_launch.device_guard(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert not isinstance(fused_launch.device_guard(torch.device("cpu")), torch.cuda.device)


def test_a_training_run_falls_back_and_records_why(tmp_path, monkeypatch, caplog):
    """A tiny run in-process whose kernel fails its check: it completes on the PyTorch path, warns once, and its
    summary.json says which path ran and why."""
    _inject(monkeypatch, "launch")
    with fused.fused_path("auto"), caplog.at_level(logging.WARNING):
        summary = fit(compose_cfg(*FAST, "trainer.epochs=1", "trainer.max_steps=2"), tmp_path)
    assert summary["status"] in ("completed", "stopped")
    assert len(_fallback_warnings(caplog)) == 1
    stored = json.loads((tmp_path / "summary.json").read_text())["attention_kernels"]
    assert stored["setting"] == "auto" and stored["path"] == "pytorch"
    assert "Failed to find C compiler" in stored["reason"] and "PyTorch path runs instead" in stored["reason"]


def test_on_is_refused_on_the_cpu_before_the_run_directory_is_made(tmp_path):
    out = run_app("train.py", *FAST, "attention.fused=on", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    assert "attention.fused=on: the fused kernels run on CUDA devices only" in out.stderr
    assert tree_state(tmp_path) == {}


def test_a_bad_setting_is_refused_naming_the_key(tmp_path):
    out = run_app("train.py", *FAST, "attention.fused=maybe", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 1 and "attention.fused" in out.stderr and "auto, on, off" in out.stderr, out.stderr


def _run(path: str | None, reason: str = "") -> RunResult:
    summary = {"attention_kernels.path": path, "attention_kernels.reason": reason} if path else {}
    return RunResult(Path("run"), "completed", summary, None, {})


def test_the_report_says_which_path_ran_where_kernels_were_near():
    """quest-report's notes: the kernels' path where a run used them or fell back, nothing for CPU runs."""
    failed = "attention.fused=auto: the fused l2_normalize kernel on cuda:0 (float32, head width 64) failed its check"
    assert kernel_note([_run("pytorch", "no kernel was used"), _run(None)]) == ""
    assert kernel_note([_run("fused", "every kernel used passed"), _run("fused")]) == "kernels: 2 fused"
    assert kernel_note([_run("fused"), _run("pytorch", failed)]) == f"kernels: 1 fused, 1 pytorch ({failed})"


register_eval_configs()
EVAL = ("model.name=vit_pico_patch4_16", "model.img_size=16", "attention=quest", "data=digits", "eval=clean")


def test_an_evaluation_follows_the_setting_and_records_the_path(tmp_path, monkeypatch, caplog):
    """eval.py's evaluations take attention.fused as training does: a failing kernel, one warning, the PyTorch
    path, and eval_results.json says so."""
    _inject(monkeypatch, "launch")
    with fused.fused_path("auto"), caplog.at_level(logging.WARNING):
        report = run_evaluation(eval_cfg(*EVAL), tmp_path / "out")
    assert len(_fallback_warnings(caplog)) == 1
    stored = json.loads((tmp_path / "out" / "eval_results.json").read_text())["attention_kernels"]
    assert stored == report["attention_kernels"] and stored["path"] == "pytorch", stored
    assert "Failed to find C compiler" in stored["reason"]


def test_an_evaluation_with_on_is_refused_on_the_cpu_before_its_directory(tmp_path):
    with pytest.raises(ValueError, match="^attention.fused=on: the fused kernels run on CUDA devices only"):
        run_evaluation(eval_cfg(*EVAL, "attention.fused=on"), tmp_path / "out")
    assert tree_state(tmp_path) == {}


@kernels
def test_check_kernels_reports_every_kernel(monkeypatch):
    """The public check (bench/gpu.py's): every kernel ok (on the GPU, or in Triton's interpreter); a wrong one named,
    with its error."""
    checks = fused.check_kernels(DEVICE, torch.float32, 16)
    assert [c.kernel for c in checks] == ["l2_normalize", "layer_norm", "elliptical_m"]
    assert all(c.device.startswith(DEVICE) and c.head_dim == 16 for c in checks), checks
    # a kernel the installed Triton is too old for is refused without a launch, naming the release it needs
    assert all(c.ok and c.max_abs_error < 1e-4 if not triton_too_old(c.kernel) else
               (not c.ok and c.reason == triton_too_old(c.kernel) and c.max_abs_error is None) for c in checks), checks
    _inject(monkeypatch, "wrong")
    l2, layer_norm, _ = fused.check_kernels(DEVICE, torch.bfloat16, 16)
    assert not l2.ok and not layer_norm.ok and l2.max_abs_error > 0.02
    assert "differs from its PyTorch reference" in l2.reason and l2.dtype == "bfloat16"


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [24, 256])
def test_the_kernels_pass_their_check_in_every_dtype(dtype, head_dim):
    """The check's tolerance lets the right kernels through (a false failure would turn them off on a GPU)."""
    checks = fused.check_kernels(DEVICE, dtype, head_dim)
    assert all(c.ok or c.reason == triton_too_old(c.kernel) for c in checks), [c.reason for c in checks if not c.ok]


def test_a_kernel_is_not_used_under_a_triton_older_than_it_needs(monkeypatch, caplog):
    """Under a Triton older than a kernel needs (fused_check.TRITON_NEEDED), its check fails before any launch,
    naming both releases, and attention.fused=auto runs the PyTorch path, said once."""
    monkeypatch.setattr(fused_check, "triton_release", lambda: (3, 0))
    monkeypatch.setattr(fused_launch, "l2_normalize_forward", lambda *a: pytest.fail("launched"))
    check = fused.check_kernels("cpu", torch.float32, 16)[0]
    needs = fused_check.TRITON_NEEDED["l2_normalize"]
    assert (check.kernel, check.ok, check.max_abs_error) == ("l2_normalize", False, None)
    assert check.reason == (f"the fused l2_normalize kernel needs triton>={needs[0]}.{needs[1]}; this environment "
                            "has triton 3.0")
    with fused.fused_path("auto"), caplog.at_level(logging.WARNING):
        assert not fused.fused_applies(torch.randn(1, 2, 4, 8))
        assert fused.record()["path"] == "pytorch"
    assert len(_fallback_warnings(caplog)) == 1 and "needs triton>=" in _fallback_warnings(caplog)[0]
    monkeypatch.setattr(fused_check, "triton_release", lambda: (99, 0))
    assert fused_check.triton_too_old("elliptical_m") is None


def test_after_a_failing_check_no_kernel_runs_on_that_device(monkeypatch, caplog):
    """qknorm_ds's LayerNorm passes, then elliptical's m fails: from then on neither runs, said once, recorded."""
    x = torch.randn(1, 2, 4, 8)
    with fused.fused_path("auto"), caplog.at_level(logging.WARNING):
        assert fused.fused_applies(x, "layer_norm")
        monkeypatch.setattr(fused_launch, "elliptical_m", lambda *a: _no_compiler())
        assert not fused.fused_applies(x, "elliptical_m")
        assert not fused.fused_applies(x, "layer_norm") and not fused.fused_applies(x, "l2_normalize")
        record = fused.record()
    assert len(_fallback_warnings(caplog)) == 1
    assert record["path"] == "fused until a check failed"
    assert [(c["kernel"], c["ok"]) for c in record["checks"]] == [("layer_norm", True), ("elliptical_m", False)]


def test_a_tensor_past_the_kernels_row_index_takes_the_pytorch_path():
    """The kernels' addresses are 64-bit, their row index 32-bit: a tensor of 2^31 rows or more never reaches them,
    whatever the setting (meta tensors: the shapes without the memory)."""
    with fused.fused_path(True):
        assert fused.fused_applies(torch.empty(1, 1, 2 ** 31 - 1, 16, device="meta"))
        assert not fused.fused_applies(torch.empty(1, 1, 2 ** 31, 16, device="meta"))
