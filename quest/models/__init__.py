"""timm integration: models built with a chosen attention formulation, CPU-sized presets, and the ``quest_vit``
entry point that exported folders name (timm / Hugging Face interop: ``quest-export`` in quest.tools.export,
pretrained weights in quest.models.pretrained; docs/interop.md)."""
from .factory import attention_layers, convert_attention, create_model, model_seq_len
from .presets import CPU_PRESETS
from .stochastic_depth import drop_path_rates, uniform_drop_path
from .timm_model import ARCHITECTURE, exported_architecture, quest_vit

__all__ = ["create_model", "convert_attention", "attention_layers", "model_seq_len", "CPU_PRESETS",
           "uniform_drop_path", "drop_path_rates", "ARCHITECTURE", "exported_architecture", "quest_vit"]
