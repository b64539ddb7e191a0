"""Messages and docs name only settings that exist: every ``key=value`` a document (docs/, README.md) or a string of
quest's code (error messages, advice lines) names, with a dotted key or a config group, passes the override check of
train.py, eval.py or the toy study (quest.config.overrides: the key is in that app's schema, the group has that option).
The examples of refused input that the docs and messages show on purpose are listed, and each must be refused."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from quest.cli import config_root
from quest.config.hydra_store import register_configs
from quest.config.overrides import app_groups, default_options, override_problems
from quest.config.schema import TrainConfig
from quest.evaluation import register_eval_configs
from quest.evaluation.config import eval_config_schema
from quest.toy.config import ToyConfig

ROOT = Path(__file__).resolve().parents[2]
TOKEN = re.compile(r"(?<![\w.$/-])(\+{0,2}[a-z_]\w*(?:\.\w+)*=[^\s`'\",;)|]+)")
#: shown as input that is refused (typos in "Bad input", the override check's own examples): each must be refused
REFUSED_EXAMPLES = {"trainer.epoch=3", "+recipe.lrr=0.1", "attention=flash", "data.widht=2",
                    "+eval.adversarial.pgd.stepz=3", "eval.adversarial.pgd.stepz=3", "++eval.roots.v3=/x"}
#: docs/evaluation.md's example plugin registers this evaluation in the reader's own package
PLUGIN_EXAMPLE = ("eval=topk_folder", "eval.topk_folder.", "+eval.topk_folder.")
#: placeholders and non-settings (a partial key quoted from a protocol's message)
NOT_SETTINGS = {"attention=A", "attention=name", "group.key=value", "data.width=2?", "fgsm.eps=[0.0]",
                "cpp.vec_isa_ok=False", "eval=explain."}


@pytest.fixture(scope="module")
def apps():
    register_configs()
    register_eval_configs()
    root = config_root()
    return [(TrainConfig, app_groups(root, "train"), default_options(root, "train")),
            (eval_config_schema(), app_groups(root, "eval"), default_options(root, "eval")),
            (ToyConfig, app_groups(root / "toy", "toy"), default_options(root / "toy", "toy"))]


def _doc_tokens() -> set[str]:
    found = set()
    for path in [*ROOT.glob("docs/*.md"), ROOT / "README.md"]:
        text = path.read_text()
        for span in re.findall(r"`([^`\n]+)`", text) + re.findall(r"```bash\n(.*?)```", text, re.S):
            found.update(TOKEN.findall(span))
    return found


def _code_tokens() -> set[str]:
    found = set()
    for path in (ROOT / "quest").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.update(TOKEN.findall(node.value))
    return found


def _settings(tokens: set[str], groups: set[str]) -> list[str]:
    """The tokens that name a setting: a dotted key or a config group (a Python keyword argument, ``dim=1``, or
    a placeholder, ``<run>``, is not one)."""
    out = []
    for token in sorted(tokens):
        key = token.lstrip("+~").split("=")[0]
        if ("." in key or key in groups) and not re.search(r"[<{$]|\.\.\.", token) and not key.startswith("hydra."):
            out.append(token)
    return out


@pytest.mark.parametrize("where", ["docs", "code"])
def test_every_setting_a_doc_or_a_message_names_exists(where, apps):
    groups = set().union(*(g for _, g, _ in apps))
    tokens = _settings(_doc_tokens() if where == "docs" else _code_tokens(), groups)
    assert len(tokens) > (100 if where == "docs" else 20)  # the extraction finds what is there
    wrong = [t for t in tokens if t not in REFUSED_EXAMPLES | NOT_SETTINGS and not t.startswith(PLUGIN_EXAMPLE)
             and all(override_problems([t], schema, g, d) for schema, g, d in apps)]
    assert wrong == [], f"named in {where} but refused by every app's override check: {wrong}"


def test_the_refused_examples_are_refused(apps):
    for token in REFUSED_EXAMPLES:
        assert all(override_problems([token], schema, g, d) for schema, g, d in apps), token


def test_a_setting_that_does_not_exist_is_caught(apps):
    """The check can fail: a key one letter off a real one, or a group option no config file has."""
    for token in ("trainer.compile_mod=default", "recipe=deit4"):
        assert all(override_problems([token], schema, g, d) for schema, g, d in apps), token
