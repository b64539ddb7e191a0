"""Rows of the refusal contract that need more than arguments (tests/runtime/test_refusal_contract.py): logger=wandb
(its values and an online run's credentials, checked before the first change; a wandb.init that fails), and every
damaged input, generated: each file a command reads back, cut short, emptied, overwritten with random bytes, of the
wrong JSON type, a directory in its place or (not as root) unreadable, through every command that reads it."""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .refusal_cases import CHECKPOINT, SHARDS, SMALL_EVAL, TOY_SMALL, TRAIN, Refusal, Scene

#: what reaches wandb.init, per case: it must not be called before the command's checks passed
WANDB_INIT_CALLS: list[dict] = []


def no_wandb_credentials(mode: str | None) -> Callable[[Scene], None]:
    """A user without wandb credentials (a home without .netrc or wandb settings, no WANDB_* key) and WANDB_MODE
    ``mode``, and a wandb whose init records its calls and fails: nothing can connect. wandb's settings are read
    again from this environment (a fresh wandb singleton)."""
    def setup(scene: Scene) -> None:
        import wandb
        from wandb.sdk import wandb_setup

        mp = scene.monkeypatch
        home = scene.tmp / "home"  # under the hashed folder: reading wandb's settings writes nothing there either
        home.mkdir()
        mp.setenv("HOME", str(home))
        for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_CONFIG_DIR", "NETRC",
                     "WANDB_DIR", "WANDB_MODE"):
            mp.delenv(name, raising=False)
        if mode is not None:
            mp.setenv("WANDB_MODE", mode)
        mp.setattr(wandb_setup, "_singleton", None)
        WANDB_INIT_CALLS.clear()

        def init(**kwargs):
            WANDB_INIT_CALLS.append(kwargs)
            raise AssertionError("wandb.init must not be reached")

        mp.setattr(wandb, "init", init)
    return setup


def wandb_not_called(scene: Scene) -> None:
    assert WANDB_INIT_CALLS == [], WANDB_INIT_CALLS


def _wandb_unreachable(scene: Scene) -> None:
    """Credentials found, but wandb.init fails as wandb 0.31's does when its server is unreachable: its run folder
    under <run>/wandb, its links re-pointed at it, then CommError. In an earlier run's directory: an earlier
    attempt's offline wandb run and wandb's links to it, which must stay."""
    import wandb
    from wandb.errors import CommError

    no_wandb_credentials("online")(scene)
    scene.monkeypatch.setenv("WANDB_API_KEY", "a" * 40)  # the form wandb accepts; never sent anywhere here

    def unreachable(**kwargs):
        WANDB_INIT_CALLS.append(kwargs)
        folder = Path(kwargs["dir"]) / "wandb"
        logs = folder / "run-20260101_000000-abc" / "logs"
        logs.mkdir(parents=True)
        (logs / "debug.log").write_text("wandb's log of the attempt\n")
        for link, target in (("latest-run", logs.parent.name), ("debug.log", f"{logs.parent.name}/logs/debug.log")):
            (folder / link).unlink(missing_ok=True)
            (folder / link).symlink_to(target)
        raise CommError('Timed out while retrying: Post "https://api.wandb.ai/graphql": connection refused')

    scene.monkeypatch.setattr(wandb, "init", unreachable)
    if (scene.target / "checkpoints").is_dir():
        earlier = scene.target / "wandb" / "offline-run-20250101_000000-abc"
        (earlier / "logs").mkdir(parents=True)
        (scene.target / "wandb" / "latest-run").symlink_to(earlier.name)
        (scene.target / "wandb" / "debug.log").symlink_to(f"{earlier.name}/logs/debug.log")


def _init_called_once_online(scene: Scene) -> None:
    assert len(WANDB_INIT_CALLS) == 1 and WANDB_INIT_CALLS[0]["mode"] == "online", WANDB_INIT_CALLS


RUN = (*TRAIN, "hydra.run.dir={target}")
WANDB_ROWS = [
    Refusal("online_without_credentials", "train.py", (*RUN, "logger=wandb"), ("`wandb login`",), "earlier",
            setup=no_wandb_credentials("online"), check=wandb_not_called),
    Refusal("online_by_key_without_credentials", "train.py", (*RUN, "logger=wandb", "logger.mode=online"),
            ("WANDB_API_KEY",), "new", setup=no_wandb_credentials(None), check=wandb_not_called),
    Refusal("bad_wandb_mode", "train.py", (*RUN, "logger=wandb"), ("WANDB_MODE",), "under_empty_parent",
            setup=no_wandb_credentials("ofline"), check=wandb_not_called),
    Refusal("bad_wandb_mode_beside_logger_mode", "train.py", (*RUN, "logger=wandb", "logger.mode=offline"),
            ("WANDB_MODE",), "earlier", setup=no_wandb_credentials("ofline"), check=wandb_not_called),
    Refusal("bad_project", "train.py", (*RUN, "logger=wandb", "logger.project=team/project"), ("logger.project",),
            "new", setup=no_wandb_credentials("offline"), check=wandb_not_called),
    Refusal("online_without_credentials", "eval.py", (CHECKPOINT, "logger=wandb"), ("`wandb login`",),
            setup=no_wandb_credentials("online"), check=wandb_not_called),
    # a finished run would only be reported: the earlier one is asked for one more step
    *[Refusal("wandb_run_did_not_start", "train.py", (*RUN, "logger=wandb", *more),
              ("the wandb run did not start (CommError: Timed out", "but its lock file"), state,
              setup=_wandb_unreachable, check=_init_called_once_online, bug=bug, claimed=True)
      for state, more, bug in (("new", (), None), ("under_empty_parent", (), None),
                               ("earlier", ("trainer.max_steps=2",), None))],
]


