"""The table of refusals (tests/runtime/test_refusal_contract.py runs every row): one row per command, the state of
the folder it would write, its arguments, the words its one error line must hold and its exit code.

A row's strings are templates, filled in per case: ``{target}`` the folder the command writes (a run directory, a
results or output folder), ``{tmp}`` the test's folder (everything under it is hashed before and after), ``{run}``,
``{runs}``, ``{images}``, ``{bad_images}`` the shared inputs that commands only read (outside ``{tmp}``).

States (what ``{target}`` is before the command): ``new`` missing with its parents, outside the working directory;
``under_empty_parent`` missing under an empty ``runs/`` of the user's (it stays); ``earlier`` a copy of a run
stopped at trainer.max_steps; ``evaluated`` the same with an evaluation beside it; ``toy`` a copy of a finished toy
study (TOY_SMALL); ``out`` a missing output folder under ``{tmp}``; ``first`` the folder as the row's own command
left it when it ran once before (a rerun's case).
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..helpers import FAST

TRAIN = (*[a for a in FAST if not a.startswith("trainer.")], "trainer.max_steps=1")
DATA_FREE = tuple(a for a in TRAIN if not a.startswith("data"))  # for the refusals that choose a data set
REPLACE = ("trainer.resume=never", "trainer.overwrite=true")  # would archive an earlier run: only once checks passed
CHECKPOINT = "checkpoint={target}/checkpoints/last.pt"
SMALL_EVAL = ("eval=clean", "eval.clean.max_samples=8")
TOY_SMALL = ("grid=quick", "grid.lrs=[0.01]", "grid.weight_decays=[0.0]", "grid.data_seeds=[0]", "grid.init_seeds=[0]",
             "data.train_size=16", "data.test_size=16", "train.epochs=1", "probe_size=8", "workers=1",
             "compile=false", "attentions=[standard]", "device=cpu")
STATES = ("new", "under_empty_parent", "earlier")
HOLDER = "pid 1 on elsewhere"
FOREIGN = b'{"somebody": "else\'s file"}\n'  # valid JSON: refused for not being the command's, not for being garbage
SHARDS = "python -m quest.tools.make_shards"


@dataclass(frozen=True)
class Scene:
    """One case's places: ``tmp`` (hashed), the working directory, the folder the command writes, the inputs."""

    tmp: Path
    cwd: Path
    target: Path
    inputs: dict[str, Path]
    monkeypatch: object
    held: list[int] = field(default_factory=list)  # locks this test holds for another process, released after


class ExitCodeDiffers(AssertionError):
    """A refusal that keeps the rest of the contract exits with another code than the row's."""


class TimesDiffer(AssertionError):
    """A refusal that leaves every entry's bytes, mode and links as they were changes a modification time."""


@dataclass(frozen=True)
class Refusal:
    """``program`` with ``args`` in ``state`` is refused: exit ``code``, ``errors`` lines ``<program>: error: ...``
    (one, or one per job of a sweep and the sweep's), the first holding every word of ``says``, no traceback, and
    every entry under ``{tmp}`` as it was. ``setup`` changes the scene before (a damaged file, a held lock, a
    patched module); ``check`` asserts more after (what must not have been called). ``bug``: a known defect, (the
    part of the contract it breaks, why), run as a strict xfail that only that part may fail."""

    name: str
    program: str
    args: tuple[str, ...]
    says: tuple[str, ...]
    state: str = "earlier"
    code: int = 1
    errors: int = 1
    setup: Callable[[Scene], None] | None = None
    check: Callable[[Scene], None] | None = None
    bug: tuple[type[AssertionError], str] | None = None
    #: failed once it had claimed its folder (wandb.init, the first change: docs/training.md): its lock names it,
    #: with the folders made to hold it; nothing else changed
    claimed: bool = False

    @property
    def id(self) -> str:
        return f"{self.program}:{self.name}:{self.state}"


def hold(lock: str, holder: str = HOLDER) -> Callable[[Scene], None]:
    """Another process holds ``{target}/<lock>`` (this test holds it, naming ``holder``): no timing involved."""
    def setup(scene: Scene) -> None:
        from quest.store.locks import lock_file

        fd = lock_file(scene.target / lock, "test")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{holder}\n".encode(), 0)
        scene.held.append(fd)
    return setup


