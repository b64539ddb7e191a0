"""Faults from below quest, generated (tests/runtime/test_refusal_contract.py runs them): every entry point x every
fault of the operating system, a file name, YAML or a weights file that applies to what it reads and writes.

A :class:`Writer` is one command with ``{out}``, the folder (or file) it writes, and the inputs it reads. A fault
puts ``{out}`` where the system refuses it (through a link that leads nowhere, under a file, in a read-only folder,
a name too long, a name that is not UTF-8, a disk that fills at the first write: injected, and a real tmpfs where
root can mount one) or where quest does (a name holding a line break), or gives the command a config folder whose
file is not YAML or not a mapping (or that is a link to nowhere), its input under a name that is not UTF-8 or
through a link to nowhere, or weights of another shape. Whatever the case, the command exits 0, 1 or 2, never 70 (a
bug), with no traceback and at most one error line (one per job of a sweep, and the sweep's), naming the file or
key, and holds no file open once it has ended; a refusal leaves the folder as it was.
"""
from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .refusal_cases import SHARDS, SMALL_EVAL, TOY_SMALL, TRAIN, Scene

#: a folder name in Latin-1, as old zip archives extract it: not UTF-8, so Python holds it surrogate-escaped
NOT_UTF8 = os.fsdecode(b"caf\xe9")
LONG = "x" * 300  # over every file system's 255 bytes per name


@dataclass(frozen=True)
class Writer:
    """``program`` with ``args``: ``{out}`` the place it writes (``out`` what its path ends with), ``{in}`` the copy
    of the shared input ``reads`` it reads (``weights``: the weights file in it, relative), ``prepare``: the shared
    input copied into ``{out}`` first (a folder the command changes in place), ``group``: a config group a Hydra app
    takes from ``--config-dir``, ``errors``: the most error lines a refusal prints (a sweep: one per job, and its own),
    ``only``: the faults it is tried with, where not every one that applies."""

    name: str
    program: str
    args: tuple[str, ...]
    out: str = "out"
    reads: str | None = None
    weights: str | None = None
    prepare: str | None = None
    group: str | None = None
    errors: int = 1
    only: tuple[str, ...] | None = None


CKPT = "checkpoints/last.pt"
SAFETENSORS = "model.safetensors"
HYDRA_OUT = "hydra.run.dir={out}"
WRITERS = [
    Writer("train", "train.py", (*TRAIN, HYDRA_OUT), group="logger"),
    Writer("resume", "train.py", (*TRAIN, "trainer.max_steps=2", HYDRA_OUT), prepare="run", weights=CKPT),
    Writer("init_from", "train.py", (*TRAIN, "trainer.init_from={in}/" + CKPT, HYDRA_OUT), reads="run", weights=CKPT),
    Writer("pretrained", "train.py", (*TRAIN, "model.pretrained=local-dir:{in}", HYDRA_OUT), reads="export",
           weights=SAFETENSORS),
    # each job where its single run would be (here one per learning rate under the folder), the record beside them
    Writer("sweep", "train.py", ("-m", *TRAIN, "recipe.lr=1e-3,2e-3", "hydra.run.dir={out}/lr${recipe.lr}",
                                 "hydra.sweep.dir={out}/.sweeps"), group="logger", errors=3),
    Writer("eval", "eval.py", ("checkpoint={in}/" + CKPT, *SMALL_EVAL, HYDRA_OUT), reads="run", weights=CKPT,
           group="logger"),
    # eval.py's default results folder: beside the run it evaluates (<run>/eval/clean/last-model)
    Writer("eval_beside", "eval.py", ("checkpoint={out}/" + CKPT, *SMALL_EVAL), out="run", prepare="run"),
    Writer("eval_weights", "eval.py", ("model=vit_pico", "attention=quest", "weights=local-dir:{in}", "eval=clean",
                                       "data=fake", "data.img_size=16", "data.fake_val_size=16", HYDRA_OUT),
           reads="export", weights=SAFETENSORS),
    Writer("toy", "quest-toy", (*TOY_SMALL, HYDRA_OUT), group="study"),
    Writer("export", "quest-export", ("{in}", "--out", "{out}"), reads="run", weights=CKPT),
    # the ONNX export takes 6-10 s: only the faults found before it (its write is the same atomic write as export's)
    Writer("export_onnx", "quest-export", ("{in}", "--out", "{out}", "--onnx"), reads="run",
           only=("dangling_link", "under_a_file", "read_only", "read_only_asked", "name_too_long")),
    Writer("report", "quest-report", ("{in}", "--out", "{out}"), reads="runs"),
    Writer("plot", "quest-plot", ("perf", "{in}", "--out", "{out}"), out="fig.png", reads="run"),
    Writer("cap", "quest-data", ("cap", "{in}", "{out}", "--short-side", "16", "--no-progress", "--workers", "1"),
           reads="images"),
    Writer("convert", SHARDS, ("convert", "{in}", "{out}", "--shard-size", "4"), reads="images"),
    Writer("index", SHARDS, ("index", "{out}", "train=shards-train-*.tar"), prepare="shards"),
]


