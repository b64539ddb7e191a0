"""No process outlives its command (quest/runtime/workers.py): the data pre-flight's worker pool ends with the command
whatever ends it, including a signal it does not handle (SIGTERM kills Python at once, with no cleanup that would
join the pool) and SIGKILL; the same initializer is in every pool and loader quest starts (checked below)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ..helpers import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc")


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc: no psutil)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """An image folder whose pre-flight takes seconds: 1,500 noisy 96 px PNGs."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for c in range(2):
        folder = root / "train" / f"c{c}"
        folder.mkdir(parents=True)
        for i in range(750):
            Image.fromarray(rng.integers(0, 256, (96, 96, 3), dtype=np.uint8)).save(folder / f"{i}.png",
                                                                                   compress_level=0)
    return root


@pytest.mark.process  # a command killed from outside, and the processes it started: only real processes show it
@pytest.mark.xdist_group("machine")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT])
def test_the_preflight_workers_end_with_the_command(images, tmp_path, signum):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "quest.tools.data_check", "check", str(images), "--workers", "2", "--no-cache",
           "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and len(workers) < 2:
            workers = [p for p in _children(proc.pid) if "python" in Path(f"/proc/{p}/cmdline").read_bytes().decode(
                errors="replace").split("\0")[0]] if _alive(proc.pid) else []
            time.sleep(0.02)
        assert len(workers) == 2 and proc.poll() is None, "the pre-flight ended before its workers could be seen"
        os.kill(proc.pid, signum)  # mid-check: the workers have 1,500 images to decode
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the kernel ends the workers when their parent goes (SIGKILL: no handler, nothing to wait for); the loop only
    # waits for it to have done so
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in workers if _alive(p)], f"workers outlived the command: {workers}"


def test_every_pool_and_loader_quest_starts_dies_with_its_parent():
    """The mechanism is in each place that starts workers (a new pool without it fails here)."""
    import re

    starts = re.compile(r"ProcessPoolExecutor\(|\.Pool\(|DataLoader\(")
    missing = []
    for path in sorted(p for p in (ROOT / "quest").rglob("*.py") if p.name != "workers.py"):
        text = path.read_text()
        for match in starts.finditer(text):
            call = text[match.start():text.find("\n\n", match.start())]
            if "num_workers" not in call and "Pool" not in call:
                continue  # a loader without workers of its own
            if not re.search(r"die_with_parent|loader_worker_init|_worker_init", call):
                missing.append(f"{path.relative_to(ROOT)}: {call.splitlines()[0].strip()}")
    assert not missing, missing
