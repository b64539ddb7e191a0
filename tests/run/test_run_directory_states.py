"""The run directory as a state machine (quest.run.plan): a run stopped at any point, with any one of its
files missing, cut short at any byte, or replaced with garbage, either resumes exactly (the same weights and the
same metrics rows as a run that was never stopped) or is refused with a message that names the file, leaving the
directory byte for byte as it was. Nothing is ever deleted or overwritten without being kept in .replaced/ first.

A matrix over every file x fault x stopped state. Each refusal of a start (another config, trainer.resume=never, a
held or unwritable directory, a bad value, through train.py with Hydra's record and train.log) is a row of the
refusal contract (tests/runtime/test_refusal_contract.py)."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from omegaconf import OmegaConf

from quest.config.checks import ConfigError
from quest.train import fit
from quest.train.trainer import Run

from ..helpers import FAST, compose_cfg

# 2 epochs of 4 steps; a checkpoint at steps 3 and 6 and at each epoch's end (4, 8); best.pt from epoch 1 on
CONFIG = [*FAST, "trainer.epochs=2", "trainer.checkpoint_every_n_steps=3"]
STEPS = 8
FILES = ["checkpoints/last.pt", "checkpoints/best.pt", "metrics.jsonl", "summary.json", "run.json", ".lock",
         ".hydra/config.yaml", ".hydra/overrides.yaml", "train.log"]
FAULTS = ["missing", "truncated", "garbage"]
#: files whose loss or damage never stops a run: each is rebuilt, kept aside or carries no state
REPAIRABLE = {"metrics.jsonl", "summary.json", "run.json", ".lock", ".hydra/config.yaml", ".hydra/overrides.yaml",
              "train.log", "checkpoints/best.pt"}
#: what a user would lose: each must survive a start, in place (the same bytes, or the same bytes continued) or in
#: .replaced/
RESULTS = ["metrics.jsonl", "summary.json"]


def _fit(run_dir: Path, *overrides: str) -> dict:
    cfg = compose_cfg(*CONFIG, *overrides)
    record = {".hydra/config.yaml": OmegaConf.to_yaml(cfg), ".hydra/overrides.yaml": "- " + "\n- ".join(overrides)}
    return fit(cfg, run_dir, provenance=record)


def wall_clock(key: str) -> bool:
    """A metric measured with a clock (rates, data wait, step time, peak memory): it differs between two runs."""
    return key == "train/img_per_s" or key.startswith("perf/")


def _rows(run_dir: Path) -> dict[tuple, float]:
    """Every metrics row by (step, keys), with its values except the wall-clock ones."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        key = (row["step"], tuple(sorted(row)))
        assert key not in out, f"metrics row logged twice: {key}"
        out[key] = {k: v for k, v in row.items() if not wall_clock(k)}
    return out


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    return {**{f"model.{k}": v for k, v in ckpt["model"].items()}, **{f"ema.{k}": v for k, v in ckpt["ema"].items()}}


def _files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _digest(run_dir: Path) -> dict[str, str]:
    return {name: hashlib.sha256(data).hexdigest() for name, data in _files(run_dir).items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A run that was never stopped."""
    run_dir = tmp_path_factory.mktemp("reference")
    assert _fit(run_dir)["status"] == "completed"
    return _weights(run_dir), _rows(run_dir)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run directory as a run stopped at ``step`` left it, by a crash (a kill -9 after the step's rows were
    logged) or at trainer.max_steps; one per (mode, step), copied for each test."""
    made: dict[tuple[str, int], Path] = {}

    def make(mode: str, step: int) -> Path:
        if (mode, step) not in made:
            run_dir = tmp_path_factory.mktemp(f"{mode}{step}")
            if mode == "crash":
                train_step = Run.train_step

                def crash(self, batches, **kw):
                    if self.state.step == step:
                        raise RuntimeError("simulated crash")
                    return train_step(self, batches, **kw)

                with mock.patch.object(Run, "train_step", crash), pytest.raises(RuntimeError, match="simulated"):
                    _fit(run_dir)
            else:
                assert _fit(run_dir, f"trainer.max_steps={step}")["status"] == "stopped"
            made[mode, step] = run_dir
        return made[mode, step]

    return make


def _damage(path: Path, fault: str, cut: float, seed: int) -> None:
    if fault == "missing":
        path.unlink()
    elif fault == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[:int(cut * len(data))])  # 0 .. len-1 bytes: always shorter
    else:
        rng = torch.Generator().manual_seed(seed)
        size = max(path.stat().st_size, 16)
        path.write_bytes(bytes(torch.randint(0, 256, (size,), generator=rng, dtype=torch.uint8).tolist()))


def _kept(data: bytes, run_dir: Path) -> bool:
    """``data`` is somewhere under .replaced/ (a file kept aside or archived)."""
    return any(p.is_file() and p.read_bytes() == data for p in (run_dir / ".replaced").rglob("*"))


