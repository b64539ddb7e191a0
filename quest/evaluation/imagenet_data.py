"""ImageNet-family test sets in their on-disk layouts, with labels in the standard 1000-class order.

The class index of a wnid folder is its position in the 1000 sorted ImageNet wnids (timm's
``_info/imagenet_synsets.txt``), never its position among the folders present, so a partial copy (or a test fixture
of a few classes) keeps the right labels. ImageNet-v2 folders are class indices: label = int(folder name).
"""
from __future__ import annotations

import os
import pkgutil
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

from PIL import Image
from torch.utils.data import Dataset

from quest.data.entries import LayoutError, is_hidden, is_image_name, require_distinct

__all__ = [
    "ImageList", "LAYOUTS", "imagenet_wnids", "subset_classes", "require_dir", "wnid_samples", "v2_samples",
    "real_files", "V2_DIR",
]

# The layout each root must have, quoted in every error about it.
LAYOUTS = {
    "val": "<eval.roots.val>/<wnid>/<image>.JPEG (ImageNet val in wnid folders, "
           "e.g. n01440764/ILSVRC2012_val_00000293.JPEG)",
    "v2": "<eval.roots.v2>/imagenetv2-<variant>-format-val/<class index 0..999>/<image>.jpeg",
    "real": "<eval.roots.real or eval.roots.val>/[<wnid>/]ILSVRC2012_val_<8 digits>.JPEG "
            "(all images listed in real.json)",
    "a": "<eval.roots.a>/<wnid>/<image> (ImageNet-A: 200 wnid folders)",
    "r": "<eval.roots.r>/<wnid>/<image> (ImageNet-R: 200 wnid folders)",
    "c": "<eval.roots.c>/<corruption>/<severity 1..5>/<wnid>/<image>.JPEG (ImageNet-C, 224x224 images)",
}
V2_DIR = "imagenetv2-{variant}-format-val"


@lru_cache(maxsize=None)
def imagenet_wnids() -> tuple[str, ...]:
    """The 1000 ImageNet-1k wnids in sorted order: index i is class i of every ImageNet-1k classifier."""
    wnids = tuple(pkgutil.get_data("timm.data", "_info/imagenet_synsets.txt").decode().split())
    assert len(wnids) == 1000 and list(wnids) == sorted(wnids)
    return wnids


@lru_cache(maxsize=None)
def subset_classes(which: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """ImageNet-A or -R: (the 200 columns of the 1000-way logits, ascending; their wnids, sorted). Target t of an
    A/R image is the position of its wnid in the second list, which is the t-th kept column."""
    indices = tuple(int(i) for i in pkgutil.get_data("timm.data", f"_info/imagenet_{which}_indices.txt").split())
    wnids = tuple(pkgutil.get_data("timm.data", f"_info/imagenet_{which}_synsets.txt").decode().split())
    all_wnids = imagenet_wnids()
    if len(indices) != 200 or list(indices) != sorted(indices) or [all_wnids[i] for i in indices] != list(wnids):
        raise RuntimeError(f"timm's imagenet_{which} index and synset lists disagree")
    return indices, wnids


def require_dir(path: str | Path | None, key: str, what: str) -> Path:
    """An existing directory, or an error naming the setting, the path and the expected layout."""
    layout = LAYOUTS[key]
    if path is None:
        raise FileNotFoundError(f"{what} needs eval.roots.{key}=<directory>; expected layout {layout}")
    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"{what}: {root} does not exist or is not a directory; expected layout {layout}")
    return root


def _entries(folder: Path, what: str) -> list[Path]:
    """The visible entries of ``folder`` (names starting with '.' are never data: quest.data.entries); an
    unreadable folder is an error naming it and the permission it lacks."""
    from .inputs import permission_message

    try:
        if not os.access(folder, os.R_OK | os.X_OK):  # r without x lists names whose type cannot be read
            raise PermissionError(folder)
        return [p for p in folder.iterdir() if not is_hidden(p.name)]
    except PermissionError:
        raise PermissionError(permission_message(folder, what)) from None


