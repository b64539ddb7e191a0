"""Changes to a folder's tree, each asking the running command's phase first (quest.runtime.phase): folders made,
files moved, copied, linked and removed, and what a command replaces kept in ``.replaced/<UTC time>[-label]/``
(nothing is deleted), with the refusal of outputs already present."""
from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from quest.runtime.phase import may_change
from quest.store.damage import DamagedFile

__all__ = ["OutputExists", "refuse_present", "REPLACED", "replaced_problem", "replaced_dir", "make_dirs", "remove",
           "remove_empty_dirs", "move", "make_link", "same_file_as", "remove_made_dirs", "move_aside", "MoveAsideError"]


class OutputExists(ValueError):
    """A command would replace files it finds in place (quest.runtime.errors counts a ValueError as the user's)."""


class MoveAsideError(OSError):
    """A file a command would replace could not be moved into ``.replaced/``; what :func:`move_aside` had moved
    is back in place (an OSError: the user's to resolve, quest.runtime.errors)."""

    def __str__(self) -> str:  # the message already says the system's words: no "[Errno 1]" before it
        return self.strerror or super().__str__()


def refuse_present(paths: Iterable[str | Path], overwrite: bool, flag: str = "--overwrite") -> list[Path]:
    """A command's check before it writes ``paths``: OutputExists naming those that exist and ``flag``, unless
    ``overwrite``; those that exist."""
    present = [Path(p) for p in paths if Path(p).exists() or Path(p).is_symlink()]
    if present and not overwrite:
        names = ", ".join(str(p) for p in present)
        raise OutputExists(f"{names} already exist{'s' if len(present) == 1 else ''}: pass {flag} to replace "
                           f"{'it' if len(present) == 1 else 'them'} (the old files are kept in .replaced/ beside "
                           "them), or choose another output")
    return present


#: where a folder quest owns keeps what a command replaced (a run, an evaluation's results, an export): nothing is
#: deleted, every replacement gets its own ``.replaced/<UTC time>[-<label>]/``
REPLACED = ".replaced"


def replaced_problem(folder: str | Path) -> DamagedFile | None:
    """Why ``folder/.replaced`` cannot keep what a command replaces (a link: what is kept would leave the folder; a
    file), or None: a command that may move files aside asks before its first change (quest.store.output_folder)."""
    root = Path(folder) / REPLACED
    if not (root.is_symlink() or (root.exists() and not root.is_dir())):
        return None
    kind = f"a symbolic link to {os.readlink(root)}" if root.is_symlink() else "not a directory"
    return DamagedFile(root, f"{kind}, expected the folder inside {folder} where quest keeps what a command replaces",
                       "Move it away; quest makes the folder again")


def replaced_dir(folder: str | Path, label: str = "") -> Path:
    """A new ``folder/.replaced/<UTC time>[-label]/`` (made), for what a command is about to replace;
    :class:`DamagedFile` when ``.replaced`` is a link (what is kept would leave the folder) or a file."""
    import datetime

    root = Path(folder) / REPLACED
    may_change(root)
    problem = replaced_problem(folder)
    if problem is not None:
        raise problem
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    # two replacements within one tick of a coarse clock: the second gets a count, never the first one's folder
    n = 1
    while True:
        name = stamp if n == 1 else f"{stamp}-{n}"
        dest = Path(folder) / REPLACED / (f"{name}-{label}" if label else name)
        try:
            dest.mkdir(parents=True)
            return dest
        except FileExistsError:
            n += 1


def make_dirs(path: str | Path) -> Path:
    """``path`` and its missing parents made (``mkdir -p``), once the command's checks are done (every folder a
    command makes is a change: quest.runtime.phase)."""
    path = Path(path)
    if not path.is_dir():
        may_change(path)
        path.mkdir(parents=True, exist_ok=True)
    return path


