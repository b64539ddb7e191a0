"""Every recipe x every model, and every experiment x every model, composed and resolved: the values the recipe,
model and trainer groups end up with. tests/fixtures/recipe_matrix.json holds this matrix as the code before recipes
owned their per-model-size tables (model.recipe_values) composed it; tests/config/test_recipe_tables.py composes it again.

    PYTHONPATH=$PWD python -m tests.recipe_matrix   # rewrites the fixture (only when a value is meant to change)
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from tests.helpers import CONFIGS, compose_cfg

FIXTURE = Path(__file__).parent / "fixtures" / "recipe_matrix.json"
#: a value that does not resolve (a missing size, ${hydra:...} outside a Hydra run)
UNRESOLVED = "<unresolved>"
#: the groups whose values are recorded; the per-size tables themselves are not values (they moved)
GROUPS = ("recipe", "model", "trainer")
TABLE_KEYS = ("model.recipe_values", "recipe.by_model_size")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def _leaves(node: Any, prefix: str, out: dict[str, Any]) -> None:
    for key in node.keys():
        path = f"{prefix}.{key}"
        if any(path == t or path.startswith(t + ".") for t in TABLE_KEYS):
            continue
        if OmegaConf.is_dict(node._get_node(key)):
            _leaves(node[key], path, out)
            continue
        if "${hydra:" in str(node._get_node(key)._value()):
            # resolved from the Hydra job that runs it (trainer.init_from of a fine-tuning sweep): whatever job ran
            # last in this process, not the recipe; recorded as unresolved, as in a process that has run none
            out[path] = UNRESOLVED
            continue
        try:
            value = node[key]
            out[path] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        except Exception:  # noqa: BLE001 -- recorded as unresolved, whatever the reason
            out[path] = UNRESOLVED


def resolved_values(*overrides: str) -> dict[str, Any]:
    """Every leaf of the recipe, model and trainer groups, resolved, or UNRESOLVED."""
    cfg = compose_cfg(*overrides)
    out: dict[str, Any] = {}
    for group in GROUPS:
        _leaves(cfg[group], group, out)
    return out


def matrix() -> dict[str, dict[str, Any]]:
    rows = {}
    for model in options("model"):
        for recipe in options("recipe"):
            rows[f"recipe={recipe} model={model}"] = resolved_values(f"recipe={recipe}", f"model={model}")
        for experiment in options("experiment"):
            rows[f"experiment={experiment} model={model}"] = resolved_values(f"experiment={experiment}",
                                                                             f"model={model}")
    return rows


if __name__ == "__main__":
    FIXTURE.parent.mkdir(exist_ok=True)
    rows = matrix()  # one line per composed config
    FIXTURE.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(rows[k], sort_keys=True)}" for k in sorted(rows))
                       + "\n}\n")
    print(f"wrote {FIXTURE}")