def foreign(place: str) -> Callable[[Scene], None]:
    """A file the command did not write where it writes ``place``."""
    def setup(scene: Scene) -> None:
        path = scene.target / place.format(first_image=_first_image(scene.target))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        path.write_bytes(FOREIGN)
    return setup


def replaced_unusable(kind: str) -> Callable[[Scene], None]:
    """``{target}/.replaced`` is a file, or a link to a folder outside: nothing the command moves aside could be kept
    there, which it must find before its first change (a data tool used to mark its output incomplete first)."""
    def setup(scene: Scene) -> None:
        path = scene.target / ".replaced"
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "file":
            path.write_bytes(FOREIGN)
        else:
            path.symlink_to(scene.tmp)
    return setup


def _first_image(folder: Path) -> str:
    found = sorted((folder / "train").rglob("*.png")) if (folder / "train").is_dir() else []
    return str(found[0].relative_to(folder)) if found else "train/cat/0.png"


def steps(*setups: Callable[[Scene], None]) -> Callable[[Scene], None]:
    def setup(scene: Scene) -> None:
        for one in setups:
            one(scene)
    return setup


def _damage(scene: Scene) -> None:
    (scene.target / "checkpoints" / "last.pt").write_bytes(b"garbage")


def _version(scene: Scene) -> None:
    last = scene.target / "checkpoints" / "last.pt"
    ckpt = torch.load(last, weights_only=True)
    ckpt["version"] = 999  # a quest newer than this one wrote it
    torch.save(ckpt, last)
    (scene.target / "summary.json").unlink()  # an interrupted run: the next command resumes from last.pt


def _in_the_way(scene: Scene) -> None:
    (scene.target / "tensorboard").write_text("a file where the run writes a directory\n")


def _unwritable(scene: Scene) -> None:  # root writes anywhere: the permission is taken where the check asks
    real = os.access
    scene.monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == scene.target
                              else real(p, mode, **kw))


def _unwritable_part(name: str) -> Callable[[Scene], None]:
    """``{target}/<name>`` not writable by this user, as the check asks (root writes anywhere)."""
    def setup(scene: Scene) -> None:
        real = os.access
        scene.monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == scene.target / name
                                  else real(p, mode, **kw))
    return setup


def _folder_in_place(name: str) -> Callable[[Scene], None]:
    def setup(scene: Scene) -> None:
        (scene.target / name).unlink()
        (scene.target / name / "inside").mkdir(parents=True)
    return setup


def _link_into_checkpoints(scene: Scene) -> None:
    (scene.tmp / "linked").symlink_to(scene.target / "checkpoints")


def _run_inside(rel: str) -> Callable[[Scene], None]:
    """A copy of the earlier run at ``{tmp}/<rel>``."""
    def setup(scene: Scene) -> None:
        shutil.copytree(scene.target, scene.tmp / rel, symlinks=True)
    return setup


def _afile(scene: Scene) -> None:
    (scene.tmp / "afile").write_text("x\n")


def without(module: str) -> Callable[[Scene], None]:
    """``module`` as if not installed: the extras' check (quest.runtime.extras) finds no module of that name."""
    def setup(scene: Scene) -> None:
        import quest.runtime.extras

        installed = quest.runtime.extras._installed
        scene.monkeypatch.setattr(quest.runtime.extras, "_installed", lambda name: name != module and installed(name))
    return setup


without_wandb = without("wandb")


def _blocker(name: str) -> Callable[[Scene], None]:
    def setup(scene: Scene) -> None:
        (scene.cwd / name).write_text("a file\n")
    return setup


def _earlier_sweep(scene: Scene) -> None:
    sweep = scene.tmp / "elsewhere" / "sweep"
    (sweep / "job").mkdir(parents=True)
    (sweep / "job" / "summary.json").write_text("{}\n")
    (sweep / "multirun.yaml").write_text("an earlier sweep's record\n")


def _earlier_toy(scene: Scene) -> None:
    (scene.target / ".hydra").mkdir(parents=True)
    (scene.target / ".hydra" / "config.yaml").write_text("grid: quick\n")
    (scene.target / "toy.log").write_text("[an earlier study's log]\n")
    (scene.target / "runs.csv").write_text("attention,outcome\n")


