"""A tiny ImageFolder and a tiny QUEST run trained on it, for the timm / Hugging Face interop tests."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from quest.train import fit
from tests.helpers import compose_cfg

CLASSES = ("cat", "dog", "eel")


def make_image_folder(root: Path, per_class: int = 8, size: int = 20, seed: int = 0) -> Path:
    """root/{train,val}/<class>/<i>.png: noisy images whose mean colour depends on the class (learnable)."""
    rng = np.random.default_rng(seed)
    for split in ("train", "val"):
        for c, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                base = np.zeros((size, size, 3))
                base[..., c] = 160.0
                img = np.clip(base + rng.normal(0, 50, (size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(img).save(folder / f"{i}.png")
    return root


def train_tiny_run(data_root: Path, run_dir: Path, attention: str = "quest") -> Path:
    """A few steps of vit_pico on the folder: digits-style normalisation (0.5), crop_pct 0.875 and bilinear
    resizing, so that an export that kept timm's ImageNet defaults instead would be seen. The EMA decays fast,
    so its weights differ from the model's."""
    overrides = [
        "data=imagefolder", f"data.root={data_root}", f"data.num_classes={len(CLASSES)}", "data.img_size=16",
        "data.batch_size=8", "data.num_workers=0", "data.mean=[0.5,0.5,0.5]", "data.std=[0.5,0.5,0.5]",
        "model=vit_pico", f"attention={attention}", "recipe=light", "recipe.crop_pct=0.875",
        "recipe.eval_interpolation=bilinear", "recipe.ema_decay=0.5", "trainer.epochs=2",
        "trainer.log_every_n_steps=1",
    ]
    fit(compose_cfg(*overrides), run_dir)
    return run_dir
