"""What makes two runs one setting for ``python -m quest.report``: every value of their config that can change a
result, and the data set they trained on (docs/report.md, "Rows: how runs are grouped").

The rule is declared the other way round: :data:`NEUTRAL_KEYS` lists the keys that do not change what a run trains
or measures, each with the reason, and every other key counts. A key added to the config later therefore separates
runs until it is shown neutral here, instead of silently pooling runs that differ in it.

The data set is one more setting, :data:`DATA_SET`: summary.json's ``data_fingerprint`` (the training and
validation sizes and a digest of the class names, recorded from the data sets the run trained on), so that a run on
another ``data.root`` holding other data is another setting, and the same data under two paths is one. Runs written
before the fingerprint was recorded are told apart by their ``data.root``.
"""
from __future__ import annotations

import json
from typing import Any

from .runs import RunResult

__all__ = ["REPEAT_KEYS", "NEUTRAL_KEYS", "DATA_SET", "neutral", "value_of", "data_set", "setting", "hashable"]

#: Settings that repeat an experiment rather than define it: the seeds (the report's repetitions).
REPEAT_KEYS = ("trainer.seed", "data.subset_seed", "seed")

#: The keys that do not change a result, and why. Two kinds: those that change nothing the run computes (where it
#: writes, what it logs, thresholds that only decide its status), and those that run the same computation another
#: way, so that only the rounding of floating-point sums or the order of random draws differs: the kind of
#: difference the seeds make, which the repetitions measure. A ``prefix.*`` entry covers every key under it.
NEUTRAL_KEYS: dict[str, str] = {
    # where the run reads and writes
    "data.root": "where the data set lies; the data itself is compared as the data set's fingerprint (DATA_SET)",
    "data.download": "whether a missing data set may be fetched; the data set trained on is compared by fingerprint",
    "model.pretrained_download": "whether the weights model.pretrained names may be fetched; the name is compared",
    "run_dir": "the output directory",
    "trainer.resume": "whether a run directory's checkpoint is continued; a resume is bit-identical "
                      "(tests/run/test_interrupts.py)",
    "trainer.overwrite": "whether a previous run in the directory is archived first",
    "trainer.checkpoint_every_n_steps": "when checkpoints are written; a resume from any of them is exact",
    # what the run logs
    "logger.*": "where metrics go (wandb, tensorboard) and their labels",
    "trainer.log_every_n_steps": "the cadence of log lines and metrics rows; training reads the same numbers",
    "trainer.data_wait_warning": "the threshold of the telemetry's advice in train.log",
    "trainer.low_mfu_warning": "the threshold of the telemetry's advice in train.log",
    "diagnostics.*": "attention statistics measured beside training; a step after them is bit-identical "
                     "(tests/diagnostics/test_diagnostics.py)",
    # thresholds that decide a run's status, not its numbers: a run that crosses one is marked (stopped, diverged,
    # bad_data) and the report handles it by its status
    "trainer.max_steps": "a cap that stops a run early: the run is marked stopped in its setting's row",
    "trainer.max_loss": "the loss above which a run counts as diverged: marked diverged in its row",
    "trainer.max_loss_factor": "the same threshold as a multiple of the chance loss",
    "data.max_skipped_fraction": "the share of unreadable images above which a run fails (status bad_data)",
    "data.preflight": "a check of the image files before the first step; what it leaves out (data.bad_images=skip) "
                      "changes the data set's size, compared in the fingerprint",
    # the same computation run another way: floating-point rounding or the order of random draws only
    "trainer.device": "the device the same model and batches run on",
    "trainer.compile": "the same model traced and fused by torch.compile",
    "trainer.compile_mode": "torch.compile's tuning of the same computation",
    "trainer.compile_backend": "torch.compile's code generator for the same computation",
    "trainer.torch_threads": "the CPU threads of the same computation",
    "attention.fused": "the same q/k transforms by quest's Triton kernels or PyTorch's operators (summary.json's "
                       "attention_kernels says which ran)",
    "data.num_workers": "the loader's processes: the same images and transforms, each worker drawing from its own "
                        "random stream (another count draws other augmentations, as another seed would)",
    "data.pin_memory": "how batches are copied to the GPU",
    "data.eval_batch_size": "validation's batch size: a ViT in eval mode scores each image on its own",
}

#: The pseudo-key of the data set a run trained on (summary.json's ``data_fingerprint``), a row key when it differs.
DATA_SET = "data_set"


def neutral(key: str) -> bool:
    """Whether ``key`` is a seed or a key of :data:`NEUTRAL_KEYS` (or under a ``prefix.*`` one)."""
    if key in REPEAT_KEYS:
        return True
    return any(key == k or (k.endswith(".*") and key.startswith(k[:-1])) for k in NEUTRAL_KEYS)


def data_set(r: RunResult) -> str | None:
    """The data set ``r`` trained on, in words: its sizes and classes as summary.json's ``data_fingerprint``
    recorded them, else (a run written before the fingerprint) its ``data.root``; None when neither is known."""
    fp = {k.removeprefix("data_fingerprint."): v for k, v in r.summary.items() if k.startswith("data_fingerprint.")}
    if fp:
        classes = "" if fp.get("num_classes") is None else f", {fp['num_classes']} classes"
        digest = f" [{str(fp['classes_sha256'])[:12]}]" if fp.get("classes_sha256") else ""
        files = f", files [{str(fp['files_sha256'])[:12]}]" if fp.get("files_sha256") else ""
        return f"train {fp.get('train_size')} / val {fp.get('val_size')}{classes}{digest}{files}"
    root = (r.config or {}).get("data.root")
    return None if root is None and r.config is None else f"data.root={root} (size not recorded)"


def value_of(r: RunResult, key: str) -> Any:
    """A setting of ``r`` as the report groups by it: :data:`DATA_SET`, else :meth:`RunResult.value`."""
    return data_set(r) if key == DATA_SET else r.value(key)


def _canonical(value: Any) -> Any:
    """``value`` in one form per meaning: a number as a float (the int 1 and the float 1.0 are one lr), a tuple as a
    list, a mapping's keys as text; a string stays a string (the text "0.002" is not the number 0.002)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    return f"<{type(value).__name__}> {value}"


def hashable(value: Any) -> str:
    """``value`` as a dict key, in its canonical, typed form (:func:`_canonical`) as JSON text: every value, nested
    mappings and lists included, hashes, and two values are one setting only when they are of one kind and equal."""
    return json.dumps(_canonical(value), sort_keys=True)


def setting(r: RunResult, fallback: tuple[str, ...]) -> dict[str, Any]:
    """Every value of ``r`` that can change a result: its config without the :func:`neutral` keys, and its data
    set; without a config record, the ``fallback`` settings of its summary."""
    if r.config is not None:
        values = {k: hashable(v) for k, v in r.config.items() if not neutral(k)}
    else:
        values = {k: hashable(r.value(k)) for k in fallback}
    return {**values, DATA_SET: data_set(r)}
