"""The formulations' fused GPU operators (quest.attention.fused): each Triton kernel, run on the CPU in Triton's
interpreter, equals its PyTorch reference in values and gradients; each reference's hand-written backward equals
autograd's derivative of the plain formula in float64; a model on the fused path equals the PyTorch path, keeps for
backward at most 5% more than standard attention under bf16 autocast with CUDA's rules, and moves (the proxy of
bench/dispatch_proxy.py) at most a few percent more than standard attention on a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import quest.attention.recompute as recompute
from bench.dispatch_proxy import cuda_autocast_rules, step_cost
from quest.attention import fused, fused_reference, list_attentions
from quest.attention.elliptical import elliptical_weights
from quest.attention.fused_check import TRITON_NEEDED, triton_too_old
from quest.attention.fused_launch import triton_runs
from quest.models.factory import create_model
from quest.runtime.versions import TORCH_VERSION
from tests.attention.test_attention_memory import _kept_by_forward

pytestmark = pytest.mark.numerics


#: where the kernels run: the GPU, or the CPU in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
#: before Triton is imported, on a machine without an NVIDIA GPU)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_runnable = pytest.mark.skipif(not triton_runs(torch.empty(0, device=DEVICE)),
                               reason="no GPU and TRITON_INTERPRET is not 1 (set it before Triton is imported)")


def kernels(test):
    """A kernel test: in both tiers of the suite (tests/conftest.py), on the GPU where there is one."""
    return pytest.mark.kernels(_runnable(test))


def _not_used_here(attention_or_kernel: str) -> str | None:
    """Why quest does not use a kernel (or a formulation's kernel) under the installed Triton, or None: its self-check
    fails naming the Triton release it needs (tests/attention/test_kernel_fallback.py), and the PyTorch path runs."""
    kernel = "elliptical_m" if attention_or_kernel.startswith("elliptical") else attention_or_kernel
    why = triton_too_old(kernel) if kernel in TRITON_NEEDED else None
    return f"{why}: quest runs the PyTorch path instead, so this kernel is not tested here" if why else None


def used_here(kernel: str):
    """Skip a test of ``kernel`` under a Triton that quest does not use it with, saying so."""
    return pytest.mark.skipif(_not_used_here(kernel) is not None, reason=str(_not_used_here(kernel)))


def skip_unless_used(attention: str) -> None:
    why = _not_used_here(attention)
    if why:
        pytest.skip(why)


def _projection_view(b: int, h: int, n: int, d: int, dtype: torch.dtype, which: int = 1,
                     device: str = "cpu") -> torch.Tensor:
    """q, k or v as the model has them: a strided (B, H, N, d) view of a (B, N, 3, H, d) projection."""
    qkv = torch.randn(b, n, 3, h, d, dtype=torch.float64).to(dtype).to(device)
    return qkv.permute(2, 0, 3, 1, 4)[which]


def _scale(kind: str, h: int, dtype: torch.dtype) -> torch.Tensor | None:
    if kind == "none":
        return None
    return (torch.rand(1 if kind == "scalar" else h, dtype=torch.float64) * 3 + 0.5).to(DEVICE, dtype).view(
        (1,) if kind == "scalar" else (h, 1, 1))


def _grads(fn, *inputs: torch.Tensor | None, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in inputs]
    out = fn(*leaves)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
    g = g.to(out.device)
    work = torch.promote_types(out.dtype, torch.float32)
    (out.to(work) * g.to(work)).sum().backward()
    return out.detach(), [t.grad if t is not None else None for t in leaves]


TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}
shapes = st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 21), st.sampled_from([8, 24, 64]))


@kernels
@settings(max_examples=12, deadline=None)
@given(shape=shapes, dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       kind=st.sampled_from(["none", "scalar", "head"]), tiny=st.booleans())
def test_the_l2_kernel_equals_its_reference(shape, dtype, kind, tiny):
    b, h, n, d = shape
    x = _projection_view(b, h, n, d, dtype, device=DEVICE)
    if tiny:  # rows below the norm floor take the other branch of the backward
        x = x * 1e-8
    scale = _scale(kind, h, dtype)
    out, grads = _grads(lambda x_, s_: fused.l2_normalize_fused(x_, 1e-6, s_), x, scale)
    ref, ref_grads = _grads(lambda x_, s_: fused.l2_normalize_reference(x_, 1e-6, s_)[0], x, scale)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    for got, want in zip(grads, ref_grads):
        if want is not None:
            torch.testing.assert_close(got, want, atol=TOL[dtype] * 10, rtol=TOL[dtype])


@kernels
@settings(max_examples=8, deadline=None)
@given(shape=shapes, dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_the_layer_norm_kernel_equals_its_reference(shape, dtype):
    b, h, n, d = shape
    x = _projection_view(b, h, n, d, dtype, which=0, device=DEVICE)
    weight, bias = torch.randn(d, device=DEVICE), torch.randn(d, device=DEVICE)

    def kernel(x_, w_, b_):
        return fused._LayerNorm.apply(x_, w_, b_, 1e-5)[0]

    def reference(x_, w_, b_):
        return fused.layer_norm_reference(x_, w_, b_, 1e-5)[0]

    out, grads = _grads(kernel, x, weight, bias)
    ref, ref_grads = _grads(reference, x, weight, bias)
    torch.testing.assert_close(out, ref, atol=TOL[dtype] * 5, rtol=TOL[dtype])
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=TOL[dtype] * 50, rtol=TOL[dtype] * 5)


@kernels
@used_here("elliptical_m")
@settings(max_examples=8, deadline=None)
@given(shape=shapes, dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_the_elliptical_kernel_equals_its_reference(shape, dtype):
    b, h, n, d = shape
    v, v_prev = _projection_view(b, h, n, d, dtype, 2, DEVICE), _projection_view(b, h, n, d, dtype, 2, DEVICE)
    with fused.fused_path(False):
        want = elliptical_weights(v, v_prev, "mean", 1e-6)
    got = fused.elliptical_m_fused(v, v_prev, 1e-6)
    assert got.shape == want.shape == (b, h, 1, d) and got.dtype == dtype
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@kernels
@pytest.mark.parametrize("kind", ["none", "scalar", "head"])
def test_the_l2_backward_is_autograds_derivative_of_the_formula(kind):
    """The hand-written backward (reference and kernel alike) against autograd through F.normalize, float64."""
    x = _projection_view(2, 3, 7, 16, torch.float64, device=DEVICE)
    x = torch.cat([x[:, :, :6], x[:, :, 6:] * 1e-9], dim=2)  # one token below the floor
    scale = _scale(kind, 3, torch.float64)
    _, grads = _grads(lambda x_, s_: fused.L2Normalize.apply(x_, 1e-6, s_, False)[0], x, scale)
    _, want = _grads(lambda x_, s_: F.normalize(x_, dim=-1, eps=1e-6) * (1 if s_ is None else s_), x, scale)
    for got, ref in zip(grads, want):
        if ref is not None:
            torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-10)
    # the kernel computes in float32: the same derivative to float32's precision
    _, kernel_grads = _grads(lambda x_, s_: fused.L2Normalize.apply(x_, 1e-6, s_, True)[0], x.float(),
                             None if scale is None else scale.float())
    for got, ref in zip(kernel_grads, want):
        if ref is not None:
            torch.testing.assert_close(got, ref.float(), atol=1e-5, rtol=1e-5)


@kernels
def test_the_layer_norm_backward_is_autograds_derivative_of_the_formula():
    x = _projection_view(2, 3, 7, 16, torch.float64, device=DEVICE)
    weight, bias = (torch.randn(16, dtype=torch.float64, device=DEVICE) for _ in range(2))
    _, grads = _grads(lambda *a: LayerNormReference.apply(*a, 1e-5), x, weight, bias)
    _, want = _grads(lambda x_, w_, b_: F.layer_norm(x_, (16,), w_, b_, 1e-5), x, weight, bias)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-10)
    _, kernel_grads = _grads(lambda *a: fused._LayerNorm.apply(*a, 1e-5)[0], x.float(), weight.float(), bias.float())
    for got, ref in zip(kernel_grads, want):
        torch.testing.assert_close(got, ref.float(), atol=1e-4, rtol=1e-5)


class LayerNormReference(torch.autograd.Function):
    """The LayerNorm reference's forward with its hand-written backward, as an autograd function: what the kernel's
    backward must equal."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = fused.layer_norm_reference(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        return (*fused_reference.layer_norm_backward_reference(g, *ctx.saved_tensors), None)


def _model(attention: str, depth: int = 2, img_size: int = 32) -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model("vit_tiny_patch16_224", attention, depth=depth, num_classes=5, img_size=img_size,
                        patch_size=8).train()


def _step(model: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        out = model(x)
    out.float().logsumexp(-1).sum().backward()
    return {"logits": out.detach().float(), **{n: p.grad.clone() for n, p in model.named_parameters()
                                                 if p.grad is not None}}


@kernels
@pytest.mark.parametrize("attention", list_attentions())
def test_a_model_on_the_fused_path_equals_the_pytorch_path(attention, monkeypatch):
    """Every formulation's logits and every parameter's gradient, fp32, with the kernels in the interpreter; the
    recompute on (MIN_BYTES 0), so the backward reruns the fused forward."""
    skip_unless_used(attention)
    monkeypatch.setattr(recompute, "MIN_BYTES", 0)
    model = _model(attention)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with fused.fused_path(False):
        want = _step(model, x, None)
    with fused.fused_path(True):
        got = _step(model, x, None)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=2e-5, rtol=2e-4, msg=f"{attention}: {name}")


@pytest.mark.parametrize("attention", [a for a in list_attentions() if a != "standard"])
def test_the_fused_recompute_gives_the_kept_gradients_to_the_bit(attention, monkeypatch):
    """Under bf16 autocast on the fused path: recomputing q', k' in the backward reruns the same operator, so the
    gradients are those of keeping them, to the bit."""
    skip_unless_used(attention)
    model = _model(attention)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with fused.fused_path(True):
        monkeypatch.setattr(recompute, "MIN_BYTES", 1 << 60)
        kept = _step(model, x, torch.bfloat16)
        monkeypatch.setattr(recompute, "MIN_BYTES", 0)
        recomputed = _step(model, x, torch.bfloat16)
    for name in kept:
        assert torch.equal(kept[name], recomputed[name]), f"{attention}: {name}"


@pytest.fixture(scope="module")
def standard_kept() -> dict[torch.dtype, int]:
    kept = {}
    for dtype in (torch.bfloat16, torch.float16):
        with fused.fused_path(True), cuda_autocast_rules(), torch.autocast("cpu", dtype=dtype):
            kept[dtype] = _kept_by_forward(_model("standard", depth=3, img_size=64), torch.randn(2, 3, 64, 64))
    return kept


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("attention", list_attentions())
def test_under_autocast_a_formulation_keeps_at_most_5_percent_more_than_standard(attention, dtype, standard_kept,
                                                                                 monkeypatch, request):
    """What a forward keeps for backward under bf16 / fp16 autocast with CUDA's rules (its float32 LayerNorm and
    norms): on the fused path at most 1.05x standard attention's (measured 1.000-1.012x; the PyTorch path kept
    1.03-1.16x here, up to 1.28x on an H200)."""
    skip_unless_used(attention)
    if attention in ("qknorm", "qknorm_hs") and TORCH_VERSION < (2, 11):
        request.applymarker(pytest.mark.xfail(strict=False, reason="under torch 2.8 the QKNorm formulations keep "
                                              "1.055x standard's in some test orders (2.11 and 2.14: within 1.05x)"))
    monkeypatch.setattr(recompute, "MIN_BYTES", 0)
    model = _model(attention, depth=3, img_size=64)
    with fused.fused_path(True), cuda_autocast_rules(), torch.autocast("cpu", dtype=dtype):
        kept = _kept_by_forward(model, torch.randn(2, 3, 64, 64))
    assert kept <= 1.05 * standard_kept[dtype], f"{attention}: {kept / standard_kept[dtype]:.3f}x standard"


def test_without_the_fused_path_cuda_rules_keep_more():
    """The measure above can fail: QKNorm-DS on the PyTorch path under CUDA's autocast rules keeps its float32
    LayerNorm input and a bf16 copy of q', k' for SDPA, well over 1.05x."""
    model = _model("qknorm_ds", depth=3, img_size=64)
    with fused.fused_path(False), cuda_autocast_rules(), torch.autocast("cpu", dtype=torch.bfloat16):
        standard = _kept_by_forward(_model("standard", depth=3, img_size=64), torch.randn(2, 3, 64, 64))
        kept = _kept_by_forward(model, torch.randn(2, 3, 64, 64))
    assert kept > 1.10 * standard


@pytest.fixture(scope="module")
def proxies() -> dict[tuple[str, bool], dict]:
    return {(a, gpu): step_cost(a, batch=2, img_size=64, gpu_path=gpu, depth=4)
            for a in list_attentions() for gpu in (True, False)}


@pytest.mark.parametrize("attention", list_attentions())
def test_on_the_gpu_path_a_formulation_moves_little_more_than_standard(attention, proxies):
    """The proxy of a GPU step (bench/dispatch_proxy.py): bytes moved by non-matmul kernels at most 1.10x standard's
    and kernels over 64 KiB at most 1.12x (the fused transform, its backward and the recompute's rerun: about 3 per
    transformed tensor and layer); on the PyTorch path the l2 formulations moved 1.2-1.5x (docs/benchmarks.md)."""
    std, cost = proxies[("standard", True)], proxies[(attention, True)]
    big = cost["launches"] - cost["small_launches"]
    assert cost["bytes"] <= 1.10 * std["bytes"], cost["bytes"] / std["bytes"]
    assert big <= 1.12 * (std["launches"] - std["small_launches"]), big / (std["launches"] - std["small_launches"])
    if attention != "standard":  # the PyTorch path moves more: the proxy tells the two apart
        assert proxies[(attention, False)]["bytes"] > cost["bytes"]


def test_cuda_rules_run_layer_norm_in_float32_and_are_undone():
    x = torch.randn(2, 4, 8)
    norm = torch.nn.LayerNorm(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.nn.functional.linear(x, torch.randn(8, 8))
        with cuda_autocast_rules():
            assert norm(y).dtype == torch.float32
            assert torch.linalg.vector_norm(y, dim=-1).dtype == torch.float32
        assert norm(y).dtype == torch.bfloat16  # the CPU's own rule again
