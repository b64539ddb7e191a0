"""Run the toy study: the grid (``study=grid``, the paper's) or the sensitivity study (``study=sensitivity``).

Work is done in chunks of one (formulation, training-set size, data realisation): every (lr, weight decay,
initialisation) of the grid trains at once (quest.toy.batched). Each finished chunk is written atomically to
``<out>/chunks/``; a rerun with the same config skips finished chunks, so an interrupted study resumes where it
stopped (a chunk is believed back only once every field is checked: quest.toy.chunks). Chunks train in ``workers``
processes side by side (one per CPU core by default): this process and ``workers - 1`` spawned ones
(quest.toy.workers). Outcomes are derived from the stored accuracies when results are aggregated, under this
project's rules and under the paper's ranges.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from quest.attention import list_attentions
from quest.evaluation.progress import Progress
from quest.runtime.workers import die_with_parent
from quest.store.files import atomic_write, write_csv_atomic, write_json_atomic
from quest.store.output_folder import OutputFolder, holding

from .batched import train_chunk
from .checks import check_toy_config
from .chunks import ChunkTask, chunk_of, grid_runs, read_chunk
from .chunks import fingerprint as chunk_fingerprint
from .compiled import resolve_toy_device
from .config import OutcomeRules, PaperOutcomeRules, StopRule
from .data import ToyDataConfig, make_toy_data
from .outcomes import (
    SENSITIVITY_FIELDS,
    classify,
    classify_paper,
    sensitivity_table,
    stop_size,
    success_rates,
    test_key,
    variant_spec,
)
from .workers import relay_logs, send_logs_to, share_tasks

__all__ = ["run_study", "check_study"]

log = logging.getLogger(__name__)
RUN_FIELDS = ["attention", "lr", "weight_decay", "data_seed", "init_seed", "train_acc", "test_acc", "final_train_loss",
              "outcome", "paper_outcome"]


# --- chunks (quest.toy.chunks) -----------------------------------------------------------------------------------


def _train_task(cfg: Mapping[str, Any], task: ChunkTask) -> dict[str, Any]:
    """Train one chunk and write it to ``task.path``; the chunk's rows carry accuracies, not outcomes."""
    # a chunk trains for minutes: a line every log_every_s seconds (by time only: the chunk's end has its own line),
    # its elapsed time counted from here, the data's and the models' building included
    progress = Progress(f"{task.name}, n={task.data['train_size']}, data {task.data_seed}", cfg["train"]["epochs"],
                        unit="epoch", every_s=cfg.get("log_every_s", 10.0), nested=True, logger=log)
    specs = grid_runs(cfg["grid"])
    data_cfg = ToyDataConfig(**task.data)
    data = make_toy_data(data_cfg, task.data_seed)
    tests = {"test": data.test}
    for fraction in task.tests:  # the same training set (drawn first), test sets with another biased share
        other = make_toy_data(dataclasses.replace(data_cfg, test_biased_fraction=float(fraction)), task.data_seed)
        assert torch.equal(other.train.x, data.train.x)
        tests[test_key(fraction)] = other.test
    start = time.perf_counter()
    res = train_chunk(
        task.spec["attention"], specs, data.train, tests, task.data_seed,
        epochs=cfg["train"]["epochs"], batch_size=cfg["train"]["batch_size"],
        model_kwargs={"seq_len": data_cfg.seq_len, "dim": data_cfg.dim, "num_classes": data_cfg.num_classes,
                      **cfg["model"]},
        probe_size=cfg["probe_size"], compile=cfg["compile"], betas=tuple(cfg["train"]["betas"]),
        eps=cfg["train"]["eps"], device=cfg.get("device") or "cpu", runs_per_call=cfg.get("runs_per_call"),
        param_init=task.spec["param_init"], frozen=task.spec["frozen"],
        on_epoch=lambda epoch: progress.update(extra=task.position),
    )
    chunk = chunk_of(task, specs, res, time.perf_counter() - start)
    atomic_write(Path(task.path), lambda f: torch.save(chunk, f))
    return chunk


_WORKER_CFG: dict = {}


def _worker_init(cfg: Mapping[str, Any], threads: int | None, records: Any) -> None:
    die_with_parent()  # quest/runtime/workers.py: a study killed by a signal takes its workers with it
    _WORKER_CFG.update(cfg)
    send_logs_to(records)
    if threads:
        torch.set_num_threads(int(threads))
    try:  # torch.compile makes a (disabled) tqdm bar, whose default lock is a multiprocessing semaphore: a worker
        # terminated at the end never releases it, and the resource tracker warns of a leak when the study exits
        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())
    except ImportError:
        pass


