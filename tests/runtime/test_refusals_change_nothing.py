"""Every check before the first change (issue 48, item 3): each refusal a start of train.py, eval.py or the toy study
can make, from the command line's keys to the run directory's lock and files, leaves the file system as it was:
the same names, bytes and modes under the test's tree, no directory left behind (the run directory Hydra made, and
its parents outside the working directory), none removed that was there before (an empty ``runs/``), and one line,
exit code 1, no traceback.

A matrix: refusal x the state of the directory the command would write (missing with its parents, under an empty
parent that was there before, holding an earlier run). The apps run in this process (each the console script's
function with its argv), so that a missing package or an unwritable directory can be simulated."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quest import cli
from quest.run import sweep_jobs
from quest.runtime.errors import EXIT_ERROR
from quest.store import made_dirs
from quest.store.locks import lock_file
from quest.store.tree import remove_made_dirs

from ..helpers import FAST
from ..interop_helpers import make_image_folder
from ..tree_state import tree_state

TRAIN = [a for a in FAST if not a.startswith("trainer.")] + ["trainer.max_steps=1"]
DATA_FREE = [a for a in TRAIN if not a.startswith("data")]  # for the refusals that choose a data set of their own
STATES = ["new", "under_empty_parent", "earlier"]
REPLACE = ["trainer.resume=never", "trainer.overwrite=true"]




def start(app: str, args: list[str], cwd: Path, monkeypatch, capsys) -> tuple[int, str]:
    """Run ``app`` (train.py, eval.py, quest-toy) in this process as a shell would; (exit code, stderr)."""
    main = {"train.py": cli.train, "eval.py": cli.evaluate, "quest-toy": cli.toy}[app]
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [app, *args])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # what a user sees
    monkeypatch.setattr(sweep_jobs, "failed", [])  # this command's sweep only
    capsys.readouterr()
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def refused(app: str, args: list[str], cwd: Path, names: str, root: Path, monkeypatch, capsys,
            held: int | None = None) -> None:
    """``app`` with ``args`` is refused with one line naming ``names`` (exit 1, no traceback), and every entry under
    ``root`` is as it was. ``held``: a lock this test holds for another process, released after the command."""
    before = tree_state(root)
    try:
        code, err = start(app, args, cwd, monkeypatch, capsys)
    finally:
        if held is not None:
            os.close(held)
    assert code == EXIT_ERROR, err[-3000:]
    assert err.count(f"{app}: error: ") == 1 and "Traceback" not in err, err[-3000:]
    assert names in err[err.index(f"{app}: error: "):], err[-3000:]
    assert tree_state(root) == before


def without_wandb(monkeypatch) -> None:
    """wandb as if not installed: the extras' check (quest.runtime.extras) finds no module of that name."""
    import quest.runtime.extras

    installed = quest.runtime.extras._installed
    monkeypatch.setattr(quest.runtime.extras, "_installed", lambda module: module != "wandb" and installed(module))


def holding(lock: Path) -> int:
    """Another process's lock on ``lock``: this test holds it, its holder named as another machine's process."""
    fd = lock_file(lock, "test")
    os.pwrite(fd, b"pid 1 on elsewhere\n", 0)
    return fd


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory) -> Path:
    """A run directory as a run stopped at trainer.max_steps left it (.hydra/, train.log, checkpoints, ...)."""
    run = tmp_path_factory.mktemp("earlier") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(run.parent)
        mp.setattr(sys, "argv", ["train.py", *TRAIN, f"hydra.run.dir={run}"])
        cli.train()
    assert (run / "checkpoints" / "last.pt").is_file() and (run / ".hydra" / "config.yaml").is_file()
    return run


@pytest.fixture(scope="module")
def bad_images(tmp_path_factory) -> Path:
    """An image folder with one file that is not an image (outside the hashed tree: the pre-flight keeps its cache
    there on purpose, docs/data.md)."""
    root = make_image_folder(tmp_path_factory.mktemp("data") / "images", per_class=2)
    next((root / "train").rglob("*.png")).write_bytes(b"not an image")
    return root


