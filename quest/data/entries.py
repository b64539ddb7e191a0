"""Which entries of an image folder are data: the one rule every reader follows (the training data set, its
pre-flight, ``quest-data check``, ``quest-data cap``, make_shards, the evaluation folders; docs/data.md, "Which
entries are data").

- An entry whose name starts with '.' (``.ipynb_checkpoints``, ``.DS_Store``, macOS's ``._photo.jpg``) is never a
  class or an image, at any depth.
- A class folder is a visible directory (or a link to one) of the split folder; two class folders that resolve to
  the same place, or one inside another (links), are refused naming both: they would label the same images twice.
- An image is a visible file under a class folder (sub-folders and links followed, each real folder once) whose
  extension torchvision's ImageFolder reads (:data:`IMAGE_SUFFIXES`); what else lies there is never read, and the
  pre-flight names it (:func:`not_read_reason`).
- A class folder with no image is refused: its class would exist with nothing to learn.
"""
from __future__ import annotations

import os
from pathlib import Path

from torchvision.datasets.folder import IMG_EXTENSIONS

from quest.runtime.errors import UserError

__all__ = ["IMAGE_SUFFIXES", "LayoutError", "is_hidden", "is_image_name", "not_read_reason", "class_folders",
           "require_distinct", "class_files", "class_listing", "image_samples", "require_images_at_top"]

IMAGE_SUFFIXES = tuple(sorted(IMG_EXTENSIONS))  # what ImageFolder reads: '.gif' is not among them


class LayoutError(UserError, ValueError):
    """A folder that does not have an image folder's layout; the message names the entries and the layout."""


def is_hidden(name: str) -> bool:
    return name.startswith(".")


def is_image_name(name: str) -> bool:
    """A file the data set reads: visible, with an extension of :data:`IMAGE_SUFFIXES` (any case)."""
    return not is_hidden(name) and name.lower().endswith(IMAGE_SUFFIXES)


def not_read_reason(name: str) -> str | None:
    """None for a file the data set reads, else why it never reads it (the pre-flight's reason for it)."""
    if is_image_name(name):
        return None
    suffix = os.path.splitext(name)[1] or "no extension"
    return f"not read by the data set: {suffix} is not an image extension it reads ({' '.join(IMAGE_SUFFIXES)})"


def _expected(root: Path) -> str:
    return f"{root}/<class>/<image> (one visible sub-directory per class)"


def class_folders(root: str | Path) -> list[Path]:
    """The class folders of ``root`` in ImageFolder's (sorted) order; a :class:`LayoutError` naming both when two
    resolve to the same place or one lies inside another (or holds ``root`` itself)."""
    root = Path(root)
    folders = sorted((p for p in root.iterdir() if not is_hidden(p.name) and p.is_dir()), key=lambda p: p.name)
    require_distinct(root, folders)
    return folders


def require_distinct(root: str | Path, folders: list[Path]) -> None:
    """Each of ``folders`` (class folders of ``root``) its own place: none resolves to another, lies inside another,
    or holds ``root``; else a :class:`LayoutError` naming both."""
    root = Path(root)
    real = {p: p.resolve() for p in folders}
    top = root.resolve()
    for p in folders:
        if real[p] == top or real[p] in top.parents:
            raise LayoutError(f"class folder {p} resolves to {real[p]}, which holds the split folder {root} itself; "
                              f"expected {_expected(root)}, each class folder its own place")
    by_place = sorted(folders, key=lambda p: (str(real[p]), p.name))
    for a, b in zip(by_place, by_place[1:]):
        if real[a] == real[b] or real[a] in real[b].parents:
            how = "both resolve to" if real[a] == real[b] else f"{b.name} resolves to a folder inside"
            raise LayoutError(f"class folders {a} and {b} are the same images ({how} {real[a]}): they would label "
                              f"them twice; expected {_expected(root)}, each class folder its own place")


def class_files(class_dir: str | Path) -> list[Path]:
    """Every visible file under ``class_dir`` in ImageFolder's order: sub-folders and links followed (as ImageFolder),
    hidden entries at any depth left out, each real folder walked once (a link loop ends)."""
    found: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(class_dir, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames.clear()
            continue
        seen.add(real)
        dirnames[:] = [d for d in dirnames if not is_hidden(d)]
        found.append((dirpath, sorted(f for f in filenames if not is_hidden(f))))
    # torchvision's order (make_dataset: sorted(os.walk(...)), then sorted names): the same samples in the same
    # order as ImageFolder gives a folder without hidden entries
    return [Path(dirpath) / f for dirpath, names in sorted(found) for f in names]


def require_images_at_top(root: str | Path, folders: list[Path]) -> None:
    """Bounded work before any walk (one listing per class folder): a class folder that directly holds files but no
    image and no sub-folder is refused, so that a folder that is not a data set (a link to /usr) is named at once."""
    for folder in folders:
        with os.scandir(folder) as entries:
            files = 0
            for entry in entries:
                if is_hidden(entry.name):
                    continue
                if is_image_name(entry.name) or entry.is_dir():
                    break
                files += 1
            else:
                if files:
                    raise LayoutError(f"{folder} holds {files} file(s) and none is an image "
                                      f"({' '.join(IMAGE_SUFFIXES)}): {root} is not an image folder; expected "
                                      f"{_expected(Path(root))}")


def class_listing(root: str | Path) -> list[tuple[Path, list[Path]]]:
    """Every class folder of ``root`` with every visible file under it (images and what else lies there), checked:
    the layout at the top first (bounded work), then a class folder without an image is a :class:`LayoutError`."""
    folders = class_folders(root)
    if not folders:
        raise LayoutError(f"{root} has no class sub-directories; expected {_expected(Path(root))}")
    require_images_at_top(root, folders)
    out = []
    for folder in folders:
        files = class_files(folder)
        if not any(is_image_name(p.name) for p in files):
            raise LayoutError(f"class folder {folder} holds no image ({' '.join(IMAGE_SUFFIXES)}); expected "
                              f"{_expected(Path(root))}, every class with at least one image")
        out.append((folder, files))
    return out


def image_samples(root: str | Path) -> tuple[list[str], list[tuple[str, int]]]:
    """(class names, [(image path, class index)]) of an image folder split: what the data set reads."""
    listing = class_listing(root)
    samples = [(str(p), index) for index, (_, files) in enumerate(listing) for p in files if is_image_name(p.name)]
    return [folder.name for folder, _ in listing], samples
