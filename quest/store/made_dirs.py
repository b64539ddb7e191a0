"""The directories a command's output will be made in: which of them are missing (:func:`missing_dirs`: the folders
a lock taken before the checks makes, and puts back on a refusal, quest.store.owned_dir), and what keeps one from
being made (:func:`output_dir_problem`: checked before Hydra runs for the command line's ``hydra.run.dir=``, and before
each job for the configured one, quest.run.hydra_job).
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["missing_dirs", "output_dir_problem"]


def missing_dirs(path: str | Path) -> list[Path]:
    """``path`` (made absolute, symlinks kept) and its parents that do not exist, deepest first."""
    path, out = Path(os.path.abspath(path)), []
    while not os.path.lexists(path) and path != path.parent:
        out.append(path)
        path = path.parent
    return out


def output_dir_problem(path: str, file: bool = False) -> str | None:
    """What keeps ``path`` (an output directory, relative to the working directory) from being made, in words, or
    None: a name longer than the file system allows, a part that exists and is not a directory, or a link that
    leads nowhere (making it would fail with the operating system's error naming no reason), or a leading ``~`` (it
    would be made as a directory named ``~``, not the home directory the user meant). ``file``: ``path`` is a file
    to write, whose folder is made: only its name's length is checked, what stands in its place is the command's
    to judge (an earlier output it replaces)."""
    limit = 255
    try:
        limit = os.pathconf(".", "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        pass
    parts = Path(path).parts
    if parts and parts[0].startswith("~"):  # the shell expands ~ only outside quotes; Hydra never does
        return (f"{parts[0]} is not expanded here: Hydra would make a directory named {parts[0]!r} in the working "
                f"directory; write the path out ({os.path.expanduser(parts[0])}/...)")
    long = next((part for part in parts if len(os.fsencode(part)) > limit), None)
    if long is not None:
        return (f"the directory name {long[:40]}... is {len(os.fsencode(long))} bytes long; this file system allows "
                f"{limit} per name (choose a shorter one)")
    path_limit = 4096
    try:
        path_limit = os.pathconf(".", "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):
        pass
    whole = len(os.fsencode(os.path.abspath(path)))
    if whole >= path_limit:  # every name may fit while the whole path does not: ENAMETOOLONG on the first look
        return (f"the path {str(path)[:60]}... is {whole} bytes long; this system allows {path_limit - 1} per path "
                "(choose a shorter one)")
    here = Path(".")
    for part in Path(path).parts[:-1] if file else Path(path).parts:
        here = here / part
        if here.is_symlink() and not here.exists():  # scratch not mounted, a link copied from another machine
            return (f"{here} is a link to {os.readlink(here)}, which does not exist (a file system not mounted?); "
                    "mount it, or give another directory")
        if here.exists() and not here.is_dir():
            return f"{here} exists and is not a directory (expected a directory to write into)"
    return None