def remove(path: str | Path) -> None:
    """Remove ``path``: a folder with what it holds, else the file or link itself (never what a link leads to)."""
    path = Path(path)
    may_change(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def remove_empty_dirs(top: str | Path, keep_top: bool) -> None:
    """Remove every folder under ``top`` (and ``top`` itself unless ``keep_top``) that holds nothing, deepest first."""
    for dirpath, _, _ in os.walk(top, topdown=False):
        if (not keep_top or Path(dirpath) != Path(top)) and not os.listdir(dirpath):
            may_change(dirpath)
            os.rmdir(dirpath)


def move(source: str | Path, target: str | Path) -> Path:
    """``source`` moved to ``target`` (its folder made): a rename within a file system (a link stays a link), a copy
    and removal across them. A failure leaves ``source`` where it was and nothing at ``target``; only a folder copied
    across file systems whose removal then fails part way stays copied whole at ``target``. Nothing already at
    ``target`` is replaced (FileExistsError): every target is a fresh place in ``.replaced/``, or the place a file
    was just moved from, and the clean-up below removes only what this call made."""
    source, target = Path(source), Path(target)
    may_change(source)
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, f"cannot move {source} to {target}: it exists", str(target))
    make_dirs(target.parent)
    try:
        os.rename(source, target)
        return target
    except OSError as exc:
        # a refused rename (a file that may not move: chattr +i, a folder this user cannot write, a mount point) is
        # not retried as a copy: shutil.move's copy would land at target and the removal of source fail the same way
        if exc.errno != errno.EXDEV:
            raise
    if source.is_dir() and not source.is_symlink():
        try:
            shutil.copytree(source, target, symlinks=True)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)  # source untouched: no partial copy stays
            raise
        shutil.rmtree(source)  # what it removed is in the whole copy at target
        return target
    try:
        shutil.copy2(source, target, follow_symlinks=False)
        os.unlink(source)
    except BaseException:
        if os.path.lexists(source):  # whole (an unlink is all or nothing): the copy goes; else the copy is all there is
            target.unlink(missing_ok=True)
        raise
    return target


def make_link(link: str | Path, target: str | Path) -> Path:
    """A symbolic link at ``link`` to ``target``, its folder made."""
    link, target = Path(link), Path(target)
    make_dirs(link.parent)
    may_change(link)
    link.symlink_to(target, target_is_directory=target.is_dir())
    return link


def same_file_as(source: str | Path, target: str | Path, keep_errnos: tuple[int, ...] = ()) -> None:
    """Make ``target`` the same file as ``source`` atomically: a hard link where the file system has them (no copy
    of a large checkpoint), else a copy (an OSError whose errno is in ``keep_errnos``, such as a full disk, is raised
    instead); either way through a temporary name, then a rename. A failure leaves ``target`` as it was."""
    source, target = Path(source), Path(target)
    may_change(target)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.link.tmp")
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(source, tmp)
        except OSError as exc:
            if exc.errno in keep_errnos:
                raise
            with open(source, "rb") as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 * 2**20)
                dst.flush()
                os.fsync(dst.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_made_dirs(made: Iterable[str | Path]) -> None:
    """Remove the directories a refused command made (deepest first), each only while empty, stopping at the first
    that is not: whatever anything wrote in them stays, and a directory that was there before is never in ``made``."""
    for path in made:
        try:
            Path(path).rmdir()
        except OSError:
            return


def move_aside(folder: str | Path, paths: Iterable[str | Path], label: str = "",
               into: Path | None = None) -> Path | None:
    """Move those of ``paths`` that exist into a new :func:`replaced_dir` of ``folder``, each under its path
    relative to ``folder`` (its name when outside it: two files of one name in different sub-folders never meet);
    it, or None when none existed. The one way quest's runs, evaluations and tools keep what they replace.
    ``into``: a folder an earlier call of the same command returned, so that one command's files are kept together.

    All or nothing: when one cannot be moved, those already moved are put back and the folders made for them
    removed (``.replaced/`` too when this call made it), and :class:`MoveAsideError` says which file and why, so that a
    command refused there replaces nothing and leaves no copy behind."""
    present = [Path(p) for p in paths if Path(p).exists() or Path(p).is_symlink()]
    if not present:
        return None
    root = Path(folder) / REPLACED
    made = [] if root.exists() or root.is_symlink() else [root]
    dest = into if into is not None else replaced_dir(folder, label)
    moved: list[tuple[Path, Path]] = []
    for path in present:
        rel = path.relative_to(folder) if path.is_relative_to(folder) else Path(path.name)
        try:
            moved.append((path, move(path, dest / rel)))
        except OSError as exc:
            raise _put_back(moved, dest, made, (path, dest / rel), exc) from exc
    return dest


def _put_back(moved: list[tuple[Path, Path]], dest: Path, made: list[Path], failed: tuple[Path, Path],
              exc: OSError) -> MoveAsideError:
    """Undo a :func:`move_aside` whose move ``failed`` (source, target): the error, in one line, saying what is
    where."""
    stuck = []
    for source, target in reversed(moved):
        try:
            move(target, source)
        except OSError:  # said in the message: the file is whole, only where it is kept differs
            stuck.append(f"{source} is kept as {target}")
    source, target = failed
    if target.exists() or target.is_symlink():  # a folder copied across file systems, its removal failed part way
        stuck.append(f"{source} is partly removed and kept whole as {target}")
    remove_empty_dirs(dest, keep_top=False)
    remove_made_dirs(made)  # .replaced/ itself, when this call made it and it holds nothing
    after = "; ".join(stuck) if stuck else "nothing was replaced"
    return MoveAsideError(exc.errno, f"cannot replace {source}: it could not be moved into {dest.parent} "
                                     f"({exc.strerror or exc}); {after}")
