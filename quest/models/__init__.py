"""timm integration: models built with a chosen attention formulation, and CPU-sized presets."""
from .factory import attention_layers, convert_attention, create_model, model_seq_len
from .presets import CPU_PRESETS
from .stochastic_depth import drop_path_rates, uniform_drop_path

__all__ = ["create_model", "convert_attention", "attention_layers", "model_seq_len", "CPU_PRESETS",
           "uniform_drop_path", "drop_path_rates"]