def _images(folder: Path, what: str = "evaluation") -> list[Path]:
    # the training data set's rule for an image (quest.data.entries): the same files count in both
    return sorted(p for p in _entries(folder, what) if is_image_name(p.name) and p.is_file())


def _class_dirs(root: Path, key: str, what: str) -> list[Path]:
    dirs = sorted(p for p in _entries(root, what) if p.is_dir())
    if not dirs:
        raise FileNotFoundError(f"{what}: {root} has no class folders; expected layout {LAYOUTS[key]}")
    try:
        require_distinct(root, dirs)  # two labels for the same images otherwise
    except LayoutError as exc:
        raise LayoutError(f"{what}: {exc}") from None
    return dirs


def wnid_samples(root: Path, wnids: Sequence[str], key: str, what: str) -> list[tuple[str, int]]:
    """(path, index of the folder's wnid in ``wnids``) for every image under ``root/<wnid>/``; a folder whose name is
    not in ``wnids`` is an error (a wrong root, or a layout that would shift labels)."""
    position = {w: i for i, w in enumerate(wnids)}
    samples: list[tuple[str, int]] = []
    for folder in _class_dirs(root, key, what):
        if folder.name not in position:
            raise ValueError(f"{what}: folder {folder} is not one of the expected {len(wnids)} wnids; "
                             f"expected layout {LAYOUTS[key]}")
        samples += [(str(p), position[folder.name]) for p in _images(folder, what)]
    if not samples:
        raise FileNotFoundError(f"{what}: no images under {root}; expected layout {LAYOUTS[key]}")
    return samples


def v2_samples(folder: Path, what: str) -> list[tuple[str, int]]:
    """ImageNet-v2: the folder name *is* the class index. A string-sorted ImageFolder would put '10' before '2'."""
    samples: list[tuple[str, int]] = []
    for sub in _class_dirs(folder, "v2", what):
        if not sub.name.isdigit() or not 0 <= int(sub.name) < 1000 or sub.name != str(int(sub.name)):
            # '07' beside '7' would be a second folder of class 7
            raise ValueError(f"{what}: folder {sub} is not a class index 0..999 (written without leading zeros); "
                             f"expected layout {LAYOUTS['v2']}")
        samples += [(str(p), int(sub.name)) for p in _images(sub, what)]
    if not samples:
        raise FileNotFoundError(f"{what}: no images under {folder}; expected layout {LAYOUTS['v2']}")
    return samples


def real_files(root: Path, what: str) -> list[str]:
    """Every image under ``root`` (flat, or one level of wnid folders), sorted by file name, which for
    ILSVRC2012_val_%08d.JPEG is the order of real.json."""
    files = _images(root, what) + [p for d in _class_dirs_if_any(root, what) for p in _images(d, what)]
    if not files:
        raise FileNotFoundError(f"{what}: no images under {root}; expected layout {LAYOUTS['real']}")
    return [str(p) for p in sorted(files, key=lambda p: p.name)]


def _class_dirs_if_any(root: Path, what: str) -> list[Path]:
    dirs = sorted(p for p in _entries(root, what) if p.is_dir())
    return _class_dirs(root, "real", what) if dirs else []


class ImageList(Dataset):
    """(image, target) for a fixed list of (path, target), in that order; RGB PIL images before ``transform``."""

    def __init__(self, samples: Sequence[tuple[str, int]], transform: Callable | None = None):
        self.samples = list(samples)
        self.targets = [t for _, t in self.samples]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, target = self.samples[index]
        try:
            with Image.open(path) as f:
                img = f.convert("RGB")
        except Exception as exc:  # PIL raises several types for truncated / non-image files
            raise OSError(f"cannot read image {path}: {exc}") from exc
        if self.transform is not None:
            img = self.transform(img)
        return img, target
