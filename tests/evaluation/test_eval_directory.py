"""Evaluations are immutable: a results directory holds the results of one key (checkpoint content, weights, suite
and the settings of its evaluations, transform, data roots read); a rerun with another key is refused before any
work and changes nothing, or archives the old results first (eval.overwrite=true); the same key is not evaluated
twice; ``eval_results.json`` says running / complete / partial, so a killed or failed evaluation never looks
complete, and what finished is kept and reused."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from quest.evaluation import register_eval_configs, run_evaluation, unregister_evaluation
from quest.evaluation.directory import (
    NOT_NUMBERS,
    EvalDirectory,
    EvalDirectoryError,
    fingerprint,
    fingerprint_key,
)
from quest.run.checkpoint import load_checkpoint, save_checkpoint
from quest.train import fit

from ..helpers import CONFIGS, compose_cfg, eval_cfg
from ..warm import _zygote, run_app

register_eval_configs()

BASE = ["eval=clean", "eval.clean.max_samples=40"]
# a module of two test evaluations: one that stalls (to be killed) and one that fails, each when told to; the
# stalling one writes its process id to the flag file (renamed into place: never read half written)
STEPS = textwrap.dedent('''
    import os, pathlib, time
    from quest.evaluation import register_evaluation

    @register_evaluation("stall_step")
    def stall_step(run, section):
        flag = os.environ.get("EVAL_TEST_STALL")
        if flag:
            pathlib.Path(flag + ".tmp").write_text(str(os.getpid()))
            os.replace(flag + ".tmp", flag)
            time.sleep(600)
        return {"top1": 50.0, "n": 2, "correct": 1}

    @register_evaluation("fail_step")
    def fail_step(run, section):
        if os.environ.get("EVAL_TEST_FAIL"):
            raise RuntimeError("fail_step was told to fail")
        return {"top1": 25.0, "n": 4, "correct": 1}
''')


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("run")
    fit(compose_cfg("data=digits", "model=vit_pico", "recipe=light", "data.batch_size=32", "trainer.epochs=1",
                    "trainer.max_steps=2", "trainer.log_every_n_steps=1"), run)
    return run


@pytest.fixture()
def ckpt(run_dir, tmp_path) -> Path:
    """A private copy of the checkpoint (some cases change its content)."""
    path = tmp_path / "checkpoints" / "last.pt"
    path.parent.mkdir()
    path.write_bytes((run_dir / "checkpoints" / "last.pt").read_bytes())
    return path


def _perturb(path: Path) -> None:
    state = load_checkpoint(path)
    name = next(k for k, v in state["model"].items() if v.is_floating_point())
    state["model"][name] = state["model"][name] + 0.5
    save_checkpoint(path, {k: v for k, v in state.items() if k != "format"})


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".eval.lock"}


# what changes the numbers (each must be refused, naming the key) ...
CHANGES = [
    (["eval.crop_pct=0.5"], "evaluated.crop_pct"),  # the example
    (["eval.interpolation=bilinear"], "evaluated.interpolation"),
    (["eval.clean.max_samples=30"], "settings.clean.max_samples"),
    (["eval.batch_size=7"], "settings.batch_size"),
    (["eval.precision=bf16"], "settings.precision"),
    (["data.val_fraction=0.3"], "evaluated.data_config.val_fraction"),  # applied to the checkpoint's data config
    (["data.split_seed=1"], "evaluated.data_config.split_seed"),
    ("perturb", "evaluated.checkpoint_sha256"),  # training went on: the same path, other weights
]


@pytest.mark.parametrize("change, key", CHANGES, ids=[k for _, k in CHANGES])
def test_a_rerun_with_other_numbers_is_refused_then_archived_on_request(ckpt, tmp_path, change, key):
    out = tmp_path / "out"
    first = run_evaluation(eval_cfg(f"checkpoint={ckpt}", *BASE), out)
    assert first["status"] == "complete"
    before = _snapshot(out)
    extra = [] if change == "perturb" else change
    if change == "perturb":
        _perturb(ckpt)
    with pytest.raises(EvalDirectoryError, match=rf"holds complete results of another evaluation; these differ "
                                                 rf"from the stored ones:\n(.|\n)*{key}(.|\n)*eval.overwrite=true"):
        run_evaluation(eval_cfg(f"checkpoint={ckpt}", *BASE, *extra), out)
    assert _snapshot(out) == before  # nothing written, nothing replaced

    second = run_evaluation(eval_cfg(f"checkpoint={ckpt}", *BASE, *extra, "eval.overwrite=true"), out)
    assert second["status"] == "complete" and second["key"] != first["key"]
    archived = list((out / ".replaced").iterdir())
    assert len(archived) == 1 and archived[0].name.endswith("-complete")
    kept = {name[len(".replaced/") + len(archived[0].name) + 1:]: data for name, data in _snapshot(out).items()
            if name.startswith(".replaced/")}
    assert kept == before  # the old results, byte for byte


# ... and what does not (the same key: nothing to do, nothing rewritten)
SAME = [[], ["eval.num_workers=0"], ["eval.log_every_n=3"], ["eval.log_every_s=0"], ["eval.torch_threads=1"],
        ["eval.device=cpu"], ["eval.crop_pct=1.0"]]  # 1.0: the digits recipe's own crop


@pytest.mark.parametrize("extra", SAME, ids=lambda e: e[0] if e else "identical")
def test_a_rerun_of_the_same_key_does_nothing(ckpt, tmp_path, extra):
    out = tmp_path / "out"
    first = run_evaluation(eval_cfg(f"checkpoint={ckpt}", *BASE), out)
    before = _snapshot(out)
    again = run_evaluation(eval_cfg(f"checkpoint={ckpt}", *BASE, *extra), out)
    assert again["already_complete"] and again["results"] == json.loads(json.dumps(first["results"]))
    assert _snapshot(out) == before


def test_a_moved_checkpoint_is_the_same_checkpoint(ckpt, tmp_path):
    """The key holds the checkpoint's content, not its path: a run directory moved elsewhere keeps its results."""
    out = tmp_path / "out"
    first = run_evaluation(eval_cfg(f"checkpoint={ckpt}", *BASE), out)
    moved = tmp_path / "moved" / "last.pt"
    moved.parent.mkdir()
    ckpt.rename(moved)
    again = run_evaluation(eval_cfg(f"checkpoint={moved}", *BASE), out)
    assert again.get("already_complete") and again["key"] == first["key"]


