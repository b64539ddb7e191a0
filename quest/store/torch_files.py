"""What a file given as ``checkpoint=`` or ``weights=`` really is, so that a refusal says which case it is.

``torch.load`` fails on a text file with "101", on random bytes with a weights-only unpickling error and on a
truncated checkpoint with a miniz message; none of these says what is wrong with the file. :func:`inspect_torch_file`
looks at the bytes first (zip magic, the legacy torch pickle header, zip end-of-central-directory record) and only
then at what ``torch.load(weights_only=True)`` returns, and :func:`checkpoint_problem` / :func:`weights_problem`
turn that into one message per case, with advice that fits the case (``weights=`` only for a plain state_dict).
"""
from __future__ import annotations

import re
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["FORMAT", "ZIP_MAGIC", "PROTOCOL_WARNING", "TorchFile", "inspect_torch_file", "load_weights_only",
           "state_dict_of", "checkpoint_problem", "weights_problem", "damaged_member"]

#: the "format" entry of every checkpoint train.py writes (quest.run.checkpoint)
FORMAT = "quest-checkpoint-v1"
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default (zip) format since torch 1.6

# torch's legacy format starts with its magic number pickled with protocol 2
LEGACY_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19."
PICKLE_PROTO = 0x80  # the first opcode of a pickle of protocol >= 2
#: the start of torch.load's warning about a pickle protocol other than torch.save's (load_weights_only)
PROTOCOL_WARNING = r"Detected pickle protocol \d+ in the checkpoint"


@dataclass
class TorchFile:
    """``kind``: empty | not_torch | truncated | unsafe | state_dict | quest_checkpoint | other.
    ``detail``: why, in a few words, for the message; ``obj``: what torch.load returned, when it loaded."""

    kind: str
    detail: str
    obj: Any = field(default=None, repr=False)


def state_dict_of(obj: Any) -> dict[str, torch.Tensor] | None:
    """The state_dict ``obj`` is (a non-empty dict of tensors) or wraps (``{"state_dict"|"model": state_dict}`` with
    at most two more entries, such as an epoch), else None. What ``weights=`` accepts."""
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict) and len(obj) <= 3:
            obj = obj[key]
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    return None


def _describe_bytes(head: bytes) -> str:
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and all(c.isprintable() or c in "\t\r\n" for c in text):
        first = text.strip().splitlines()[0][:60] if text.strip() else ""
        return f"it looks like a text file, starting {first!r}"
    return f"it starts with the bytes {head[:8]!r}, neither a zip archive ({ZIP_MAGIC!r}) as torch.save writes nor " \
           "torch's legacy format"


def load_weights_only(path: str | Path, map_location: str | torch.device = "cpu") -> Any:
    """``torch.load(path, weights_only=True)`` without torch's UserWarning about the file's pickle protocol, which it
    gives before trying a file pickled with another protocol than its own (a foreign pickle, most often one it then
    refuses): the refusal, in quest's one line, says what the user needs. Every other warning passes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PROTOCOL_WARNING, category=UserWarning)
        return torch.load(path, map_location=map_location, weights_only=True)


def _load(path: Path) -> tuple[Any, Exception | None]:
    try:
        return load_weights_only(path), None
    except Exception as exc:  # noqa: BLE001 (every failure is classified below)
        return None, exc


def _first_line(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:200]


def _failed_load(exc: Exception, layout: str) -> TorchFile:
    text = str(exc)
    operand = re.search(r"Unsupported operand (\d+)", text)
    if operand is not None:
        # an instruction of pickle protocol 4 or 5 (149 is FRAME, the first of every such pickle): torch.save(...,
        # pickle_protocol=4), which torch's weights-only reader cannot read, whatever the file holds
        return TorchFile("unsafe", f"it was written with a pickle protocol above 3 (torch.save(..., "
                                   f"pickle_protocol=4 or 5); pickle opcode {operand.group(1)}), which "
                                   "torch.load(weights_only=True) cannot read: save it again with torch.save's default "
                                   "protocol")
    if "Weights only load failed" in text:
        # torch's message is a page of advice; the line that matters names the refused class
        match = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        what = f" ({match.group(1)})" if match else ""
        return TorchFile("unsafe", f"it holds pickled Python objects{what}, e.g. a whole model saved with "
                                   "torch.save(model), which torch.load(weights_only=True) refuses")
    if isinstance(exc, EOFError):
        return TorchFile("truncated", f"the file ends early ({layout})")
    return TorchFile("truncated", f"{layout}; torch.load: {_first_line(exc)}")


def _loaded(obj: Any) -> TorchFile:
    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        return TorchFile("quest_checkpoint", f"a {FORMAT} file", obj)
    state = state_dict_of(obj)
    if state is not None:
        first = next(iter(state))
        return TorchFile("state_dict", f"{len(state)} tensors, e.g. {first!r}, and no train.py config", obj)
    if isinstance(obj, dict):
        if "format" in obj:
            return TorchFile("other", f"format {obj['format']!r}, not {FORMAT!r}", obj)
        keys = ", ".join(map(repr, list(obj)[:8])) + (", ..." if len(obj) > 8 else "")
        return TorchFile("other", f"a dict with keys [{keys}] and no 'format': {FORMAT!r}", obj)
    return TorchFile("other", f"a {type(obj).__module__}.{type(obj).__qualname__}, not a dict", obj)


def inspect_torch_file(path: str | Path) -> TorchFile:
    """Classify an existing file (see :class:`TorchFile`); loads it with ``weights_only=True`` only when its bytes
    are those of a torch file."""
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        return TorchFile("empty", "it is empty (0 bytes)")
    with open(path, "rb") as f:
        head = f.read(256)
    if head.startswith(ZIP_MAGIC):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
                bad_member = archive.testzip()  # torch.load does not check CRCs (see damaged_member)
        except zipfile.BadZipFile:
            return TorchFile("truncated", f"the file ends early / zip archive incomplete: no valid "
                                          f"end-of-central-directory record in its {size:,} bytes")
        if not any(n.endswith("/data.pkl") for n in names):
            return TorchFile("not_torch", f"it is a zip archive without a data.pkl (members: {names[:4]})")
        if bad_member is not None:
            return TorchFile("truncated", f"zip member {bad_member} fails its CRC check")
        obj, exc = _load(path)
        return _loaded(obj) if exc is None else _failed_load(exc, "zip archive complete but unreadable")
    if head.startswith(LEGACY_MAGIC):
        obj, exc = _load(path)
        return _loaded(obj) if exc is None else _failed_load(exc, "torch's legacy (pre-1.6) format")
    if head[0] == PICKLE_PROTO:
        return TorchFile("not_torch", "it is a Python pickle (pickle.dump), not a torch.save file")
    return TorchFile("not_torch", _describe_bytes(head))


def _given(option: str, path: Path) -> str:
    """How the file was given: ``<option>=path``, or the path alone for a command's argument (``option`` empty)."""
    return f"{option}={path}" if option else str(path)


