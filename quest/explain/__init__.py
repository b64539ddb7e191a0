"""Explanations for any model quest builds: raw [CLS] attention, attention rollout and AG-CAM (docs/explain.md),
and their localization metrics against bounding boxes (Table 6 of the QUEST paper)."""
from .methods import AGCAM_GRADIENTS, METHODS, agcam, attention_rollout, cls_attention, explain, to_image
from .recorder import AttentionRecord, check_explainable, explicit_attention

__all__ = ["AGCAM_GRADIENTS", "METHODS", "agcam", "attention_rollout", "cls_attention", "explain", "to_image",
           "AttentionRecord", "check_explainable", "explicit_attention"]
