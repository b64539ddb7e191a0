"""Older formats of the files quest writes, upgraded to today's in one place (docs/training.md, "Older formats").

Formats changed while quest was developed. Each reader calls the upgrade of what it reads, where it reads it, and
from then on sees only today's format:

| what | older format | upgrade | called by |
|---|---|---|---|
| checkpoint (``*.pt``) | no ``version`` key | :func:`upgrade_checkpoint_v1` | quest.run.checkpoint.load_record |
| checkpoint + metrics.jsonl | ``metrics_bytes`` only | :func:`upgrade_metrics_size_only` | quest.run.plan |
| run config: ``data`` | one flat DataConfig | :func:`upgrade_data_config_flat` | quest.run.directory, quest.data.registry |
| run config: ``data`` | no ``pipeline`` | :func:`upgrade_data_config_without_pipeline` | quest.run.directory |
| run config: ``model`` | ``model.recipe_values`` | :func:`upgrade_run_config_recipe_values` | quest.run.directory |
| eval_results.json | no ``status`` | :func:`upgrade_eval_results_without_status` | quest.evaluation.directory, report |

One function per (format, version), each saying what the old format was, what wrote it and what today's equivalent
is; a dispatcher per kind of file (:func:`upgrade_checkpoint`, :func:`checkpoint_metrics_text`,
:func:`upgrade_run_config`, :func:`upgrade_eval_results`) applies the ones a file needs. Every upgrade returns a new
dict (the input is never changed) and gives today's format back unchanged.

This module is plain Python on plain containers: it imports nothing of quest and no torch, so that the torch-free
readers (the data registry, the report) stay cheap to import and nothing here can close an import cycle. What an
upgrade needs to know of the rest of quest (a data set's own keys) its caller passes in.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

__all__ = ["FLAT_DATA_KEYS", "upgrade_checkpoint", "upgrade_checkpoint_v1", "checkpoint_metrics_text",
           "upgrade_metrics_size_only", "upgrade_run_config", "upgrade_data_config", "upgrade_data_config_flat",
           "upgrade_data_config_without_pipeline", "upgrade_run_config_recipe_values", "upgrade_eval_results",
           "upgrade_eval_results_without_status"]

# ---------------------------------------------------------------------------------------------------------------
# checkpoints/*.pt (quest.run.checkpoint_record.CheckpointRecord)


def upgrade_checkpoint_v1(record: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint dict without a ``version`` key -> record version 1 with the key.

    Old: ``{"format": "quest-checkpoint-v1", "model", "ema", "optimizer", "scheduler", "scaler", "rng", "sharded",
    "config", "meta", "state", "choices", "derived", "data", "metrics_bytes", "metrics_text"}``, written by the
    trainer's own dict before every writer went through CheckpointRecord (commit c6734fb, which added ``version``;
    tests/fixtures/checkpoint_v1.pt is such a file). Those written before metrics.jsonl was kept in checkpoints
    (commit f47f3ff) lack ``metrics_text``. Today: the same keys (the layout did not change, so it is version 1) with
    ``"version": 1``, and ``"metrics_text": None`` where the file had none (what today's record holds when it does not
    know the text; the run directory then upgrades with metrics.jsonl itself: :func:`upgrade_metrics_size_only`)."""
    upgraded = {**record, "version": 1}
    upgraded.setdefault("metrics_text", None)
    return upgraded


