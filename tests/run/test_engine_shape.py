"""The training engine's ownership rules (docs/training.md, "Who owns what"), checked on the source so that a change
that breaks them fails here instead of in review: the run's counters change only inside quest/run/train_state.py,
and Run (quest/train/trainer.py) neither logs nor saves, so nothing below the loop calls back up into it."""
from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import pytest

from quest.run.train_state import TrainState

QUEST = Path(__file__).resolve().parents[2] / "quest"
FIELDS = {f.name for f in fields(TrainState)}


def _state_like(node: ast.expr) -> bool:
    """``st``, ``state`` or ``<anything>.state``: how quest names a TrainState."""
    return (isinstance(node, ast.Name) and node.id in {"st", "state"}) or (
        isinstance(node, ast.Attribute) and node.attr == "state")


def _writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every assignment to a TrainState field, or of a ``.state`` to a TrainState built from
    values."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(t, ast.Attribute) and t.attr in FIELDS and _state_like(t.value):
                    found.append((t.lineno, ast.unparse(t)))
                value = node.value if isinstance(node, ast.Assign) else None
                # a new run's TrainState() is its start; one built from values replaces the counters
                if (isinstance(t, ast.Attribute) and t.attr == "state" and isinstance(value, ast.Call)
                        and ast.unparse(value.func) == "TrainState" and (value.args or value.keywords)):
                    found.append((t.lineno, ast.unparse(t)))
    return found


def test_the_scan_finds_writes_to_the_counters():
    # the rule's own reference: each form a counter could be changed in is found, reads are not
    source = ("st.step += 1\nself.state.epoch = 3\nrun.state.best_top1, run.state.best_epoch = 1.0, 2\n"
              "x = st.step\nself.state = TrainState(**saved)\nself.sampler.epoch = 1\nself.state = TrainState()\n")
    assert [what for _, what in _writes(ast.parse(source))] == [
        "st.step", "self.state.epoch", "run.state.best_top1", "run.state.best_epoch", "self.state"]


def test_only_progress_changes_the_run_counters():
    offenders = [f"{path.relative_to(QUEST.parent)}:{line}: {what}"
                 for path in sorted(QUEST.rglob("*.py")) if path.name != "progress.py"
                 for line, what in _writes(ast.parse(path.read_text()))]
    assert offenders == [], "change TrainState through its methods (quest/run/train_state.py): " + "; ".join(offenders)


def test_run_neither_logs_nor_saves():
    tree = ast.parse((QUEST / "engine" / "trainer.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not imported & {"logger", "loop", "lifecycle"}, imported
    run = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Run")
    calls = {ast.unparse(n.func) for n in ast.walk(run) if isinstance(n, ast.Call)}
    assert not [c for c in calls if c.endswith((".log", ".save")) or "logger" in c], calls
    params = {a.arg for n in ast.walk(run) if isinstance(n, ast.FunctionDef) for a in n.args.args}
    assert "logger" not in params


def test_train_state_round_trips_and_refuses_keys_it_does_not_know():
    st = TrainState()
    st.drew_batch()
    st.took_step()
    st.saw_images(8)
    st.trained_for(1.5)
    st.add_drawn(1, 9)
    assert st.validated(50.0) and not st.validated(50.0) and st.validated(60.0)
    st.end_epoch()
    st.logs_to("abc")
    saved = st.state_dict()
    wall = saved["attempts"][0]["wall_s"]  # this attempt's wall time so far: a clock
    assert wall >= 0
    assert saved == {"step": 1, "epoch": 1, "micro_in_epoch": 0, "best_top1": 60.0, "best_epoch": 0,
                     "images_seen": 8, "train_seconds": 1.5, "wandb_id": "abc", "train_skipped": 1, "train_drawn": 9,
                     "attempts": [{"first_step": 0, "steps": 1, "images": 8, "train_s": 1.5, "wall_s": wall,
                                   "compile_s": 0.0, "compile_steps": 0, "loader_start_s": 0.0, "figures": {}}]}
    again = TrainState(step=99, epoch=7)
    again.load_state_dict({"step": 1})  # a key missing from an older state: today's default, not the old value
    assert again == TrainState(step=1)
    again.load_state_dict(saved)
    assert again == st
    with pytest.raises(ValueError, match=r"\['lr'\]"):
        again.load_state_dict({**saved, "lr": 0.1})