# The states a file is damaged in: (how the run stopped, at which step, where a truncated file is cut, the seed of
# the garbage). Every file there: killed right after the epoch-1 checkpoint (last.pt and best.pt the same state, rows
# of step 5 logged after it), and stopped at step 7 (last.pt at 7, best.pt at 4, a final summary.json). Then the
# earliest state each file is there in: killed at step 1, before any checkpoint (the run starts again from nothing;
# a cut at 0 leaves an empty file), or stopped at the first checkpoint (step 3, before epoch 1 ended). These are
# what hypothesis ran (max_examples=1, derandomized: beside the two named examples, always the same one, the
# simplest that passed its assume()), written out as the cases they are.
LATE = [("crash", 5, 0.5, 1), ("stopped", 7, 0.3, 2)]
EARLY = [("crash", 1, 0.0, 0), ("stopped", 3, 0.68, 551)]


def _there(name: str, mode: str, step: int) -> bool:
    """Whether the run directory has the file: summary.json once a run stopped (a crash writes none), last.pt from
    the first checkpoint (step 3) on, best.pt once epoch 1's end (after step 4) was checkpointed."""
    return {"summary.json": mode == "stopped", "checkpoints/last.pt": step >= 3,
            "checkpoints/best.pt": step >= 5}.get(name, True)


CASES = [(name, fault, *state) for name in FILES for fault in FAULTS
         for state in [s for s in LATE if _there(name, *s[:2])] + [s for s in EARLY if _there(name, *s[:2])][:1]]


@pytest.mark.slow
@pytest.mark.parametrize("name, fault, mode, step, cut, seed", CASES,
                         ids=[f"{m}{s}-{n}-{f}" for n, f, m, s, _, _ in CASES])
def test_any_file_missing_cut_or_garbage_resumes_exactly_or_is_refused_naming_it(
        tmp_path_factory, reference, stopped, name, fault, mode, step, cut, seed):
    run_dir = tmp_path_factory.mktemp("case") / "run"
    shutil.copytree(stopped(mode, step), run_dir)
    target = run_dir / name
    assert target.exists(), f"{name} is not there to damage at {mode} step {step}"
    before = _files(run_dir)
    _damage(target, fault, cut, seed)
    damaged = target.read_bytes() if target.exists() else None
    digest = _digest(run_dir)
    try:
        summary = _fit(run_dir)
    except ConfigError as exc:
        assert name not in REPAIRABLE, f"{name} {fault} at {mode} step {step} was refused: {exc}"
        assert Path(name).name in str(exc), f"the refusal does not name {name}: {exc}"
        assert "trainer.overwrite=true" in str(exc)  # and says how to go on
        assert _digest(run_dir) == digest, "a refused command changed the run directory"
        return
    # resumed: exactly the run that was never stopped
    weights, rows = reference
    assert summary["status"] == "completed" and summary["step"] == STEPS
    got = _weights(run_dir)
    assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in weights)
    assert _rows(run_dir) == rows
    # never a silent restart: a run that had a checkpoint continued from one
    history = json.loads((run_dir / "run.json").read_text())["history"]
    had_checkpoint = any(n.startswith("checkpoints/") and n.endswith(".pt") for n in before)
    assert (history[-1]["event"] == "resume") == had_checkpoint, history
    # nothing lost: each result is where it was (continued) or kept aside, and so is the damaged file
    after = _files(run_dir)
    for result in RESULTS:
        if before.get(result) and result != name:
            old = before[result]
            assert after.get(result, b"").startswith(old) or _kept(old, run_dir), f"{result} was lost"
    if damaged and name in RESULTS + ["run.json", "checkpoints/best.pt"]:
        assert _kept(damaged, run_dir), f"the damaged {name} was not kept aside"


@pytest.mark.parametrize("content", [b"[]", b"", b"{\"status\": ", b"\xff\xfe garbage", b"null", b"3"])
def test_a_summary_or_record_of_another_shape_is_kept_aside_not_a_traceback(tmp_path, stopped, content):
    """summary.json / run.json holding JSON of another type (an array, a number) or no JSON at all."""
    shutil.copytree(stopped("stopped", 3), tmp_path, dirs_exist_ok=True)  # trainer.max_steps=3, trained once
    for name in ("summary.json", "run.json"):
        (tmp_path / name).write_bytes(content)
    summary = _fit(tmp_path)
    assert summary["status"] == "completed" and summary["resumed"]
    assert sum(p.read_bytes() == content for p in (tmp_path / ".replaced").rglob("*.json")) == 2
    why = next((tmp_path / ".replaced").rglob("why.txt")).read_text()
    assert "summary.json: damaged" in why and "run.json: damaged" in why