def _worker_seconds(task: ChunkTask) -> float:
    return _train_task(_WORKER_CFG, task)["seconds"]


def _default_workers(cfg: Mapping[str, Any]) -> int:
    if torch.device(cfg.get("device") or "cpu").type != "cpu":
        return 1
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _execute(cfg: Mapping[str, Any], tasks: list[ChunkTask], folder: OutputFolder) -> None:
    """Train the chunks of ``tasks`` that are not on disk yet in ``workers`` processes: this one and a pool of
    ``workers - 1`` (quest.toy.workers); each chunk is recorded in ``folder``'s record once written."""
    todo = []
    for t in tasks:
        path = Path(t.path)
        if path.exists():  # this config's (_check_chunks)
            log.info("%s, n=%d, data %d: done before (%s), skipped", t.name, t.data["train_size"], t.data_seed,
                     path.name)
        else:
            todo.append(t)
    if not todo:
        return
    todo = [dataclasses.replace(t, position=f"chunk {i}/{len(todo)}") for i, t in enumerate(todo, 1)]
    workers = min(int(cfg.get("workers") or _default_workers(cfg)), len(todo))
    threads = cfg.get("threads") or (1 if workers > 1 else None)
    start = time.perf_counter()

    def done(i: int, task: ChunkTask, seconds: float) -> None:
        folder.manifest.note([task.path])  # a rerun reuses only the chunks on this record
        elapsed = time.perf_counter() - start
        log.info("%s, n=%d, data %d: trained in %.1f s [%d/%d chunks, %.0f s elapsed, about %.0f s to go]",
                 task.name, task.data["train_size"], task.data_seed, seconds, i, len(todo), elapsed,
                 elapsed / i * (len(todo) - i))

    if workers <= 1:
        if threads:
            torch.set_num_threads(int(threads))
        for i, task in enumerate(todo, 1):
            done(i, task, _train_task(cfg, task)["seconds"])
        return
    log.info("training %d chunks in this process and %d worker process(es) (%s thread(s) each)", len(todo),
             workers - 1, threads)
    finished = itertools.count(1)
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch / OpenMP state
    saved_threads = torch.get_num_threads()
    records = ctx.Queue()  # the workers' log records (their chunks' progress lines), logged here
    relay = relay_logs(records)
    try:
        with ctx.Pool(workers - 1, initializer=_worker_init, initargs=(dict(cfg), threads, records)) as pool:
            torch.set_num_threads(int(threads))  # this process trains as a worker does, then gets its threads back
            try:
                share_tasks(todo, lambda t: _train_task(cfg, t)["seconds"], pool, _worker_seconds, workers - 1,
                            lambda t, seconds: done(next(finished), t, seconds))
            finally:
                torch.set_num_threads(saved_threads)
            # leaving the with block terminates the idle workers: a graceful close() and join() costs 2-3 s more
    finally:
        records.put(None)
        relay.join(timeout=10)  # the records already sent are logged before the study's next line
        records.close()


