"""DDP and FSDP on CPU with gloo: 2 processes x batch b train what 1 process x batch 2b trains, resume exactly, make
one collective per step, and refuse ranks that see different data."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from quest.run.checkpoint import load_checkpoint

from ..helpers import ROOT
from ..warm import run_app

# Two ranks on a 2-core machine: these tests take it whole, one after another on one xdist worker. Whole training
# runs in two ranks, end to end (slow: out of the fast tier, as when every one of them started torchrun).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("machine")]

# no random augmentation, dropout, drop path, mixup or EMA: the two runs must do the same arithmetic
DETERMINISTIC = [
    "data=fake", "data.img_size=16", "data.fake_train_size=64", "data.fake_val_size=30", "model=vit_pico",
    "recipe=light", "recipe.scale=[1.0,1.0]", "recipe.ratio=[1.0,1.0]", "recipe.smoothing=0", "recipe.ema=false",
    "trainer.epochs=2", "trainer.log_every_n_steps=1",
]
# float32 sums of per-rank gradients are reduced in another order than one process's sum: equal to round-off
TOLERANCE = dict(atol=2e-5, rtol=1e-4)


def _env() -> dict[str, str]:
    return {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], cwd: Path, nproc: int = 1, check: bool = True) -> list[subprocess.CompletedProcess]:
    """``train.py *args`` as ``nproc`` ranks, each forked from the warm zygote (tests/warm.py) with the environment
    torchrun gives its workers: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are all that
    quest.runtime.distributed reads. What these runs prove (the arithmetic of 2 ranks, exact resumes) does not depend
    on who set those variables, and a fork starts in milliseconds where torchrun's three interpreters spent ~10 s of
    imports per run. The launcher itself is proven by the one-collective test at the end, a training under torchrun.
    One thread each, said explicitly: the zygote read OMP_NUM_THREADS when it imported torch, not this run."""
    args = [*args, "trainer.torch_threads=1"]
    port = _free_port()

    def rank(r: int) -> subprocess.CompletedProcess:
        dist = {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} if nproc > 1 else {}
        # a rank that fails closes its gloo sockets, and the other rank's next collective fails with it
        return run_app("train.py", *args, cwd=cwd, env={**_env(), **dist}, timeout=600)

    with ThreadPoolExecutor(nproc) as pool:
        outs = list(pool.map(rank, range(nproc)))
    for r, out in enumerate(outs):
        assert out.returncode == 0 or not check, f"rank {r}: {out.stderr[-3000:]}"
    return outs


def _torchrun(script: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The real launcher, torchrun's agent starting two interpreters: a training under it is proven once, below."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={_free_port()}", str(script), *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """One process x batch 16, run once: the DDP and the FSDP runs of 2 x 8 are both compared with it."""
    d = tmp_path_factory.mktemp("one")
    _run([*DETERMINISTIC, "data.batch_size=16", f"hydra.run.dir={d / 'one'}"], d)
    return d / "one"


def test_two_processes_equal_one_process_with_twice_the_batch(tmp_path, one_process):
    _run([*DETERMINISTIC, "data.batch_size=8", f"hydra.run.dir={tmp_path / 'two'}"], tmp_path, nproc=2)
    one, two = (load_checkpoint(d / "checkpoints" / "last.pt") for d in (one_process, tmp_path / "two"))
    assert one["state"]["step"] == two["state"]["step"] == 8
    for key, value in one["model"].items():
        torch.testing.assert_close(two["model"][key], value, **TOLERANCE, msg=key)
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (one_process, tmp_path / "two"))
    assert (s1["global_batch"], s2["global_batch"], s2["world_size"]) == (16, 16, 2)
    assert s1["lr"] == s2["lr"]
    # validation over 30 images split 15/15 without padding: the same numbers as one process
    assert abs(s1["val/top1"] - s2["val/top1"]) < 1e-4 and abs(s1["val/loss"] - s2["val/loss"]) < 1e-4
    # only rank 0 wrote outputs: one metrics line per step, not two
    rows = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 9))


def test_two_process_run_resumes_exactly_with_per_rank_randomness(tmp_path):
    random_aug = ["data=fake", "data.img_size=16", "data.fake_train_size=64", "data.fake_val_size=16",
                  "data.batch_size=8", "model=vit_pico", "recipe=light", "recipe.drop_path=0.1", "trainer.epochs=2"]
    _run([*random_aug, f"hydra.run.dir={tmp_path / 'straight'}"], tmp_path, nproc=2)
    _run([*random_aug, "trainer.max_steps=3", f"hydra.run.dir={tmp_path / 'resumed'}"], tmp_path, nproc=2)
    _run([*random_aug, f"hydra.run.dir={tmp_path / 'resumed'}"], tmp_path, nproc=2)
    a, b = (load_checkpoint(tmp_path / d / "checkpoints" / "last.pt") for d in ("straight", "resumed"))
    assert len(b["rng"]) == 2 and not torch.equal(b["rng"][0]["torch"], b["rng"][1]["torch"])
    for part in ("model", "ema"):
        for key, value in a[part].items():
            torch.testing.assert_close(b[part][key], value, atol=0, rtol=0, msg=f"{part}.{key}")


def test_fsdp_trains_like_ddp_and_resumes_from_sharded_checkpoints(tmp_path, one_process):
    fsdp = [*DETERMINISTIC, "data.batch_size=8", "trainer.strategy=fsdp"]
    _run([*fsdp, f"hydra.run.dir={tmp_path / 'fsdp'}"], tmp_path, nproc=2)
    _run([*fsdp, "trainer.max_steps=3", f"hydra.run.dir={tmp_path / 'resumed'}"], tmp_path, nproc=2)
    _run([*fsdp, f"hydra.run.dir={tmp_path / 'resumed'}"], tmp_path, nproc=2)
    one, full, resumed = (load_checkpoint(d / "checkpoints" / "last.pt")
                          for d in (one_process, tmp_path / "fsdp", tmp_path / "resumed"))
    assert full["sharded"] == "last.dcp" and (tmp_path / "fsdp" / "checkpoints" / "last.dcp" / ".metadata").is_file()
    for key, value in one["model"].items():  # last.pt holds the gathered, unsharded weights
        torch.testing.assert_close(full["model"][key], value, **TOLERANCE, msg=key)
        torch.testing.assert_close(resumed["model"][key], full["model"][key], atol=0, rtol=0, msg=key)
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (one_process, tmp_path / "fsdp"))
    assert abs(s1["val/top1"] - s2["val/top1"]) < 1e-4 and abs(s1["val/loss"] - s2["val/loss"]) < 1e-3


def test_ranks_that_see_different_data_are_refused_naming_each_ranks_counts(tmp_path):
    """Rank 1's copy of the data root holds more training images than rank 0's (data.root resolves per rank
    through ${oc.env:RANK}): refused before the first collective of training, with every rank's counts, instead of
    a collective mismatch (gloo) or a hang (NCCL)."""
    from PIL import Image

    for rank, per_class in ((0, 4), (1, 6)):
        for split, count in (("train", per_class), ("val", 2)):
            for c in ("a", "b"):
                d = tmp_path / f"rank{rank}" / split / c
                d.mkdir(parents=True)
                for i in range(count):
                    Image.new("RGB", (16, 16), (40 * i, 0, 0)).save(d / f"{i}.png")
    args = ["data=imagefolder", f"data.root='{tmp_path}/rank${{oc.env:RANK}}'", "data.num_classes=2",
            "data.img_size=16", "data.batch_size=2", "data.num_workers=0", "model=vit_pico", "recipe=light",
            "trainer.epochs=1", f"hydra.run.dir={tmp_path / 'run'}"]
    outs = _run(args, tmp_path, nproc=2, check=False)  # every rank refuses with the same code; rank 0 says why
    assert [out.returncode for out in outs] == [1, 1], [out.stderr[-3000:] for out in outs]
    assert "rank 0: train samples 8, val samples 4; rank 1: train samples 12, val samples 4" in outs[0].stderr, \
        outs[0].stderr[-3000:]
    assert "RankDataMismatch" in outs[0].stderr  # (HYDRA_FULL_ERROR=1, the suite's: its traceback too)
    assert "train.py: error: " not in outs[1].stderr, outs[1].stderr[-3000:]  # the same error, said once
    for out in outs:
        assert "ollective" not in out.stderr  # not gloo's mismatch abort
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# Run inside each process of a 2-process run: counts the collectives (torch.distributed.all_reduce) and quest's host
# reads (Tensor.item / tolist / bool / float / int called from quest's code, as in test_train.py's one-process
# test: torch's own optimizer reads its CPU step counters) from the start of one optimizer step to the start of the
# next, everything the loop does between them included (the stop-signal check, logging, the checkpoint cadence),
# except drawing the next batch. DDP's gradient all-reduce runs in its C++ reducer, not through
# torch.distributed.all_reduce: it is not counted.
_COUNTING = '''
import atexit, json, os, sys
sys.path.insert(0, {root!r})
import torch
import torch.distributed as dist
from quest.train.trainer import Run

windows, on = [], [False]

def counted(kind, original, quests_only):
    def wrapper(*args, **kwargs):
        if on[0] and windows and (not quests_only or
                                  sys._getframe(1).f_globals.get("__name__", "").startswith("quest.")):
            windows[-1][kind] += 1
        return original(*args, **kwargs)
    return wrapper

for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
    setattr(torch.Tensor, name, counted("reads", getattr(torch.Tensor, name), True))
dist.all_reduce = counted("all_reduce", dist.all_reduce, False)
step, batches_of = Run.train_step, Run.step_batches

def train_step(self, batches, **kw):
    windows.append({{"reads": 0, "all_reduce": 0}})
    return step(self, batches, **kw)

def step_batches(self):
    for batches in batches_of_paused(self):
        on[0] = True
        yield batches

def batches_of_paused(self):
    it = batches_of(self)
    while True:
        on[0] = False  # drawing the next batch is not counted
        try:
            batches = next(it)
        except StopIteration:
            return
        yield batches

Run.train_step, Run.step_batches = train_step, step_batches
atexit.register(lambda: open(f"counts{{os.environ['RANK']}}.json", "w").write(json.dumps(windows)))
sys.argv[0] = "train.py"
from quest.cli import train
train()
'''


@pytest.mark.process
def test_one_collective_and_one_host_read_per_optimizer_step_under_ddp(tmp_path):
    """docs/training.md, "The training loop": under DDP each optimizer step makes exactly one collective and one
    device-to-host read, the stop-signal check included (this rank's stop request rides in the step's flags), with
    gradient accumulation and a log row every step."""
    (tmp_path / "counting.py").write_text(_COUNTING.format(root=str(ROOT)))
    args = ["data=fake", "data.img_size=16", "data.fake_train_size=256", "data.fake_val_size=16", "data.batch_size=8",
            "model=vit_pico", "recipe=light", "trainer.epochs=1", "trainer.accum_steps=2", "trainer.max_steps=6",
            "trainer.log_every_n_steps=1", f"hydra.run.dir={tmp_path / 'run'}"]
    out = _torchrun(tmp_path / "counting.py", args, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["step"] == 6
    for rank in (0, 1):
        windows = json.loads((tmp_path / f"counts{rank}.json").read_text())
        assert len(windows) == 6, windows  # steps 1..6 of 8 in the epoch: no validation inside the windows
        # every window but the last, which runs on into the run's end (the final save and validation)
        assert windows[:-1] == [{"reads": 1, "all_reduce": 1}] * 5, (rank, windows)
