"""Every training input pipeline (data.pipeline=timm, split, device) with loader workers: the batches are those of a
loader without workers, and a worker's failure ends the loop with one line naming the pipeline, the worker and the
cause, never a hang (quest.data.worker_errors). The workers are torch's DataLoader processes (forked by
multiprocessing, no interpreter started); every test has a timeout, so a hang fails it instead of the suite."""
from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset

from quest.data.pipelines.prefetch import finish_ahead
from quest.data.pipelines.tensor_input import _read_bytes
from quest.data.pipelines.train_input import build_train_input
from quest.data.worker_errors import LoaderWorkerError, NamedLoader
from quest.runtime.distributed import DistContext
from quest.runtime.errors import is_user_error
from quest.train.builders import _loaders

from ..helpers import compose_cfg

# RandomResizedCrop at scale 1 and the images' own ratio (40 x 30: 4/3) is the whole image, no flip, no erasing:
# the worker's draws (seeded per worker by torch) choose nothing, so every pipeline gives the same pixels however
# many workers there are
WHOLE = ["recipe.scale=[1.0,1.0]", "recipe.ratio=[1.3333333333333333,1.3333333333333333]", "recipe.hflip=0",
         "recipe.reprob=0"]
# random crops, flips and erasing: drawn in the training process by data.pipeline=device (its workers read bytes)
RANDOM = ["recipe.hflip=0.5", "recipe.reprob=0.25", "recipe.remode=pixel"]


def _jpegs(root: Path) -> Path:
    """2 classes x 6 photographs of 40 x 30 (JPEG) in an image folder's layout (train and val)."""
    for split in ("train", "val"):
        for c in range(2):
            folder = root / split / f"n0000000{c}"
            folder.mkdir(parents=True)
            for i in range(6):
                pixels = np.random.default_rng(10 * c + i).integers(0, 256, (30, 40, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"img{i}.JPEG", quality=90)
    return root


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory) -> Path:
    return _jpegs(tmp_path_factory.mktemp("jpegs"))


def _batches(root: Path, pipeline: str, workers: int, recipe: list[str]) -> list[tuple[torch.Tensor, list[int]]]:
    """The finished batches of one epoch of the training loader quest builds (quest.train.builders), under fixed
    seeds."""
    cfg = compose_cfg("data=imagefolder", f"data.root={root}", "data.num_classes=2", "data.img_size=16",
                      "data.batch_size=4", f"data.num_workers={workers}", f"data.pipeline={pipeline}",
                      "model=vit_pico", "recipe=light", *recipe)
    train_input = build_train_input(cfg.recipe, cfg.data, 16)
    loader, val = _loaders(cfg, DistContext(), 16, train_input)
    assert isinstance(loader, NamedLoader) and loader.num_workers == workers
    assert isinstance(val, NamedLoader) and val.name == "validation"  # its worker's failure is one line too
    loader.sampler.set_epoch(0)
    loader.generator.manual_seed(5)
    random.seed(3), torch.manual_seed(3)
    return [(images, targets.tolist())
            for images, targets, _ in finish_ahead(loader, train_input.finish, torch.device("cpu"))]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline", ["timm", "split", "device"])
def test_every_pipeline_gives_the_same_batches_with_two_workers_as_without(jpegs, pipeline):
    """Crops that are the whole image (no draw decides anything): bit for bit the batches of a loader without
    workers, in the same order, for each pipeline."""
    alone = _batches(jpegs, pipeline, 0, WHOLE)
    workers = _batches(jpegs, pipeline, 2, WHOLE)
    assert len(alone) == len(workers) == 3
    for (a, ta), (b, tb) in zip(alone, workers):
        assert ta == tb and a.dtype == b.dtype == torch.float32 and a.shape == (4, 3, 16, 16)
        assert torch.equal(a, b)
    assert not torch.equal(alone[0][0], alone[1][0])  # the batches are images, not a constant