def _damaged_toy_record(scene: Scene) -> None:
    (scene.target / ".manifest.jsonl").write_text("{ cut short")


def _not_loaded(module: str, function: str) -> Callable[[Scene], None]:
    """Refused at once: what the command loads (minutes for a model and a data set) is not."""
    def setup(scene: Scene) -> None:
        import importlib

        def loaded(*args, **kwargs):
            raise AssertionError(f"{function} was called before the folder was found held")

        scene.monkeypatch.setattr(importlib.import_module(module), function, loaded)
    return setup


def _tars(scene: Scene) -> None:
    scene.target.mkdir(parents=True)
    for shard in scene.inputs["shards"].glob("*.tar"):
        (scene.target / shard.name).write_bytes(shard.read_bytes())


def _rows(name: str, program: str, args: tuple[str, ...], says: tuple[str, ...], states: tuple[str, ...],
          **more) -> list[Refusal]:
    return [Refusal(name, program, args, says, state, **more) for state in states]


T = "train.py"
# train.py: every state for one refusal of each stage (the command line before Hydra, the config's checks, the
# data's checks, the files it names, the run directory's own state); the other refusals of a stage in one state each
TRAIN_ROWS = [
    Refusal("unknown_key", T, (*TRAIN, "hydra.run.dir={target}", "recipe.nope=1"), ("recipe.nope",), "new"),
    # the config's checks say every problem they found, one per indented line
    *_rows("bad_values", T, (*TRAIN, "hydra.run.dir={target}", "recipe.lr=-1", "data.batch_size=0", "trainer.epochs=0",
                             "trainer.precision=fp8"),
           ("recipe.lr", "data.batch_size", "trainer.epochs", "trainer.precision"), STATES),
    Refusal("bad_relation", T, (*TRAIN, "hydra.run.dir={target}", "recipe.mixup=0.5", "data.batch_size=15"),
            ("data.batch_size",), "new"),
    Refusal("patch_size", T, (*TRAIN, "hydra.run.dir={target}", "model.img_size=30"), ("img_size",),
            "under_empty_parent"),
    Refusal("no_cuda", T, (*TRAIN, "hydra.run.dir={target}", "trainer.device=cuda"), ("cuda",), "earlier"),
    Refusal("missing_extra", T, (*TRAIN, "hydra.run.dir={target}", "logger=wandb"), ("quest[wandb]",), "new",
            setup=without_wandb),
    Refusal("data_root_unset", T, (*DATA_FREE, "hydra.run.dir={target}", "data=imagefolder", "data.num_classes=2"),
            ("data.root",), "new"),
    Refusal("data_root_missing", T, (*DATA_FREE, "hydra.run.dir={target}", "data=imagefolder", "data.num_classes=3",
                                     "data.root={tmp}/nodata", *REPLACE), ("nodata",), "earlier"),
    *_rows("data_preflight", T, (*DATA_FREE, "hydra.run.dir={target}", "data=imagefolder", "data.num_classes=3",
                                 "data.num_workers=0", "data.root={bad_images}", *REPLACE), ("not an image",),
           STATES),
    *_rows("resume_file_missing", T, (*TRAIN, "hydra.run.dir={target}", "trainer.resume={tmp}/nope.pt"),
           ("nope.pt",), STATES),
    Refusal("init_from_missing", T, (*TRAIN, "hydra.run.dir={target}", "trainer.init_from={tmp}/weights.pt",
                                     *REPLACE), ("weights.pt",), "earlier"),
    Refusal("output_under_a_file", T, (*TRAIN, "hydra.run.dir={tmp}/afile/run"), ("not a directory",), "new",
            setup=_afile),
    # a run directory inside another run's (its checkpoints/): either run's replacement would move the other's files
    Refusal("inside_another_run", T, (*TRAIN, "hydra.run.dir={target}/checkpoints"),
            ("lies inside the run directory", "{target}"), "earlier"),
    # the same through a link to that folder, and a run directory around another run (which it would lock out)
    Refusal("inside_another_run_through_a_link", T, (*TRAIN, "hydra.run.dir={tmp}/linked"),
            ("lies inside the run directory", "{target}"), "earlier", setup=_link_into_checkpoints),
    Refusal("around_another_run", T, (*TRAIN, "hydra.run.dir={tmp}/outer"), ("holds the run directory",
                                                                            "{tmp}/outer/inner"), "earlier",
            setup=_run_inside("outer/inner")),
    # a file the run writes that is a folder, or a folder it writes that this user cannot write: before any change
    *[Refusal(f"{name}_is_a_folder", T, (*TRAIN, "hydra.run.dir={target}"), (f"{name} is a directory",),
              setup=_folder_in_place(name)) for name in ("metrics.jsonl", "run.json")],
    Refusal("checkpoints_unwritable", T, (*TRAIN, "hydra.run.dir={target}"), ("checkpoints cannot be written",),
            setup=_unwritable_part("checkpoints")),
    Refusal("name_too_long", T, (*TRAIN, f"hydra.run.dir={{tmp}}/{'x' * 300}"), ("x" * 100,), "new"),
    Refusal("another_config", T, (*TRAIN, "hydra.run.dir={target}", "recipe.lr=0.5"), ("recipe.lr: 0.002 -> 0.5",)),
    Refusal("resume_never", T, (*TRAIN, "hydra.run.dir={target}", "trainer.resume=never"),
            ("trainer.overwrite=true",)),
    Refusal("explicit_resume", T, (*TRAIN, "hydra.run.dir={target}", "trainer.resume={target}/checkpoints/last.pt",
                                   "recipe.lr=0.5"), ("recipe.lr",)),
    # another run's checkpoint resumed into a new directory with another config: its weights are what init_from takes
    Refusal("explicit_resume_elsewhere", T, (*TRAIN, "hydra.run.dir={tmp}/fresh", "recipe.lr=0.5",
                                             "trainer.resume={target}/checkpoints/last.pt"),
            ("recipe.lr", "trainer.init_from={target}/checkpoints/last.pt"), "earlier"),
    Refusal("checkpoint_damaged", T, (*TRAIN, "hydra.run.dir={target}"), ("last.pt",), setup=_damage),
    Refusal("checkpoint_version", T, (*TRAIN, "hydra.run.dir={target}"), ("last.pt",), setup=_version),
    # held: refused before its parts are built (the model, the data and its pre-flight)
    *[Refusal("in_use", T, (*TRAIN, "hydra.run.dir={target}", "logger=tensorboard"),
              ("in use by another process", HOLDER), state,
              setup=steps(hold(".lock"), _not_loaded("quest.train.trainer", "build_components")))
      for state in ("new", "earlier")],
    Refusal("file_in_the_way", T, (*TRAIN, "hydra.run.dir={target}", "logger=tensorboard"),
            ("tensorboard is not a directory",), setup=_in_the_way),
    Refusal("unwritable", T, (*TRAIN, "hydra.run.dir={target}"), ("cannot be written", "hydra.run.dir="),
            setup=_unwritable),
    # the directory the config names (not the command line's, checked before Hydra) through a file
    Refusal("runs_through_a_file", T, TRAIN, ("{cwd}/runs exists and is not a directory",), "new",
            setup=_blocker("runs")),
    Refusal("sweep_through_a_file", T, ("-m", *TRAIN, "recipe.lr=1e-3,2e-3"),
            ("{cwd}/runs exists and is not a directory",), "new", setup=_blocker("runs")),
    # two jobs of a sweep that would run in one directory (they differ in what names no run): before any job
    Refusal("sweep_jobs_share_a_directory", T, ("-m", *TRAIN, "trainer.device=cpu,auto"),
            ("2 jobs of the sweep would run in one directory", "trainer.device=cpu", "trainer.device=auto"), "new"),
    Refusal("sweep_one_run_dir_for_all", T, ("-m", *TRAIN, "recipe.lr=1e-3,2e-3", "hydra.run.dir={target}"),
            ("2 jobs of the sweep would run in one directory", "recipe.lr=0.001 | recipe.lr=0.002"), "new"),
    # a sweep whose every job is refused: each job's line, then the sweep's; its directory (and multirun.yaml) go
    *[Refusal("sweep_all_refused", T, ("-m", *TRAIN, "recipe.lr=-1,-2", "hydra.sweep.dir={tmp}/elsewhere/sweep"),
              ("recipe.lr must be > 0", "2 job(s) of the sweep failed", "(refused; its error is above)"), state,
              errors=3, setup=setup, bug=bug) for state, setup, bug in (
                  ("new", None, None), ("earlier_sweep", _earlier_sweep, None))],
]