def place(state: str, tmp: Path, earlier: Path | None) -> tuple[Path, Path]:
    """(working directory, run directory) for a state; the run directory's parents outside the working directory
    when it is new."""
    cwd = tmp / "cwd"
    cwd.mkdir()
    if state == "new":
        return cwd, tmp / "elsewhere" / "a" / "b" / "run"
    if state == "under_empty_parent":
        (cwd / "runs").mkdir()  # the user's, empty: it stays
        return cwd, cwd / "runs" / "x" / "run"
    shutil.copytree(earlier, tmp / "run", symlinks=True)
    return cwd, tmp / "run"


def _damage(run: Path) -> None:
    (run / "checkpoints" / "last.pt").write_bytes(b"garbage")


def _version(run: Path) -> None:
    last = run / "checkpoints" / "last.pt"
    ckpt = torch.load(last, weights_only=True)
    ckpt["version"] = 999  # a quest newer than this one wrote it
    torch.save(ckpt, last)
    (run / "summary.json").unlink()  # an interrupted run: the next command resumes from last.pt


def _hold(run: Path) -> int:
    return holding(run / ".lock")


def _in_the_way(run: Path) -> None:
    (run / "tensorboard").write_text("a file where the run writes a directory\n")


# name -> (overrides, where it applies, what the message names, a change to the directory before the command)
TRAIN_REFUSALS = {
    "unknown_key": (["recipe.nope=1"], STATES, "recipe.nope", None),  # before Hydra runs
    "bad_value": (["recipe.lr=-1"], STATES, "recipe.lr", None),
    "bad_relation": (["recipe.mixup=0.5", "data.batch_size=15"], STATES, "data.batch_size", None),
    "patch_size": (["model.img_size=30"], STATES, "img_size", None),
    "no_cuda": (["trainer.device=cuda"], STATES, "cuda", None),
    "missing_extra": (["logger=wandb"], STATES, "quest[wandb]", None),
    # with trainer.overwrite=true, which would archive an earlier run: only once the data passed its checks
    "data_root_missing": (["data=imagefolder", "data.num_classes=3", "data.root={tmp}/nodata", *REPLACE], STATES,
                          "nodata", None),
    "data_preflight": (["data=imagefolder", "data.num_classes=3", "data.num_workers=0", "data.root={images}",
                        *REPLACE], STATES, "not an image", None),
    "resume_file_missing": (["trainer.resume={tmp}/nope.pt"], STATES, "nope.pt", None),
    "output_under_a_file": (["hydra.run.dir={tmp}/afile/run"], ["new"], "not a directory", None),
    "another_config": (["recipe.lr=0.5"], ["earlier"], "recipe.lr", None),
    "resume_never": (["trainer.resume=never"], ["earlier"], "trainer.overwrite=true", None),
    "checkpoint_damaged": ([], ["earlier"], "last.pt", _damage),
    "checkpoint_version": ([], ["earlier"], "last.pt", _version),
    "init_from_missing": (["trainer.init_from={tmp}/weights.pt", *REPLACE], STATES, "weights.pt", None),
    "in_use": ([], ["earlier"], "pid 1 on elsewhere", _hold),
    "file_in_the_way": (["logger=tensorboard"], ["earlier"], "tensorboard is not a directory", _in_the_way),
    "unwritable": ([], ["earlier"], "cannot be written", None),
}


@pytest.mark.parametrize("refusal, state", [(r, s) for r, case in TRAIN_REFUSALS.items() for s in case[1]])
def test_a_refused_train_start_changes_nothing(refusal, state, tmp_path, earlier_run, bad_images, monkeypatch,
                                               capsys):
    args, _, names, prepare = TRAIN_REFUSALS[refusal]
    cwd, run = place(state, tmp_path, earlier_run)
    (tmp_path / "afile").write_text("x\n")
    held = prepare(run) if prepare is not None else None
    if refusal == "unwritable":  # root writes anywhere: the permission is taken away where the check asks
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == run else real(p, mode, **kw))
    if refusal == "missing_extra":
        without_wandb(monkeypatch)
    base = DATA_FREE if any(a.startswith("data=") for a in args) else TRAIN
    args = [a.format(tmp=tmp_path, images=bad_images) for a in args]
    refused("train.py", [*base, f"hydra.run.dir={run}", *args], cwd, names, tmp_path, monkeypatch, capsys, held)


