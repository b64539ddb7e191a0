"""What an evaluation reads, declared up front: every data root of a suite is checked (it exists, has the layout,
holds images, every folder is readable) before the first evaluation starts, and recorded in eval_results.json.

Each evaluation registers an ``inputs(run, section) -> list[Input]`` (quest.evaluation.registry); an :class:`Input`
names the setting (``eval.roots.v2``, ``data.root``), the path it holds and a check that lists what the evaluation
will read, raising a clear error when it cannot. Listings are kept on the run (:func:`listed`), so the evaluation
reads the same list without walking the folders twice.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

__all__ = ["Input", "listed", "data_input", "readable_dir", "permission_message", "data_identity"]


@dataclass(frozen=True)
class Input:
    """One data root an evaluation reads: ``key`` (the setting, e.g. ``eval.roots.c``), ``path`` (what it holds;
    a description for a built-in data set) and ``check()``, which raises when the evaluation could not read it."""

    key: str
    path: str
    check: Callable[[], Any]


def listed(run: Any, key: Any, make: Callable[[], Any]) -> Any:
    """``make()`` once per run and ``key``: a folder listing shared by the up-front check and the evaluation."""
    cache = run.listings
    if key not in cache:
        cache[key] = make()
    return cache[key]


def permission_message(path: str | Path, what: str) -> str:
    """'<what>: cannot read <path>: permission denied (drwx------, owner uid N; this process runs as uid M) ...'."""
    path = Path(path)
    try:
        st = path.stat()
        mode = f"{stat.filemode(st.st_mode)}, owner uid {st.st_uid}"
    except OSError:
        mode = "its mode cannot be read"
    need = "read and execute (r-x)" if path.is_dir() else "read (r--)"
    return (f"{what}: cannot read {path}: permission denied ({mode}; this process runs as uid {os.getuid()}); "
            f"every folder and image the evaluation reads needs {need} permission for this user")


def readable_dir(path: str | Path, what: str) -> Path:
    """``path`` and its sub-folders (one level: class folders) can be listed; else a PermissionError naming the
    folder and the permission missing (torchvision's ImageFolder would skip it: "Found no valid file ...")."""
    path = Path(path)
    for folder in [path, *(p for p in _subdirs(path, what))]:
        if not os.access(folder, os.R_OK | os.X_OK):
            raise PermissionError(permission_message(folder, what))
    return path


def _subdirs(path: Path, what: str) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))  # never data
    except PermissionError:
        raise PermissionError(permission_message(path, what)) from None


def _val_folder(data: Any) -> Path | None:
    from quest.data import get_dataset

    find = get_dataset(data.name).val_folder
    return find(data) if find is not None else None


def _data_description(data: Any) -> str:
    root = data.get("root")
    if (folder := _val_folder(data)) is not None:
        return str(folder)
    return f"{root} ({data.name} {data.val_split} split)" if root else f"built-in data set {data.name} (val split)"


def data_input(run: Any, what: str, transform: Any = None) -> list[Input]:
    """The configured data set's val split (the checkpoint's data, data=<name>, with any data.* override applied);
    its check builds the data set (image folders: every class folder readable first)."""
    from quest.data import build_dataset

    data = run.target.data
    if data is None:
        def refuse() -> None:
            raise ValueError(f"{what} evaluates a data set: pass data=<name> (e.g. data=digits) with model=..., or "
                             "evaluate a checkpoint (its data config is stored in it)")
        return [Input("data", "none", refuse)]

    def check() -> Any:
        folder = _val_folder(data)
        if folder is not None and folder.is_dir():
            readable_dir(folder, f"{what} (data={data.name} val split)")
        return build_dataset(data, "val", transform)

    return [Input("data.root", _data_description(data), check)]


def data_identity(found: Any, root: str) -> dict[str, Any]:
    """What an input's check found, by content as training records its data (summary.json's ``data_fingerprint``):
    ``size`` (images), ``files_sha256`` (a digest of the sorted file names relative to ``root`` with their labels:
    the same files moved or copied are the same digest, other files another) and ``classes_sha256`` (the class
    names in order); None where the check lists no files (a built-in data set, ImageNet-C's cells listed one at a
    time), so that the record says what is not known instead of guessing."""
    import hashlib
    import json

    from quest.run.directory import files_sha256, listed_samples

    size = len(found) if hasattr(found, "__len__") and not isinstance(found, (str, tuple)) else None
    files = None
    if listed_samples(found) is not None:
        files = files_sha256(found)
    elif isinstance(found, list) and all(isinstance(x, tuple) and len(x) == 2 for x in found):  # (path, label)
        prefix = os.path.join(root, "")
        rows = sorted(f"{os.path.relpath(p, root) if not str(p).startswith(prefix) else str(p)[len(prefix):]}\t{y}\n"
                      for p, y in found)
        files = hashlib.sha256(b"files-2\n" + "".join(rows).encode("utf-8", "surrogateescape") + b"\n").hexdigest()
    classes = getattr(found, "classes", None) or getattr(getattr(found, "dataset", None), "classes", None)
    digest = None if classes is None else hashlib.sha256(json.dumps(list(classes)).encode("utf-8")).hexdigest()
    return {"size": size, "classes_sha256": digest, "files_sha256": files}
