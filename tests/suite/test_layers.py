"""The house's layers (README, "Where things are"): quest's packages in rows, the commands at the top and the process
at the bottom; a package imports only packages of its own row or below, never one above, so that what a lower
package does can be read, tested and reused without what stands on it. The entry points (a package's
``__main__``) stand above every row. A package of quest that no row names is an error too: the layers list every
concern."""
from __future__ import annotations

import pytest

from .test_import_graph import ROOT, import_graph

LAYERS = [
    {"cli"},
    {"toy", "tools"},
    {"evaluation"},
    {"train"},
    {"run"},
    {"report", "diagnostics", "explain"},
    {"models", "attention"},
    {"config"},
    {"data"},
    {"store"},
    {"runtime"},
]


def _package(module: str) -> str | None:
    """The concern of a module (quest.data.sets.digits -> data); None for quest's own __init__ (run by every
    import of quest, not a design choice) and for configs (no code)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "configs" else None


def _row(package: str) -> int:
    return next(i for i, row in enumerate(LAYERS) if package in row)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``module -> imported`` for every import of a package in a row above the importer's."""
    found = []
    for module, deps in graph.items():
        if module.endswith(".__main__"):  # an entry point stands above every row
            continue
        mine = _package(module)
        for dep in deps:
            theirs = _package(dep)
            if mine and theirs and mine != theirs and _row(theirs) < _row(mine):
                found.append(f"{module} -> {dep}")
    return sorted(found)


def test_every_package_of_quest_has_its_row():
    graph = import_graph(ROOT, "quest")
    packages = {p for p in map(_package, graph) if p}
    assert packages == set().union(*LAYERS), packages ^ set().union(*LAYERS)


def test_no_package_imports_one_above_its_row():
    found = upward_imports(import_graph(ROOT, "quest"))
    assert not found, "imports of a package above the importer's row:\n" + "\n".join(found)


@pytest.mark.parametrize("graph, expected", [
    ({"quest.store.files": {"quest.runtime.phase"}}, []),  # down a row
    ({"quest.store.files": {"quest.train.lifecycle"}}, ["quest.store.files -> quest.train.lifecycle"]),  # up
    ({"quest.models.factory": {"quest.attention.base"}}, []),  # one row
    ({"quest.toy.__main__": {"quest.cli"}}, []),  # an entry point
])
def test_an_import_up_a_row_is_found(graph, expected):
    assert upward_imports(graph) == expected