@dataclass(frozen=True)
class Fault:
    """Where ``{out}`` is put (``place``: the folder above it, which ``setup`` changes once the case's inputs are in it);
    ``names``: what the error line must hold (a part of the path, the file, the key); ``writes``: the fault comes
    once the command has started to write (a full disk), so its folder may have changed."""

    name: str
    place: str
    names: tuple[str, ...]
    setup: Callable[[Scene, Path], None] | None = None
    folder: bool = True  # the place is a folder, made before the case's inputs are copied into it
    writes: bool = False
    refused: bool = False  # exit 0 is no answer: every command asks before it writes there
    writers: tuple[str, ...] | None = None  # the writers it is tried with, where not every one
    mounts: bool = False  # a file system mounted on the place: over what a writer's ``prepare`` put there


def _dangling(scene: Scene, place: Path) -> None:  # scratch not mounted
    place.symlink_to(scene.tmp / "not-mounted")


def _a_file(scene: Scene, place: Path) -> None:
    place.write_text("a file where a folder belongs\n")


def _read_only(scene: Scene, place: Path) -> None:
    """A read-only folder (a read-only mount, another user's run): no folder under it can be written."""
    for top, dirs, files in os.walk(place, topdown=False):
        for name in files:
            Path(top, name).chmod(0o444)
        for name in dirs:
            Path(top, name).chmod(0o555)
    place.chmod(0o555)


def _read_only_asked(scene: Scene, place: Path) -> None:
    """A folder this user cannot write, as the commands ask it (``os.access``) before they write: root writes
    anywhere, so the system's answer is taken away where the check asks, as the contract's ``_unwritable`` does;
    ``read_only`` is the same folder where permissions bind."""
    real, root = os.access, os.path.abspath(place)

    def access(path, mode, **kwargs):
        where = os.path.abspath(path) if isinstance(path, (str, os.PathLike)) else ""
        if mode & os.W_OK and (where == root or where.startswith(f"{root}/")):
            return False
        return real(path, mode, **kwargs)
    scene.monkeypatch.setattr(os, "access", access)


def full_disk(scene: Scene) -> None:
    """The disk fills at the first file written under the test's folder: fsync, where a file system with delayed
    allocation first reports it, fails with ENOSPC as the system's call does (no file name on the error)."""
    real = os.fsync
    root = str(scene.tmp)

    def fsync(fd):
        try:
            where = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            where = ""
        if where.startswith(root):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)
    scene.monkeypatch.setattr(os, "fsync", fsync)


def mounted_under(root: Path) -> list[str]:
    """The mount points under ``root``, deepest first (/proc/self/mounts escapes a space as \\040)."""
    points = []
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            point = line.split()[1].replace("\\040", " ")
            if point.startswith(f"{root}/"):
                points.append(point)
    return sorted(points, reverse=True)


