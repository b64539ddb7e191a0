"""Foreign weights in eval.py (``model=<timm name> attention=<name> weights=<file or folder>``): the class count
comes from the weights, the data set's classes are matched to the model's by name where both have names, and every
mismatch is a message that says what to pass instead of a raw size mismatch from ``load_state_dict``."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn

from quest.store.files import read_json
from quest.store.run_files import checked_export_config

__all__ = ["weights_num_classes", "export_record", "ClassOrder", "class_order"]

log = logging.getLogger("quest.eval")


def weights_num_classes(state: dict[str, torch.Tensor]) -> int | None:
    """Rows of the classifier (``head.weight``, timm's ViT layout), None without one."""
    head = state.get("head.weight")
    return int(head.shape[0]) if head is not None and head.ndim == 2 else None


def export_record(weights: str) -> dict[str, Any] | None:
    """config.json of a ``local-dir:`` folder (a quest-export or a timm save), else None."""
    if not weights.startswith("local-dir:"):
        return None
    path = Path(weights.partition(":")[2]).expanduser() / "config.json"
    data = read_json(path)  # every field checked before its model, attention or preprocessing is believed
    return None if data is None else checked_export_config(data, path)


class ClassOrder(nn.Module):
    """The model's logits put in the data set's class order (``order[i]``: the model output of data class i)."""

    def __init__(self, model: nn.Module, order: Sequence[int]):
        super().__init__()
        self.model = model
        self.register_buffer("order", torch.as_tensor(list(order), dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)[:, self.order]


def class_order(model_labels: Sequence[str] | None, data_classes: Sequence[str] | None, weights: str,
                data_name: str) -> list[int] | None:
    """Where each of the data set's classes sits among the model's outputs, matched by name; None when the orders
    agree or either side has no names (then outputs and classes pair by position, as logged)."""
    if not model_labels or not data_classes:
        log.info("class names unknown on %s: the data set's class i is the model's output i",
                 "the weights' side" if not model_labels else "the data set's side")
        return None
    model_labels, data_classes = [str(c) for c in model_labels], [str(c) for c in data_classes]
    if model_labels == data_classes:
        return None
    missing = [c for c in data_classes if c not in model_labels]
    if missing:
        raise ValueError(f"data={data_name} has classes the model of weights={weights} was not trained on: "
                         f"{missing[:8]} (its classes: {model_labels[:8]}{', ...' if len(model_labels) > 8 else ''})")
    log.info("matched the data set's %d classes to the model's by name", len(data_classes))
    return [model_labels.index(c) for c in data_classes]
