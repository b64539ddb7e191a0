"""What a refused command must leave as it was: every entry under a folder, never following a link, as its kind, its
permission bits and what it holds (a file's SHA-256, a link's target). Two states compare equal only if nothing under
the folder was made, removed, moved, written, re-pointed or re-moded."""
from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path


def tree_state(root: Path) -> dict[str, tuple]:
    """Relative path -> (kind, mode bits, content) of every entry under ``root`` (directories too; a link's target,
    not what it points at)."""
    out: dict[str, tuple] = {}
    for top, dirs, files in os.walk(root):  # links to folders are listed, not entered
        for name in dirs + files:
            path = Path(top, name)
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                content: str | None = os.readlink(path)
            elif stat.S_ISREG(info.st_mode):
                content = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                content = None
            out[str(path.relative_to(root))] = (stat.S_IFMT(info.st_mode), stat.S_IMODE(info.st_mode), content)
    return dict(sorted(out.items()))