def open_under(root: Path) -> list[str]:
    """The files under ``root`` this process holds open (none on a system without /proc/self/fd)."""
    found = []
    for fd in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed since
            continue
        if target.startswith(f"{root}/"):
            found.append(target)
    return found


def _small_disk(kib: int) -> Callable[[Scene, Path], None]:
    """A real file system of ``kib`` KiB (tmpfs, whole pages) at ``place``: full once that much is written, wherever
    quest writes then (an append, a lock's holder line, an atomic write, the log). Root only (mount); skipped
    elsewhere."""
    def setup(scene: Scene, place: Path) -> None:
        import subprocess

        import pytest

        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(place)],
                                               capture_output=True).returncode != 0:
            pytest.skip("mounting a size-limited tmpfs needs root (disk_full injects the same error)")
    return setup


OUT_FAULTS = [
    Fault("dangling_link", "scratch", ("scratch",), _dangling, folder=False),
    Fault("under_a_file", "afile", ("afile",), _a_file, folder=False),
    Fault("read_only", "locked", ("locked",), _read_only),
    Fault("read_only_asked", "asked", ("asked",), _read_only_asked, refused=True),
    Fault("name_too_long", LONG, ("x" * 40,), folder=False),
    # every name short enough, the whole path over PATH_MAX: the first look at it fails (ENAMETOOLONG)
    Fault("path_too_long", "/".join(["y" * 200] * 21), ("per path",), folder=False),
    Fault("not_utf8_name", NOT_UTF8, ("caf",)),
    # a line break in the name (a shell's $(ls ...) that matched two paths): refused, shown escaped on the one line
    Fault("line_break_name", "two\nlines", ("two\\nlines",), refused=True),
    Fault("disk_full", "full", ("full",), writes=True),
    Fault("disk_really_full", "tiny", ("tiny",), _small_disk(4), writes=True, mounts=True),
    # train.py's run filling a disk at each of its writes in turn: Hydra's record, run.json, the log, a checkpoint
    *[Fault(f"disk_full_at_{kib}k", "small", ("small",), _small_disk(kib), writes=True, mounts=True,
            writers=("train",))
      for kib in (12, 16, 20, 24)],
]


def _not_yaml(path: Path) -> None:
    path.write_text("name: broken\n  mode: [\n")  # a hand edit cut short


def _not_a_mapping(path: Path) -> None:
    path.write_text("- name\n- broken\n")


CONFIG_DAMAGES: dict[str, Callable[[Path], None]] = {"not_yaml": _not_yaml, "not_a_mapping": _not_a_mapping}


WIDER = "norm.weight"