# --- faults from below quest ------------------------------------------------------------------------------------
def _dangling(scene: Scene) -> None:
    """scratch not mounted: ``{tmp}/scratch`` is a link to a folder that does not exist."""
    (scene.tmp / "scratch").symlink_to(scene.tmp / "not-mounted")


def _broken_yaml(scene: Scene) -> None:
    """A config folder of the user's whose data option is not YAML (a hand edit cut short)."""
    (scene.tmp / "configs" / "data").mkdir(parents=True)
    (scene.tmp / "configs" / "data" / "broken.yaml").write_text("name: fake\n  num_classes: [\n")


def _cluster(scontrol: str | None) -> Callable[[Scene], None]:
    """A PATH where SLURM is not installed (``scontrol`` None), or where ``scontrol ping`` fails with this line (a
    login node that cannot reach its controller): fake binaries, so that no real cluster is ever asked."""
    def setup(scene: Scene) -> None:
        bin_dir = scene.tmp / "bin"
        bin_dir.mkdir()
        if scontrol is not None:
            for name, script in (("sbatch", "exit 1"), ("scontrol", f"echo '{scontrol}' >&2; exit 1")):
                (bin_dir / name).write_text(f"#!/bin/sh\n{script}\n")
                (bin_dir / name).chmod(0o755)
        scene.monkeypatch.setenv("PATH", str(bin_dir))
        if scontrol is not None:  # its answer, without starting it: the process boundary is not what this row proves
            import subprocess

            real = subprocess.run

            def run(args, *a, **k):
                if list(args)[:2] == ["scontrol", "ping"]:
                    return subprocess.CompletedProcess(args, 1, "", f"{scontrol}\n")
                return real(args, *a, **k)
            scene.monkeypatch.setattr(subprocess, "run", run)
    return setup


# faults from below quest (the operating system, YAML), for every app: one line naming the path, never a traceback
DANGLING = ("{tmp}/scratch is a link to {tmp}/not-mounted, which does not exist",)
BELOW_ROWS = [
    Refusal("dangling_link", "train.py", (*TRAIN, "hydra.run.dir={tmp}/scratch/run"), DANGLING, "new", setup=_dangling),
    Refusal("dangling_link", "eval.py", (CHECKPOINT, "hydra.run.dir={tmp}/scratch/results"), DANGLING, setup=_dangling),
    Refusal("dangling_link", "quest-toy", (*TOY_SMALL, "hydra.run.dir={tmp}/scratch/toy"), DANGLING, "new", setup=_dangling),
    Refusal("dangling_link_sweep", "train.py", ("-m", *TRAIN, "recipe.lr=1e-3,2e-3", "hydra.sweep.dir={tmp}/scratch/sweep"),
            DANGLING, "new", setup=_dangling),
    # a SLURM sweep where no cluster takes its jobs: one line, no multirun/ folder, nothing submitted
    Refusal("slurm_not_installed", "train.py", ("-m", "hydra/launcher=slurm", *TRAIN, "recipe.lr=1e-3,2e-3"),
            ("no `sbatch` on PATH",), "new", setup=_cluster(None)),
    Refusal("slurm_unreachable", "train.py", ("-m", "hydra/launcher=slurm", *TRAIN, "recipe.lr=1e-3,2e-3"),
            ("SLURM's controller cannot be reached", "Could not establish a configuration source"), "new",
            setup=_cluster("scontrol: fatal: Could not establish a configuration source")),
    Refusal("config_not_yaml", "train.py", ("--config-dir", "{tmp}/configs", *TRAIN, "data=broken", "hydra.run.dir={target}"),
            ("the config could not be composed", "{tmp}/configs/data/broken.yaml"), "new", setup=_broken_yaml),
]