@pytest.mark.timeout(60)
def test_the_device_pipeline_draws_the_same_random_batches_with_workers(jpegs):
    """data.pipeline=device draws every crop, flip and erasing box in the training process: random augmentation
    is bit for bit the same with two workers as without. (timm and split draw in the workers, each seeded by torch
    per worker: the same for the same seeds and worker count, other draws than without workers.)"""
    alone = _batches(jpegs, "device", 0, RANDOM)
    workers = _batches(jpegs, "device", 2, RANDOM)
    for (a, ta), (b, tb) in zip(alone, workers):
        assert ta == tb and torch.equal(a, b)
    whole = _batches(jpegs, "device", 0, WHOLE)
    assert not torch.equal(alone[0][0], whole[0][0])  # the draws did something
    for pipeline in ("timm", "split"):
        first, again = _batches(jpegs, pipeline, 2, RANDOM), _batches(jpegs, pipeline, 2, RANDOM)
        assert all(ta == tb and torch.equal(a, b) for (a, ta), (b, tb) in zip(first, again))


@pytest.mark.timeout(120)
def test_data_pipeline_device_trains_with_a_loader_worker(jpegs, tmp_path):
    """The run that failed: data.pipeline=device, one loader worker, JPEG files; it trains to the end."""
    from quest.train import fit

    summary = fit(compose_cfg("data=imagefolder", f"data.root={jpegs}", "data.num_classes=2", "data.img_size=16",
                              "data.batch_size=4", "data.num_workers=1", "data.pipeline=device", "model=vit_pico",
                              "recipe=light", "trainer.epochs=1"), tmp_path / "run")
    assert summary["status"] == "completed" and summary["train_input"].startswith("device: ")


def test_a_batch_of_files_is_one_ordinary_buffer_torch_can_send(jpegs):
    """The cause of data.pipeline=device's failure with workers, and its fix, without a worker: torchvision's
    read_file maps the file, and torch's sharing (what a worker's queue runs) fails on it with "Bad file descriptor";
    collate_bytes copies a batch's files into one buffer, which it sends, and which gives back each file's bytes."""
    import errno
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

    from quest.data.pipelines.tensor_input import EncodedBatch, collate_bytes

    files = _Files(jpegs)
    mapped = files[0][0]
    with pytest.raises(OSError) as err:
        ForkingPickler.dumps(mapped)
    assert err.value.errno == errno.EBADF
    batch, targets, skipped = collate_bytes([files[0], None, files[3]])
    assert isinstance(batch, EncodedBatch) and len(batch) == 2 and targets.tolist() == [0, 3] and skipped == 1
    ForkingPickler.dumps(batch)  # one storage, in shared memory once sent
    assert all(torch.equal(a, b) for a, b in zip(batch.files(), (files[0][0], files[3][0])))
    empty, _, skipped = collate_bytes([None, None])
    assert len(empty) == 0 and empty.files() == [] and skipped == 2


class _Files(Dataset):
    """Each item: a file's bytes as torchvision's read_file gives them and its index; ``fail(index)`` first."""

    def __init__(self, root: Path, fail=None):
        self.paths = sorted(str(p) for p in (root / "train").rglob("*.JPEG"))
        self.fail = fail

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        if self.fail is not None:
            self.fail(index)
        return _read_bytes(self.paths[index]), index


def _raise_in_second_batch(index: int) -> None:
    if index == 5:
        raise ValueError(f"cannot read image number {index}")


def _bug(index: int) -> None:
    raise ZeroDivisionError("division by zero")


def _exit(index: int) -> None:
    os._exit(3)


def _stall(index: int) -> None:
    if index < 4:  # batch 0, worker 0's: the loader waits for it; worker 1 goes on
        time.sleep(3600)


def _collate_as_is(batch: list) -> list:
    """No copy: the file-mapped tensors of torchvision's read_file go to the queue as they are (what
    data.pipeline=device collated before its EncodedBatch)."""
    return batch


