"""The QUEST paper's spurious-correlation toy study (section 2.2, A.3, A.4): ``python -m quest.toy grid=full``.

data: the task; model: the one-layer, one-head Transformer; batched: many runs trained as one vmapped computation;
study: the grid, outcomes, CSVs and resume; plots: heatmaps and key-norm trajectories. Results: docs/results.md.
"""
from .batched import ParamLayout, RunSpec, batch_order, train_chunk
from .data import ToyData, ToyDataConfig, ToySplit, make_toy_data
from .model import ToyTransformer
from .outcomes import OUTCOMES, classify, success_rates, summary_table
from .study import run_study

__all__ = [
    "ParamLayout", "RunSpec", "batch_order", "train_chunk", "ToyData", "ToyDataConfig", "ToySplit",
    "make_toy_data", "ToyTransformer", "OUTCOMES", "classify", "run_study", "success_rates", "summary_table",
]
