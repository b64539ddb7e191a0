"""The one error for a file quest cannot believe: damaged, foreign, or of another kind than expected."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from quest.runtime.errors import printable

__all__ = ["DamagedFile"]


class DamagedFile(ValueError):
    """A file quest wrote earlier, or one standing where quest expects its own, that cannot be believed: cut short,
    overwritten, another format, or a field that is not of its declared type or range (quest.store.records). One
    error for every such file, so that a reader that keeps a damaged file aside, or refuses it, catches one class.

    The message names the file and what was expected; ``path`` and ``problem`` say it to code. ``joined`` is what
    stands between the two in the message: " is damaged: " for a file judged whole, ": " for a problem that starts
    with the field it names (``run.json: epoch is -1, expected a value >= 0``), " " for a problem that is the rest
    of a sentence about the file (``.manifest.jsonl line 3 is not JSON``)."""

    def __init__(self, path: str | Path, problem: str, remedy: str = "", joined: str = " is damaged: "):
        # the name as found on disk, a line break in it escaped: the message stays one line
        super().__init__(f"{printable(str(path))}{joined}{problem}" + (f". {remedy}" if remedy else ""))
        self.path, self.problem, self.remedy, self.joined = Path(path), problem, remedy, joined

    def __reduce__(self) -> tuple[Any, ...]:
        # raised in a worker process, it crosses to the parent whole (the default would call __init__ with the
        # message alone)
        return type(self), (self.path, self.problem, self.remedy, self.joined)
