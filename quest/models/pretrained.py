"""Pretrained weights in (``model.pretrained=``): a timm tag, ``local-dir:DIR``, ``hf-hub:ID`` or a weights file,
loaded into a model of any quest attention.

QUEST and QNorm add no parameters: they reuse every weight of a standard ViT as it is. Parameters a formulation
adds (QKNorm's scale, QKNorm-HS's per-head scales) keep the initial values the model was built with, and a
classifier with another class count is dropped and starts from the model's own initialisation, as timm's
``load_pretrained`` does. Position embeddings and patch embeddings are resampled to the model's size by
timm's ``checkpoint_filter_fn``.

Nothing is downloaded unless asked (the ``download`` argument, ``model.pretrained_download=true``): the Hub and timm's URL
weights are read from the local caches, and ``HF_HUB_OFFLINE=1`` forbids a download even then.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from quest.store.weights_check import check_weights

__all__ = ["pretrained_problem", "pretrained_state_dict", "load_pretrained_weights"]

log = logging.getLogger("quest.models")

WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")
_HUB_FILES = ("model.safetensors", "pytorch_model.bin")
_KEPT_PROJECTIONS = ("qkv.", "proj.", "wq.", "wk.", "wv.")


def _kind(source: str) -> str:
    if source.startswith("local-dir:"):
        return "local-dir"
    if source.startswith("hf-hub:"):
        return "hf-hub"
    if source.endswith(WEIGHT_SUFFIXES) or "/" in source or source.startswith(("~", ".")):
        return "file"
    return "timm"


def pretrained_problem(source: str) -> str | None:
    """What is wrong with ``source`` that a cheap look can tell (before any model is built), else None."""
    kind = _kind(source)
    if kind == "local-dir":
        path = Path(source.partition(":")[2]).expanduser()
        if not (path / "config.json").is_file() and not any(path.glob("*.safetensors")):
            return f"local-dir:{path} is not a folder of exported weights (no config.json, no .safetensors)"
    elif kind == "hf-hub":
        if not source.partition(":")[2]:
            return "hf-hub: needs a repository id, e.g. hf-hub:timm/deit_tiny_patch16_224.fb_in1k"
    elif kind == "file":
        path = Path(source).expanduser()
        if not path.is_file():
            return f"{path} does not exist (a weights file ends in {', '.join(WEIGHT_SUFFIXES)})"
        if not source.endswith(WEIGHT_SUFFIXES):
            return f"{path}: a weights file ends in {', '.join(WEIGHT_SUFFIXES)}"
    else:
        from timm.models import get_pretrained_cfg, is_model

        if not is_model(source):
            return (f"{source!r} is neither a timm model or tag (timm.list_pretrained()), nor local-dir:DIR, "
                    "hf-hub:ID or a weights file")
        if get_pretrained_cfg(source, allow_unregistered=False) is None:
            return f"timm has no pretrained weights named {source!r} (see timm.list_pretrained('{source}*'))"
    return None


def _load_file(path: Path, option: str = "model.pretrained") -> dict[str, torch.Tensor]:
    """A weights file's state_dict; DamagedFile naming it when it is not whole (safetensors' own error says what).
    ``option``: the key that named it, in the error (eval.py's ``weights``)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not a weights file" + (" (it is a directory)" if path.is_dir() else ""))
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        from quest.store.damage import DamagedFile

        try:
            return load_file(str(path), device="cpu")
        except SafetensorError as exc:
            raise DamagedFile(path, f"not a whole safetensors file ({exc})") from None
    from quest.store.torch_files import inspect_torch_file, state_dict_of, weights_problem

    found = inspect_torch_file(path)
    problem = weights_problem(path, found, option)
    if problem is not None:
        raise ValueError(problem)
    obj = found.obj
    if isinstance(obj, dict) and isinstance(obj.get("state_dict_ema"), dict):  # timm train.py checkpoints
        obj = obj["state_dict"] if "state_dict" in obj else obj
    return state_dict_of(obj)


def _folder_weights(folder: Path) -> Path:
    """The weights file of a ``local-dir:`` folder, chosen much as timm's load_state_dict_from_path does (the Hub's
    names first, then the first file of each weights suffix), to be read with :func:`_load_file`'s checks: timm's
    loader would let a damaged file's own error (safetensors', pickle's) through as a bug of quest."""
    for name in _HUB_FILES:
        if (folder / name).exists():
            return folder / name
    for suffix in WEIGHT_SUFFIXES:
        found = sorted(folder.glob(f"*{suffix}"))
        if found:
            return found[0]
    raise FileNotFoundError(f"local-dir:{folder} holds no weights file ({', '.join(_HUB_FILES)}, or a file ending in "
                            f"{', '.join(WEIGHT_SUFFIXES)})")


def _from_hub(repo: str, download: bool, filename: str | None = None,
              option: str = "model.pretrained") -> dict[str, torch.Tensor]:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id, _, revision = repo.partition("@")
    tried = []
    for name in ([filename] if filename else _HUB_FILES):
        try:
            path = hf_hub_download(repo_id, name, revision=revision or None, local_files_only=not download)
        except LocalEntryNotFoundError:
            tried.append(name)
            continue
        except Exception as exc:  # noqa: BLE001 (a missing file in a repo that exists: try the next name)
            if type(exc).__name__ in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
                tried.append(name)
                continue
            raise
        return _load_file(Path(path), option)
    how = ("set model.pretrained_download=true to download it (HF_HUB_OFFLINE=1 forbids that too)" if not download
           else "and it could not be downloaded (is HF_HUB_OFFLINE=1 set?)")
    raise FileNotFoundError(f"hf-hub:{repo}: none of {tried} is in the local Hugging Face cache; {how}")


def _from_timm(tag: str, download: bool) -> dict[str, torch.Tensor]:
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(tag, allow_unregistered=False)
    if cfg is None:
        raise ValueError(f"timm has no pretrained weights named {tag!r}")
    if cfg.hf_hub_id:
        return _from_hub(cfg.hf_hub_id, download, cfg.hf_hub_filename)
    if cfg.url:
        from torch.hub import get_dir, load_state_dict_from_url

        cached = Path(get_dir()) / "checkpoints" / Path(cfg.url).name
        if not download and not cached.is_file():
            raise FileNotFoundError(f"{tag}: its weights ({cfg.url}) are not in torch's cache ({cached}); set "
                                    "model.pretrained_download=true to download them")
        return load_state_dict_from_url(cfg.url, map_location="cpu", weights_only=True)
    raise ValueError(f"timm's pretrained config of {tag!r} names no weights (no hf_hub_id, no url)")


def pretrained_state_dict(source: str, download: bool = False, option: str = "model.pretrained") -> dict[str, torch.Tensor]:
    """The state_dict ``source`` names (see the module docstring), loaded on the CPU with ``weights_only``;
    ``option``: the key that named it, in every error (eval.py's ``weights``)."""
    problem = pretrained_problem(source)
    if problem is not None:
        raise ValueError(f"{option}={source}: {problem}")
    kind = _kind(source)
    if kind == "local-dir":
        return _load_file(_folder_weights(Path(source.partition(":")[2]).expanduser()), option)
    if kind == "hf-hub":
        return _from_hub(source.partition(":")[2], download, option=option)
    if kind == "file":
        return _load_file(Path(source).expanduser(), option)
    return _from_timm(source, download)


def _formulation_params(model: nn.Module) -> set[str]:
    """Parameters a quest formulation adds to timm's attention (they keep their initial values)."""
    from .factory import attention_layers

    names = set()
    for prefix, layer in attention_layers(model):
        for name, _ in layer.named_parameters():
            if not name.startswith(_KEPT_PROJECTIONS):
                names.add(f"{prefix}.{name}")
    return names


def load_pretrained_weights(model: nn.Module, source: str, download: bool = False) -> dict[str, Any]:
    """Load ``source``'s weights into ``model`` (built with its attention, class count and input size); returns
    what happened (for logs and the run record). Raises ``ValueError`` naming the weights that do not fit or hold
    NaN/inf (quest.store.weights_check), before the model changes."""
    from timm.models.vision_transformer import checkpoint_filter_fn

    state = dict(pretrained_state_dict(source, download))
    state = checkpoint_filter_fn(state, model)  # timm's conversions: pos_embed / patch_embed resampling, ...
    own = model.state_dict()
    head_dropped: list[str] = []
    head = getattr(model, "head", None)
    if isinstance(head, nn.Linear):
        for key in ("head.weight", "head.bias"):
            if key in state and key in own and state[key].shape != own[key].shape:
                head_dropped.append(key)
        if head_dropped:
            pretrained_classes = state["head.weight"].shape[0] if "head.weight" in state else "?"
            log.info("model.pretrained=%s has %s classes, the model %d: new head, initialised as built", source,
                     pretrained_classes, head.out_features)
            for key in ("head.weight", "head.bias"):
                state.pop(key, None)
    added = _formulation_params(model)
    # a formulation's own parameters keep their initial values, and a dropped classifier its initialisation
    optional = [k for k in own if k in added or (head_dropped and k.startswith("head."))]
    check_weights(state, f"model.pretrained={source}", "weights", own, optional)
    result = model.load_state_dict(state, strict=False)
    kept_initial = sorted(k for k in result.missing_keys if k in added)
    return {"source": source, "new_head": bool(head_dropped), "initial_values_kept": kept_initial}
