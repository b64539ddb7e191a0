"""Run the toy study's grid, classify every run, write runs.csv / success_rates.csv and the figures.

Work is done in chunks of one (formulation, data realisation): every (lr, weight decay, initialisation) of the grid
trains at once (quest.toy.batched). Each finished chunk is written atomically to ``<out>/chunks/``; a rerun with the
same config skips finished chunks, so an interrupted study resumes where it stopped.
"""
from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from quest.attention import list_attentions
from quest.io import atomic_write, markdown_table, write_csv_atomic, write_json_atomic

from .batched import RunSpec, train_chunk
from .config import OutcomeRules
from .data import ToyDataConfig, make_toy_data

__all__ = ["OUTCOMES", "classify", "run_study", "success_rates", "summary_table"]

log = logging.getLogger(__name__)
OUTCOMES = ("correct", "biased", "degenerate", "other")
RUN_FIELDS = ["attention", "lr", "weight_decay", "data_seed", "init_seed", "train_acc", "test_acc", "final_train_loss",
              "outcome"]


def classify(train_acc: float, test_acc: float, rules: OutcomeRules) -> str:
    """The paper's outcome of a run from its train and test accuracy (fractions); see :class:`OutcomeRules`."""
    if train_acc >= rules.correct_min and test_acc >= rules.correct_min:
        return "correct"
    if train_acc <= rules.degenerate_train_max and test_acc <= rules.degenerate_test_max:
        return "degenerate"
    if train_acc >= rules.biased_train_min and test_acc <= rules.biased_test_max:
        return "biased"
    return "other"


