"""A path a record names (quest.store.records.relative_path: a manifest's entries, a data tool's shards, an export's
files) stays inside the record's folder with every folder on the way followed: a part that is a link to somewhere
else would have a file outside moved or removed as the record's own. The last part may itself be a link (moving or
removing it touches only the link). Held by ``path_problem``, which every record reader's check calls."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from quest.store.damage import DamagedFile
from quest.store.manifest import MANIFEST_NAME, Manifest
from quest.store.records import path_problem

# the parts a path is made of: a real folder, a link to a folder inside, a link to a folder outside, a file name
PARTS = ("real", "in_link", "out_link", "file.bin")


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> tuple[Path, Path]:
    """``folder`` (a record's) beside ``outside``: folder/real/ (with the same parts below it), folder/in_link ->
    folder/real, folder/out_link -> outside; outside/victim.bin is somebody else's file."""
    top = tmp_path_factory.mktemp("links")
    folder, outside = top / "folder", top / "outside"
    outside.mkdir()
    (outside / "victim.bin").write_bytes(b"theirs")
    for base in (folder, folder / "real"):
        (base / "real").mkdir(parents=True)
        (base / "in_link").symlink_to(folder / "real")
        (base / "out_link").symlink_to(outside)
        (base / "file.bin").write_bytes(b"ours")
    return folder, outside


def test_a_path_is_refused_exactly_where_a_folder_on_its_way_leads_outside(tree):
    """Every path of one to three parts: refused iff a part before the last resolves outside the folder."""
    folder, _ = tree
    names = ["/".join(parts) for n in (1, 2, 3) for parts in itertools.product(PARTS, repeat=n)]
    refused = {name for name in names if path_problem(name, "path", folder) is not None}
    assert refused == {name for name in names if not (folder / name).parent.resolve().is_relative_to(folder.resolve())}
    assert "out_link/file.bin" in refused and "real/out_link/file.bin" in refused and "out_link" not in refused
    assert "in_link/real/file.bin" not in refused
    problem = path_problem("real/out_link/victim.bin", "path", folder)
    assert "'real/out_link/victim.bin'" in problem and f"through the link {folder / 'real' / 'out_link'} -> " in problem


def test_a_manifest_entry_through_a_link_out_of_its_folder_is_refused_before_anything_is_moved(tree):
    folder, outside = tree
    entry = {"path": "out_link/victim.bin", "by": "quest-data cap", "size": 6, "mtime_ns": 1, "sha256": "0" * 64}
    (folder / MANIFEST_NAME).write_text(json.dumps({"manifest": 1, "settings": {}}) + "\n" + json.dumps(entry) + "\n")
    try:
        with pytest.raises(DamagedFile, match=r"line 2: path is 'out_link/victim\.bin', which leads out of .* "
                                              r"through the link .*out_link"):
            Manifest(folder, "quest-data cap")
    finally:
        (folder / MANIFEST_NAME).unlink()
    assert (outside / "victim.bin").read_bytes() == b"theirs"