def test_eval_py_writes_no_hydra_record_beside_the_results():
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="eval", overrides=["eval=clean"], return_hydra_config=True)
    assert cfg.hydra.output_subdir is None  # eval_results.json records the command with the results


def _leaves(tree, prefix=()):
    if isinstance(tree, dict) and tree:
        for k, v in tree.items():
            yield from _leaves(v, (*prefix, k))
    else:
        yield prefix, tree


SETTINGS = OmegaConf.to_container(eval_cfg("eval=digits_robustness").eval, resolve=True)
# every scalar or list setting (sections without keys are not settings); run decides which sections count (below)
LEAVES = sorted(leaf for leaf in _leaves(SETTINGS) if leaf[0] != ("run",) and not isinstance(leaf[1], dict))


@settings(max_examples=150, deadline=None)
@given(leaf=st.sampled_from(LEAVES), value=st.one_of(st.integers(-3, 10**6), st.text(max_size=5), st.none(),
                                                     st.booleans(), st.lists(st.integers(0, 9), max_size=3)))
def test_the_key_changes_exactly_when_a_setting_that_changes_numbers_does(leaf, value):
    """Property over every key of the real schema: a setting of an evaluation that runs, or a shared setting
    other than the ones that change no number (device, workers, threads, logging), changes the key; the others
    (and roots and crop/interpolation, which enter as read and as resolved) do not."""
    path, old = leaf
    if value == old:
        return
    changed = json.loads(json.dumps(SETTINGS))
    node = changed
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    target, inputs = {"source": "checkpoint", "checkpoint_sha256": "ab", "crop_pct": 0.875}, {"data.root": "x"}
    differs = fingerprint_key(fingerprint(changed, target, inputs)) != fingerprint_key(fingerprint(SETTINGS, target,
                                                                                                   inputs))
    top = path[0]
    section = isinstance(SETTINGS[top], dict)
    expected = (top not in NOT_NUMBERS | {"roots", "crop_pct", "interpolation"}
                and (not section or top in SETTINGS["run"]))
    assert differs == expected, path


def test_the_evaluations_run_are_part_of_the_key():
    fewer = {**SETTINGS, "run": ["clean"]}
    target = {"source": "checkpoint", "checkpoint_sha256": "ab"}
    assert fingerprint_key(fingerprint(fewer, target, {})) != fingerprint_key(fingerprint(SETTINGS, target, {}))