def success_rates(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per formulation: outcome counts and the share of correct runs, overall and per (lr, weight decay) cell."""
    groups: dict[tuple, Counter] = {}
    for r in rows:
        for key in ((r["attention"], "all", "all"), (r["attention"], r["lr"], r["weight_decay"])):
            groups.setdefault(key, Counter())[r["outcome"]] += 1
    out = []
    for (attention, lr, wd), counts in groups.items():
        n = sum(counts.values())
        out.append({"attention": attention, "lr": lr, "weight_decay": wd, "runs": n,
                    **{o: counts[o] for o in OUTCOMES}, "success_rate": counts["correct"] / n})
    return out


def _fingerprint(cfg: Any) -> str:
    keys = {k: cfg[k] for k in ("grid", "data", "model", "train")}
    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _run_chunk(cfg: Any, data_cfg: ToyDataConfig, attention: str, data_seed: int) -> dict[str, Any]:
    g = cfg["grid"]
    specs = [RunSpec(float(lr), float(wd), int(s))
             for lr, wd, s in itertools.product(g["lrs"], g["weight_decays"], g["init_seeds"])]
    data = make_toy_data(data_cfg, data_seed)
    start = time.perf_counter()
    res = train_chunk(
        attention, specs, data.train, data.test, data_seed,
        epochs=cfg["train"]["epochs"], batch_size=cfg["train"]["batch_size"],
        model_kwargs={"seq_len": data_cfg.seq_len, "dim": data_cfg.dim, "num_classes": data_cfg.num_classes,
                      **cfg["model"]},
        probe_size=cfg["probe_size"], compile=cfg["compile"], betas=tuple(cfg["train"]["betas"]),
        eps=cfg["train"]["eps"],
    )
    # accuracies only: the outcome is derived from them when results are aggregated (run_study)
    rows = []
    for spec, tr, te, loss in zip(specs, res.train_acc.tolist(), res.test_acc.tolist(), res.final_loss.tolist()):
        rows.append({"attention": attention, "lr": spec.lr, "weight_decay": spec.weight_decay,
                     "data_seed": data_seed, "init_seed": spec.init_seed, "train_acc": round(tr, 6),
                     "test_acc": round(te, 6), "final_train_loss": round(loss, 6)})
    return {"rows": rows, "key_norms": res.key_norms, "seconds": time.perf_counter() - start}


def run_study(cfg: Mapping[str, Any], out_dir: str | Path) -> dict[str, Any]:
    """Train the grid of ``cfg`` (a plain dict of :class:`~quest.toy.config.ToyConfig`) into ``out_dir``."""
    out, chunks = Path(out_dir), Path(out_dir) / "chunks"
    chunks.mkdir(parents=True, exist_ok=True)
    data_cfg = ToyDataConfig(**cfg["data"])
    unknown = [a for a in cfg["attentions"] if a not in list_attentions()]
    if unknown or not cfg["attentions"]:
        raise ValueError(f"toy study: attentions {unknown or '[]'} not usable; choose from {list_attentions()}")
    for key in ("lrs", "weight_decays", "data_seeds", "init_seeds"):
        if not cfg["grid"][key]:
            raise ValueError(f"toy study: grid.{key} is empty; give at least one value")
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))
    if not _can_plot():  # said before the grid trains, not after
        log.warning("matplotlib is not installed: the study writes its CSVs but no figures (pip install "
                    "'quest[report]')")
    fingerprint = _fingerprint(cfg)
    rules = OutcomeRules(**cfg["outcome"])
    rows, key_norms, timings = [], {}, {}
    for attention in cfg["attentions"]:
        for data_seed in cfg["grid"]["data_seeds"]:
            path = chunks / f"{attention}-data{data_seed}.pt"
            if path.exists():
                chunk = torch.load(path, weights_only=True)
                if chunk["fingerprint"] != fingerprint:
                    raise RuntimeError(
                        f"{path} holds results of a different toy config (fingerprint {chunk['fingerprint']}, this "
                        f"config {fingerprint}); use another output directory (out_dir=...) or delete {chunks}")
                log.info("%s, data %d: done before (%s), skipped", attention, data_seed, path.name)
            else:
                chunk = {"fingerprint": fingerprint, **_run_chunk(cfg, data_cfg, attention, data_seed)}
                atomic_write(path, lambda f, c=chunk: torch.save(c, f))
            chunk_rows = [{**r, "outcome": classify(r["train_acc"], r["test_acc"], rules)} for r in chunk["rows"]]
            log.info("%s, data %d: %d runs in %.1f s: %s", attention, data_seed, len(chunk_rows), chunk["seconds"],
                     dict(Counter(r["outcome"] for r in chunk_rows)))
            rows += chunk_rows
            key_norms.setdefault(attention, []).append(chunk["key_norms"])
            timings[attention] = timings.get(attention, 0.0) + chunk["seconds"]
    rates = success_rates(rows)
    write_csv_atomic(out / "runs.csv", rows, RUN_FIELDS)
    write_csv_atomic(out / "success_rates.csv", rates, list(rates[0]))
    norms = {a: torch.cat(v) for a, v in key_norms.items()}  # (runs, epochs + 1, 3) in runs.csv order
    atomic_write(out / "key_norms.pt", lambda f: torch.save(norms, f))
    timing = {"train_seconds": timings, "total_train_seconds": sum(timings.values()), "fingerprint": fingerprint,
              "config": {k: cfg[k] for k in ("grid", "data", "model", "train", "outcome")}}
    write_json_atomic(out / "study.json", timing)
    if _can_plot():
        from .plots import plot_heatmaps, plot_key_norms  # matplotlib only when writing figures

        plot_heatmaps(rates, cfg["grid"], out / "success_heatmaps.png")
        plot_key_norms(rows, norms, out / "key_norms.png")
    return {"rows": rows, "success_rates": rates, "key_norms": norms, "timing": timing}


def _can_plot() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def summary_table(rates: Iterable[Mapping[str, Any]]) -> str:
    """Markdown: per formulation, the overall success rate and outcome shares."""
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    rows = [(r["attention"], r["runs"], pct(r["success_rate"]), pct(r["biased"] / r["runs"]),
             pct(r["degenerate"] / r["runs"]), pct(r["other"] / r["runs"])) for r in rates if r["lr"] == "all"]
    return "\n".join(markdown_table(["attention", "runs", "correct (success rate)", "biased", "degenerate", "other"],
                                     rows))
