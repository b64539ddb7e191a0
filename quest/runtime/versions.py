"""The lowest torch, torchvision and timm quest runs on, and the torch release it runs on.

quest installs beside the torch a container already has (docs/getting-started.md, "Tested versions"). Below the
floors (:data:`FLOORS`, the lower bounds pyproject.toml declares; a test holds the two equal) quest does not start:
``import quest``, which every command and library use runs first, raises :class:`BelowFloor`, one line naming the
package, the version found and the floor, before any work. Above them quest calls torch's APIs directly; where a
release between the floor and the newest computes something wrong, the code that meets it compares
:data:`TORCH_VERSION` and takes another way there, saying why beside the comparison.

The versions come from the installed distributions' metadata, so that the check at ``import quest`` does not import
torch (a command's ``--help`` does not wait for it).
"""
from __future__ import annotations

import re
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import TracebackType

from quest.runtime.errors import UserError

__all__ = ["FLOORS", "TORCH_FOUND", "TORCH_VERSION", "BelowFloor", "parse_version", "installed", "below_floor",
           "check_floors"]

#: distribution -> the lowest release quest runs on: pyproject.toml's lower bounds (tests/runtime/test_versions.py
#: holds the two equal), the versions constraints-floor.txt pins and CI's floor phase tests
FLOORS: dict[str, tuple[int, int, int]] = {"torch": (2, 8, 0), "torchvision": (0, 23, 0), "timm": (1, 0, 29)}


def parse_version(text: str) -> tuple[int, int, int]:
    """``"2.4.1+cu121"`` -> ``(2, 4, 1)``: the release, its leading dotted numbers, without local, pre-, post- or
    dev-release tags (an NGC container's ``2.8.0a0+5228986c39`` is 2.8.0; ``2.8rc1`` is 2.8.0, not 2.8.1)."""
    release = re.match(r"\d+(?:\.\d+)*", text.strip())
    parts = [int(p) for p in release.group().split(".")[:3]] if release else []
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def installed(distribution: str) -> str | None:
    """The installed version of ``distribution`` as its metadata says, None where it has none (not installed, or
    built without metadata: its import then decides)."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _torch_found() -> str:
    found = installed("torch")
    if found is None:  # a torch without metadata (built in place): ask the module itself
        import torch

        found = torch.__version__
    return found


#: the installed torch as it names itself ("2.8.0+cu128"), and its release
TORCH_FOUND = _torch_found()
TORCH_VERSION = parse_version(TORCH_FOUND)


class BelowFloor(UserError, ImportError):
    """An installed torch, torchvision or timm older than quest's floor (one line, no traceback)."""


def below_floor() -> str | None:
    """One line naming the first of :data:`FLOORS` installed below its floor (the package, the version found, the
    floor); None when every one is at or above it."""
    for name, floor in FLOORS.items():
        found = installed(name)
        if found is not None and parse_version(found) < floor:
            need = ".".join(map(str, floor))
            return (f"quest needs {name}>={need}; this environment has {name} {found} (install {name}>={need}, "
                    "docs/getting-started.md, \"Tested versions\")")
    return None


def check_floors() -> None:
    """Refuse (:class:`BelowFloor`) an environment holding a torch, torchvision or timm below quest's floor. Left
    uncaught (a command, ``python -m quest.toy``, a script importing quest), it ends the process with its one line,
    ``<program>: error: <message>``, and exit code 1, without a traceback: the refusal happens while ``quest`` itself
    is imported, before any command's error path (quest.runtime.errors) exists to report it."""
    problem = below_floor()
    if problem is not None:
        sys.excepthook = _one_line_for_below_floor(sys.excepthook)
        raise BelowFloor(problem, name="quest")


def _one_line_for_below_floor(previous: Callable[..., object]) -> Callable[..., None]:
    """sys.excepthook: a :class:`BelowFloor` as its one line, anything else as ``previous`` reports it."""

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not isinstance(exc, BelowFloor):
            previous(kind, exc, tb)
            return
        program = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-m") else "quest"
        print(f"{Path(program).name}: error: {exc}", file=sys.stderr, flush=True)

    return hook

