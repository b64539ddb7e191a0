"""timm integration: models built with a chosen attention formulation, and CPU-sized presets."""
from .factory import attention_layers, convert_attention, create_model, model_seq_len
from .presets import CPU_PRESETS

__all__ = ["create_model", "convert_attention", "attention_layers", "model_seq_len", "CPU_PRESETS"]