@pytest.fixture()
def steps(tmp_path, monkeypatch):
    folder = tmp_path / "steps_pkg"
    folder.mkdir()
    (folder / "eval_test_steps.py").write_text(STEPS)
    monkeypatch.syspath_prepend(str(folder))
    register_eval_configs(["eval_test_steps"])
    yield folder
    for name in ("stall_step", "fail_step"):
        unregister_evaluation(name)
    sys.modules.pop("eval_test_steps", None)
    register_eval_configs()


def test_a_kill_during_a_rerun_never_leaves_results_looking_complete(ckpt, tmp_path, steps):
    out = tmp_path / "out"
    suite = [f"checkpoint={ckpt}", *BASE, "eval.run=[clean,stall_step]"]
    first = run_evaluation(eval_cfg(*suite), out)
    assert first["status"] == "complete"
    flag = tmp_path / "stalled"
    # eval.py with the test's evaluations as a user adds them (QUEST_EVAL_MODULES), forked from the warm zygote in a
    # thread of this process, which kills it (SIGKILL) once the rerun is inside its second evaluation, its first
    # result written: a killed process is the point, not a fresh interpreter
    env = {**os.environ, "PYTHONPATH": str(steps), "QUEST_EVAL_MODULES": "eval_test_steps", "EVAL_TEST_STALL": str(flag)}
    ran: dict = {}
    runner = threading.Thread(target=lambda: ran.update(proc=run_app(
        "eval.py", *suite, "eval.crop_pct=0.5", "eval.overwrite=true", f"hydra.run.dir={out}", cwd=tmp_path, env=env,
        timeout=600)))
    runner.start()
    try:
        while runner.is_alive() and not flag.exists():
            runner.join(0.1)
        assert flag.exists(), ran["proc"].stderr[-2000:] if "proc" in ran else "no start"
    finally:
        if flag.exists():
            os.kill(int(flag.read_text()), signal.SIGKILL)
        runner.join()
    assert ran["proc"].returncode == -signal.SIGKILL  # killed inside stall_step, not finished
    status, record = EvalDirectory(out).state()
    assert status == "interrupted" and record["status"] == "running"
    assert record["settings"]["crop_pct"] == 0.5 and set(record["results"]) == {"clean"}
    archived = [json.loads(p.read_text()) for p in (out / ".replaced").glob("*/eval_results.json")]
    assert [a["status"] for a in archived] == ["complete"] and archived[0]["settings"]["crop_pct"] is None

    run = tmp_path / "report_run"  # quest.report leaves the interrupted evaluation out
    (run / "eval" / "clean").mkdir(parents=True)
    # a copy: a link out of the run directory would be refused by the report (quest.store.files.inside_folder)
    shutil.copytree(out, run / "eval" / "clean" / "last-model")
    from quest.report.runs import _eval_metrics
    assert _eval_metrics(run)[0] == {}

    # the same command again: the finished clean pass is reused, the rest runs, the results are complete
    again = run_evaluation(eval_cfg(*suite, "eval.crop_pct=0.5"), out)
    assert again["status"] == "complete" and again["results"]["clean"] == record["results"]["clean"]
    assert again["results"]["stall_step"]["top1"] == 50.0


def test_a_failure_part_way_keeps_what_finished_marked_partial(ckpt, tmp_path, steps, monkeypatch):
    out = tmp_path / "out"
    suite = [f"checkpoint={ckpt}", *BASE, "eval.run=[clean,fail_step,stall_step]"]
    monkeypatch.setenv("EVAL_TEST_FAIL", "1")
    with pytest.raises(RuntimeError, match="told to fail"):
        run_evaluation(eval_cfg(*suite), out)
    status, record = EvalDirectory(out).state()
    assert status == "partial" and set(record["results"]) == {"clean"}
    assert record["error"] == {"evaluation": "fail_step", "message": "RuntimeError: fail_step was told to fail"}
    assert "- status: partial (fail_step failed" in (out / "eval_results.md").read_text()
    clean = run_evaluation(eval_cfg(f"checkpoint={ckpt}", *BASE), tmp_path / "alone")["results"]["clean"]
    assert record["results"]["clean"]["correct"] == clean["correct"] and record["results"]["clean"]["n"] == 40
    monkeypatch.delenv("EVAL_TEST_FAIL")
    again = run_evaluation(eval_cfg(*suite), out)
    assert again["status"] == "complete" and list(again["results"]) == ["clean", "fail_step", "stall_step"]


