"""``quest-export RUN_DIR|CHECKPOINT --out DIR [--weights model|ema]``: a train.py run as a timm / Hugging Face model.

The folder holds what ``timm.create_model("local-dir:DIR", pretrained=True)`` and the Hugging Face Hub read:

- ``config.json``: ``architecture`` ``quest_vit.<attention>`` (:mod:`quest.models.timm_model`), ``num_classes``,
  ``model_args`` (the timm model, the attention and its options, num_classes, img_size, the model kwargs of the
  run), ``pretrained_cfg`` (input size, mean, std, crop_pct, interpolation as the run evaluated) and ``quest``
  (where the weights come from);
- ``model.safetensors``: the model's or the EMA's weights;
- ``README.md``: a model card with the run's config, metrics and provenance.

Every file is written atomically (quest.io); the checkpoint loads with ``weights_only=True``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from quest.engine.builders import build_model, resolve_img_size
from quest.engine.checkpoint import CheckpointRecord, load_record
from quest.errors import input_error, program_name
from quest.io import atomic_write, file_sha256, json_text, keep_or_refuse, markdown_table, write_text_atomic
from quest.models.timm_model import ARCHITECTURE, exported_architecture

__all__ = ["export_run", "resolve_checkpoint", "export_config", "main"]

WEIGHTS_FILE = "model.safetensors"
# what the model card's example writes for the folder's path (tests put the real path in its place and run it)
CARD_FOLDER = "path/to/this/folder"


def resolve_checkpoint(source: str | Path) -> Path:
    """A checkpoint file, or a run directory's ``checkpoints/last.pt``."""
    path = Path(source).expanduser()
    if path.is_dir():
        for candidate in (path / "checkpoints" / "last.pt", path / "last.pt"):
            if candidate.is_file():
                return candidate
        raise FileNotFoundError(f"{path} is a directory without checkpoints/last.pt: pass a train.py run directory "
                                "or a checkpoint file")
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass a train.py run directory or a checkpoint file")
    return path


def _model_args(stored: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "model": stored.model.name,
        "attention": stored.attention.name,
        "attention_options": OmegaConf.to_container(stored.attention.options, resolve=True),
        "num_classes": int(stored.data.num_classes),
        "img_size": resolve_img_size(stored),
        **OmegaConf.to_container(stored.model.kwargs, resolve=True),
    }
    if stored.model.get("layer_scale_init") is not None:
        args["init_values"] = float(stored.model.layer_scale_init)
    return args


def export_config(ckpt: CheckpointRecord, model: torch.nn.Module, weights: str, source: Path) -> dict[str, Any]:
    """config.json of the export (see the module docstring)."""
    stored = OmegaConf.create(ckpt.config)
    img_size = resolve_img_size(stored)
    classes = (ckpt.data or {}).get("classes")
    pretrained_cfg = {
        "input_size": [3, img_size, img_size], "fixed_input_size": True,
        "mean": [float(v) for v in stored.data.mean], "std": [float(v) for v in stored.data.std],
        "crop_pct": float(stored.recipe.crop_pct), "crop_mode": "center",
        "interpolation": str(stored.recipe.eval_interpolation),
        "num_classes": int(stored.data.num_classes), "first_conv": "patch_embed.proj", "classifier": "head",
    }
    config: dict[str, Any] = {
        "architecture": exported_architecture(stored.attention.name),
        "num_classes": int(stored.data.num_classes),
        "num_features": int(getattr(model, "num_features", 0)) or None,
        "global_pool": getattr(model, "global_pool", None),
        "model_args": _model_args(stored),
        "pretrained_cfg": pretrained_cfg,
        "quest": {"weights": weights, "checkpoint": str(source), "checkpoint_sha256": file_sha256(source),
                  "step": ckpt.state.get("step"), "epoch": ckpt.state.get("epoch"),
                  "train_data": stored.data.name, "choices": dict(ckpt.choices or {}),
                  "quest_version": _version()},
    }
    if classes and len(classes) == int(stored.data.num_classes):
        config["label_names"] = [str(c) for c in classes]
    return config


def _version() -> str:
    from quest import __version__

    return __version__


def _metrics(run_dir: Path) -> dict[str, Any]:
    """The run's final metrics (summary.json), when the checkpoint sits in a run directory."""
    summary = run_dir / "summary.json"
    if not summary.is_file():
        return {}
    record = json.loads(summary.read_text())
    return {k: v for k, v in record.items() if k.startswith(("val/", "val_ema/", "best/")) or k in
            ("status", "epoch", "step", "best_epoch", "num_params")}


