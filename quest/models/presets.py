"""Small ViTs for CPU work, registered in timm's model registry so ``timm.create_model`` and Hydra know them.

Shapes follow the ViT family (pre-norm blocks, [CLS] token, learned position embedding); only width, depth,
patch and input size shrink so a run fits a laptop CPU in minutes.
"""
from __future__ import annotations

from typing import Any

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer, _create_vision_transformer

__all__ = ["CPU_PRESETS"]

# name -> VisionTransformer kwargs. Each is small enough to train on 2 CPU cores.
CPU_PRESETS: dict[str, dict[str, Any]] = {
    # 16 px input, 4x4 patches of 4 px: the built-in digits data (8x8 upsampled to 16), 17 tokens.
    "vit_pico_patch4_16": dict(img_size=16, patch_size=4, embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0),
    # 32 px, 4 px patches: CIFAR-sized inputs.
    "vit_nano_patch4_32": dict(img_size=32, patch_size=4, embed_dim=128, depth=6, num_heads=4, mlp_ratio=2.0),
    # ViT-Ti width and heads at 32 px.
    "vit_micro_patch4_32": dict(img_size=32, patch_size=4, embed_dim=192, depth=6, num_heads=3, mlp_ratio=4.0),
}


# timm reads a module-level ``default_cfgs`` when registering; it records input size, crop and normalisation.
default_cfgs = generate_default_cfgs(
    {
        name: dict(
            url="", num_classes=1000, input_size=(3, kw["img_size"], kw["img_size"]), crop_pct=1.0,
            interpolation="bicubic", mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
            first_conv="patch_embed.proj", classifier="head",
        )
        for name, kw in CPU_PRESETS.items()
    }
)


def _make(name: str):
    def factory(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
        return _create_vision_transformer(name, pretrained=pretrained, **{**CPU_PRESETS[name], **kwargs})

    factory.__name__ = name
    factory.__qualname__ = name
    factory.__doc__ = f"CPU preset {name}: {CPU_PRESETS[name]}"
    return factory


for _name in CPU_PRESETS:
    register_model(_make(_name))
