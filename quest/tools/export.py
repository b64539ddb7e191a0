"""``quest-export RUN_DIR|CHECKPOINT --out DIR [--weights model|ema]``: a train.py run as a timm / Hugging Face model.

The weights exported by default are the ones the run reports as its result (summary.json's ``val/top1``: the trained
model's, not the EMA's); the command says which it took and their validation top-1, and the model card labels every
metric with the weights it was measured on. A run that has not finished (no summary.json, interrupted, requeued) or
that diverged or failed on its data is refused, naming its status, unless ``--allow-unfinished``.

The folder holds what ``timm.create_model("local-dir:DIR", pretrained=True)`` and the Hugging Face Hub read:

- ``config.json``: ``architecture`` ``quest_vit.<attention>`` (:mod:`quest.models.timm_model`), ``num_classes``,
  ``model_args`` (the timm model, the attention and its options, num_classes, img_size, the model kwargs of the
  run), ``pretrained_cfg`` (input size, mean, std, crop_pct, interpolation as the run evaluated) and ``quest``
  (where the weights come from);
- ``model.safetensors``: the model's or the EMA's weights;
- ``README.md``: a model card with the run's config, metrics and provenance.

Every file is written atomically (quest.store.files); the checkpoint loads with ``weights_only=True``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from quest.attention.registry import refuse_code_named_by_file
from quest.evaluation.progress import Heartbeat
from quest.models.timm_model import ARCHITECTURE, exported_architecture
from quest.report.markdown import markdown_table
from quest.run.checkpoint import CheckpointRecord, load_record
from quest.runtime.errors import describe, input_error, parse_arguments, program_name
from quest.runtime.extras import MissingExtra
from quest.store.damage import DamagedFile
from quest.store.files import atomic_write, file_sha256, inside_folder, json_text, parse_json, write_text_atomic
from quest.store.output_folder import holding, input_path, output_path
from quest.store.run_files import read_summary, run_holding
from quest.store.tree import refuse_present
from quest.store.weights_check import check_weights
from quest.train.builders import build_model, resolve_img_size

from .onnx_export import ONNX_FILE, checked_onnx, require_onnx

__all__ = ["export_run", "resolve_checkpoint", "export_config", "main"]

WEIGHTS_FILE = "model.safetensors"
# what the model card's example writes for the folder's path (tests put the real path in its place and run it)
CARD_FOLDER = "path/to/this/folder"


def resolve_checkpoint(source: str | Path) -> Path:
    """A checkpoint file, or a run directory's ``checkpoints/last.pt``; a link, as the file it leads to: the run a
    checkpoint belongs to (its summary.json, its status and val/top1) is the one whose folder holds the file, not the
    link's (a ``last.pt`` linked to another run's would be exported with this run's figures)."""
    path = Path(source).expanduser()
    if path.is_dir():
        for candidate in (path / "checkpoints" / "last.pt", path / "last.pt"):
            if candidate.is_file():
                return candidate.resolve() if candidate.is_symlink() else candidate
        raise FileNotFoundError(f"{path} is a directory without checkpoints/last.pt: pass a train.py run directory "
                                "or a checkpoint file")
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass a train.py run directory or a checkpoint file")
    return path.resolve() if path.is_symlink() else path


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


FINISHED = ("completed", "stopped")  # stopped: trainer.max_steps reached, a finished run by design


def _run_dir(path: Path) -> Path:
    """The run directory a checkpoint sits in (``<run>/checkpoints/last.pt``), or its own folder."""
    return path.parent.parent if path.parent.name == "checkpoints" else path.parent


def run_summary(path: Path) -> dict[str, Any]:
    """summary.json of the run directory a checkpoint sits in, every field checked (quest.store.run_files), or {} when
    there is none."""
    run_dir = _run_dir(path)
    summary = run_dir / "summary.json"
    try:
        record = read_summary(inside_folder(summary, run_dir))  # never another run's, through a link
    except (OSError, ValueError) as exc:  # not JSON, a field of the wrong type or range, unreadable
        problem = exc.problem if isinstance(exc, DamagedFile) else describe(exc).removeprefix(f"{summary}: ")
        raise ValueError(f"cannot read {summary}: {problem}; it says whether the "
                         "run finished: repair or remove it (a removed summary makes this an unfinished run: "
                         "--allow-unfinished)") from None
    return record or {}