# --- damaged inputs -----------------------------------------------------------------------------------------------
def _truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _config_a_list(path: Path) -> None:
    """A checkpoint, whole and loadable, whose config is a list (OmegaConf would fail deep inside on it)."""
    stored = torch.load(path, map_location="cpu", weights_only=True)
    stored["config"] = [1, 2]
    torch.save(stored, path)


def _config_value_out_of_range(path: Path) -> None:
    """A checkpoint, whole and loadable, whose config holds a value train.py refuses (a hand edit: model.img_size=-1),
    which timm would meet only deep inside building the model."""
    stored = torch.load(path, map_location="cpu", weights_only=True)
    stored["config"]["model"]["img_size"] = -1
    torch.save(stored, path)


DAMAGES: dict[str, Callable[[Path], None]] = {
    "truncated": _truncated,
    "empty": lambda p: p.write_bytes(b""),
    "random bytes": lambda p: p.write_bytes(random.Random(0).randbytes(97)),
    "wrong JSON type": lambda p: p.write_text("[1, 2]\n"),
    "a directory": _directory,
    # root reads any file whatever its mode: these cases are marked unprivileged
    "unreadable": lambda p: p.chmod(0),
    "config a list": _config_a_list,
    "config value out of range": _config_value_out_of_range,
}
# a torch or safetensors file: its header, whole or cut, is not JSON; an empty one is refused where a cut one is
BINARY_DAMAGES = ("truncated", "random bytes", "a directory", "unreadable")
TEXT_DAMAGES = ("truncated", "empty", "random bytes", "wrong JSON type", "a directory", "unreadable")


@dataclass(frozen=True)
class Reader:
    """A command that reads back files of ``folder`` (a copy of that shared input is ``{target}``)."""

    name: str
    program: str
    folder: str
    files: tuple[str, ...]
    args: tuple[str, ...]


OUT = "{tmp}/out"
READERS = [
    Reader("train", "train.py", "run", ("checkpoints/last.pt", "summary.json", "run.json", "metrics.jsonl"), RUN),
    Reader("pretrained", "train.py", "export", ("model.safetensors",),
           (*TRAIN, "model.pretrained=local-dir:{target}", f"hydra.run.dir={OUT}")),
    Reader("eval_checkpoint", "eval.py", "run", ("checkpoints/last.pt",), (CHECKPOINT, *SMALL_EVAL,
                                                                           f"hydra.run.dir={OUT}")),
    Reader("eval_again", "eval.py", "evaluated", ("eval/clean/last-model/eval_results.json",), (CHECKPOINT, *SMALL_EVAL)),
    Reader("eval_weights", "eval.py", "export", ("config.json", "model.safetensors"),
           ("model=vit_pico", "attention=quest", "weights=local-dir:{target}", "eval=clean", "data=fake",
            "data.img_size=16", "data.fake_val_size=16", f"hydra.run.dir={OUT}")),
    Reader("export", "quest-export", "run", ("checkpoints/last.pt", "summary.json"), ("{target}", "--out", OUT)),
    Reader("report", "quest-report", "evaluated", ("summary.json", "run.json", "eval/clean/last-model/eval_results.json"),
           ("{tmp}/runs", "--out", OUT)),
    Reader("report_old", "quest-report", "old", (".hydra/config.yaml",), ("{tmp}/runs", "--out", OUT)),
    Reader("plot", "quest-plot", "run", ("metrics.jsonl", "summary.json"), ("perf", "{target}", "--out",
                                                                          f"{OUT}/perf.png")),
    Reader("check", "quest-data", "images", ("train/.quest-preflight.json",), ("check", "{target}", "--no-progress",
                                                                                "--workers", "1")),
    Reader("check_shards", "quest-data", "shards", ("_info.json",), ("check", "{target}", "--no-progress", "--workers",
                                                                     "1")),
    Reader("cap", "quest-data", "capped", ("_capped.json", ".manifest.jsonl"),
           ("cap", "{images}", "{target}", "--short-side", "16", "--no-progress", "--workers", "1")),
    Reader("shards", SHARDS, "shards", (".manifest.jsonl", "_info.json"), ("convert", "{images}", "{target}",
                                                                         "--shard-size", "4")),
]


def damaged_cases() -> list[tuple[Reader, str, str]]:
    """(reader, file, damage): every file each command reads back x every damage of its kind, and a checkpoint
    whose config is a list or holds a value out of its range for every command that reads checkpoints."""
    cases = [(reader, name, damage) for reader in READERS for name in reader.files
             for damage in (BINARY_DAMAGES if name.endswith((".pt", ".safetensors")) else TEXT_DAMAGES)]
    cases += [(reader, "checkpoints/last.pt", damage) for reader in READERS for damage in ("config a list",
              "config value out of range") if reader.name in ("train", "eval_checkpoint", "export")]
    return cases


def damage(path: Path, how: str) -> None:
    assert path.is_file(), f"the shared input has no {path.name} to damage"
    DAMAGES[how](path)