def model_card(config: dict[str, Any], ckpt: CheckpointRecord, metrics: dict[str, Any]) -> str:
    """README.md: what the model is, how to load it, the run's metrics, config and provenance."""
    args, quest = config["model_args"], config["quest"]
    lines = [
        "---", "library_name: timm", "pipeline_tag: image-classification",
        "tags: [image-classification, timm, quest, vision-transformer]", "---", "",
        f"# {args['model']} with {args['attention']} attention ({quest['weights']} weights)", "",
        f"A timm `{args['model']}` whose attention layers are quest's `{args['attention']}` formulation "
        f"(options: `{json.dumps(args['attention_options'])}`), trained with quest and exported by `quest-export`.",
        "It needs quest: `config.json` names the architecture `" + config["architecture"] + "`, which timm knows "
        "only after `import quest`; without it timm refuses the folder instead of building a model with other "
        "attention.", "",
        "```python", "import quest  # registers the quest_vit architecture and quest's attn_layer names with timm",
        # the example reads this folder's own files (offline); downloading from the Hub is left to the reader
        "import timm", "", f"model = timm.create_model(\"local-dir:{CARD_FOLDER}\", pretrained=True).eval()",
        "config = timm.data.resolve_data_config({}, model=model)",
        "transform = timm.data.create_transform(**config)", "```", "",
        "Once this folder is uploaded to the Hugging Face Hub, `hf-hub:<user>/<repo>` in place of the `local-dir:` "
        "path loads it from there (a download).", "",
        "## Metrics", "",
    ]
    if metrics:
        lines += markdown_table(["metric", "value"], metrics.items())
    else:
        lines.append("No summary.json beside the checkpoint: no metrics recorded.")
    lines += ["", "## Provenance", "",
              f"- checkpoint: `{quest['checkpoint']}` (sha256 `{quest['checkpoint_sha256']}`), "
              f"step {quest['step']}, epoch {quest['epoch']}",
              f"- weights: {quest['weights']}", f"- training data: {quest['train_data']}",
              f"- config choices: `{json.dumps(quest['choices'])}`", f"- quest version: {quest['quest_version']}",
              "", "## Training config", "", "```yaml", OmegaConf.to_yaml(OmegaConf.create(ckpt.config)).rstrip(),
              "```", ""]
    return "\n".join(lines)


def export_run(source: str | Path, out: str | Path, weights: str = "ema", overwrite: bool = False) -> Path:
    """Write the export of ``source`` (a run directory or checkpoint file) to ``out``; returns ``out``.

    ``weights="ema"`` takes the EMA weights (what the run's best numbers usually are) and refuses a run trained
    without EMA; ``"model"`` the trained weights themselves. An earlier export in ``out`` is refused (naming its
    files), or with ``overwrite`` moved to ``out/.replaced/<UTC time>/``; other files in ``out`` are left alone."""
    if weights not in ("model", "ema"):
        raise ValueError(f"--weights must be model or ema, got {weights!r}")
    path = resolve_checkpoint(source)
    ckpt = load_record(path)  # weights_only=True
    state = getattr(ckpt, weights)
    if state is None:
        raise ValueError(f"--weights {weights}: {path} holds no EMA weights (trained with recipe.ema=false); "
                         "use --weights model")
    model = build_model(OmegaConf.create(ckpt.config))
    model.load_state_dict(state)  # strict: the export holds exactly what the model has
    from safetensors.torch import save as safetensors_bytes

    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    out = Path(out).expanduser()
    keep_or_refuse([out / WEIGHTS_FILE, out / "config.json", out / "README.md"], overwrite, keep_in=out)
    config = export_config(ckpt, model, weights, path)
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    atomic_write(out / WEIGHTS_FILE, lambda f: f.write(safetensors_bytes(tensors, metadata={"format": "pt"})))
    write_text_atomic(out / "config.json", json_text(config))
    write_text_atomic(out / "README.md", model_card(config, ckpt, _metrics(run_dir)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="quest-export", description="Export a train.py run as a timm / Hugging Face model folder "
        f"(config.json naming {ARCHITECTURE}.<attention>, model.safetensors, README.md): docs/interop.md.")
    parser.add_argument("source", help="a train.py run directory (its checkpoints/last.pt) or a checkpoint file")
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument("--weights", choices=("model", "ema"), default="ema",
                        help="the EMA weights (default) or the trained model's")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier export in --out (its files are kept in --out/.replaced/)")
    args = parser.parse_args(argv)
    try:
        out = export_run(args.source, args.out, args.weights, args.overwrite)
    except (FileNotFoundError, ValueError) as exc:
        return input_error(program_name("quest-export"), exc)
    print(f"exported {args.source} ({args.weights} weights) to {out}")
    return 0


if __name__ == "__main__":  # quest's one error path (quest/errors.py), as the quest-export console script
    from quest.errors import program_name, reporting_errors

    with reporting_errors(program_name("quest-export")):
        code = main()
    sys.exit(code)