def unfinished_reason(summary: dict[str, Any], ckpt: CheckpointRecord, path: Path) -> str | None:
    """Why the checkpoint is not a finished run's result (None when it is)."""
    status = summary.get("status")
    if status is None:
        return f"there is no summary.json beside {path} (a run that is running, was killed, or a moved file)"
    if status not in FINISHED:
        return f"the run's status is {status}"
    if path.name != "best.pt" and summary.get("step") != ckpt.state.get("step"):
        return (f"summary.json says {status} at step {summary.get('step')}, but {path.name} holds step "
                f"{ckpt.state.get('step')} (the run was continued after it ended)")
    return None


def labelled_metrics(summary: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """(metric, the weights it was measured on, value) for the model card: the final model's (``val/``), the
    final EMA's (``val_ema/``) and the best epoch's model (``best/``, which best.pt holds)."""
    rows = []
    for key, value in summary.items():
        if key.startswith("val/"):
            rows.append((key, "model, last step", value))
        elif key.startswith("val_ema/"):
            rows.append((key, "EMA, last step", value))
        elif key.startswith("best/") and value is not None:  # no best.pt before an epoch ended
            rows.append((key, f"model at epoch {summary.get('best_epoch')} (best.pt)", value))
        elif key in ("status", "epoch", "step", "best_epoch", "num_params"):
            rows.append((key, "", value))
    return rows


def _recorded_top1(ckpt: CheckpointRecord, path: Path) -> float | None:
    """The model's validation top-1 as the checkpoint itself recorded it: best.pt's best, or the last validation row
    of the metrics it saw at its own step (None where it holds none: the EMA's is in summary.json only)."""
    if path.name == "best.pt":
        return ckpt.state.get("best_top1")
    try:
        rows = [parse_json(line) for line in (ckpt.metrics_text or "").splitlines() if line.strip()]
    except ValueError as exc:  # a JSON decoding error names no file
        raise ValueError(f"{path}: metrics_text is not the metrics log it saw ({exc}); expected JSON lines") from None
    vals = [r.get("val/top1") for r in rows if isinstance(r, dict) and r.get("step") == ckpt.state.get("step")
            and isinstance(r.get("val/top1"), (int, float))]
    return vals[-1] if vals else None


def exported_top1(summary: dict[str, Any], weights: str, path: Path, ckpt: CheckpointRecord) -> float | None:
    """The validation top-1 of the exported weights, when the run measured it. summary.json's figure for the model's
    weights must be the one the checkpoint recorded: a summary edited, or another run's, is refused, not claimed."""
    if path.name == "best.pt":
        claimed = summary.get("best/val/top1") if weights == "model" else None
    else:
        claimed = summary.get("val/top1" if weights == "model" else "val_ema/top1")
    recorded = _recorded_top1(ckpt, path) if weights == "model" else None
    if claimed is not None and recorded is not None and abs(claimed - recorded) > 1e-6:
        key = "best/val/top1" if path.name == "best.pt" else "val/top1"
        raise ValueError(f"{_run_dir(path) / 'summary.json'} says {key} {claimed:g}, but {path} recorded "
                         f"{recorded:g} for these weights: the summary was edited or is another run's, and the model "
                         "card would claim a figure nobody measured")
    return claimed


def model_card(config: dict[str, Any], ckpt: CheckpointRecord, metrics: list[tuple[str, str, Any]],
               top1: float | None) -> str:
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
    which = f"This folder holds the {quest['weights']} weights of step {quest['step']}: " + (
        f"validation top-1 {top1:.2f}%." if isinstance(top1, (int, float)) else
        "the run did not measure them on its validation set.")
    lines += [which, ""]
    if metrics:
        lines += markdown_table(["metric", "measured on", "value"], metrics)
    else:
        lines.append("No summary.json beside the checkpoint: no metrics recorded.")
    lines += ["", "## Provenance", "",
              f"- checkpoint: `{quest['checkpoint']}` (sha256 `{quest['checkpoint_sha256']}`), "
              f"step {quest['step']}, epoch {quest['epoch']}",
              f"- weights: {quest['weights']}", f"- training data: {quest['train_data']}",
              *([f"- ONNX: `{quest['onnx']['file']}` (opset {quest['onnx']['opset']}, dynamic batch axis); "
                 f"onnxruntime's logits within {quest['onnx']['max_abs_diff_vs_pytorch']:.2g} of PyTorch's"]
                if quest.get("onnx") else []),
              f"- config choices: `{json.dumps(quest['choices'])}`", f"- quest version: {quest['quest_version']}",
              "", "## Training config", "", "```yaml", OmegaConf.to_yaml(OmegaConf.create(ckpt.config)).rstrip(),
              "```", ""]
    return "\n".join(lines)


def export_run(source: str | Path, out: str | Path, weights: str = "model", overwrite: bool = False,
               allow_unfinished: bool = False, onnx: bool = False, trust_code: bool = False) -> Path:
    """Write the export of ``source`` (a run directory or checkpoint file) to ``out``; returns ``out``.

    ``weights="model"`` takes the trained weights, the ones the run's ``val/top1`` was measured on; ``"ema"`` the
    EMA's (refused for a run trained without EMA). A run that has not finished, diverged or failed on its data is
    refused naming its status, unless ``allow_unfinished``. An earlier export in ``out`` is refused (naming its
    files), or with ``overwrite`` moved to ``out/.replaced/<UTC time>/``; other files in ``out`` are left alone.
    ``out`` is held (quest.store.output_folder) for the whole export: a second one into it is refused naming this one.
    ``onnx``: also ``model.onnx`` (quest.tools.onnx_export), checked with onnxruntime. ``trust_code``: build a model
    whose attention the checkpoint names by import path, importing that module (refused otherwise)."""
    return export_checked(source, out, weights, overwrite, allow_unfinished, onnx, trust_code)[0]


def export_checked(source: str | Path, out: str | Path, weights: str, overwrite: bool, allow_unfinished: bool,
                   onnx: bool = False, trust_code: bool = False) -> tuple[Path, str | None, float | None]:
    """export_run's work; returns the folder, why the run is unfinished (None: finished) and the exported weights'
    validation top-1 (None: not measured), for the command's line."""
    if weights not in ("model", "ema"):
        raise ValueError(f"--weights must be model or ema, got {weights!r}")
    if onnx:
        require_onnx()  # before any work
    out = Path(out).expanduser()
    inside = run_holding(out)  # an export folder is handed on whole: never a run's folder, whose lock it would take
    if inside is not None:
        raise ValueError(f"--out {out} lies in the run directory {inside}; give the export a folder of its own "
                         f"(e.g. {inside.parent / (inside.name + '-export')})")
    files = [out / WEIGHTS_FILE, out / "config.json", out / "README.md"] + ([out / ONNX_FILE] if onnx else [])
    # held from the first look at the folder to the last file: a second export into it is refused at once, never
    # interleaved with this one (quest.store.output_folder)
    with holding(out, "quest-export", transient=True) as folder:
        refuse_present(files, overwrite)
        path = resolve_checkpoint(source)
        ckpt = load_record(path, option="")  # weights_only=True; the file named as given, with what it is
        attention = ckpt.config.get("attention")
        refuse_code_named_by_file(attention.get("name") if isinstance(attention, dict) else None, "attention.name",
                                  path, trust_code, "pass --trust-code")
        summary = run_summary(path)
        unfinished = unfinished_reason(summary, ckpt, path)
        problems = []  # every one in the one message
        if unfinished and not allow_unfinished:
            problems.append(f"{unfinished}; export a run that completed or stopped at trainer.max_steps, or pass "
                            "--allow-unfinished to export this checkpoint anyway")
        state = getattr(ckpt, weights)
        if state is None:
            problems.append(f"--weights {weights}: {path} holds no EMA weights (trained with recipe.ema=false); use "
                            "--weights model")
        if problems:
            raise ValueError(f"{source}: " + "; and ".join(problems))
        model = build_model(OmegaConf.create(ckpt.config))
        check_weights(state, path, f"{'EMA' if weights == 'ema' else 'model'} weights", model.state_dict())
        model.load_state_dict(state)  # strict: the export holds exactly what the model has
        from safetensors.torch import save as safetensors_bytes

        tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        config = export_config(ckpt, model, weights, path)
        top1 = exported_top1(summary, weights, path, ckpt) if not unfinished else None
        config["quest"].update({"run_status": summary.get("status"), "val_top1": top1})
        serialized = None
        if onnx:  # checked before anything in the folder changes: a failed check leaves the earlier export in place
            # torch.export, the conversion and onnxruntime's check print nothing: a ViT-S takes 10 s on a core
            say = _stderr_line
            say(f"exporting {ONNX_FILE} (torch.export, then checked with onnxruntime)")
            with Heartbeat(f"exporting {ONNX_FILE}", say):
                serialized, config["quest"]["onnx"] = checked_onnx(model, config["pretrained_cfg"]["input_size"][-1])
        folder.make_room(files)  # the earlier export (only with overwrite: refused above) to .replaced/
        if serialized is not None:
            atomic_write(out / ONNX_FILE, lambda f: f.write(serialized))
        atomic_write(out / WEIGHTS_FILE, lambda f: f.write(safetensors_bytes(tensors, metadata={"format": "pt"})))
        write_text_atomic(out / "config.json", json_text(config))
        write_text_atomic(out / "README.md", model_card(config, ckpt, labelled_metrics(summary), top1))
    return out, unfinished, top1


def _stderr_line(text: str) -> None:
    print(f"quest-export: {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="quest-export", description="Export a train.py run as a timm / Hugging Face model folder "
        f"(config.json naming {ARCHITECTURE}.<attention>, model.safetensors, README.md): docs/interop.md.")
    parser.add_argument("source", type=input_path,
                        help="a train.py run directory (its checkpoints/last.pt) or a checkpoint file")
    parser.add_argument("--out", required=True, type=output_path, help="the folder to write")
    parser.add_argument("--weights", choices=("model", "ema"), default="model",
                        help="the trained model's weights (default: the ones the run's val/top1 was measured on) "
                             "or the EMA's")
    parser.add_argument("--onnx", action="store_true",
                        help="also write model.onnx (dynamic batch axis), checked against PyTorch with onnxruntime; "
                             "needs pip install 'quest[onnx]'")
    parser.add_argument("--allow-unfinished", action="store_true",
                        help="export a run that has not finished, diverged or failed on its data (refused otherwise)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier export in --out (its files are kept in --out/.replaced/)")
    parser.add_argument("--trust-code", action="store_true",
                        help="export a checkpoint whose attention is an import path (package.module:Class), importing "
                             "that module: only for a checkpoint and a module you trust (refused otherwise)")
    args = parse_arguments(parser, argv)
    try:
        out, unfinished, top1 = export_checked(args.source, args.out, args.weights, args.overwrite,
                                               args.allow_unfinished, args.onnx, args.trust_code)
    except (FileNotFoundError, ValueError, MissingExtra) as exc:  # FolderHeld, OutputExists: ValueErrors
        return input_error(program_name("quest-export"), exc)
    measured = f"validation top-1 {top1:.2f}%" if top1 is not None else "not measured on the validation set"
    print(f"exported {args.source} ({args.weights} weights, {measured}"
          + (f"; unfinished: {unfinished}" if unfinished else "") + f") to {out}")
    return 0


if __name__ == "__main__":  # quest's one error path (quest/runtime/errors.py), as the quest-export console script
    from quest.runtime.errors import program_name, reporting_errors

    with reporting_errors(program_name("quest-export")):
        code = main()
    sys.exit(code)