def test_a_rerun_of_a_finished_run_changes_nothing_either(tmp_path, earlier_run, monkeypatch, capsys):
    """Not a refusal, but the same promise: the finished run is reported, its directory as it was. A file named
    like the directory of a logger that is off (wandb, with logger=jsonl) is not in the way."""
    cwd, run = place("earlier", tmp_path, earlier_run)
    (run / "wandb").write_text("the user's file\n")
    before = tree_state(tmp_path)
    code, err = start("train.py", [*TRAIN, f"hydra.run.dir={run}"], cwd, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert tree_state(tmp_path) == before


@pytest.mark.parametrize("state", ["new", "earlier"])
def test_a_sweep_whose_every_job_is_refused_changes_nothing(state, tmp_path, monkeypatch, capsys):
    """A multirun: each job's directory goes, and the sweep directory Hydra made (with its multirun.yaml), or the
    multirun.yaml it rewrote in an earlier sweep's directory is put back."""
    sweep = tmp_path / "elsewhere" / "sweep"
    if state == "earlier":
        (sweep / "job").mkdir(parents=True)
        (sweep / "job" / "summary.json").write_text("{}\n")
        (sweep / "multirun.yaml").write_text("an earlier sweep's record\n")
    (tmp_path / "cwd").mkdir()
    before = tree_state(tmp_path)
    code, err = start("train.py", ["-m", *TRAIN, "recipe.lr=-1,-2", f"hydra.sweep.dir={sweep}"], tmp_path / "cwd",
                      monkeypatch, capsys)
    assert code == EXIT_ERROR and "Traceback" not in err, err[-3000:]
    assert err.count("recipe.lr must be > 0") == 2 and "2 job(s) of the sweep failed" in err, err[-3000:]
    assert tree_state(tmp_path) == before


@pytest.mark.parametrize("app, args, blocker", [
    ("train.py", TRAIN, "runs"),  # runs/<data>/<model>-...
    ("train.py", ["-m", *TRAIN, "recipe.lr=1e-3,2e-3"], "multirun"),  # multirun/<time>
    ("quest-toy", [], "runs"),  # runs/toy/<grid>-n<size>
])
def test_a_configured_directory_through_a_file_is_one_line(app, args, blocker, tmp_path, monkeypatch, capsys):
    """The directory the config names (not the command line, which is checked before Hydra) through a file: Hydra's
    mkdir would fail with its traceback."""
    (tmp_path / blocker).write_text("a file\n")
    refused(app, args, tmp_path, f"{tmp_path / blocker} exists and is not a directory", tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("app, args, names", [
    ("train.py", [*TRAIN, "recipe.nope=1"], "recipe.nope"),  # the command line's, before Hydra runs
    ("train.py", [*TRAIN, "recipe.lr=-1"], "recipe.lr"),  # the config's, before the processes join their group
    ("eval.py", ["checkpoint={run}/checkpoints/last.pt", "eval.batch_size=0"], "eval.batch_size"),
])
def test_under_torchrun_a_refused_start_is_said_once(app, args, names, tmp_path, earlier_run, monkeypatch, capsys):
    """Every process of a torchrun group runs the same command and finds the same refusal: rank 0 says it, the
    others exit with the same code silently (each rank simulated here by the environment torchrun gives it)."""
    import quest.runtime.errors

    monkeypatch.setattr(quest.runtime.errors, "_joined", False)
    cwd, run = place("earlier", tmp_path, earlier_run)
    before, said = tree_state(tmp_path), []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        said.append(start(app, [a.format(run=run) for a in args], cwd, monkeypatch, capsys))
    assert said[0][0] == said[1][0] == EXIT_ERROR, said
    assert said[0][1].count(f"{app}: error: ") == 1 and names in said[0][1], said[0][1][-3000:]
    assert said[1][1] == "", said[1][1][-3000:]
    assert tree_state(tmp_path) == before


# --- eval.py and the toy study ----------------------------------------------------------------------------------
CHECKPOINT = "checkpoint={run}/checkpoints/last.pt"
SMALL_EVAL = ["eval=clean", "eval.clean.max_samples=8"]
RANDOM_MODEL = ["model=vit_pico", "attention=quest"]  # random weights: nothing to load from disk
# the results directory: beside the run (<run>/eval/<suite>/<checkpoint>-model, Hydra's default), or one of its own
# (hydra.run.dir) that is missing with its parents outside the working directory
WHERE = {"beside_run": [], "new": ["hydra.run.dir={tmp}/elsewhere/a/b/results"]}
EVAL_REFUSALS = {
    "nothing_to_evaluate": ([], "nothing to evaluate", ["beside_run"]),  # before Hydra runs
    "unknown_suite_key": ([CHECKPOINT, "eval.nope=1"], "eval.nope", ["beside_run"]),  # before Hydra runs
    "bad_value": ([CHECKPOINT, "eval.batch_size=0"], "eval.batch_size", list(WHERE)),
    "no_cuda": ([CHECKPOINT, "eval.device=cuda"], "cuda", list(WHERE)),
    "missing_extra": ([CHECKPOINT, "logger=wandb"], "quest[wandb]", list(WHERE)),
    "checkpoint_missing": (["checkpoint={tmp}/elsewhere/gone/checkpoints/last.pt"], "last.pt", list(WHERE)),
    "data_root_missing": ([*RANDOM_MODEL, "eval=imagenet_val", "eval.roots.val={tmp}/nodata"], "nodata", list(WHERE)),
    # an earlier evaluation's complete results of another config (eval.crop_pct) where this one would write
    "another_config": ([CHECKPOINT, *SMALL_EVAL, "eval.crop_pct=0.5"], "holds complete results of another "
                       "evaluation", ["beside_run"]),
    # the results directory of its own (hydra.run.dir), held by another eval.py
    "in_use": ([CHECKPOINT, "hydra.run.dir={tmp}/held"], "pid 1 on elsewhere", ["beside_run"]),
}


@pytest.fixture(scope="module")
def evaluated_run(earlier_run, tmp_path_factory) -> Path:
    """The earlier run with an evaluation of it (SMALL_EVAL) in its default results directory."""
    run = tmp_path_factory.mktemp("evaluated") / "run"
    shutil.copytree(earlier_run, run, symlinks=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(run.parent)
        mp.setattr(sys, "argv", ["eval.py", f"checkpoint={run}/checkpoints/last.pt", *SMALL_EVAL])
        cli.evaluate()
    assert (run / "eval" / "clean" / "last-model" / "eval_results.json").is_file()
    return run


@pytest.mark.parametrize("refusal, where", [(r, w) for r, case in EVAL_REFUSALS.items() for w in case[2]])
def test_a_refused_eval_start_changes_nothing(refusal, where, tmp_path, earlier_run, evaluated_run, monkeypatch,
                                              capsys):
    """eval.py writes beside the run (<run>/eval/<suite>/...): the run directory is in the hashed tree, and so is
    every directory Hydra made for the results (beside the run, or of their own with their missing parents), which
    the refusal removes again. A checkpoint that is missing would have its results in a new directory beside it,
    outside the working directory."""
    args, names, _ = EVAL_REFUSALS[refusal]
    cwd, run = place("earlier", tmp_path, evaluated_run if refusal == "another_config" else earlier_run)
    if refusal == "missing_extra":
        without_wandb(monkeypatch)
    held = None
    if refusal == "in_use":
        (tmp_path / "held").mkdir()
        held = holding(tmp_path / "held" / ".eval.lock")
    args = [a.format(run=run, tmp=tmp_path) for a in [*args, *WHERE[where]]]
    refused("eval.py", args, cwd, names, tmp_path, monkeypatch, capsys, held)


@pytest.mark.parametrize("app, args, sweep_key", [
    ("eval.py", [CHECKPOINT, "eval.batch_size=0,-1"], "hydra.sweep.dir"),
    ("quest-toy", ["data.train_size=-1,-2"], "hydra.sweep.dir"),
])
def test_an_eval_or_toy_sweep_whose_every_job_is_refused_changes_nothing(app, args, sweep_key, tmp_path, earlier_run,
                                                                          monkeypatch, capsys):
    """As for train.py: each job's refusal is said, the sweep goes on, and the sweep directory Hydra made (with
    its multirun.yaml) goes again."""
    cwd, run = place("earlier", tmp_path, earlier_run)
    before = tree_state(tmp_path)
    args = ["-m", *[a.format(run=run) for a in args], f"{sweep_key}={tmp_path}/elsewhere/sweep"]
    code, err = start(app, args, cwd, monkeypatch, capsys)
    assert code == EXIT_ERROR and "Traceback" not in err, err[-3000:]
    assert err.count(f"{app}: error: ") == 3 and "2 job(s) of the sweep failed" in err, err[-3000:]
    assert tree_state(tmp_path) == before


TOY_REFUSALS = {
    "bad_value": (["data.train_size=-1"], "data.train_size"),
    "unknown_attention": (["attentions=[nope]"], "nope"),
    "no_cuda": (["device=cuda"], "CUDA"),
}


@pytest.mark.parametrize("state", ["new", "earlier"])
@pytest.mark.parametrize("refusal", TOY_REFUSALS)
def test_a_refused_toy_study_changes_nothing(refusal, state, tmp_path, monkeypatch, capsys):
    """The study's directory: Hydra's record and toy.log are written once the study passed every check."""
    args, names = TOY_REFUSALS[refusal]
    cwd, out = place("new", tmp_path, None)
    if state == "earlier":  # an earlier study's files
        (out / ".hydra").mkdir(parents=True)
        (out / ".hydra" / "config.yaml").write_text("grid: quick\n")
        (out / "toy.log").write_text("[an earlier study's log]\n")
        (out / "runs.csv").write_text("attention,outcome\n")
    refused("quest-toy", [*args, f"hydra.run.dir={out}"], cwd, names, tmp_path, monkeypatch, capsys)


TOY_SMALL = ["grid=quick", "grid.lrs=[0.01]", "grid.weight_decays=[0.0]", "grid.data_seeds=[0]", "grid.init_seeds=[0]",
             "data.train_size=16", "data.test_size=16", "train.epochs=1", "probe_size=8", "workers=1",
             "compile=false", "attentions=[standard]", "device=cpu"]


def test_a_toy_rerun_of_another_config_changes_nothing(tmp_path, monkeypatch, capsys):
    """A study's folder holding its chunks of another toy config: refused before the study claims the folder (its
    lock file keeps naming the earlier study) and before it writes Hydra's record and toy.log."""
    cwd, out = place("new", tmp_path, None)
    code, err = start("quest-toy", [*TOY_SMALL, f"hydra.run.dir={out}"], cwd, monkeypatch, capsys)
    assert code == 0 and (out / "chunks" / "standard-data0.pt").is_file(), err[-3000:]
    refused("quest-toy", [*TOY_SMALL, "train.epochs=2", f"hydra.run.dir={out}"], cwd, "different toy config",
            tmp_path, monkeypatch, capsys)



@pytest.mark.parametrize("why", ["held", "damaged_record"])
def test_a_toy_rerun_refused_at_its_folder_changes_nothing(why, tmp_path, monkeypatch, capsys):
    """A rerun into a study's folder that another study holds, or whose record is damaged: refused before toy.log
    (and Hydra's record) is touched, the folder byte-identical."""
    cwd, out = place("new", tmp_path, None)
    code, err = start("quest-toy", [*TOY_SMALL, f"hydra.run.dir={out}"], cwd, monkeypatch, capsys)
    assert code == 0 and (out / "toy.log").is_file(), err[-3000:]
    held = None
    if why == "held":
        held, names = holding(out / ".lock"), "pid 1 on elsewhere"
    else:
        (out / ".manifest.jsonl").write_text("{ cut short")
        names = ".manifest.jsonl"
    rerun = [a for a in TOY_SMALL if a != "device=cpu"]  # device=auto: a line is logged, toy.log must not get it
    refused("quest-toy", [*rerun, f"hydra.run.dir={out}"], cwd, names, tmp_path, monkeypatch, capsys, held=held)

# --- the mechanism: which directories a command made -------------------------------------------------------------
@settings(max_examples=60)
@given(existing=st.sets(st.sampled_from(["a", "a/b", "a/b/c", "d", "d/e"])),
       target=st.sampled_from(["a/b/c/run", "a/x/run", "d/e", "d/e/f/g", "q/r", "a"]))
def test_only_the_directories_that_were_missing_are_removed(existing, target, tmp_path_factory):
    """Whatever existed before (an empty directory too) stays; what a refused command's lock made goes."""
    root = tmp_path_factory.mktemp("m")
    for name in existing:
        (root / name).mkdir(parents=True, exist_ok=True)
    before = {p for p in root.rglob("*")}
    made = made_dirs.missing_dirs(root / target)
    assert all(not p.exists() for p in made) and (made[-1].parent.exists() if made else True)
    (root / target).mkdir(parents=True, exist_ok=True)  # as the lock makes it
    remove_made_dirs(made)
    assert {p for p in root.rglob("*")} == before


# --- logger=wandb: its values and an online run's credentials, checked before the first change --------------------
def no_wandb_credentials(home: Path, monkeypatch) -> list:
    """A user without wandb credentials (``home`` without .netrc or wandb settings, no WANDB_* key), and a wandb
    whose init records its calls and fails: nothing can connect. wandb's settings are read again from this
    environment (a fresh wandb singleton). Returns the list of wandb.init's calls."""
    import wandb
    from wandb.sdk import wandb_setup

    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_CONFIG_DIR", "NETRC",
                 "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(wandb_setup, "_singleton", None)
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        raise AssertionError("wandb.init must not be reached")

    monkeypatch.setattr(wandb, "init", init)
    return calls


WANDB_REFUSALS = {
    # name -> (WANDB_MODE, overrides, what the message names)
    "online_without_credentials": ("online", ["logger=wandb"], "`wandb login`"),
    "online_by_key_without_credentials": (None, ["logger=wandb", "logger.mode=online"], "WANDB_API_KEY"),
    "bad_wandb_mode": ("ofline", ["logger=wandb"], "WANDB_MODE"),
    "bad_wandb_mode_beside_logger_mode": ("ofline", ["logger=wandb", "logger.mode=offline"], "WANDB_MODE"),
    "bad_project": ("offline", ["logger=wandb", "logger.project=team/project"], "logger.project"),
}


@pytest.mark.parametrize("refusal, state", [(r, s) for r in WANDB_REFUSALS for s in STATES])
def test_a_refused_wandb_start_changes_nothing(refusal, state, tmp_path, earlier_run, monkeypatch, capsys):
    """An online wandb run without credentials is refused before wandb.init (which would fail, or prompt at a
    terminal, only once the run directory was written to); a bad WANDB_MODE or wandb value too. The user's home is
    in the hashed tree: reading wandb's settings writes nothing there either."""
    mode, args, names = WANDB_REFUSALS[refusal]
    cwd, run = place(state, tmp_path, earlier_run)
    calls = no_wandb_credentials(tmp_path / "home", monkeypatch)
    if mode is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", mode)
    refused("train.py", [*TRAIN, f"hydra.run.dir={run}", *args], cwd, names, tmp_path, monkeypatch, capsys)
    assert calls == []


def test_a_refused_wandb_eval_changes_nothing(tmp_path, earlier_run, monkeypatch, capsys):
    cwd, run = place("earlier", tmp_path, earlier_run)
    calls = no_wandb_credentials(tmp_path / "home", monkeypatch)
    monkeypatch.setenv("WANDB_MODE", "online")
    refused("eval.py", [CHECKPOINT.format(run=run), "logger=wandb"], cwd, "`wandb login`", tmp_path, monkeypatch,
            capsys)
    assert calls == []


@pytest.mark.parametrize("state", STATES)
def test_a_wandb_run_that_does_not_start_changes_nothing_but_the_lock(state, tmp_path, earlier_run, monkeypatch,
                                                                        capsys):
    """Credentials found, but wandb.init fails (its server unreachable: wandb raises CommError after its
    init_timeout) having made its folder under <run>/wandb. wandb.init cannot be checked without starting it, so it
    is the first change once the run directory is claimed: the command stops with one line, the folder wandb made
    goes, and the run directory is as it was but its lock file, which names this command (and, in a new directory,
    the folders that hold it). In an earlier run's directory the command would resume it."""
    from wandb.errors import CommError

    cwd, run = place(state, tmp_path, earlier_run)
    calls = no_wandb_credentials(tmp_path / "home", monkeypatch)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)  # the form wandb accepts; never sent anywhere here
    import wandb

    def unreachable(**kwargs):  # as wandb 0.31's: its run folder, its links re-pointed at it, then the error
        calls.append(kwargs)
        folder = Path(kwargs["dir"]) / "wandb"
        logs = folder / "run-20260101_000000-abc" / "logs"
        logs.mkdir(parents=True)
        (logs / "debug.log").write_text("wandb's log of the attempt\n")
        for link, target in (("latest-run", logs.parent.name), ("debug.log", f"{logs.parent.name}/logs/debug.log")):
            (folder / link).unlink(missing_ok=True)
            (folder / link).symlink_to(target)
        raise CommError('Timed out while retrying: Post "https://api.wandb.ai/graphql": connection refused')

    monkeypatch.setattr(wandb, "init", unreachable)
    if state == "earlier":  # an earlier attempt's offline wandb run, and wandb's links to it
        earlier = run / "wandb" / "offline-run-20250101_000000-abc"
        (earlier / "logs").mkdir(parents=True)
        (run / "wandb" / "latest-run").symlink_to(earlier.name)
        (run / "wandb" / "debug.log").symlink_to(f"{earlier.name}/logs/debug.log")
    more = ["trainer.max_steps=2"] if state == "earlier" else []  # a finished run would only be reported
    before = tree_state(tmp_path)
    code, err = start("train.py", [*TRAIN, f"hydra.run.dir={run}", "logger=wandb", *more], cwd, monkeypatch, capsys)
    assert code == EXIT_ERROR and err.count("train.py: error: ") == 1 and "Traceback" not in err, err[-3000:]
    assert "the wandb run did not start (CommError: Timed out" in err and "but its lock file" in err, err[-3000:]
    assert len(calls) == 1 and calls[0]["mode"] == "online"
    after = tree_state(tmp_path)
    lock = str((run / ".lock").relative_to(tmp_path))
    assert (run / ".lock").read_text().startswith(f"pid {os.getpid()} ")  # claimed: it names this command
    made = {str(p.relative_to(tmp_path)) for p in [run, *run.parents] if p.is_relative_to(tmp_path)} - set(before)
    assert {k: v for k, v in after.items() if k != lock and k not in made} == \
        {k: v for k, v in before.items() if k != lock}
    if state == "earlier":  # tree_state() holds the targets too; said here in words
        assert os.readlink(run / "wandb" / "latest-run") == earlier.name
        assert os.readlink(run / "wandb" / "debug.log") == f"{earlier.name}/logs/debug.log"
