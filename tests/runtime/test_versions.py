"""quest on the torch an environment already has (quest.runtime.versions): below the floors pyproject.toml declares it
refuses to start in one line naming the package, the version found and the floor; at and above them it starts."""
from __future__ import annotations

import importlib
import sys
import tomllib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.requirements import Requirement
from packaging.version import Version

import quest
import quest.runtime.versions as versions
import quest_cli
from quest.runtime.errors import is_user_error

from ..helpers import ROOT


def test_parse_version_reads_the_release_without_local_tags():
    assert versions.parse_version("2.4.1+cu121") == (2, 4, 1)
    assert versions.parse_version("2.15.0a0+git1234") == (2, 15, 0)
    assert versions.parse_version("2.8.0a0+5228986c39.nv25.06") == (2, 8, 0)
    assert versions.parse_version("3.6") == (3, 6, 0)


def test_the_floors_are_pyprojects_lower_bounds():
    """FLOORS is what pyproject.toml declares: each of torch, torchvision and timm has a ``>=`` bound there, and
    it is the floor quest checks."""
    declared = {}
    for line in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        req = Requirement(line)
        lower = [s.version for s in req.specifier if s.operator == ">="]
        if req.name in versions.FLOORS:
            assert len(lower) == 1, f"pyproject.toml: {line!r} has no single >= bound"
            declared[req.name] = versions.parse_version(lower[0])
    assert declared == versions.FLOORS


def _installed_as(monkeypatch, **found: str) -> None:
    """The metadata quest reads says ``found`` for these distributions (the rest as installed); sys.excepthook, which
    a refusal sets, is put back after the test."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    real = versions.version
    monkeypatch.setattr(versions, "version", lambda name: found[name] if name in found else real(name))


@pytest.mark.parametrize("name, older", [("torch", "2.7.1+cu126"), ("torchvision", "0.22.1"), ("timm", "1.0.26")])
def test_a_release_below_the_floor_is_refused_in_one_line(name, older, monkeypatch):
    _installed_as(monkeypatch, **{name: older})
    floor = ".".join(map(str, versions.FLOORS[name]))
    with pytest.raises(versions.BelowFloor) as raised:
        versions.check_floors()
    assert str(raised.value) == (f"quest needs {name}>={floor}; this environment has {name} {older} (install "
                                 f"{name}>={floor}, docs/getting-started.md, \"Tested versions\")")
    assert is_user_error(raised.value) and isinstance(raised.value, ImportError)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(versions.FLOORS)), release=st.tuples(*[st.integers(0, 30)] * 3),
       parts=st.integers(2, 3), tag=st.sampled_from(["", "+cu128", "+cpu", "a0+5228986c39.nv25.06", "rc1", ".post1",
                                                     ".dev20260101"]))
def test_any_release_is_refused_exactly_when_it_is_below_its_floor(name, release, parts, tag):
    """Every version string a distribution may carry (2 or 3 parts; local, pre-, post- and dev-release tags): refused
    in one line naming it exactly when its release, as packaging reads it, is below the floor; accepted otherwise."""
    text = ".".join(map(str, release[:parts])) + tag
    expected = tuple((list(Version(text).release) + [0, 0])[:3])  # the independent reading
    assert versions.parse_version(text) == expected
    with pytest.MonkeyPatch.context() as patch:
        _installed_as(patch, **{name: text})
        problem = versions.below_floor()
    if expected < versions.FLOORS[name]:
        assert problem is not None and f"this environment has {name} {text} " in problem and "\n" not in problem
    else:
        assert problem is None or f"{name} " not in problem.split(";")[0]  # another package's floor, never this one


@pytest.mark.parametrize("found", ["2.8.0", "2.8.0a0+5228986c39.nv25.06", "2.10.1", "3.0.0"])
def test_the_floor_and_above_are_accepted(found, monkeypatch):
    _installed_as(monkeypatch, torch=found)
    assert versions.below_floor() is None
    versions.check_floors()


def test_import_quest_refuses_a_torch_below_the_floor(monkeypatch):
    """``import quest`` is where the check runs (every command and library use passes through it): re-running the
    package's ``__init__`` with torch 2.6 installed raises the one line, before it registers anything."""
    _installed_as(monkeypatch, torch="2.6.0")
    with pytest.raises(versions.BelowFloor, match=r"^quest needs torch>=2\.8\.0; this environment has torch 2\.6\.0 "):
        importlib.reload(quest)
    monkeypatch.undo()
    importlib.reload(quest)  # as it was, for the tests after this one
    assert quest.register_with_timm is not None


def test_a_command_says_the_refusal_in_one_line(monkeypatch, capsys):
    """A command (train.py, every quest-* script, ``python -m quest.toy``) imports quest when it starts: the refusal,
    uncaught, ends the process with its one error line (Python's exit code 1 for an uncaught exception, quest's for
    a user error), no traceback."""
    _installed_as(monkeypatch, timm="1.0.20")

    def import_quest(name):  # what the command's import of quest.cli runs first: quest's __init__
        versions.check_floors()
        return importlib.import_module(name)

    monkeypatch.setattr(quest_cli, "import_module", import_quest)
    monkeypatch.setattr(sys, "argv", ["/some/checkout/train.py"])
    with pytest.raises(versions.BelowFloor) as raised:
        quest_cli.train()
    sys.excepthook(raised.type, raised.value, raised.tb)  # what Python does with it at the top
    assert capsys.readouterr().err == ("train.py: error: quest needs timm>=1.0.29; this environment has timm 1.0.20 "
                                       "(install timm>=1.0.29, docs/getting-started.md, \"Tested versions\")\n")
    sys.excepthook(ValueError, ValueError("another"), None)  # any other exception: Python's own report
    assert "ValueError: another" in capsys.readouterr().err