E = "eval.py"
RESULTS_OF_ITS_OWN = "hydra.run.dir={tmp}/elsewhere/a/b/results"  # missing with its parents
# the results folder: beside the run (<run>/eval/<suite>/<checkpoint>-model, Hydra's default), or one of its own
WHERE = {"": (), "_results_of_its_own": (RESULTS_OF_ITS_OWN,)}
EVAL_ROWS = [
    Refusal("nothing_to_evaluate", E, (), ("nothing to evaluate",)),
    Refusal("unknown_suite_key", E, (CHECKPOINT, "eval.nope=1"), ("eval.nope",)),
    *[Refusal(f"bad_value{where}", E, (CHECKPOINT, "eval.batch_size=0", *WHERE[where]), ("eval.batch_size",))
      for where in WHERE],
    Refusal("no_cuda", E, (CHECKPOINT, "eval.device=cuda"), ("cuda",)),
    Refusal("missing_extra", E, (CHECKPOINT, "logger=wandb", RESULTS_OF_ITS_OWN), ("quest[wandb]",),
            setup=without_wandb),
    *[Refusal(f"checkpoint_missing{where}", E, ("checkpoint={tmp}/elsewhere/gone/checkpoints/last.pt",
                                                 *WHERE[where]), ("last.pt",)) for where in WHERE],
    Refusal("data_root_missing", E, ("model=vit_pico", "attention=quest", "eval=imagenet_val",
                                     "eval.roots.val={tmp}/nodata"), ("nodata",)),
    Refusal("another_config", E, (CHECKPOINT, *SMALL_EVAL, "eval.crop_pct=0.5"),
            ("holds complete results of another evaluation",), "evaluated"),
    # the results folder of its own, held by another eval.py: refused before the model is loaded
    Refusal("in_use", E, ("checkpoint={run}/checkpoints/last.pt", "eval=clean", "hydra.run.dir={target}"),
            (HOLDER,), "out", setup=steps(hold(".eval.lock"), _not_loaded("quest.evaluation.runner", "load_target"))),
    # a training run's own directory as the results folder: its .hydra/ (and wandb/) would be replaced by eval.py's
    *[Refusal(f"into_the_run{flag}", E, ("checkpoint={target}/checkpoints/last.pt", "eval=clean",
                                         "eval.clean.max_samples=40", "hydra.run.dir={target}", *more),
              ("is a training run's directory",), "earlier") for flag, more in (("", ()),
                                                                                 ("_overwrite", ("eval.overwrite=true",)))],
    Refusal("sweep_all_refused", E, ("-m", CHECKPOINT, "eval.batch_size=0", "eval.use_ema=true,false",
                                     "hydra.sweep.dir={tmp}/elsewhere/sweep"),
            ("eval.batch_size", "2 job(s) of the sweep failed"), errors=3),
]

