"""The applications bench/gpu.py runs end to end: train.py (alone or under torchrun), ``python -m quest.toy``, and the
device's share of the training input. As child interpreters from the command line, each with a time limit (its whole
process group ended at the limit: torchrun's worker too); in a test as calls in its process through quest's Python
API (the same overrides), where nothing can be cut short."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["cli_run", "train_run", "toy_quick", "toy_chunk", "input_on_device", "ROOT"]


def cli_run(args: list[str], cwd: Path, env: dict[str, str], timeout: float, summary: bool = True) -> dict[str, Any]:
    """``args`` as a child in its own process group, ended (SIGTERM, then SIGKILL) after ``timeout`` seconds: its
    exit code (None when ended), time, output's tail and (``summary``) the summary.json it wrote under ``cwd``."""
    tic = time.perf_counter()
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    ended, stdout, stderr = False, "", ""
    try:
        stdout, stderr = proc.communicate(timeout=max(timeout, 1.0))
    except BaseException as exc:  # the limit, or this process stopped (SIGTERM, Ctrl-C): no child outlives it
        if not isinstance(exc, subprocess.TimeoutExpired):
            _end_group(proc, signal.SIGKILL)
            raise
        ended = True
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
            if not _end_group(proc, sig):
                break
            try:
                stdout, stderr = proc.communicate(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
    seconds = time.perf_counter() - tic
    found = next(cwd.rglob("summary.json"), None) if summary else None
    out = {"returncode": None if ended else proc.returncode, "seconds": seconds,
           "summary": json.loads(found.read_text()) if found else None, "stdout_tail": (stdout or "")[-4000:],
           "stderr_tail": (stderr or "")[-1500:] if ended or proc.returncode else "",
           "error_line": error_line(stderr or "") if ended or proc.returncode else ""}
    if ended:
        out["ended"] = f"at the budget, after {timeout:.0f} s"
    return out


def _end_group(proc: subprocess.Popen, sig: int) -> bool:
    """Send ``sig`` to the process group ``proc`` leads (started by cli_run: torchrun and its worker, say); False
    when it is gone already."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return False
    return True


def error_line(stderr: str) -> str:
    """The line of a failed run's error stream that says what went wrong: quest's one-line error (``train.py: error:
    ...``), else a traceback's last exception line (not torchrun's ChildFailedError about its worker), else the last
    line with words."""
    lines = [line.strip() for line in stderr.splitlines() if any(c.isalnum() for c in line)]
    for pattern in (r"^[\w.-]+: error: ", r"^[\w.]*(Error|Exception)\b.*: "):
        found = [line for line in lines if re.match(pattern, line) and "ChildFailedError" not in line]
        if found:
            return found[-1][:300]
    return (lines or [""])[-1][:300]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_process(work: Callable[[], int]) -> dict[str, Any]:
    """``work()`` (an exit code) as cli_run reports a child: an exception is exit 1 with its traceback as stderr."""
    tic = time.perf_counter()
    try:
        code, tail = int(work()), ""
    except Exception:
        code, tail = 1, traceback.format_exc()[-1500:]
    return {"returncode": code, "seconds": time.perf_counter() - tic, "stderr_tail": tail, "error_line": error_line(tail)}


def train_run(overrides: list[str], cwd: Path, env: dict[str, str], torchrun: bool, in_process: bool,
              timeout: float = 1200) -> dict[str, Any]:
    """``python train.py *overrides`` in ``cwd`` (``torchrun``: launched by torch.distributed.run, one process). With
    ``in_process``: the config composed from the same overrides and trained by quest.train.fit in this process, under
    the variables torchrun gives its one worker (so fit joins a one-process gloo group), instead of a child."""
    if not in_process:
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
                     f"--master_port={_free_port()}"] if torchrun else [sys.executable])
        return cli_run([*launcher, str(ROOT / "train.py"), *overrides], cwd, env, timeout)
    import torch.distributed as dist
    from hydra import compose, initialize_config_dir

    from quest.cli import config_root
    from quest.config.hydra_store import register_configs
    from quest.train import exit_code, fit

    def work() -> int:
        register_configs()
        with initialize_config_dir(config_dir=str(config_root()), version_base="1.3"):
            cfg = compose("train", overrides=overrides)
        ranks = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())} if torchrun else {}
        with mock.patch.dict(os.environ, {**env, **ranks}):  # restored afterwards: the caller's process goes on
            try:
                return exit_code(fit(cfg, cwd / "run"))
            finally:
                if torchrun and dist.is_initialized():  # a process goes on after this run: leave no group behind
                    dist.destroy_process_group()

    out = _in_process(work)
    summary = next(cwd.rglob("summary.json"), None)
    return {**out, "summary": json.loads(summary.read_text()) if summary else None}


def toy_quick(device: torch.device, overrides: list[str], env: dict[str, str], in_process: bool,
              timeout: float = 1200) -> dict[str, Any]:
    """``python -m quest.toy grid=quick device=<device> *overrides``: its exit code, time and summary table; with
    ``in_process`` the same config composed and run by quest.toy.study.run_study in this process."""
    with tempfile.TemporaryDirectory() as tmp:
        args = ["grid=quick", f"device={device.type}", f"out_dir={tmp}", *overrides]
        if not in_process:
            out = cli_run([sys.executable, "-m", "quest.toy", *args], ROOT, env, timeout, summary=False)
            table = [line for line in out["stdout_tail"].splitlines() if line.startswith("|")]  # not its log lines
            return {**{k: v for k, v in out.items() if k not in ("summary", "stdout_tail")}, "table": "\n".join(table)}
        from hydra import compose, initialize_config_dir
        from omegaconf import OmegaConf

        from quest.cli import config_root
        from quest.toy.config import register_toy_config
        from quest.toy.outcomes import summary_table
        from quest.toy.study import run_study

        table: list[str] = []

        def work() -> int:
            register_toy_config()
            with initialize_config_dir(config_dir=str(config_root() / "toy"), version_base="1.3"):
                cfg = compose("toy", overrides=args)
            table.append(summary_table(run_study(OmegaConf.to_container(cfg, resolve=True), tmp)["success_rates"]))
            return 0

        return {**_in_process(work), "table": "".join(table).strip()[-600:]}


def toy_chunk(device: torch.device, smoke: bool) -> dict[str, Any]:
    """One full-grid chunk of the toy study (QUEST, 150 runs: every lr x weight decay x 5 initialisations) timed
    end to end, compilation included, and the full grid's time estimated from it (30 such chunks)."""
    from bench.toy import grid_specs  # the full grid's chunk: every lr x weight decay cell x 5 initialisations
    from quest.toy import ToyDataConfig, make_toy_data, train_chunk

    specs = grid_specs(150)
    cfg = ToyDataConfig(train_size=64 if smoke else 4096, test_size=64 if smoke else 1024)
    data = make_toy_data(cfg, 0)
    epochs = 1 if smoke else 50
    kwargs = {"seq_len": cfg.seq_len, "dim": cfg.dim, "num_classes": cfg.num_classes}
    tic = time.perf_counter()
    res = train_chunk("quest", specs, data.train, data.test, 0, epochs, 32, kwargs, compile=not smoke, device=device)
    seconds = time.perf_counter() - tic
    run_steps = len(specs) * epochs * -(-cfg.train_size // 32)
    return {"chunk_runs": len(specs), "train_size": cfg.train_size, "epochs": epochs, "chunk_seconds": seconds,
            "phases": res.seconds, "run_steps_per_s": run_steps / seconds,
            "full_grid_estimate_s": 30 * seconds}  # 6 formulations x 5 data realisations


def input_on_device(device: torch.device, smoke: bool) -> dict[str, Any]:
    """The device's share of data.pipeline=split and =device (docs/data.md): img/s of the DeiT augmentation on
    batches (RandAugment rand-m9-mstd0.5-inc1, normalise, random erasing 0.25) from uint8 crops, and of the whole
    input from JPEG bytes (decode with nvJPEG, crop, flip, then the same); and whether the device's RandAugment
    gives the CPU's pixels for the same draws."""
    import random

    from omegaconf import OmegaConf

    from bench.data_inputs import make_jpegs
    from quest.data.pipelines.device_augment import DeviceRandAugment
    from quest.data.pipelines.tensor_input import CropFlip, DeviceFinish, decode_rgb

    size, batch, rounds = (32, 8, 2) if smoke else (224, 128, 10)
    recipe = OmegaConf.create({"auto_augment": "rand-m9-mstd0.5-inc1", "reprob": 0.25, "remode": "pixel",
                               "recount": 1, "train_interpolation": "bicubic"})
    data = OmegaConf.create({"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]})
    crop = CropFlip(size, (0.08, 1.0), (3 / 4, 4 / 3), "bicubic", 0.5)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    random.seed(0), torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        encoded = [torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8)
                   for p in make_jpegs(Path(tmp), batch)]
    crops = torch.stack([crop(decode_rgb(e)) for e in encoded]).to(device)
    stages = {"split: RA + normalise + erase from uint8 crops": (DeviceFinish(recipe, data, size), crops),
              "device: decode + crop + flip + RA + normalise + erase from JPEG bytes":
                  (DeviceFinish(recipe, data, size, crop=crop), encoded)}
    out: dict[str, Any] = {"batch": batch, "img_size": size, "img_per_s": {}}
    for name, (finish, images) in stages.items():
        finish(images, device)  # warm-up
        sync()
        times = []
        for _ in range(rounds):
            tic = time.perf_counter()
            finish(images, device)
            sync()
            times.append(time.perf_counter() - tic)
        out["img_per_s"][name] = batch / statistics.median(times)
    augment = DeviceRandAugment("rand-m9-mstd0.5-inc1", size, data.mean)
    draws = augment.draw(batch)
    out["rand_augment_equals_cpu"] = torch.equal(augment.apply(crops, draws).cpu(), augment.apply(crops.cpu(), draws))
    out["ok"] = out["rand_augment_equals_cpu"]
    return out
