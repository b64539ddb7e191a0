"""Optional dependencies: each part that needs more than the core installs it as an extra (pyproject.toml), imports
it only when used, and says which extra to install when it is missing."""
from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable
from types import ModuleType

__all__ = ["require", "require_all", "missing", "MissingExtra", "Need"]

Need = tuple[str, str, str]  # (module, extra, what needs it), as :func:`require` takes them


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the ``pip install 'quest[...]'`` to run."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module``, or raise :class:`MissingExtra` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(f"{feature} needs the Python package that provides {module!r} ({exc}); install it with "
                           f"pip install 'quest[{extra}]'") from exc


def _installed(module: str) -> bool:
    """Whether ``module``'s top-level package can be found, without importing it (cheap: a check before any work)."""
    try:
        return importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def missing(needs: Iterable[Need]) -> list[Need]:
    """The entries of ``needs`` whose module is not installed, each once."""
    out: list[Need] = []
    for need in needs:
        if need not in out and not _installed(need[0]):
            out.append(need)
    return out


def require_all(needs: Iterable[Need], context: str) -> None:
    """Raise :class:`MissingExtra` listing every missing module of ``needs`` and the extras that install them, or
    return. ``context`` says what was asked for (``eval=digits_robustness``)."""
    absent = missing(needs)
    if not absent:
        return
    extras = sorted({extra for _, extra, _ in absent})
    by_feature: dict[str, list[str]] = {}
    for module, _, feature in absent:
        by_feature.setdefault(feature, []).append(repr(module))
    what = "; ".join(f"{feature} needs {', '.join(modules)}" for feature, modules in by_feature.items())
    raise MissingExtra(f"{context} needs optional packages that are not installed ({what}); install them with "
                       f"pip install 'quest[{','.join(extras)}]', or leave those parts out")