def _check(cfg: Mapping[str, Any]) -> None:
    names = list(cfg["attentions"]) + list((cfg.get("study") or {}).get("scale_variants") or [])
    known = set(list_attentions())
    unknown = [a for a in names if variant_spec(cfg, a)["attention"] not in known]
    if unknown or not cfg["attentions"]:
        raise ValueError(f"toy study: attentions {unknown or '[]'} not usable; choose from {list_attentions()} or a "
                         f"name in variants ({sorted(cfg.get('variants') or {})})")
    study = (cfg.get("study") or {}).get("name", "grid")
    if study == "sensitivity" and not cfg["study"]["train_sizes"]:
        raise ValueError("toy study: study=sensitivity needs study.train_sizes")
    device = torch.device(cfg.get("device") or "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"toy study: device={device} but torch sees no CUDA device")


def _load_rows(cfg: Mapping[str, Any], tasks: list[ChunkTask]) -> tuple[list[dict], dict[str, list], dict[str, float]]:
    rules, paper = OutcomeRules(**cfg["outcome"]), PaperOutcomeRules(**cfg["paper_outcome"])
    rows, key_norms, timings = [], {}, {}
    for t in tasks:
        chunk = read_chunk(t, cfg)  # every field checked: a chunk trained before, or by a worker
        chunk_rows = [{**r, "outcome": classify(r["train_acc"], r["test_acc"], rules),
                       "paper_outcome": classify_paper(r["train_acc"], r["test_acc"], paper)} for r in chunk["rows"]]
        log.info("%s, n=%d, data %d: %d runs (%.1f s): %s", t.name, t.data["train_size"], t.data_seed, len(chunk_rows),
                 chunk["seconds"], dict(Counter(r["outcome"] for r in chunk_rows)))
        rows += chunk_rows
        key_norms.setdefault(t.name, []).append(chunk["key_norms"])
        timings[t.name] = timings.get(t.name, 0.0) + chunk["seconds"]
    return rows, key_norms, timings


def check_study(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """Every check of the study that can refuse it (the values, then the names and the device); writes nothing.
    The config with ``device=auto`` resolved."""
    check_toy_config(cfg)
    if cfg.get("device") in (None, "auto"):
        cfg = {**cfg, "device": resolve_toy_device(cfg.get("device"))}
    _check(cfg)
    return cfg


def run_study(cfg: Mapping[str, Any], out_dir: str | Path, accepted: Callable[[], None] | None = None
              ) -> dict[str, Any]:
    """Train the study of ``cfg`` (a plain dict of :class:`~quest.toy.config.ToyConfig`) into ``out_dir``.
    ``accepted``: called once every check has passed and the folder is claimed, before the study trains (the command's record and
    log file go there: a refused study leaves them as they were)."""
    auto = cfg.get("device") in (None, "auto")
    cfg = check_study(cfg)
    if auto:
        log.info("device=auto: training on the %s (the toy models are too small for a GPU to pay; device=cuda to "
                 "use one)", cfg["device"])
    if not _can_plot():  # said before the grid trains, not after
        log.warning("matplotlib is not installed: the study writes its CSVs but no figures (pip install "
                    "'quest[report]')")
    # held for the whole study (quest.store.output_folder): a second study into out_dir is refused naming this one
    with holding(out_dir, "quest-toy") as folder:
        if (cfg.get("study") or {}).get("name", "grid") == "sensitivity":
            return _run_sensitivity(cfg, folder, accepted)
        return _run_grid(cfg, folder, accepted)


#: what each study writes beside its chunks
GRID_FILES = ("runs.csv", "success_rates.csv", "key_norms.pt", "study.json", "success_heatmaps.png", "key_norms.png")
SENSITIVITY_FILES = ("runs.csv", "sensitivity.csv", "sensitivity.json", "sensitivity.png")


def _make_room(cfg: Mapping[str, Any], folder: OutputFolder, tasks: list[ChunkTask], files: Sequence[str],
               accepted: Callable[[], None] | None) -> None:
    """The last check, then the first change: a chunk the study's record says it wrote that is damaged or of another
    config is refused (the folder as it was; quest.toy.chunks.read_chunk); then the study's chunks and files that its
    record says it wrote stay (reused, or replaced in place), and anything else in their places is moved to
    .replaced/, never deleted or taken for a chunk."""
    for t in tasks:
        path = Path(t.path)
        if folder.manifest.owns(path):  # reused by _execute (another file in its place is moved aside below)
            read_chunk(t, cfg)
    kept = folder.make_room([Path(t.path) for t in tasks] + [folder.path / name for name in files], keep_own=True)
    if kept is not None:
        log.warning("files this study did not write were in the places of its outputs: moved to %s", kept)
    if accepted is not None:  # the folder is claimed: the command's changes have begun (quest.runtime.phase)
        accepted()


def _note(folder: OutputFolder, files: Sequence[str]) -> None:
    folder.manifest.note([folder.path / name for name in files if (folder.path / name).exists()])


def _grid_tasks(cfg: Mapping[str, Any], out: Path, names: Sequence[str], sizes: Sequence[int],
                tests: Sequence[float], per_size_dir: bool) -> list[ChunkTask]:
    tasks = []
    for name in names:
        spec = variant_spec(cfg, name)
        for size in sizes:
            data = {**cfg["data"], "train_size": int(size)}
            ToyDataConfig(**data)  # checked before anything trains
            fingerprint = chunk_fingerprint(cfg, data, spec, tests)
            for seed in cfg["grid"]["data_seeds"]:
                sub = out / "chunks" / (f"n{size}" if per_size_dir else "")
                tasks.append(ChunkTask(name, spec, data, tuple(tests), int(seed), str(sub / f"{name}-data{seed}.pt"),
                                   fingerprint))
    return tasks


def _run_grid(cfg: Mapping[str, Any], folder: OutputFolder, accepted: Callable[[], None] | None) -> dict[str, Any]:
    out = folder.path
    tasks = _grid_tasks(cfg, out, cfg["attentions"], [cfg["data"]["train_size"]], (), per_size_dir=False)
    _make_room(cfg, folder, tasks, GRID_FILES, accepted)
    wall = time.perf_counter()
    _execute(cfg, tasks, folder)
    rows, key_norms, timings = _load_rows(cfg, tasks)
    for r in rows:
        r.pop("train_size")
    rates = success_rates(rows)
    write_csv_atomic(out / "runs.csv", rows, RUN_FIELDS)
    write_csv_atomic(out / "success_rates.csv", rates, list(rates[0]))
    norms = {a: torch.cat(v) for a, v in key_norms.items()}  # (runs, epochs + 1, 3) in runs.csv order
    atomic_write(out / "key_norms.pt", lambda f: torch.save(norms, f))
    timing = {"train_seconds": timings, "total_train_seconds": sum(timings.values()),
              "wall_seconds_this_call": time.perf_counter() - wall, "workers": cfg.get("workers"),
              "fingerprints": sorted({t.fingerprint for t in tasks}),
              "config": {k: cfg[k] for k in ("grid", "data", "model", "train", "outcome", "paper_outcome")}}
    write_json_atomic(out / "study.json", timing)
    if _can_plot():
        from .plots import plot_heatmaps, plot_key_norms  # matplotlib only when writing figures

        labels = {a: variant_spec(cfg, a)["label"] for a in cfg["attentions"]}
        plot_heatmaps(rates, cfg["grid"], out / "success_heatmaps.png", labels=labels,
                      subtitle=f"{cfg['data']['train_size']:,} training samples, {cfg['train']['epochs']} epochs")
        if cfg["probe_size"]:
            plot_key_norms(rows, norms, out / "key_norms.png", labels=labels)
    _note(folder, GRID_FILES)
    return {"rows": rows, "success_rates": rates, "key_norms": norms, "timing": timing}


# --- the sensitivity study ---------------------------------------------------------------------------------------


def _run_sensitivity(cfg: Mapping[str, Any], folder: OutputFolder,
                     accepted: Callable[[], None] | None) -> dict[str, Any]:
    st, out = cfg["study"], folder.path
    names = list(dict.fromkeys(list(cfg["attentions"]) + list(st["scale_variants"])))
    fractions = [float(f) for f in st["test_biased_fractions"]]
    tasks = _grid_tasks(cfg, out, names, st["train_sizes"], fractions, per_size_dir=True)
    _make_room(cfg, folder, tasks, SENSITIVITY_FILES, accepted)
    wall = time.perf_counter()
    _execute(cfg, tasks, folder)
    rows, _, timings = _load_rows(cfg, tasks)
    table = sensitivity_table(rows, cfg)
    stop = stop_size(table, cfg["attentions"], st["train_sizes"], StopRule(**st["stop"]))
    fields = ["attention", "lr", "weight_decay", "data_seed", "init_seed", "train_size", "train_acc", "test_acc",
              *[test_key(f) for f in fractions], "final_train_loss", "outcome", "paper_outcome"]
    write_csv_atomic(out / "runs.csv", rows, fields)
    write_csv_atomic(out / "sensitivity.csv", table, SENSITIVITY_FIELDS)
    summary = {"stop": stop, "train_seconds": timings, "total_train_seconds": sum(timings.values()),
               "wall_seconds_this_call": time.perf_counter() - wall, "workers": cfg.get("workers"),
               "config": {k: cfg[k] for k in ("grid", "data", "model", "train", "outcome", "paper_outcome", "study",
                                              "variants", "attentions")}}
    write_json_atomic(out / "sensitivity.json", summary)
    log.info("stopping rule: training-set size %d (%s)", stop["size"],
             "rates stable from there" if stop["converged"] else "the largest measured; rates still changing")
    if _can_plot():
        from .plots import plot_sensitivity

        plot_sensitivity(table, cfg, stop["size"], out / "sensitivity.png",
                         labels={n: variant_spec(cfg, n)["label"] for n in names})
    _note(folder, SENSITIVITY_FILES)
    # for the command line's summary: overall success per formulation and size
    rates = [{"attention": f"{r['attention']} (n={r['train_size']})", "lr": "all", "runs": r["runs"],
              "success_rate": r["success_rate"], "biased": r["biased"], "degenerate": r["degenerate"],
              "other": r["other"]} for r in table if r["axis"] == "train_size"]
    return {"rows": rows, "table": table, "stop": stop, "success_rates": rates, "timing": summary}


def _can_plot() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