@pytest.mark.parametrize("content, message", [
    ("{\"results\": {\"clean\": ", r"eval_results.json is not valid JSON"),
    ("[]", r"eval_results.json holds a JSON list without a 'results' object"),
    ("{\"results\": {\"clean\": {\"top1\": 1}}}", r"older quest that did not record what they depend on"),
])
def test_unreadable_or_unkeyed_results_are_refused_naming_the_file(ckpt, tmp_path, content, message):
    out = tmp_path / "out"
    out.mkdir()
    (out / "eval_results.json").write_text(content)
    with pytest.raises(EvalDirectoryError, match=message) as info:
        run_evaluation(eval_cfg(f"checkpoint={ckpt}", *BASE), out)
    assert str(out) in str(info.value) and (out / "eval_results.json").read_text() == content
    report = run_evaluation(eval_cfg(f"checkpoint={ckpt}", *BASE, "eval.overwrite=true"), out)
    assert report["status"] == "complete"
    assert [p.read_text() for p in (out / ".replaced").glob("*/eval_results.json")] == [content]


def test_overwrite_archives_only_what_eval_py_wrote(ckpt, run_dir, tmp_path):
    """hydra.run.dir=<a training run>: eval.overwrite=true moves the results aside, never the run's own files."""
    out = tmp_path / "a_run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    (out / "checkpoints" / "last.pt").write_bytes(ckpt.read_bytes())
    run_evaluation(eval_cfg(f"checkpoint={ckpt}", *BASE), out)
    run_evaluation(eval_cfg(f"checkpoint={ckpt}", *BASE, "eval.crop_pct=0.5", "eval.overwrite=true"), out)
    (archive,) = (out / ".replaced").iterdir()
    assert sorted(p.name for p in archive.iterdir()) == ["eval.log", "eval_results.csv", "eval_results.json", "eval_results.md"]
    assert (out / "metrics.jsonl").read_text() == "{}\n" and (out / "checkpoints" / "last.pt").is_file()


def test_a_directory_in_use_is_refused(ckpt, tmp_path):
    out = tmp_path / "out"
    holder = EvalDirectory(out)
    holder.lock()
    try:
        with pytest.raises(EvalDirectoryError, match="being written by another eval.py"):
            run_evaluation(eval_cfg(f"checkpoint={ckpt}", *BASE), out)
    finally:
        holder.unlock()
    assert not (out / "eval_results.json").exists()


def test_the_results_record_the_data_roots_settings_and_command(ckpt, tmp_path):
    report = run_evaluation(eval_cfg(f"checkpoint={ckpt}", *BASE), tmp_path / "out",
                            overrides=[f"checkpoint={ckpt}", *BASE])
    stored = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert stored["inputs"] == {"data.root": "built-in data set digits (val split)"}
    assert stored["command"] == [f"checkpoint={ckpt}", *BASE] and stored["settings"]["clean"]["max_samples"] == 40
    assert stored["target"]["checkpoint_sha256"] == __import__("hashlib").sha256(ckpt.read_bytes()).hexdigest()
    assert stored["target"]["data_config"]["val_fraction"] == 0.2 and stored["key"] == report["key"]


def _directory_worker(rank: int, world: int, port: int, ckpt: str, out: str, log: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    register_eval_configs()
    seen = []
    for extra in ([], ["eval.crop_pct=0.5"], []):
        try:
            seen.append(run_evaluation(eval_cfg(f"checkpoint={ckpt}", *BASE, "eval.device=cpu", *extra), out)
                        .get("already_complete", "evaluated"))
        except EvalDirectoryError:
            seen.append("refused")
    Path(f"{log}.{rank}").write_text(json.dumps(seen))


@pytest.mark.slow
def test_every_process_of_a_group_follows_the_directory_decision(ckpt, tmp_path):
    """torchrun: the main process decides (and alone writes); the others follow it instead of waiting in a
    collective: evaluated, refused, then nothing to do, on both ranks."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # two processes of a group, not two fresh interpreters: each is forked from the warm zygote (tests/warm.py;
    # _zygote() sets its preload before multiprocessing's one forkserver starts, so no child imports torch again)
    _zygote()
    mp.start_processes(_directory_worker, args=(2, port, str(ckpt), str(tmp_path / "out"), str(tmp_path / "seen")),
                       nprocs=2, join=True, start_method="forkserver")
    for rank in (0, 1):
        assert json.loads((tmp_path / f"seen.{rank}").read_text()) == ["evaluated", "refused", True]
    assert json.loads((tmp_path / "out" / "eval_results.json").read_text())["world_size"] == 2
