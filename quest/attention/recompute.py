"""Attention whose transformed queries and keys are not kept for backward: recomputed there instead.

SDPA saves its inputs for backward. Standard attention's q and k are views of the qkv projection, which stays alive
anyway; a formulation's q' and k' (normalised, scaled, re-weighted) are new tensors, one (B, H, N, d) each per
layer, which made QUEST's and QNorm's training step hold 6% more memory than standard attention's and the QKNorms'
12-19% more (docs/benchmarks.md). Here SDPA's saved q' and k' are replaced, through autograd's saved-tensor hooks,
by a recipe: the backward reruns the formulation's transform on the raw q and k (views, already kept) under the
forward's autocast state. The transform is deterministic, so the gradients are bit-identical; it costs one more
element-wise pass per transformed tensor in the backward, and no more: an l2 normalisation remembers its
1/max(||x||, eps) from the forward (kept for its own backward anyway) and the recompute multiplies by it instead of
taking the norm again (:func:`remember_factor`).

Not used for small tensors (:data:`MIN_BYTES`), where autograd saves nothing or where someone else owns the saved
tensors: without gradients, under TorchScript, torch.fx, torch.compile (its partitioner recomputes element-wise ops
by itself), torch.func transforms (which disable saved-tensor hooks) and inside activation checkpointing (whose own
hooks must see every tensor).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

__all__ = ["recompute_applies", "attention_recomputing", "remember_factor", "recalled_factor"]

Transformed = tuple[torch.Tensor, torch.Tensor, float]


#: Below this many bytes per transformed tensor the q', k' are kept: the memory saved is small there, while the
#: recompute's Python work (about 0.1-0.3 ms per layer and step on a CPU) is not. Measured: the default run's
#: vit_pico layers (64 x 2 x 17 x 32 floats, 0.27 MiB) stepped 4-8% slower with the recompute; ViT-Ti at 224 px from
#: batch 8 up (1.2 MiB) pays 0.6-2.0% (docs/benchmarks.md, "Memory: q' and k' recomputed in the backward").
MIN_BYTES = 1 << 20


def recompute_applies(q: torch.Tensor) -> bool:
    """Whether the saved q', k' can be replaced by a recipe in this call (see the module docstring)."""
    if isinstance(q, torch.fx.Proxy) or not (torch.is_grad_enabled() and q.requires_grad):
        return False
    if torch.compiler.is_compiling() or not torch.amp.is_autocast_available(q.device.type):
        return False  # compiled: the partitioner recomputes; meta (FLOP counting): no autocast state to replay
    if q.numel() * q.element_size() < MIN_BYTES:  # after the compiling check: a traced size would become a guard
        return False
    autograd = torch._C._autograd
    # private, checked here by name: functorch disables the hooks (vmap/grad), checkpointing pushes its own
    enabled = getattr(autograd, "_saved_tensors_hooks_is_enabled", lambda: True)()
    top = getattr(autograd, "_top_saved_tensors_default_hooks", None)
    return bool(enabled) and (top is None or top(False) is None)


#: per thread, while a transform runs under attention_recomputing: ``recording`` (the forward) or ``replaying``
#: (the backward's recompute), a dict of the factors it remembered, by input tensor
_factors = threading.local()


def remember_factor(x: torch.Tensor, tag: Any, factor: torch.Tensor) -> None:
    """Remember the non-differentiable ``factor`` a transform computed from ``x`` (an l2 normalisation's 1/||x||):
    the backward's recompute gets it back from :func:`recalled_factor` instead of computing it again (the norm is
    most of the recompute's cost). ``tag`` holds what else the factor depends on (the norm floor), so that two
    normalisations of one tensor are told apart. A no-op outside a recording transform; the factor is one that
    autograd keeps for the transform's own backward anyway, so nothing more is held."""
    recording = getattr(_factors, "recording", None)
    if recording is not None:
        recording[(_key(x), tag)] = factor


def recalled_factor(x: torch.Tensor, tag: Any) -> Optional[torch.Tensor]:
    """The factor remembered for ``x`` and ``tag`` in the forward, while the backward recomputes; None otherwise."""
    replaying = getattr(_factors, "replaying", None)
    return None if replaying is None else replaying.get((_key(x), tag))


def _with_factors(mode: str, factors: dict[Any, torch.Tensor], fn: Callable[[], Any]) -> Any:
    setattr(_factors, mode, factors)
    try:
        return fn()
    finally:
        setattr(_factors, mode, None)


def _key(t: torch.Tensor) -> tuple[Any, ...]:
    # the same tensor whether autograd hands us the object SDPA got or another Python wrapper of it (data_ptr holds
    # the storage offset; it is cheaper than asking for the storage, which pack does for every saved tensor)
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


class _Recipe:
    """What pack keeps instead of a transformed tensor: which of (q', k') to recompute."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def attention_recomputing(transform: Callable[[torch.Tensor, torch.Tensor], Transformed],
                          raw: tuple[torch.Tensor, torch.Tensor],
                          attend: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> torch.Tensor:
    """``attend(*transform(*raw))``, with the transform's new outputs (those that are none of ``raw``) not saved for
    backward but recomputed by ``transform`` when the backward needs them (on detached copies of ``raw``: values
    only, so that module hooks of the transform, a FLOP counter's say, see no graph to follow)."""
    factors: dict[Any, torch.Tensor] = {}
    q2, k2, scale = _with_factors("recording", factors, lambda: transform(*raw))
    raw_keys = {_key(t) for t in raw}
    fresh = {_key(t): i for i, t in enumerate((q2, k2)) if _key(t) not in raw_keys}
    if not fresh:
        return attend(q2, k2, scale)
    device = q2.device.type
    autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
    cache: dict[int, torch.Tensor] = {}

    def rerun() -> None:
        detached = [t.detach() for t in raw]  # the same keys as raw: the factors are found
        cache.update(enumerate(_with_factors("replaying", factors, lambda: transform(*detached))[:2]))

    def recomputed(i: int) -> torch.Tensor:
        if i not in cache:  # the first of the backward's requests (or a second backward, retain_graph=True)
            # labelled, so that a profile (and bench/attention.py part e) shows what the recompute costs
            with torch.no_grad(), torch.profiler.record_function("quest.attention.recompute"):
                if (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) == autocast:
                    rerun()  # the backward runs under the forward's autocast state (the usual case): as it is
                else:
                    with torch.autocast(device, dtype=autocast[1], enabled=autocast[0]):
                        rerun()
        value = cache.pop(i)
        if not any(j in fresh.values() for j in cache):  # both handed out: nothing held
            cache.clear()
        return value

    def pack(t: torch.Tensor) -> Any:
        index = fresh.get(_key(t))
        return t if index is None else _Recipe(index)

    def unpack(packed: Any) -> torch.Tensor:
        return recomputed(packed.index) if isinstance(packed, _Recipe) else packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return attend(q2, k2, scale)
