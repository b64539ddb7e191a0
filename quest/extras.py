"""Optional dependencies: each part that needs more than the core installs it as an extra (pyproject.toml), imports
it only when used, and says which extra to install when it is missing."""
from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require", "MissingExtra"]


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the ``pip install 'quest[...]'`` to run."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module``, or raise :class:`MissingExtra` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(f"{feature} needs the Python package that provides {module!r} ({exc}); install it with "
                           f"pip install 'quest[{extra}]'") from exc