Y = "quest-toy"
TOY_ROWS = [
    Refusal("bad_value", Y, ("data.train_size=-1", "hydra.run.dir={target}"), ("data.train_size",), "new"),
    Refusal("unknown_attention", Y, ("attentions=[nope]", "hydra.run.dir={target}"), ("nope",), "new"),
    Refusal("no_cuda", Y, ("device=cuda", "hydra.run.dir={target}"), ("CUDA",), "new"),
    Refusal("bad_value", Y, ("data.train_size=-1", "hydra.run.dir={target}"), ("data.train_size",), "out",
            setup=_earlier_toy),
    Refusal("into_a_run", Y, (*TOY_SMALL, "hydra.run.dir={target}"), ("is a training run's directory",), "earlier"),
    Refusal("runs_through_a_file", Y, (), ("{cwd}/runs exists and is not a directory",), "new",
            setup=_blocker("runs")),
    Refusal("sweep_all_refused", Y, ("-m", "data.train_size=-1,-2", "hydra.sweep.dir={tmp}/elsewhere/sweep"),
            ("data.train_size", "2 job(s) of the sweep failed"), "new", errors=3),
    # a rerun into a study's folder: of another config; another study holds it; its record damaged
    Refusal("another_config", Y, (*TOY_SMALL, "train.epochs=2", "hydra.run.dir={target}"),
            ("different toy config",), "toy"),
    # device=auto: a line is logged, which toy.log must not get
    Refusal("in_use", Y, (*TOY_SMALL[:-1], "hydra.run.dir={target}"), (HOLDER,), "toy",
            setup=steps(hold(".lock"), _not_loaded("quest.toy.study", "_run_grid"))),
    Refusal("damaged_record", Y, (*TOY_SMALL[:-1], "hydra.run.dir={target}"), (".manifest.jsonl",), "toy",
            setup=_damaged_toy_record),
    Refusal("in_use", Y, (*TOY_SMALL, "hydra.run.dir={target}"), (HOLDER,), "out",
            setup=steps(hold(".lock"), _not_loaded("quest.toy.study", "_run_grid"))),
]