def test_last_checkpoint_missing_beside_best_metrics_and_summary_is_refused_not_restarted(tmp_path):
    """The issue's example: last.pt gone while best.pt, metrics.jsonl and summary.json are there."""
    _fit(tmp_path, "trainer.max_steps=6")
    (tmp_path / "checkpoints" / "last.pt").unlink()
    digest = _digest(tmp_path)
    with pytest.raises(ConfigError, match=r"(?s)last\.pt is missing.*best\.pt \(step 4\).*cp .*best\.pt.*last\.pt"):
        _fit(tmp_path)
    assert _digest(tmp_path) == digest
    # the way out it names: continue from best.pt; what was logged after it is kept aside
    shutil.copy(tmp_path / "checkpoints" / "best.pt", tmp_path / "checkpoints" / "last.pt")
    stopped_summary = (tmp_path / "summary.json").read_bytes()
    assert _fit(tmp_path)["status"] == "completed"
    assert _kept(stopped_summary, tmp_path)
    assert [s for s, _ in _rows(tmp_path)].count(5) == 1  # step 5 logged once, by the resumed run


def test_a_summary_with_a_field_of_the_wrong_type_is_kept_aside_on_resume_naming_the_field(tmp_path, stopped):
    """summary.json's step a string: not believed (the stopped run is not taken as stopped), kept aside with the
    field named, and written again by the resumed run."""
    shutil.copytree(stopped("stopped", 3), tmp_path, dirs_exist_ok=True)  # trainer.max_steps=3, trained once
    summary = json.loads((tmp_path / "summary.json").read_text())
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "step": "3"}))
    assert _fit(tmp_path, "trainer.max_steps=3")["step"] == 3
    why = "".join(p.read_text() for p in tmp_path.glob(".replaced/*/why.txt"))
    assert "summary.json: damaged: step is str '3', expected an integer" in why, why
    assert json.loads((tmp_path / "summary.json").read_text())["step"] == 3


def test_a_resume_that_cannot_keep_a_file_aside_puts_back_what_it_had_moved(tmp_path, stopped):
    """Files kept aside on a resume go all or nothing (quest.store.tree.move_aside): when the second cannot be moved
    into .replaced/, the first is put back, and the error says which file could not be moved and why."""
    shutil.copytree(stopped("stopped", 3), tmp_path, dirs_exist_ok=True)  # trainer.max_steps=3, trained once
    for name in ("summary.json", "run.json"):
        (tmp_path / name).write_bytes(b"[]")
    rename, aside = os.rename, []

    def refused_second(source, target):
        if ".replaced" in Path(target).parts:
            aside.append(source)
            if len(aside) == 2:
                raise PermissionError(errno.EACCES, "Permission denied", str(source))
        return rename(source, target)

    with mock.patch("os.rename", refused_second), pytest.raises(OSError, match=r"cannot replace .*Permission denied"):
        _fit(tmp_path)
    assert len(aside) == 2
    assert all((tmp_path / name).read_bytes() == b"[]" for name in ("summary.json", "run.json"))
    assert not [p for p in (tmp_path / ".replaced").rglob("*") if p.is_file()]


def test_a_run_json_of_another_run_is_kept_aside_and_written_again_from_the_checkpoint(tmp_path, stopped):
    """run.json copied from another run (another learning rate, which no resume changes) is not this run's history:
    kept aside, saying why, and written again from the checkpoint; the run resumes."""
    shutil.copytree(stopped("stopped", 3), tmp_path, dirs_exist_ok=True)  # trainer.max_steps=3, trained once
    record = json.loads((tmp_path / "run.json").read_text())
    record["config"]["recipe"]["lr"] = 0.5
    foreign = json.dumps(record).encode()
    (tmp_path / "run.json").write_bytes(foreign)
    assert _fit(tmp_path, "trainer.max_steps=5")["step"] == 5
    assert _kept(foreign, tmp_path)
    why = "".join(p.read_text() for p in tmp_path.glob(".replaced/*/why.txt"))
    assert "run.json: of another run" in why and "recipe.lr" in why, why
    rebuilt = json.loads((tmp_path / "run.json").read_text())
    assert rebuilt["config"]["recipe"]["lr"] != 0.5
    assert [e["event"] for e in rebuilt["history"]] == ["resume"] and "rebuilt" in rebuilt["history"][0]["note"]


def test_a_run_stopped_at_max_steps_is_told_to_raise_max_steps_to_train_longer(tmp_path, stopped, caplog):
    """Stopped at trainer.max_steps with epochs left: more epochs would change nothing, more steps would."""
    shutil.copytree(stopped("stopped", 3), tmp_path, dirs_exist_ok=True)  # trainer.max_steps=3, trained once
    caplog.set_level("INFO", logger="quest.train")
    assert _fit(tmp_path, "trainer.max_steps=3")["already_finished"]
    assert "to train it longer: trainer.max_steps=<more> (or null)" in caplog.text
