"""Training-time attention diagnostics: max attention logit, the query/key norms of its pair, norm statistics and
attention entropy of every layer, collected every few steps without changing the training computation.

>>> diag = AttentionDiagnostics(model, every_n_steps=100, max_logit_warning=1e4)
>>> if diag.due(step):
...     metrics.update(diag.collect(images, step=step))

Definitions, key names and cost: docs/diagnostics.md. Plots: ``python -m quest.report.plot diagnostics``.
"""
from .collector import DEFAULT_ENTROPY_THRESHOLD, AttentionDiagnostics
from .stats import HEAD_STATS, SCALAR_STATS, LayerStats, layer_statistics

__all__ = [
    "AttentionDiagnostics",
    "DEFAULT_ENTROPY_THRESHOLD",
    "SCALAR_STATS",
    "HEAD_STATS",
    "LayerStats",
    "layer_statistics",
]