# the tools: an input that makes the command impossible (exit 2); a file they did not write where they write
# (refused, exit 1, naming it; the cases where such a file is kept aside instead are tests/store/test_writers_hold.py);
# a folder another process holds (exit 1, naming the holder)
EXPORT = ("quest-export", ("{run}", "--out", "{target}"))
REPORT = ("quest-report", ("{runs}", "--out", "{target}"))
PLOT = ("quest-plot", ("perf", "{run}", "--out", "{target}/fig.png"))
CAP = ("quest-data", ("cap", "{images}", "{target}", "--short-side", "16", "--no-progress", "--workers", "1"))
CONVERT = (SHARDS, ("convert", "{images}", "{target}", "--name", "toy", "--shard-size", "4"))
INDEX = (SHARDS, ("index", "{target}", "train=shards-train-*.tar"))
OVERWRITE = ("--overwrite",)


def tool(name: str, command: tuple[str, tuple[str, ...]], says: tuple[str, ...], state: str = "out",
         more: tuple[str, ...] = (), **kw) -> Refusal:
    """A refusal of a tool's: exit 2 for quest-export, quest-report, quest-plot and quest-data (EXIT_USAGE: their 1
    means "ran, and found problems"), 1 for make_shards, which has one error path for every mistake."""
    code = 1 if command[0] == SHARDS else 2
    return Refusal(name, command[0], (*command[1], *more), says, state, code=code, **kw)


