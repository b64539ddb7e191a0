"""Damaged inputs through every reader and every entry point (issue 48, item 5): each file a command reads back,
cut short, emptied, overwritten with random bytes, of the wrong JSON type, a directory in its place or (not as root)
unreadable, gives one error line naming the file and a documented exit code (1, or a tool's 2), or is read right or
repaired (0); never exit 70 (a bug), never a traceback.

The commands run in this process, inside the error path their console scripts use (quest.runtime.errors.reporting_errors),
on copies of one tiny run, its export and a few data folders."""
from __future__ import annotations

import contextlib
import io
import random
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch

from quest.evaluation import register_eval_configs, run_evaluation
from quest.runtime.errors import EXIT_BUG, reporting_errors

from ..helpers import FAST, compose_cfg, eval_cfg
from ..interop_helpers import make_image_folder

MAX_STEPS = "trainer.max_steps=1"

register_eval_configs()


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


DAMAGES: dict[str, Callable[[Path], None]] = {
    "truncated": _truncated,
    "empty": lambda p: p.write_bytes(b""),
    "random bytes": lambda p: p.write_bytes(random.Random(0).randbytes(97)),
    "wrong JSON type": lambda p: p.write_text("[1, 2]\n"),
    "a directory": _directory,
    # root reads any file whatever its mode: these cases are marked unprivileged (skipped where permissions do not
    # bind; .ci/run runs them again without root's capability to override them)
    "unreadable": lambda p: p.chmod(0),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """One finished tiny run (a step of vit_pico), its export, an image folder, a capped copy and shards of it."""
    from quest.tools.data_check import main as data_main
    from quest.tools.export import export_run
    from quest.tools.make_shards import main as shards_main
    from quest.train import fit

    base = tmp_path_factory.mktemp("fuzz")
    fit(compose_cfg(*FAST, MAX_STEPS), base / "runs" / "run")
    export_run(base / "runs" / "run", base / "export", "model")
    run_evaluation(eval_cfg(f"checkpoint={base / 'runs' / 'run' / 'checkpoints' / 'last.pt'}", "eval=clean"),
                   base / "runs" / "run" / "eval" / "clean" / "last-model")
    # a run of before run.json: quest-report reads Hydra's copy of its config
    old = Path(shutil.copytree(base / "runs" / "run", base / "old" / "run"))
    (old / "run.json").unlink()
    (old / ".hydra").mkdir()
    (old / ".hydra" / "config.yaml").write_text("model:\n  name: vit_pico_patch4_16\n")
    images = make_image_folder(base / "images", per_class=2, size=20)
    with contextlib.redirect_stdout(io.StringIO()):
        assert data_main(["cap", str(images), str(base / "capped"), "--short-side", "16", "--no-progress",
                          "--workers", "1"]) == 0
        assert data_main(["check", str(images), "--no-progress", "--workers", "1"]) == 0
        shards_main(["convert", str(images), str(base / "shards"), "--shard-size", "4"])
    return {"base": base, "run": base / "runs" / "run", "old": old, "export": base / "export", "images": images,
            "capped": base / "capped", "shards": base / "shards"}


def _train(copy: Path, world: dict[str, Path], out: Path) -> int:
    from quest.train import exit_code, fit

    return exit_code(fit(compose_cfg(*FAST, MAX_STEPS), copy))


def _pretrained(copy: Path, world: dict[str, Path], out: Path) -> int:
    from quest.train import exit_code, fit

    return exit_code(fit(compose_cfg(*FAST, MAX_STEPS, f"model.pretrained=local-dir:{copy}"), out))


def _eval_checkpoint(copy: Path, world: dict[str, Path], out: Path) -> int:
    run_evaluation(eval_cfg(f"checkpoint={copy / 'checkpoints' / 'last.pt'}", "eval=clean"), out)
    return 0


def _eval_again(copy: Path, world: dict[str, Path], out: Path) -> int:
    """eval.py into the run's evaluation directory, where an earlier evaluation left its results."""
    run_evaluation(eval_cfg(f"checkpoint={copy / 'checkpoints' / 'last.pt'}", "eval=clean"),
                   copy / "eval" / "clean" / "last-model")
    return 0


def _eval_weights(copy: Path, world: dict[str, Path], out: Path) -> int:
    run_evaluation(eval_cfg("model=vit_pico", "attention=quest", f"weights=local-dir:{copy}", "eval=clean",
                            "data=fake", "data.img_size=16", "data.fake_val_size=16"), out)
    return 0


def _export(copy: Path, world: dict[str, Path], out: Path) -> int:
    from quest.tools.export import main

    return main([str(copy), "--out", str(out)])


def _report(copy: Path, world: dict[str, Path], out: Path) -> int:
    from quest.report.__main__ import main

    return main([str(copy.parent), "--out", str(out)])


def _plot(copy: Path, world: dict[str, Path], out: Path) -> int:
    from quest.report.plot import main

    return main(["perf", str(copy), "--out", str(out / "perf.png")])


def _check(copy: Path, world: dict[str, Path], out: Path) -> int:
    from quest.tools.data_check import main

    return main(["check", str(copy), "--no-progress", "--workers", "1"])


def _cap(copy: Path, world: dict[str, Path], out: Path) -> int:
    from quest.tools.data_check import main

    return main(["cap", str(world["images"]), str(copy), "--short-side", "16", "--no-progress", "--workers", "1"])


def _shards(copy: Path, world: dict[str, Path], out: Path) -> int:
    from quest.tools.make_shards import main

    main(["convert", str(world["images"]), str(copy), "--shard-size", "4"])
    return 0


# (program, the folder of the world it works on, the files it reads back there, the command)
ENTRIES = [
    ("train.py", "run", ["checkpoints/last.pt", "summary.json", "run.json", "metrics.jsonl"], _train),
    ("train.py", "export", ["model.safetensors"], _pretrained),
    ("eval.py", "run", ["checkpoints/last.pt"], _eval_checkpoint),
    ("eval.py", "run", ["eval/clean/last-model/eval_results.json"], _eval_again),
    ("eval.py", "export", ["config.json", "model.safetensors"], _eval_weights),
    ("quest-export", "run", ["checkpoints/last.pt", "summary.json"], _export),
    ("quest-report", "run", ["summary.json", "run.json", "eval/clean/last-model/eval_results.json"], _report),
    ("quest-report", "old", [".hydra/config.yaml"], _report),
    ("quest-plot", "run", ["metrics.jsonl", "summary.json"], _plot),
    ("quest-data", "images", ["train/.quest-preflight.json"], _check),
    ("quest-data", "shards", ["_info.json"], _check),
    ("quest-data", "capped", ["_capped.json", ".manifest.jsonl"], _cap),
    ("python -m quest.tools.make_shards", "shards", [".manifest.jsonl", "_info.json"], _shards),
]
# a torch or safetensors file: its header, whole or cut, is not JSON; an empty one is refused where a cut one is
BINARY_DAMAGES = ["truncated", "random bytes", "a directory", "unreadable"]
CASES = [pytest.param(program, folder, name, damage, command, id=f"{command.__name__[1:]}-{name}-{damage}",
                      marks=[pytest.mark.unprivileged] if damage == "unreadable" else [])
         for program, folder, names, command in ENTRIES for name in names
         for damage in (BINARY_DAMAGES if name.endswith((".pt", ".safetensors")) else DAMAGES)]
CASES += [pytest.param(program, "run", "checkpoints/last.pt", "config a list", command,
                       id=f"{command.__name__[1:]}-last.pt-config a list")
          for program, command in [("train.py", _train), ("eval.py", _eval_checkpoint), ("quest-export", _export)]]


def _outcome(program: str, command: Callable[[], int]) -> tuple[int, str, str]:
    """The exit code, stdout and stderr of ``command`` run as its console script runs it."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            with reporting_errors(program):
                code = command()
        except SystemExit as exc:
            code = exc.code
    return int(code or 0), out.getvalue(), err.getvalue()


@pytest.mark.parametrize("program, folder, name, damage, command", CASES)
def test_a_damaged_input_is_one_message_naming_it_never_a_bug(world, tmp_path, monkeypatch, program, folder, name,
                                                              damage, command):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # what a user sees: no traceback for their error
    copy = Path(shutil.copytree(world[folder], tmp_path / "runs" / folder, symlinks=True))
    path = copy / name
    assert path.is_file(), f"the fixture has no {name} in {folder}"
    (_config_a_list if damage == "config a list" else DAMAGES[damage])(path)
    code, out, err = _outcome(program, lambda: command(copy, world, tmp_path / "out"))
    assert code != EXIT_BUG and "Traceback" not in err, err[-3000:]
    assert code in (0, 1, 2), err[-3000:]  # read right or repaired, or refused with the error path's codes
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) <= 1 and all(line.startswith(f"{program}") for line in errors), err[-3000:]
    if code:  # refused, or (quest-data: 1) ran and reported problems: the file is named
        assert name.split("/")[-1] in (errors[0] if errors else out), (out + err)[-3000:]


def test_a_run_directory_name_too_long_for_the_file_system_is_one_message(tmp_path, monkeypatch):
    """Hydra makes the directory before quest runs: its OSError, chained through Hydra's, is one line naming it."""
    from quest.cli import train

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.chdir(tmp_path)
    long = tmp_path / ("x" * 300)
    monkeypatch.setattr("sys.argv", ["train.py", *FAST, MAX_STEPS, f"hydra.run.dir={long}"])
    code, out, err = _outcome("train.py", train)
    assert code == 1 and "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "x" * 100 in errors[0], err[-3000:]


def test_a_summary_with_a_field_of_the_wrong_type_is_kept_aside_on_resume_naming_the_field(world, tmp_path):
    """summary.json's step a string: not believed (the finished run is not taken as finished), kept aside with the
    field named, and written again by the resumed run."""
    import json

    from quest.train import fit

    copy = Path(shutil.copytree(world["run"], tmp_path / "run"))
    summary = json.loads((copy / "summary.json").read_text())
    (copy / "summary.json").write_text(json.dumps({**summary, "step": "1"}))
    assert fit(compose_cfg(*FAST, MAX_STEPS), copy)["step"] == 1
    why = "".join(p.read_text() for p in copy.glob(".replaced/*/why.txt"))
    assert "summary.json: damaged: step is str '1', expected an integer" in why, why
    assert json.loads((copy / "summary.json").read_text())["step"] == 1