def _other_shape(path: Path) -> None:
    """Weights of another model, in a file otherwise whole: the final norm one channel wider (not the classifier,
    whose rows a command reads as a number of classes)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file, save_file

        tensors = load_file(path)
        tensors[WIDER] = torch.ones(tensors[WIDER].shape[0] + 1)
        save_file(tensors, path, metadata={"format": "pt"})
        return
    stored = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("model", "ema"):
        if isinstance(stored.get(key), dict) and WIDER in stored[key]:
            stored[key][WIDER] = torch.ones(stored[key][WIDER].shape[0] + 1)
    torch.save(stored, path)


@dataclass(frozen=True)
class Case:
    """One writer under one fault: ``kind`` says which part of the command the fault is in (``out``, ``config``,
    ``input``, ``weights``)."""

    writer: Writer
    kind: str
    fault: str

    @property
    def id(self) -> str:
        return f"{self.writer.name}-{self.fault}"


def fault_cases() -> list[Case]:
    """Every writer x every fault that applies to it: its output's place (each of OUT_FAULTS), its config folder
    (Hydra's apps: a group file not YAML or not a mapping, a primary config not YAML, the folder a dangling link), the
    input it reads under a name that is not UTF-8 or through a link that leads nowhere, and its weights of another
    shape."""
    cases = [Case(w, "out", f.name) for w in WRITERS for f in OUT_FAULTS
             if not (w.prepare and f.mounts) and w.name in (f.writers or (w.name,))]
    cases += [Case(w, "config", how) for w in WRITERS if w.group
              for how in (*CONFIG_DAMAGES, "primary_not_yaml", "config_dir_dangling")]
    cases += [Case(w, "input", how) for w in WRITERS if w.reads for how in ("input_not_utf8", "input_dangling_link")]
    cases += [Case(w, "weights", "weights_other_shape") for w in WRITERS if w.weights]
    return [case for case in cases if case.writer.only is None or case.fault in case.writer.only]


OUT_FAULT = {f.name: f for f in OUT_FAULTS}


def _copy(source: Path, dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        return Path(shutil.copytree(source, dest, symlinks=True))
    return Path(shutil.copy2(source, dest))


def build_case(case: Case, scene: Scene) -> tuple[list[str], tuple[str, ...], bool, bool]:
    """Set ``case`` up in ``scene``: (the command's argv, what its error line must hold, whether the fault comes
    once it has started to write, whether it must be refused)."""
    w, tmp, inputs = case.writer, scene.tmp, scene.inputs
    out_place, names, writes = tmp / "out-folder", (), False
    read_place = tmp / "in"
    args = list(w.args)
    if case.kind == "out":
        fault = OUT_FAULT[case.fault]
        out_place, names, writes = tmp / fault.place, fault.names, fault.writes
        if fault.folder:
            out_place.mkdir()
    else:
        out_place.mkdir()
    out = out_place / w.out
    if w.prepare and os.path.isdir(out_place):  # not where the fault leaves no folder (Path.is_dir raises on a long name)
        _copy(inputs[w.prepare], out)
    if w.reads and case.fault == "input_dangling_link":  # its disk not mounted
        read_place.symlink_to(tmp / "not-mounted")
        names = (str(read_place),)
    elif w.reads:
        source = inputs[w.reads]
        read_place = tmp / (NOT_UTF8 if case.fault == "input_not_utf8" else "in")
        read_in = _copy(source, read_place / source.name)
        if case.fault == "input_not_utf8":
            names = ("caf",)
    if case.kind == "weights":
        folder = read_in if w.reads else out
        _other_shape(folder / w.weights)
        names = (WIDER, str(folder))  # the tensor, and the file (or the folder a local-dir: names)
    if case.kind == "config":
        configs = tmp / "configs"
        if case.fault == "config_dir_dangling":
            configs.symlink_to(tmp / "not-mounted")
            names = ("configs",)
        elif case.fault == "primary_not_yaml":  # --config-name: the app's own config, from the user's folder
            configs.mkdir()
            _not_yaml(configs / "broken.yaml")
            args = ["--config-name", "broken", *args]
            names = ("broken",)
        else:
            (configs / w.group).mkdir(parents=True)
            CONFIG_DAMAGES[case.fault](configs / w.group / "broken.yaml")
            args = [a for a in args if not a.startswith(f"{w.group}=")] + [f"{w.group}=broken"]
            names = ("broken",)
        args = ["--config-dir", str(configs), *args]
    if case.kind == "out":  # the fault's place made last: a read-only folder once it holds what the case put there
        if OUT_FAULT[case.fault].setup is not None:
            OUT_FAULT[case.fault].setup(scene, out_place)
        if case.fault == "disk_full":
            full_disk(scene)
    fills = {"out": str(out), "in": str(read_place / inputs[w.reads].name) if w.reads else ""}
    refused = case.kind == "out" and OUT_FAULT[case.fault].refused
    return [a.replace("{out}", fills["out"]).replace("{in}", fills["in"]) for a in args], names, writes, refused