def upgrade_checkpoint(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A loaded quest checkpoint dict (its ``format`` already checked) in today's layout: a file without a version is
    version 1 (:func:`upgrade_checkpoint_v1`); any version present is left for the record to accept or refuse."""
    return upgrade_checkpoint_v1(raw) if "version" not in raw else dict(raw)


def upgrade_metrics_size_only(metrics_bytes: int, held: bytes | None) -> bytes:
    """What a checkpoint that stored only the size of metrics.jsonl saw of it -> today's ``metrics_text``.

    Old: ``metrics_bytes`` set and ``metrics_text`` absent or None: checkpoints written before commit f47f3ff (the run
    directory as a state machine) recorded only how long metrics.jsonl was, and a resume cut the file back to that
    size ("the old rule"); nothing was rebuilt. Today: ``metrics_text``, the file's text up to the checkpoint, against
    which the run directory cuts later lines, rebuilds a missing file and replaces a damaged one. ``held`` is the file
    now (None: missing). Its first ``metrics_bytes`` bytes are the best anyone can know of what the checkpoint saw,
    and with them today's rule does exactly what the old rule did: a longer file is cut to the size, a shorter or
    missing one is left as it is (an empty text rebuilds nothing)."""
    return (held or b"")[:metrics_bytes]


def checkpoint_metrics_text(metrics_text: str | bytes | None, metrics_bytes: int | None,
                            held: bytes | None) -> bytes | None:
    """A checkpoint's view of metrics.jsonl as today's bytes: its ``metrics_text``; for a checkpoint that stored only
    the size, :func:`upgrade_metrics_size_only` of the file ``held`` now; None when it stored neither (written without
    a metrics log)."""
    if metrics_text is not None:
        return metrics_text.encode() if isinstance(metrics_text, str) else bytes(metrics_text)
    if metrics_bytes is not None:
        return upgrade_metrics_size_only(metrics_bytes, held)
    return None


# ---------------------------------------------------------------------------------------------------------------
# the resolved training config (a checkpoint's ``config``, run.json's ``config``)

#: Every data.* key of the single flat DataConfig that quest wrote into configs (and checkpoints) before data sets were
#: registered (commit 0b96722): a stored config may hold the keys of every data set, whichever it trained on.
FLAT_DATA_KEYS = frozenset({
    "name", "root", "batch_size", "eval_batch_size", "num_workers", "num_classes", "img_size", "mean", "std",
    "train_split", "val_split", "subset_fraction", "subset_seed", "val_fraction", "split_seed", "download",
    "bad_images", "max_skipped_fraction", "preflight", "fake_train_size", "fake_val_size", "pin_memory", "canvas",
    "num_samples", "shuffle_window",
})


def upgrade_data_config_flat(data: Mapping[str, Any], own_keys: Collection[str] | None) -> dict[str, Any]:
    """A flat ``data`` config -> the keys of its data set's settings.

    Old: one DataConfig with the keys of every data set (:data:`FLAT_DATA_KEYS`; e.g. ``canvas`` and
    ``fake_train_size`` beside ``data.name=digits``), in every config quest stored (checkpoints, run.json) before
    data sets were registered, each with its own settings dataclass (commit 0b96722). Today: the keys of the named
    data set's settings (quest.data.registry). ``own_keys``: those keys (the caller looks them up; None when the data
    set is not registered: returned unchanged). Only keys of the flat schema that the data set does not define are
    dropped; any other key stays (and is refused by the checks, naming it)."""
    if own_keys is None:
        return dict(data)
    return {k: v for k, v in data.items() if k in own_keys or k not in FLAT_DATA_KEYS}


def upgrade_data_config_without_pipeline(data: Mapping[str, Any]) -> dict[str, Any]:
    """A ``data`` config without ``pipeline`` -> ``pipeline: timm``.

    Old: every data config stored before the training input became a choice (commit 6146d14, data.pipeline=timm|
    split|device); such runs trained with timm's transform in the loader's workers. Today: ``data.pipeline`` names the
    training input (quest.data.pipelines.train_input), ``timm`` being that one."""
    return dict(data) if "pipeline" in data else {**data, "pipeline": "timm"}


def upgrade_data_config(data: Mapping[str, Any], own_keys: Collection[str] | None = None) -> dict[str, Any]:
    """A stored ``data`` config in today's form: the flat node narrowed to its data set's ``own_keys`` (when given:
    :func:`upgrade_data_config_flat`), then ``pipeline`` added where it predates the key."""
    return upgrade_data_config_without_pipeline(upgrade_data_config_flat(data, own_keys))


def upgrade_run_config_recipe_values(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config with ``model.recipe_values`` -> one without it, with ``recipe.by_model_size``.

    Old: ``model.recipe_values``, per-recipe tables of size-dependent values (``{"deit3": {"lr": ..., "img_size": ...,
    "drop_path": ...}}``) kept in the model configs and read by the recipes, in every config stored before recipes
    owned their per-model-size tables (commit ba97586). Today: ``recipe.by_model_size`` (rows per size word). Either
    table only looks values up, and the values it gave (``recipe.lr``, ``recipe.drop_path``, ...) are stored resolved
    beside it, so the old table is dropped; the recipe gets an empty table where it has none (no rows are invented:
    the stored values stand for themselves)."""
    model = config.get("model")
    if not isinstance(model, Mapping) or "recipe_values" not in model:
        return dict(config)
    upgraded = {**config, "model": {k: v for k, v in model.items() if k != "recipe_values"}}
    recipe = config.get("recipe")
    if isinstance(recipe, Mapping) and "by_model_size" not in recipe:
        upgraded["recipe"] = {**recipe, "by_model_size": {}}
    return upgraded


def upgrade_run_config(config: Mapping[str, Any],
                       data_keys: Callable[[Any], Collection[str] | None] | None = None) -> dict[str, Any]:
    """A resolved training config as a checkpoint or run.json of any quest stored it, in today's form:
    :func:`upgrade_run_config_recipe_values`, then its ``data`` node through :func:`upgrade_data_config`.
    ``data_keys(name)``: the keys of data set ``name``'s settings, or None (quest.data.registry.data_set_keys); without
    it the flat data node is kept whole."""
    upgraded = upgrade_run_config_recipe_values(config)
    data = upgraded.get("data")
    if isinstance(data, Mapping):
        own = data_keys(data.get("name")) if data_keys is not None else None
        upgraded["data"] = upgrade_data_config(data, own)
    return upgraded


# ---------------------------------------------------------------------------------------------------------------
# eval_results.json (quest.evaluation.directory)


def upgrade_eval_results_without_status(record: Mapping[str, Any]) -> dict[str, Any]:
    """An eval_results.json without ``status`` -> ``status: complete``.

    Old: ``{"suite", "evaluations", "target", "settings", "world_size", "device", "precision", "versions",
    "wall_time_s", "results"}``, written once by eval.py after every evaluation had finished, before results
    directories were keyed and marked (commit 40e92f4). Today: ``status`` (running, complete, partial), with ``key``
    and ``fingerprint`` (what the numbers depend on). Such a file is complete; its key is unknown and stays absent,
    so quest.evaluation.directory reuses it for no evaluation (it says they came from an older quest; eval.overwrite
    =true archives them)."""
    return {**record, "status": "complete"}


def upgrade_eval_results(record: Mapping[str, Any]) -> dict[str, Any]:
    """An eval_results.json object of any quest in today's form (:func:`upgrade_eval_results_without_status`)."""
    return dict(record) if "status" in record else upgrade_eval_results_without_status(record)
