"""data=imagenet / data=imagefolder: ``${data.root}/${data.train_split}/<class>/<image>`` and the same for
val_split, every file checked before the first step (the pre-flight, docs/data.md)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..config import DataConfig, need_root
from ..kinds import register_dataset

__all__ = ["folder_classes", "check_split_classes"]


def folder_classes(data: Any, split: str) -> tuple[Path, list[str]]:
    """The split's folder and its class folders in ImageFolder's order (visible ones, each its own place:
    quest.data.entries)."""
    from ..entries import class_folders, require_images_at_top
    from ..folder import check_image_folder

    folder = data.train_split if split == "train" else data.val_split
    root = check_image_folder(need_root(data) / folder, f"data={data.name} {split} split")
    folders = class_folders(root)
    require_images_at_top(root, folders)  # bounded (one listing per class): at the start's checks, before any work
    return root, [p.name for p in folders]


def _num_classes(data: Any) -> int:
    return len(folder_classes(data, "train")[1])


def check_split_classes(data: Any) -> None:
    """The validation split must have exactly the training split's classes, since a class index is its folder's
    position in the sorted list; otherwise validation images would be scored as another class."""
    (train_root, train), (val_root, val) = folder_classes(data, "train"), folder_classes(data, "val")
    if train != val:
        only_train, only_val = sorted(set(train) - set(val)), sorted(set(val) - set(train))
        raise ValueError(
            f"data={data.name}: the class folders of {val_root} differ from those of {train_root} "
            f"(only in train: {only_train[:20]}{' ...' if len(only_train) > 20 else ''}; only in val: "
            f"{only_val[:20]}{' ...' if len(only_val) > 20 else ''}); both splits need the same <class> folders, "
            "since a class index is the folder's position in the sorted list")


def _where(data: Any) -> str:
    return f"class folders of {data.root}/{data.train_split}"


def _build(data: Any, split: str, transform: Callable | None, read_file: Callable[[str], Any] | None = None) -> Any:
    from ..folder import SafeImageFolder
    from ..preflight import apply_preflight

    root, _ = folder_classes(data, split)
    # read_file: the training input's way to read a file (quest/data/pipelines/train_input.py), else PIL's
    ds = SafeImageFolder(root, transform=transform, bad_images=data.bad_images, loader=read_file)
    # every file checked before the first step (docs/data.md)
    if data.get("preflight", True):
        apply_preflight(ds, root, data.bad_images, data.get("max_skipped_fraction", 0.01), split)
    if len(ds.classes) != data.num_classes:
        raise ValueError(
            f"{root} has {len(ds.classes)} class folders but data.num_classes={data.num_classes}; "
            f"expected {data.num_classes} sub-directories <class>/<image>"
        )
    return ds


def _val_folder(data: Any) -> Path | None:
    return Path(data.root).expanduser() / data.val_split if data.get("root") else None


for _name in ("imagenet", "imagefolder"):
    register_dataset(_name, DataConfig, num_classes=_num_classes, check_data=check_split_classes,
                     where_classes=_where, val_folder=_val_folder, reads_files=True)(_build)
