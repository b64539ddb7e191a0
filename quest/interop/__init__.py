"""timm and Hugging Face interop: exported QUEST models as timm models (``quest_vit``), ``quest-export``, and
pretrained weights from timm tags, local folders, the Hub or files (docs/interop.md)."""
from .timm_model import ARCHITECTURE, exported_architecture, quest_vit

__all__ = ["ARCHITECTURE", "exported_architecture", "quest_vit"]
