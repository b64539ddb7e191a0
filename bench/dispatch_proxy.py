"""What a training step costs a GPU, counted on the CPU: the kernels it launches and the bytes its element-wise work
moves, per formulation (tests/attention/test_fused_kernels.py holds each against standard attention; docs/benchmarks.md says
how well it predicts the H200's step times). A benchmarking tool: bench/gpu_proxy.py prints its counts.

On a GPU a ViT step's matmuls run near the tensor cores' peak, and what a formulation adds is element-wise passes
over (B, H, N, d) tensors: each a kernel launch and a read and write of the tensor. Those are counted here at torch's
dispatcher (a ``TorchDispatchMode`` sees every operator autograd runs, forward and backward), under bf16 autocast
with **CUDA's** autocast rules rather than the CPU's: CUDA runs LayerNorm, norms, ``exp``, ``reciprocal`` and
softmax in float32 (casts and float32 tensors that the CPU's autocast, which keeps them in bf16, would hide), so
:func:`cuda_autocast_rules` re-registers those operators' CPU autocast kernels with CUDA's policy while counting.

- a launch: every operator that runs a kernel (views, reshapes, allocations and host reads are not kernels);
  a quest fused operator is one launch (``quest.<kernel>``), as its Triton kernel is on a GPU, whatever stands in
  for it on the CPU (quest.attention.fused_launch.STAND_IN, replaced while counting); those moving
  under :data:`SMALL_BYTES` (a learnable scale, a loss) are also counted apart, as ``small_launches``;
- bytes: what the non-matmul operators read and write (each tensor argument and result, its own elements once);
  matmuls, convolutions and attention kernels are left out: their cost is their FLOPs, the same for every
  formulation.
"""
from __future__ import annotations

import os
from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["step_cost", "DispatchCost", "cuda_autocast_rules", "CUDA_FP32_OPS", "CUDA_FP32_OUTPUT_OPS"]

#: operators CUDA's autocast runs in float32 (inputs cast to float32), where the CPU's leaves them in the lower
#: precision; aten/src/ATen/autocast_mode.cpp, the ``fp32`` policy, those a ViT step can reach
CUDA_FP32_OPS = ("layer_norm", "native_layer_norm", "group_norm", "exp", "log", "reciprocal", "rsqrt",
                 "pow.Tensor_Scalar", "logsumexp", "nll_loss")
#: operators CUDA's autocast gives a float32 ``dtype=`` when none is set (``fp32_set_opt_dtype``): they read the
#: lower precision and compute and write float32, with no separate cast
CUDA_FP32_OUTPUT_OPS = ("softmax.int", "log_softmax.int", "linalg_vector_norm", "sum", "sum.dim_IntList")

_MATMUL = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten.convolution", "aten._scaled_dot_product",
           "aten._efficient_attention", "aten._flash_attention", "aten.cudnn_convolution", "aten.mkldnn_")
#: operators that run no kernel: allocations (the caching allocator's work, no pass over memory) and host reads
_NO_KERNEL = ("aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
              "aten.detach", "aten.lift_fresh", "aten._local_scalar_dense", "aten._unsafe_view", "aten.alias",
              "aten.set_", "aten.resize_", "profiler.")


#: a kernel moving less than this is latency, not bandwidth: on a GPU a few microseconds whatever its size
SMALL_BYTES = 64 << 10


def _is_view(func: Any) -> bool:
    schema = func._schema
    return not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)


def _own_bytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s own elements: an expanded (stride-0) dimension is read once, not once per index."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride else 1
    return n * t.element_size()


