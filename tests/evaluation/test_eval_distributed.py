"""Two gloo processes on CPU give exactly the numbers of one: no sample dropped, duplicated or reordered."""
from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from quest.evaluation.imagenet_data import subset_classes
from quest.evaluation.runner import run_evaluations
from quest.runtime.distributed import DistContext, init_distributed

from ..eval_helpers import PixelCodeModel, digits_target, linear_digits_model, oracle_target, settings, write_wnid_tree


def _fixture(root: Path) -> None:
    indices, _ = subset_classes("a")
    # 5 val images (odd: the shards differ in size), one of them wrong
    shown = [(3, 3), (3, 4), (7, 7), (indices[0], indices[0]), (9, 9)]  # (folder class, class in the image)
    write_wnid_tree(root / "val", [(f, c, f"ILSVRC2012_val_{i + 1:08d}.JPEG") for i, (f, c) in enumerate(shown)])
    (root / "real.json").write_text(json.dumps([[3], [4, 3], [], [indices[0]], [8]]))
    write_wnid_tree(root / "a", [(indices[0], indices[0], "1.jpg"), (indices[1], indices[0], "2.jpg"),
                                 (indices[2], indices[2], "3.jpg")])


def _evaluate(ctx: DistContext, root: Path) -> dict:
    imagenet = settings(run=["imagenet_val", "imagenet_real", "imagenet_a"], batch_size=2, roots__val=str(root / "val"),
                        roots__a=str(root / "a"), imagenet_real__real_json=str(root / "real.json"))
    digits = settings(run=["clean", "corruptions", "adversarial"], batch_size=4, clean__max_samples=15,
                      corruptions__max_samples=9, corruptions__corruptions=["gaussian_noise", "frost"],
                      corruptions__extra_corruptions=["speckle_noise"], corruptions__severities=[2, 5],
                      adversarial__max_samples=9, adversarial__attacks=["fgsm", "pgd", "spsa"],
                      adversarial__pgd__eps=[0.03], adversarial__spsa__max_samples=5,
                      adversarial__spsa__nb_iter=2, adversarial__spsa__nb_sample=4)
    out = {"imagenet": run_evaluations(oracle_target(PixelCodeModel()), imagenet, ctx),
           "digits": run_evaluations(digits_target(linear_digits_model(seed=1)), digits, ctx)}
    return json.loads(json.dumps(out, default=str))


def _worker(rank: int, world: int, port: int, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    try:
        results = _evaluate(ctx, Path(root))
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _same(a, b, path=""):
    if isinstance(a, dict):
        keys = set(a) - {"seconds"}
        assert keys == set(b) - {"seconds"}, path
        for k in keys:
            _same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), (path, a, b)
    else:
        assert a == b, (path, a, b)


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    _fixture(tmp_path)
    single = _evaluate(DistContext(), tmp_path)
    out = tmp_path / "ddp.json"
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path), str(out)), nprocs=2, join=True)
    double = json.loads(out.read_text())
    _same(single, double)
    # and the numbers are the designed ones
    assert single["imagenet"]["imagenet_val"]["top1"] == pytest.approx(80.0)
    assert single["imagenet"]["imagenet_real"]["top1"] == pytest.approx(75.0)  # file 2 (shows 4: in {4, 3}) right
    assert single["imagenet"]["imagenet_real"]["n"] == 4
    assert single["imagenet"]["imagenet_a"]["top1"] == pytest.approx(200 / 3)
    assert single["digits"]["adversarial"]["clean"]["n"] == 9
