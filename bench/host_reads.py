"""A counter of device-to-host reads on the CPU, the stand-in for CUDA's sync debug mode where there is no GPU: the
Tensor methods that hand a tensor's values to the host, and ``aten._local_scalar_dense`` reached any other way (a
tensor that C++ turns into a number). Used by tests/train/test_host_reads.py and bench/gpu_loop.py's CPU smoke."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostReads", "READS"]

#: the Python methods that hand a tensor's values to the host; on the CPU, tolist / numpy / cpu / __float__ never
#: reach the dispatcher, so they are counted where they are called
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu")


class HostReads(TorchDispatchMode):
    """Counts device-to-host reads from any code (quest's, timm's, torch's). A read through one of the methods counts
    once. ``on``: count only while true (the loader's batches are not the step's). ``skip``: tensors whose reads are
    not counted (host memory on every device, such as timm's Lamb's step count, where a read is no
    synchronisation)."""

    def __init__(self, skip: Callable[[torch.Tensor], bool] = lambda tensor: False) -> None:
        super().__init__()
        self.count, self.on, self._inside, self._saved, self.skip = 0, True, 0, {}, skip

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's signature)
        if func is torch.ops.aten._local_scalar_dense.default and self.on and not self._inside:
            self.count += 1
        return func(*args, **(kwargs or {}))

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.on and not self._inside and not self.skip(tensor):
                self.count += 1
            self._inside += 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self._inside -= 1
        return read

    def __enter__(self) -> HostReads:
        self._saved = {name: getattr(torch.Tensor, name) for name in READS}
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, self._wrap(original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        super().__exit__(*exc)
