"""Command-line sugar for eval.py: ``model=<any timm name>`` besides ``model=<configs/model option>``."""
from __future__ import annotations

import re
from pathlib import Path

from quest.config.files import config_root

__all__ = ["rewrite_model_override"]

_PLAIN_MODEL = re.compile(r"^model=([A-Za-z0-9_.\-]+)$")


def rewrite_model_override(argv: list[str], configs: Path | None = None) -> list[str]:
    """``model=<name>`` selects configs/model/<name>.yaml when that file exists (a curated model with its input
    size); for any other timm model name, Hydra would fail with "Could not find 'model/<name>'", so the argument
    becomes ``model.name=<name>``. Anything else (sweeps, ``+model=``, options that exist) is left alone."""
    import timm

    configs = configs or config_root()
    out = []
    for arg in argv:
        match = _PLAIN_MODEL.match(arg)
        if match and not (configs / "model" / f"{match.group(1)}.yaml").exists():
            name = match.group(1)
            from quest.models import presets  # noqa: F401  (the CPU presets are timm names too)

            if timm.models.is_model(name):
                arg = f"model.name={name}"
        out.append(arg)
    return out