class DispatchCost(TorchDispatchMode):
    """Counts kernel launches and non-matmul bytes of every operator run inside it (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.launches = 0
        self.small_launches = 0  # of those, kernels moving under SMALL_BYTES (a scale, a norm per row, a loss)
        self.bytes = 0
        self.by_op: Counter[str] = Counter()
        self._paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if self._paused or _is_view(func) or name.startswith(_NO_KERNEL):
            return out
        self._count(name, (args, kwargs, out))
        return out

    def fused_kernel(self, name: str, reference: Callable[..., Any], args: tuple) -> Any:
        """A quest fused kernel's stand-in (quest.attention.fused_launch.STAND_IN): its reference computed
        uncounted, then one launch moving its arguments and results, as the Triton kernel on a GPU."""
        self._paused = True
        try:
            out = reference(*args)
        finally:
            self._paused = False
        self._count(f"quest.{name}", (args, out))
        return out

    def _count(self, name: str, everything: Any) -> None:
        self.launches += 1
        self.by_op[name] += 1
        tensors = [t for t in tree_flatten(everything)[0] if isinstance(t, torch.Tensor)]
        moved = sum(_own_bytes(t) for t in tensors)
        self.small_launches += moved < SMALL_BYTES
        if not name.startswith(_MATMUL):
            self.bytes += moved

    def summary(self) -> dict[str, Any]:
        return {"launches": self.launches, "small_launches": self.small_launches, "bytes": self.bytes,
                "by_op": dict(self.by_op)}


@contextmanager
def cuda_autocast_rules() -> Iterator[None]:
    """While inside: the CPU's autocast treats :data:`CUDA_FP32_OPS` and :data:`CUDA_FP32_OUTPUT_OPS` as CUDA's
    does. Process-wide for its duration (a dispatcher registration), undone on exit."""
    lib = torch.library.Library("aten", "IMPL")
    cpu_autocast = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def overload(name: str) -> Any:
        op, _, variant = name.partition(".")
        return getattr(getattr(torch.ops.aten, op), variant or "default")

    def lower(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16)

    def fp32(op: Any):
        def kernel(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(cpu_autocast):
                cast = [a.float() if lower(a) else a for a in args]
                return op(*cast, **{k: v.float() if lower(v) else v for k, v in kwargs.items()})
        return kernel

    def fp32_output(op: Any):
        def kernel(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(cpu_autocast):
                if lower(args[0]) and kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
        return kernel

    import warnings

    with warnings.catch_warnings():  # "overriding a previously registered kernel": the point, undone on exit
        warnings.simplefilter("ignore")
        for name in CUDA_FP32_OPS:
            op = overload(name)
            lib.impl(op._schema.name.split("::")[1] + ("." + op._overloadname if op._overloadname != "default"
                                                       else ""), fp32(op), "AutocastCPU")
        for name in CUDA_FP32_OUTPUT_OPS:
            op = overload(name)
            lib.impl(op._schema.name.split("::")[1] + ("." + op._overloadname if op._overloadname != "default"
                                                       else ""), fp32_output(op), "AutocastCPU")
    try:
        yield
    finally:
        lib._destroy()


def step_cost(attention: str, model: str = "vit_tiny_patch16_224", batch: int = 2, img_size: int = 224,
              dtype: torch.dtype | None = torch.bfloat16, gpu_path: bool = True, **model_kwargs: Any) -> dict[str, Any]:
    """Launches and non-matmul bytes of one training step (forward, loss, backward; the optimizer aside: the same
    for every formulation) of ``model`` with ``attention``, counted on the CPU under ``dtype`` autocast with CUDA's
    rules (None: float32, no autocast). ``gpu_path``: the formulations' fused operators as they run on a GPU
    (quest.attention.fused), else the CPU's path. The backward recomputes q', k' as at a training batch size
    (quest.attention.recompute skips tensors under 1 MiB, which the small batch here would be)."""
    from unittest import mock

    from quest.attention import fused_launch, recompute
    from quest.attention.fused import fused_path
    from quest.models import create_model

    torch.manual_seed(0)
    net = create_model(model, attention=attention, num_classes=10, img_size=img_size, **model_kwargs).train()
    images = torch.randn(batch, 3, img_size, img_size)
    targets = torch.randint(0, 10, (batch,))
    counter = DispatchCost()
    autocast = torch.autocast("cpu", dtype=dtype) if dtype is not None else torch.autocast("cpu", enabled=False)
    # the fused operators count as one kernel each whatever computes them: their PyTorch reference here (no
    # Triton interpreter: its values would be the same, at many times the time)
    with mock.patch.object(recompute, "MIN_BYTES", 0), mock.patch.dict(os.environ, {"TRITON_INTERPRET": "0"}), \
            mock.patch.object(fused_launch, "STAND_IN", counter.fused_kernel), fused_path(gpu_path), \
            cuda_autocast_rules(), counter:
        with autocast:
            loss = F.cross_entropy(net(images), targets)
        loss.backward()
    return {"attention": attention, **counter.summary()}