def _failure(dataset: Dataset, collate=None, timeout: float | None = None) -> BaseException:
    from quest.data.pipelines.tensor_input import collate_bytes

    loader = NamedLoader(dataset, batch_size=4, num_workers=2, collate_fn=collate or collate_bytes,
                            name="data.pipeline=device", **({"timeout": timeout} if timeout else {}))
    with pytest.raises(Exception) as caught:
        for _ in loader:
            pass
    return caught.value


@pytest.mark.timeout(60)
def test_an_error_raised_in_a_worker_is_one_line_naming_the_pipeline_the_worker_and_the_cause(jpegs):
    failure = _failure(_Files(jpegs, _raise_in_second_batch))
    assert isinstance(failure, LoaderWorkerError) and is_user_error(failure)
    # batch 1 (indices 4..7) goes to worker 1
    assert str(failure) == "data.pipeline=device: loader worker 1 failed: ValueError: cannot read image number 5"
    bug = _failure(_Files(jpegs, _bug))  # not the user's: a RuntimeError, its traceback printed
    assert not is_user_error(bug) and str(bug) == ("data.pipeline=device: loader worker 0 failed: ZeroDivisionError: "
                                                   "division by zero")


def _killed(index: int) -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer ends a process


@pytest.mark.timeout(60)
@pytest.mark.parametrize("end, cause", [(_exit, "exited with code 3"), (_killed, "killed by signal SIGKILL")],
                         ids=["exit", "sigkill"])
def test_a_worker_that_dies_is_one_line_with_how_it_ended(jpegs, end, cause):
    failure = _failure(_Files(jpegs, end))
    assert isinstance(failure, LoaderWorkerError) and is_user_error(failure)
    assert str(failure) in {f"data.pipeline=device: loader worker {n} failed: {cause}" for n in (0, 1)}


@pytest.mark.timeout(60)
def test_a_worker_that_sends_nothing_ends_the_loop_at_the_timeout(jpegs):
    """A stuck worker (here asleep) and the failure this pipeline had (a batch of file-mapped tensors torch cannot
    send: the worker lives on, the loader waits for its batch): after the timeout, one line instead of a hang."""
    for dataset, collate in ((_Files(jpegs, _stall), None), (_Files(jpegs), _collate_as_is)):
        failure = _failure(dataset, collate, timeout=2)
        assert isinstance(failure, LoaderWorkerError)
        assert str(failure).startswith("data.pipeline=device: loader worker 0 failed: sent no batch in 2 s")
    assert NamedLoader(_Files(jpegs), num_workers=1, name="data.pipeline=device").timeout > 0  # what training gets
    assert NamedLoader(_Files(jpegs), name="data.pipeline=device").timeout == 0  # without workers torch allows none


@pytest.mark.timeout(120)
def test_train_py_ends_with_the_one_line_when_a_worker_fails(jpegs, tmp_path):
    """The whole path: an undecodable file read by split's worker (pre-flight off, data.bad_images=error) ends
    train.py with the one error line naming the pipeline, the worker and the file, exit code 1, no traceback."""
    import shutil

    from ..warm import run_app

    root = tmp_path / "data"
    shutil.copytree(jpegs, root)
    bad = root / "train" / "n00000000" / "img0.JPEG"
    bad.write_bytes(b"not a jpeg at all")
    out = run_app("train.py", "data=imagefolder", f"data.root={root}", "data.num_classes=2", "data.img_size=16",
                  "data.batch_size=12", "data.num_workers=1", "data.pipeline=split", "data.preflight=false",
                  "model=vit_pico", "recipe=light", "trainer.epochs=1", f"hydra.run.dir={tmp_path / 'run'}",
                  cwd=tmp_path, env={**os.environ, "HYDRA_FULL_ERROR": "0"})  # the suite's own shows tracebacks
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, out.stderr[-3000:]
    assert errors[0].startswith(f"train.py: error: data.pipeline=split: loader worker 0 failed: CorruptImageError: "
                                f"cannot read image {bad}: cannot decode an image of 17 bytes")
    assert errors[0].endswith("Set data.bad_images=skip to skip such files.")
