"""A shard member that is not a regular file (a link, a directory, a device, a FIFO) is refused by every tool that
reads shards, naming the shard and the member; a member whose name starts with '.' is no part of any sample, in every
tool alike (docs/data.md, "Which entries are data")."""
from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Callable

import pytest

from quest.data.shard_index import ShardError, count_samples, resolve_shards
from quest.data.shard_preflight import check_shard_split
from quest.data.shards import WdsDataset
from quest.tools.data_check import check_root

from .test_shard_preflight import SHARD, make_shards


def _member(name: str, kind: bytes, **fields) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    for key, value in fields.items():
        setattr(info, key, value)
    return info


# kind -> a member that is not a regular file, placed after the shard's first sample
IRREGULAR = {
    "symbolic link": lambda first: _member("x.json", tarfile.SYMTYPE, linkname="/etc/passwd"),
    "hard link": lambda first: _member("x.json", tarfile.LNKTYPE, linkname=first),
    "directory": lambda first: _member("x", tarfile.DIRTYPE, mode=0o755),
    "character device": lambda first: _member("x.json", tarfile.CHRTYPE, devmajor=1, devminor=3),
    "FIFO": lambda first: _member("x.json", tarfile.FIFOTYPE),
}


def _insert(shard: Path, extra: Callable[[str], tarfile.TarInfo], payload: bytes = b"") -> str:
    """Rewrite ``shard`` with one more member after its first sample; returns that member's name."""
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    first_key = members[0][0].name.split(".", 1)[0]
    after = max(i for i, (m, _) in enumerate(members) if m.name.split(".", 1)[0] == first_key)
    added = extra(members[0][0].name)
    added.size = len(payload) if added.isfile() else 0
    with tarfile.open(shard, "w") as tar:
        for i, (m, data) in enumerate(members):
            tar.addfile(m, io.BytesIO(data))
            if i == after:
                tar.addfile(added, io.BytesIO(payload) if added.isfile() else None)
    return added.name


# --- every tool that reads shards: what it says about the shard set at ``root`` --------------------------------------
def _preflight(root: Path, tmp: Path) -> str:
    report = check_shard_split(root, "train", 3, workers=1)
    assert [Path(p.path).name for p in report.problems] == [SHARD]
    return report.problems[0].reason


def _check(root: Path, tmp: Path) -> str:
    out = io.StringIO()
    assert check_root(root, workers=1, progress=False, out=out, err=io.StringIO()) == 1
    return out.getvalue()


def _count(root: Path, tmp: Path) -> str:
    with pytest.raises(ShardError) as refused:
        count_samples(root / SHARD)
    return str(refused.value)


def _index(root: Path, tmp: Path) -> str:
    from quest.tools.make_shards import write_index

    (root / "_info.json").unlink()  # the shards of another tool, to be counted
    with pytest.raises(ShardError) as refused:
        write_index(root, {"train": "toy-train-*.tar"})
    assert not (root / "_info.json").exists()  # refused before it wrote
    return str(refused.value)


def _read(root: Path, tmp: Path) -> str:
    with pytest.raises(ShardError) as refused:
        list(WdsDataset(resolve_shards(root, "train"), train=False, num_classes=3))
    return str(refused.value)


def _cap(root: Path, tmp: Path) -> str:
    from quest.tools.capped import cap_shards

    with pytest.raises(ShardError) as refused:
        cap_shards(root, tmp / "capped", 16)
    assert not (tmp / "capped").exists()  # refused before the copy was begun
    return str(refused.value)


TOOLS = {"shard pre-flight": _preflight, "quest-data check": _check, "sample count": _count,
         "make_shards index": _index, "shard data set": _read, "quest-data cap": _cap}


@pytest.mark.parametrize("kind", sorted(IRREGULAR))
@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_a_member_that_is_not_a_regular_file_is_refused_by_every_shard_tool(tmp_path, tool, kind):
    root = make_shards(tmp_path)
    name = _insert(root / SHARD, IRREGULAR[kind])
    said = TOOLS[tool](root, tmp_path)
    assert f"member {name} is a {kind}" in said and "not a regular file" in said


def test_members_named_with_a_dot_are_in_no_sample_for_every_shard_tool(tmp_path):
    """A hidden member (or one under a hidden folder) holding a valid sample's files counts nowhere."""
    root = make_shards(tmp_path)
    clean = count_samples(root / SHARD)
    png = next(iter(tarfile.open(root / SHARD))).name
    with tarfile.open(root / SHARD) as tar:
        image = tar.extractfile(png).read()
    for hidden in (".ipynb_checkpoints/k.png", ".ipynb_checkpoints/k.cls", "._k.png", "./.k.cls"):
        _insert(root / SHARD, lambda first, hidden=hidden: _member(hidden, tarfile.REGTYPE),
                b"0" if hidden.endswith(".cls") else image)
    assert count_samples(root / SHARD) == clean
    assert not check_shard_split(root, "train", 3, workers=1).problems
    assert check_root(root, workers=1, progress=False, out=io.StringIO(), err=io.StringIO()) == 0
    assert len(list(WdsDataset(resolve_shards(root, "train"), train=False, num_classes=3))) == 10
