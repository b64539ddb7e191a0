"""quest: train and evaluate timm Vision Transformers with swappable attention (standard, QNorm, QKNorm, QUEST,
Elliptical, or your own), to reproduce and extend the QUEST paper. Sub-packages: attention, models, data, engine,
diagnostics, evaluation, explain, toy, report; console scripts in quest.cli."""
from __future__ import annotations

import importlib
import importlib.abc
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("quest")
except PackageNotFoundError:  # a checkout on sys.path without an install
    __version__ = "0+unknown"

__all__ = ["__version__"]

# timm learns quest's formulations as attn_layer names (quest.attention) and the quest_vit model that exported
# folders name (quest.models.timm_model), so timm.create_model("local-dir:...") works in any process that imported
# quest. Registering means importing torch and timm (seconds); `import quest` alone does not pay that (the console
# scripts' --help and tab completion import quest): the registration runs as soon as timm is imported, or now when
# it already is.
_SUBPACKAGES = frozenset({"attention", "models", "data", "engine", "diagnostics", "evaluation", "explain", "toy",
                          "report"})


_REGISTRANTS = ("quest.attention", "quest.models")  # what registers; each imports timm itself
_STATE = {"registered": False, "importing": 0}


def _register_with_timm() -> None:
    """Import quest.attention and quest.models (which register with timm) once timm is imported and neither of them
    is half-way through its own import (one of them importing timm is what brought us here then: its loader's
    wrapper calls again when it is done)."""
    if _STATE["registered"] or _STATE["importing"] or "timm" not in sys.modules:
        return
    _STATE["registered"] = True
    for finder in [f for f in sys.meta_path if isinstance(f, _AfterTimmImport)]:
        sys.meta_path.remove(finder)
    for name in _REGISTRANTS:
        importlib.import_module(name)


class _AfterTimmImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loaders of timm, quest.attention and quest.models so that, once the last of
    them in an import chain has executed, :func:`_register_with_timm` runs."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "timm" and name not in _REGISTRANTS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module, ours = spec.loader.exec_module, name != "timm"

        def exec_module(module: Any) -> None:
            _STATE["importing"] += ours
            try:
                run_module(module)
            finally:
                _STATE["importing"] -= ours
            _register_with_timm()

        spec.loader.exec_module = exec_module  # this spec's loader instance only
        return spec


if "timm" in sys.modules:
    _register_with_timm()
elif not any(isinstance(f, _AfterTimmImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterTimmImport())


def __getattr__(name: str) -> Any:
    # quest.attention etc. as attributes after a plain `import quest`, as when they were imported eagerly
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
