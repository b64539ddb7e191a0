"""Where quest's registries find their entries (data sets, evaluations, training input pipelines): a built-in
package, the modules named in an environment variable, and an entry-point group of installed packages. Each module
registers its entries as it is imported; a name read from the environment or from installed packages' metadata is
code the user chose to install or name, never a string read from a checkpoint or a config file."""
from __future__ import annotations

import importlib
import os

from quest.runtime.errors import UserError

__all__ = ["LOADED", "import_plugins", "import_named", "PluginImportError"]


class PluginImportError(UserError, ImportError):
    """A module the user named (an environment variable, an installed entry point) that cannot be imported: the
    user's to fix, reported as one line (quest/runtime/errors.py), not as a bug."""


def import_named(module: str, source: str, what: str) -> None:
    """Import ``module``, named by ``source``; a PluginImportError saying who named it and as what otherwise."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise PluginImportError(f"{source} names the {what} module {module!r}, which cannot be imported: {exc}"
                                ) from exc


#: the registries whose plugins are imported (or being imported), by their built-in package
LOADED: set[str] = set()


def import_plugins(builtin: str, env_var: str, group: str, what: str) -> None:
    """Import the package ``builtin``, every module of the comma-separated ``env_var`` and every entry point of
    ``group``: once per registry (named by ``builtin``), marked before importing so that a module that asks its
    registry for entries while it registers does not import them again, and tried anew after a failure."""
    if builtin in LOADED:
        return
    LOADED.add(builtin)
    try:
        importlib.import_module(builtin)
        for module in filter(None, (m.strip() for m in os.environ.get(env_var, "").split(","))):
            import_named(module, env_var, what)
        from importlib.metadata import entry_points

        for entry in entry_points(group=group):
            entry.load()
    except BaseException:
        LOADED.discard(builtin)
        raise
