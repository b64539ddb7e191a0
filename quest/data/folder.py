"""ImageFolder with a layout check up front and a policy for unreadable images."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.data import default_collate
from torchvision.datasets import ImageFolder

from quest.runtime.errors import UserError

from .config import BAD_IMAGES
from .entries import image_samples, is_hidden

log = logging.getLogger(__name__)


class CorruptImageError(UserError, RuntimeError):
    """An image in the data set could not be read; the message names the file."""


def check_image_folder(root: str | Path, what: str) -> Path:
    """``root`` must be a directory of class sub-directories (visible ones: quest.data.entries); otherwise a message
    naming the path and layout."""
    root = Path(root).expanduser()
    expected = f"{root}/<class>/<image> (one visible sub-directory per class)"
    if not root.is_dir():
        raise FileNotFoundError(f"{what}: {root} does not exist or is not a directory; expected the layout {expected}")
    if not any(p.is_dir() and not is_hidden(p.name) for p in root.iterdir()):
        raise FileNotFoundError(f"{what}: {root} has no class sub-directories; expected the layout {expected}")
    return root


class SafeImageFolder(ImageFolder):
    """``ImageFolder`` whose classes and images are quest.data.entries' (hidden entries never count; class folders
    that are the same place are refused; the pre-flight lists the same files), and whose unreadable images either
    raise :class:`CorruptImageError` naming the file (``bad_images='error'``) or are dropped from the batch and
    counted (``bad_images='skip'``, use :func:`collate_skipping_bad`)."""

    def find_classes(self, directory: str | Path) -> tuple[list[str], dict[str, int]]:
        # listed once here, handed to make_dataset: torchvision's own would count .ipynb_checkpoints as a class
        classes, self._listed = image_samples(directory)
        return classes, {c: i for i, c in enumerate(classes)}

    def make_dataset(self, directory: str | Path, class_to_idx: dict[str, int], extensions: Any = None,
                     is_valid_file: Any = None, allow_empty: bool = False) -> list[tuple[str, int]]:
        return self._listed

    def __init__(self, root: str | Path, transform: Callable | None = None, bad_images: str = "error",
                 loader: Callable[[str], Any] | None = None):
        if bad_images not in BAD_IMAGES:
            raise ValueError(f"data.bad_images must be one of {', '.join(BAD_IMAGES)}, got {bad_images!r}")
        super().__init__(str(root), transform=transform, **({"loader": loader} if loader is not None else {}))
        self.bad_images = bad_images

    def __getitem__(self, index: int) -> Any:
        path, target = self.samples[index]
        try:
            img = self.loader(path)
        except Exception as exc:  # PIL raises several types for truncated / non-image files
            if self.bad_images == "error":
                raise CorruptImageError(f"cannot read image {path}: {exc}. Set data.bad_images=skip to skip such files.") from exc
            log.warning("skipping unreadable image %s (%s)", path, exc)
            return None
        if self.transform is not None:
            try:
                img = self.transform(img)
            except CorruptImageError as exc:  # a transform that decodes itself (data.draft_decode): the same policy
                if self.bad_images == "error":
                    raise
                log.warning("skipping unreadable image %s (%s)", path, exc)
                return None
        return img, target


def collate_skipping_bad(batch: list) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Default collation of the readable samples; also returns how many were skipped."""
    good = [b for b in batch if b is not None]
    skipped = len(batch) - len(good)
    if not good:
        return torch.empty(0), torch.empty(0, dtype=torch.long), skipped
    images, targets = default_collate(good)
    return images, targets, skipped
