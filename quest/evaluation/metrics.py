"""The former name of :mod:`quest.evaluation.context` (the run context, loaders and passes) and of the counting
re-exported from :mod:`quest.engine.counts`; kept so that older imports keep working."""
from quest.engine.counts import Counts, error_fraction, percent

from .context import EvalRun, SubsetLogits, classify, evenly_spaced, fixed_subset, make_loader, ordered_topk

__all__ = ["EvalRun", "Counts", "percent", "error_fraction", "make_loader", "classify", "ordered_topk", "SubsetLogits",
           "evenly_spaced", "fixed_subset"]