def _train_py(option: str) -> str:
    return (f"{f'{option}= takes' if option else 'Expected'} a checkpoint written by train.py (<run>/checkpoints/"
            f"last.pt or best.pt, format {FORMAT})")


def _problem(option: str, path: Path, found: TorchFile) -> str | None:
    """The message for the cases ``checkpoint=`` and ``weights=`` share (the file is not a usable torch file)."""
    if found.kind in ("empty", "not_torch"):
        return f"{_given(option, path)} is not a torch checkpoint file: {found.detail}"
    if found.kind == "truncated":
        return (f"{_given(option, path)} is truncated or corrupt ({found.detail}); copy it again from where it was "
                "written (train.py writes its checkpoints atomically, so a run's own file is whole)")
    if found.kind == "unsafe":
        return (f"{_given(option, path)} cannot be loaded safely: {found.detail}. quest loads tensors and plain "
                "containers only")
    return None


def checkpoint_problem(path: str | Path, found: TorchFile | None = None, option: str = "checkpoint") -> str:
    """Why ``<option>=path`` (an existing file that is not a whole train.py checkpoint) cannot be used, and what to
    do: ``checkpoint=`` of eval.py, ``trainer.init_from=`` of train.py, a command's argument (``option`` empty:
    quest-export's run)."""
    path = Path(path)
    found = found or inspect_torch_file(path)
    common = _problem(option, path, found)
    if common is not None:
        # a damaged file was probably a checkpoint: the copy advice is enough
        return common if found.kind == "truncated" else f"{common}. {_train_py(option)}"
    if found.kind == "state_dict":
        instead = (f"pass it as weights={path} with model=<timm name> attention=<name>" if option == "checkpoint"
                   else f"start from it with model.pretrained={path} instead" if option else
                   "a state_dict has no run to export; it loads in timm as it is")
        return f"{_given(option, path)} is a plain state_dict ({found.detail}): {instead}"
    return f"{_given(option, path)} is a torch file of another kind ({found.detail}). {_train_py(option)}"


def weights_problem(path: str | Path, found: TorchFile | None = None, option: str = "weights") -> str | None:
    """Why ``<option>=path`` is not a state_dict, or None when it is one: ``weights=`` of eval.py and quest-export,
    ``model.pretrained=`` of train.py."""
    path = Path(path)
    found = found or inspect_torch_file(path)
    if found.kind == "state_dict":
        return None
    if found.kind == "quest_checkpoint":
        instead = (f"pass checkpoint={path} instead of weights= (and no model=)" if option == "weights" else
                   f"start from its weights with trainer.init_from={path} instead")
        return f"{_given(option, path)} is a quest checkpoint: {instead}"
    common = _problem(option, path, found)
    if common is not None:
        return common if found.kind == "truncated" else \
            f"{common}. {option}= takes a state_dict saved with torch.save(model.state_dict(), path)"
    return f"{_given(option, path)} is not a state_dict (a dict of tensors): {found.detail}"


def damaged_member(path: str | Path) -> str | None:
    """The first member of a zip-format torch file whose CRC does not match its bytes, else None. torch.load reads
    zip members without checking their CRCs, so a damaged tensor payload loads silently as wrong numbers."""
    with open(path, "rb") as f:
        if f.read(4) != ZIP_MAGIC:
            return None  # the legacy format has no checksums
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError):
        return "the zip directory"