TOOL_ROWS = [
    Refusal("cap_input_missing", "quest-data", ("cap", "{tmp}/no-such-run", "{target}", "--short-side", "64",
                                            "--no-progress"), ("{tmp}/no-such-run",), "out", code=2),
    Refusal("check_input_missing", "quest-data", ("check", "{tmp}/no-such-run", "--no-progress"), ("{tmp}/no-such-run",),
            "out", code=2),
    Refusal("input_missing", "quest-export", ("{tmp}/no-such-run", "--out", "{tmp}/new/export"),
            ("{tmp}/no-such-run",), "out", code=2),
    Refusal("input_missing", "quest-report", ("{tmp}/no-such-run",), ("{tmp}/no-such-run",), "out", code=2),
    Refusal("input_missing", "quest-plot", ("diagnostics", "{tmp}/no-such-run", "--out", "{target}.png"),
            ("{tmp}/no-such-run",), "out", code=2),
    # an export folder inside a run's (its own, or its checkpoints/): the export would take the run's lock file
    *[Refusal("out_in_a_run", "quest-export", ("{run}", "--out", out), ("lies in the run directory",), "out", code=2)
      for out in ("{run}", "{run}/checkpoints/export")],
    # an empty input path (an unset shell variable) would read the working directory as the input
    *[Refusal("input_empty", program, args, ("is empty", "unset shell variable"), "out", code=2) for program, args in (
        ("quest-data", ("check", "", "--no-progress")),
        ("quest-data", ("cap", "", "{target}", "--short-side", "64", "--no-progress")),
        ("quest-export", ("", "--out", "{tmp}/new/export")), ("quest-report", ("",)),
        ("quest-plot", ("diagnostics", "", "--out", "{target}.png")), (SHARDS, ("convert", "", "{target}")))],
    *[tool(f"foreign_{p}", EXPORT, (p,), setup=foreign(p)) for p in ("model.safetensors", "config.json", "README.md")],
    *[tool(f"foreign_{p}", REPORT, (p,), setup=foreign(p)) for p in ("runs.md", "runs.csv")],
    tool("foreign_fig.png", PLOT, ("fig.png",), setup=foreign("fig.png")),
    *[tool(f"foreign_{p.split('/')[0]}", CAP, (p.split("/")[0],), setup=foreign(p))
      for p in ("train/cat/0.png", "_capped.json", ".manifest.jsonl")],
    *[tool(f"foreign_{p}", CAP, (p,), "first", setup=foreign(p)) for p in ("_capped.json", ".manifest.jsonl")],
    *[tool(f"foreign_{p}", CONVERT, (p,), setup=foreign(p)) for p in ("toy-train-0000.tar", "_info.json")],
    tool("foreign_.manifest.jsonl", CONVERT, (".manifest.jsonl",), "first", setup=foreign(".manifest.jsonl")),
    Refusal("foreign_eval_results.json", E, ("checkpoint={run}/checkpoints/last.pt", "eval=clean",
                                             "eval.clean.max_samples=40", "hydra.run.dir={target}"),
            ("{target}",), "out", setup=foreign("eval_results.json")),
    # an output in the way that would be moved aside, and .replaced/ unusable: refused before any change
    *[tool(f"replaced_is_a_{kind}", command, (".replaced",), more=more, setup=steps(foreign(place), replaced_unusable(kind)))
      for kind in ("file", "link") for command, place, more in (
          (CAP, "train/cat/0.png", ()), (CONVERT, "toy-train-0000.tar", ()), (EXPORT, "config.json", OVERWRITE),
          (REPORT, "runs.md", OVERWRITE))],
    # a training run's own directory as a tool's output folder (its lock file is the run's): refused by every tool
    *[tool("into_a_run", command, ("is a training run's directory", program), "earlier", more=more)
      for command, program, more in ((REPORT, "quest-report", OVERWRITE), (CAP, "quest-data cap", ()),
                                     (CONVERT, "make_shards convert", ()))],
    tool("inside_a_run_through_a_link", ("quest-export", ("{target}", "--out", "{tmp}/linked/sub")),
         ("lies in the run directory", "{target}"), "earlier", setup=_link_into_checkpoints),
    # held: refused before the checkpoint is read (and, below, before an image is capped or decoded)
    tool("in_use", EXPORT, (HOLDER,), more=OVERWRITE,
         setup=steps(hold(".lock"), _not_loaded("quest.tools.export", "load_record"))),
    tool("onnx_missing_extra", EXPORT, ("quest[onnx]",), more=("--onnx",), setup=without("onnxruntime")),
    tool("onnx_in_use", EXPORT, (HOLDER,), more=("--onnx", "--overwrite"), setup=hold(".lock")),
    tool("in_use", REPORT, (HOLDER,), more=OVERWRITE, setup=hold(".lock")),
    tool("in_use", PLOT, (HOLDER,), more=OVERWRITE, setup=hold(".fig.png.lock")),
    *[tool("in_use", CAP, (HOLDER,), state, setup=steps(hold(".lock"), _not_loaded("quest.tools.capped", "cap_image")))
      for state in ("out", "first")],
    # refused before a single image is decoded (a data set's decode takes hours)
    *[tool("in_use", CONVERT, (HOLDER,), state, setup=steps(hold(".lock"), _not_loaded("quest.tools.make_shards", "_usable")))
      for state in ("out", "first")],
    tool("in_use", INDEX, (HOLDER,), setup=steps(_tars, hold(".lock"), _not_loaded("quest.tools.make_shards", "_count_splits"))),
]

ROWS = [*TRAIN_ROWS, *EVAL_ROWS, *TOY_ROWS, *TOOL_ROWS]
#: rows run again as two ranks of a torchrun group: rank 0 says the line, rank 1 exits with the same code silently
UNDER_TORCHRUN = ["train.py:unknown_key:new", "train.py:bad_values:earlier", "eval.py:bad_value:earlier"]
