"""The training-time attention collector: one extra, side-effect-free forward every ``every_n_steps`` steps."""
from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn as nn

from quest.attention import QKAttention
from quest.models import attention_layers

from .stats import HEAD_STATS, SCALAR_STATS, LayerStats, stacked_statistics

__all__ = ["AttentionDiagnostics", "DEFAULT_ENTROPY_THRESHOLD"]

logger = logging.getLogger("quest.diagnostics")

#: A head counts as low-entropy ("collapsed") when its mean row entropy is below this many nats. exp(0.5) = 1.65
#: effective keys: a row of 65 or 197 keys is this sharp when ~93-95% of its mass sits on one key. It is an
#: absolute value, not a fraction of log N, because collapse (Zhai et al. 2023) means "one key", whatever N is.
DEFAULT_ENTROPY_THRESHOLD = 0.5


def _unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP / DataParallel / torch.compile wrappers.

    The diagnostic forward must run eagerly on it: a DDP forward may broadcast buffers (a collective that would hang
    when only one rank collects), and new hooks or an eval-mode call would make a compiled model recompile.
    """
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode for the duration, then every submodule's own previous mode (a frozen submodule stays frozen)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _cuda_devices(model: nn.Module, images: torch.Tensor) -> list[int]:
    devices = {t.device for t in (images, *model.parameters(), *model.buffers())}
    return sorted(d.index if d.index is not None else torch.cuda.current_device() for d in devices if d.type == "cuda")


class AttentionDiagnostics:
    """Max attention logit, the q/k norms of its pair, norm statistics and attention entropy of every layer.

    Call :meth:`due` every step and :meth:`collect` when it says so. Between those calls the collector registers no
    hook and holds no tensor, so the training step costs exactly what it costs without it. :meth:`collect` runs one
    extra forward on ``num_samples`` images in eval mode, without gradients and without touching the global RNG,
    parameters, gradients or buffers, so the training trajectory is bit-identical with and without diagnostics.

    Args:
        model: a model whose attention layers are quest :class:`~quest.attention.QKAttention` layers (DDP,
            DataParallel and ``torch.compile`` wrappers are looked through).
        every_n_steps: collect at steps 0, n, 2n, ...; ``<= 0`` disables the collector (:meth:`due` is never True).
        num_samples: images of the batch the extra forward sees; logits are (num_samples, H, N, N) per layer.
        per_head: also report each head's max logit and mean entropy.
        entropy_threshold: nats; a head whose mean entropy is below it counts in ``low_entropy_head_frac``.
        max_logit_warning: log one warning (logger ``quest.diagnostics``) the first time the max logit exceeds it.
    """

    def __init__(
        self,
        model: nn.Module,
        every_n_steps: int = 100,
        num_samples: int = 8,
        per_head: bool = False,
        entropy_threshold: float = DEFAULT_ENTROPY_THRESHOLD,
        max_logit_warning: float | None = None,
    ) -> None:
        if num_samples < 1:
            raise ValueError(f"diagnostics.num_samples must be >= 1, got {num_samples}")
        if entropy_threshold < 0:
            raise ValueError(f"diagnostics.entropy_threshold is in nats and must be >= 0, got {entropy_threshold}")
        self.model = model
        self.every_n_steps = int(every_n_steps)
        self.num_samples = int(num_samples)
        self.per_head = bool(per_head)
        self.entropy_threshold = float(entropy_threshold)
        self.max_logit_warning = None if max_logit_warning is None else float(max_logit_warning)
        self._warned = False
        if self.enabled and not attention_layers(_unwrap(model)):
            raise ValueError(
                f"{type(model).__name__} has no quest attention layers to diagnose; build it with "
                "quest.models.create_model or disable diagnostics (diagnostics.every_n_steps=0)"
            )

    @property
    def enabled(self) -> bool:
        return self.every_n_steps > 0

    def due(self, step: int) -> bool:
        """True at steps 0, every_n_steps, 2 * every_n_steps, ...; never when disabled."""
        return self.enabled and step % self.every_n_steps == 0

    def collect(self, images: torch.Tensor, prefix: str = "diag/", step: int | None = None) -> dict[str, float]:
        """Statistics of every attention layer on ``images[:num_samples]``, as flat ``{key: float}``.

        Keys: ``{prefix}max_logit`` (max over layers) and ``{prefix}layerLL/<stat>`` for each layer LL in forward
        order (see :data:`~quest.diagnostics.stats.SCALAR_STATS`), plus ``{prefix}layerLL/headHH/<stat>`` with
        ``per_head``. ``step`` only labels the max-logit warning.
        """
        module = _unwrap(self.model)
        layers = attention_layers(module)
        if not layers:
            raise ValueError(f"{type(module).__name__} has no quest attention layers to diagnose")
        results = self._forward_with_hooks(module, layers, images[: self.num_samples])
        if not results:
            raise RuntimeError(f"none of the {len(layers)} attention layers of {type(module).__name__} ran in forward")
        names = [name for name, _ in results]
        parts = [self._flatten(stats) for _, stats in results]
        sizes = [p.numel() for p in parts]
        # One device->host transfer for every number of every layer, instead of a sync per .item().
        flat = torch.cat(parts).tolist()
        del results, parts  # nothing of the diagnostic forward outlives this call
        per_layer, start = [], 0
        for size in sizes:
            per_layer.append(flat[start : start + size])
            start += size
        return self._to_metrics(names, per_layer, prefix, step)

    # --- internals ----------------------------------------------------------------------------------------------
    def _forward_with_hooks(
        self, module: nn.Module, layers: list[tuple[str, QKAttention]], images: torch.Tensor
    ) -> list[tuple[str, LayerStats]]:
        seen: set[int] = set()
        inputs: list[tuple[str, tuple[Any, ...]]] = []  # each layer's (q_raw, k_raw, q_eff, k_eff, scale, mask, causal)

        def make_hook(name: str):
            def hook(layer: QKAttention, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                # A layer called twice in one forward (weight sharing) is reported for its first call.
                if id(layer) in seen:
                    return
                seen.add(id(layer))
                x = args[0] if args else kwargs["x"]
                attn_mask = args[1] if len(args) > 1 else kwargs.get("attn_mask")
                is_causal = bool(args[2] if len(args) > 2 else kwargs.get("is_causal", False))
                # project_qkv / effective_qk run in the caller's autocast context, as the layer's own forward does
                q_raw, k_raw, _ = layer.project_qkv(x)
                q_eff, k_eff, scale = layer.effective_qk(x)
                inputs.append((name, (q_raw, k_raw, q_eff, k_eff, scale, attn_mask, is_causal)))

            return hook

        handles = []
        try:
            for name, layer in layers:
                handles.append(layer.register_forward_pre_hook(make_hook(name), with_kwargs=True))
            # fork_rng: eval mode already switches dropout and drop-path off; this also covers any layer that draws
            # random numbers in eval, so the training step after collect sees the same RNG stream.
            with torch.random.fork_rng(devices=_cuda_devices(module, images)), _eval_mode(module), torch.no_grad():
                # no_grad, not inference_mode: a module that caches a tensor in this forward (a RoPE table, say)
                # must be able to use it in the next training step.
                module(images)
        finally:
            for handle in handles:
                handle.remove()
        # Hooks fire in forward order, so the layers are in forward order. Only the statistics are computed in
        # float32 (or float64) with autocast off, every group of alike layers in one batched pass.
        with torch.no_grad(), torch.autocast(device_type=images.device.type, enabled=False):
            stats = self._statistics([layer_inputs for _, layer_inputs in inputs])
        return [(name, layer_stats) for (name, _), layer_stats in zip(inputs, stats)]

    def _statistics(self, inputs: list[tuple[Any, ...]]) -> list[LayerStats]:
        """Every layer's statistics; the layers whose tensors have one shape and dtype and share their scale (a
        number), mask and causality (a ViT's: all of them) are stacked and computed together."""
        out: list[LayerStats | None] = [None] * len(inputs)
        groups: dict[Any, list[int]] = {}
        for index, (q_raw, k_raw, q_eff, k_eff, scale, mask, causal) in enumerate(inputs):
            shared = (scale if not isinstance(scale, torch.Tensor) else ("tensor", index), id(mask), causal)
            key = tuple((t.shape, t.dtype, t.device) for t in (q_raw, k_raw, q_eff, k_eff)) + shared
            groups.setdefault(key, []).append(index)
        for members in groups.values():
            q_raw, k_raw, q_eff, k_eff = (torch.stack([inputs[m][part] for m in members]) for part in range(4))
            _, _, _, _, scale, mask, causal = inputs[members[0]]
            for m, layer_stats in zip(members, stacked_statistics(q_raw, k_raw, q_eff, k_eff, scale,
                                                                  self.entropy_threshold, mask, causal)):
                out[m] = layer_stats
        return out  # type: ignore[return-value]

    def _flatten(self, stats: LayerStats) -> torch.Tensor:
        parts = [torch.stack([stats.scalars[s] for s in SCALAR_STATS])]
        if self.per_head:
            parts += [stats.heads[s] for s in HEAD_STATS]
        return torch.cat([p.reshape(-1).to(torch.float64) for p in parts])

    def _to_metrics(
        self, names: list[str], per_layer: list[list[float]], prefix: str, step: int | None
    ) -> dict[str, float]:
        metrics: dict[str, float] = {}
        layer_max: list[float] = []
        for index, values in enumerate(per_layer):
            tag = f"{prefix}layer{index:02d}/"
            metrics.update({tag + stat: value for stat, value in zip(SCALAR_STATS, values)})
            layer_max.append(values[0])
            # Heads are counted per layer: nothing forces every layer to have the same number.
            head_values = values[len(SCALAR_STATS) :]
            n_heads = len(head_values) // len(HEAD_STATS)
            for head in range(n_heads):
                for s_index, stat in enumerate(HEAD_STATS):
                    metrics[f"{tag}head{head:02d}/{stat}"] = head_values[s_index * n_heads + head]
        # NaN wins (a diverged layer must show), which Python's max() would not guarantee.
        overall = math.nan if any(math.isnan(v) for v in layer_max) else max(layer_max)
        self._maybe_warn(names, layer_max, overall, step)
        return {f"{prefix}max_logit": overall, **metrics}

    def _maybe_warn(self, names: list[str], layer_max: list[float], overall: float, step: int | None) -> None:
        if self._warned or self.max_logit_warning is None or not overall > self.max_logit_warning:
            return
        self._warned = True  # once per run: the first crossing is the signal, repeats are noise
        index = layer_max.index(overall)
        at = f" at step {step}" if step is not None else ""
        logger.warning(
            "max attention logit %.4g exceeds diagnostics.max_logit_warning=%.4g%s in layer%02d (%s); "
            "this warning is not repeated",
            overall, self.max_logit_warning, at, index, names[index],
        )
