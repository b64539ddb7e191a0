"""No import circles in quest/: the graph of every import statement in the package (module level and inside
functions alike, only ``if TYPE_CHECKING:`` blocks left out) has no cycle.

A lazy import inside a function still ties two modules into one: neither can be read, tested or moved without the
other. An edge to a package also counts its ``__init__``, which Python runs first (importing ``quest.data.x`` from
outside quest.data runs quest/data/__init__.py), except from inside that package, where it already ran.

An import by name is an import too: ``importlib.import_module`` or ``__import__`` of a string the source spells out
(a literal, ``f"{__package__}.x"``, ``f"{__name__}.x"``, or ``".x"`` relative to either), and a call of a function of
the package that hands one of its parameters to them (quest.runtime.plugins.import_plugins) with such a string. A
registry that imports the modules filling it by name is still below them and above them at once. A package's
``__init__`` that imports every module of its folder (``for m in pkgutil.iter_modules(__path__):
importlib.import_module(f"{__name__}.{m.name}")``) imports each of them.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of ``package`` under ``root``."""
    mods = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, those under ``if TYPE_CHECKING:`` left out (they never run)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skipped]


#: the functions that import the module a string argument names, and the position of that argument
IMPORT_BY_NAME = {"import_module": 0, "__import__": 0}


def _called(call: ast.Call) -> str:
    """The name a call calls: ``f`` of ``f(...)`` and of ``a.b.f(...)``."""
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def importers(trees: list[ast.AST]) -> dict[str, int]:
    """:data:`IMPORT_BY_NAME` and every function of the package that hands one of its parameters to them (name ->
    that parameter's position)."""
    found = dict(IMPORT_BY_NAME)
    for tree in trees:
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
            for call in ast.walk(fn):
                if (isinstance(call, ast.Call) and _called(call) in IMPORT_BY_NAME and call.args
                        and isinstance(call.args[0], ast.Name) and call.args[0].id in params):
                    found[fn.name] = params.index(call.args[0].id)
    return found


def _spelled_out(node: ast.expr, names: dict[str, str]) -> str | None:
    """The string ``node`` always is: a literal, or an f-string of literals and the names of ``names``
    (``__name__``, ``__package__``, a folder walk's module name); None for anything computed."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, (ast.Name, ast.Attribute)) and ast.unparse(node) in names:
        return names[ast.unparse(node)]
    if isinstance(node, ast.JoinedStr):
        parts = [_spelled_out(v.value if isinstance(v, ast.FormattedValue) and not v.format_spec else v, names)
                 for v in node.values]
        return None if None in parts else "".join(parts)
    return None


#: stands for "every module of the folder" in a name spelled out by :func:`_spelled_out`
EVERY_MODULE = "*"


def _folder_walks(tree: ast.AST) -> dict[int, dict[str, str]]:
    """Call node id -> the names that stand for :data:`EVERY_MODULE` there: the name of each module that a loop over
    ``pkgutil.iter_modules(__path__)`` (a package's own folder) walks, ``m.name`` of ``for m in ...`` or ``name`` of
    ``for _, name, _ in ...``."""
    found: dict[int, dict[str, str]] = {}
    for loop in ast.walk(tree):
        if not (isinstance(loop, ast.For) and isinstance(loop.iter, ast.Call) and _called(loop.iter) == "iter_modules"
                and loop.iter.args and isinstance(loop.iter.args[0], ast.Name) and loop.iter.args[0].id == "__path__"):
            continue
        if isinstance(loop.target, ast.Name):
            module_name = f"{loop.target.id}.name"
        elif isinstance(loop.target, ast.Tuple) and len(loop.target.elts) == 3 and isinstance(loop.target.elts[1],
                                                                                               ast.Name):
            module_name = loop.target.elts[1].id
        else:
            continue
        for stmt in loop.body:
            for call in ast.walk(stmt):
                found.setdefault(id(call), {})[module_name] = EVERY_MODULE
    return found


def _imports_by_name(tree: ast.AST, known: dict[str, int], names: dict[str, str]) -> list[str]:
    """The modules a module imports by a string it spells out (:func:`importers`), absolute names; ``<package>.*``
    (:data:`EVERY_MODULE`) for a walk over the package's folder."""
    found = []
    walks = _folder_walks(tree) if "__path__" in names else {}
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call) or (position := known.get(_called(call))) is None:
            continue
        here = names | walks.get(id(call), {})
        if len(call.args) <= position or (target := _spelled_out(call.args[position], here)) is None:
            continue
        if target.startswith("."):  # import_module(".x", package)
            anchor = _spelled_out(call.args[position + 1], here) if len(call.args) > position + 1 else None
            if anchor is None:
                continue
            target = importlib.util.resolve_name(target, anchor)
        found.append(target)
    return found


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules its import statements and its imports by name load (parents included, as
    Python runs them)."""
    mods = module_files(root, package)
    trees = {mod: ast.parse(path.read_text(), str(path)) for mod, path in mods.items()}
    known = importers(list(trees.values()))
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        names = {"__name__": mod, "__package__": here} | ({"__path__": mod} if path.name == "__init__.py" else {})
        targets = []
        for target in _imports_by_name(trees[mod], known, names):
            folder, _, last = target.rpartition(".")
            # the modules and subpackages directly in the folder, as pkgutil.iter_modules lists them
            targets += ([m for m in mods if m.rpartition(".")[0] == folder] if last == EVERY_MODULE else [target])
        for node in _imports(trees[mod]):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
                continue
            base = node.module or ""
            if node.level:
                parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        deps = set()
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                # a package this module lies in has already run its __init__ when this module is imported
                if name in mods and name != mod and not mod.startswith(name + "."):
                    deps.add(name)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_quest_has_no_import_cycle():
    graph = import_graph(ROOT, "quest")
    assert len(graph) > 100  # the whole package was read
    found = cycles(graph)
    detail = "\n".join(f"{m} -> {sorted(graph[m] & set(c))}" for c in found for m in c)
    assert not found, f"import cycles in quest/:\n{detail}"


@pytest.mark.parametrize("files, expected", [
    # a lazy import inside a function closes a cycle too
    ({"pkg/__init__.py": "", "pkg/a.py": "from pkg import b\n", "pkg/b.py": "def f():\n    from pkg.a import x\n"},
     [["pkg.a", "pkg.b"]]),
    # relative imports, two levels
    ({"pkg/__init__.py": "", "pkg/sub/__init__.py": "", "pkg/sub/a.py": "from ..c import y\n",
      "pkg/c.py": "from .sub import a\n"}, [["pkg.c", "pkg.sub.a"]]),
    # through a package's __init__, which runs when anything under it is imported from outside
    ({"pkg/__init__.py": "", "pkg/eng/__init__.py": "from .loop import run\n", "pkg/eng/loop.py": "import pkg.m\n",
      "pkg/eng/ckpt.py": "", "pkg/m.py": "from pkg.eng.ckpt import FORMAT\n"},
     [["pkg.eng", "pkg.eng.loop", "pkg.m"]]),
    # only under TYPE_CHECKING: never runs, no cycle
    ({"pkg/__init__.py": "", "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n",
      "pkg/b.py": "from pkg import a\n"}, []),
    # a module importing its own package's other modules from inside the package: no cycle
    ({"pkg/__init__.py": "from .a import x\n", "pkg/a.py": "from .b import y\n", "pkg/b.py": ""}, []),
    # imports by name: a literal, f"{__package__}.x", a relative name and __import__ close a cycle as a statement does
    ({"pkg/__init__.py": "", "pkg/a.py": "import importlib\ndef f():\n    importlib.import_module('pkg.b')\n",
      "pkg/b.py": "from pkg import a\n"}, [["pkg.a", "pkg.b"]]),
    ({"pkg/__init__.py": "", "pkg/a.py": "from importlib import import_module\nimport_module(f'{__package__}.b')\n",
      "pkg/b.py": "from pkg import a\n"}, [["pkg.a", "pkg.b"]]),
    ({"pkg/__init__.py": "", "pkg/a.py": "import importlib\nimportlib.import_module('.b', __package__)\n",
      "pkg/b.py": "from pkg import a\n"}, [["pkg.a", "pkg.b"]]),
    ({"pkg/__init__.py": "", "pkg/a.py": "__import__('pkg.b')\n", "pkg/b.py": "from pkg import a\n"},
     [["pkg.a", "pkg.b"]]),
    # through a function of the package that imports the name it is given (quest.runtime.plugins.import_plugins):
    # a registry that loads the modules filling it, which import the registry (quest/data/pipelines/train_input.py
    # and tensor_input.py once)
    ({"pkg/__init__.py": "", "pkg/plugins.py": "import importlib\ndef load(what, builtin):\n"
                                               "    importlib.import_module(builtin)\n",
      "pkg/registry.py": "from pkg.plugins import load\ndef get():\n    load('pipelines', f'{__package__}.builtin')\n",
      "pkg/builtin.py": "from pkg.registry import get\n"}, [["pkg.builtin", "pkg.registry"]]),
    # a package's __init__ importing every module of its folder, which import a registry that loads the package by
    # name (quest/data/sets/ and quest.data.registry, quest/evaluation/suites/ and quest.evaluation.registry once)
    ({"pkg/__init__.py": "", "pkg/registry.py": "import importlib\ndef load():\n    importlib.import_module('pkg.sets')\n",
      "pkg/sets/__init__.py": "import importlib, pkgutil\nfor m in pkgutil.iter_modules(__path__):\n"
                              "    importlib.import_module(f'{__name__}.{m.name}')\n",
      "pkg/sets/one.py": "", "pkg/sets/two.py": "from pkg.registry import load\n"},
     [["pkg.registry", "pkg.sets", "pkg.sets.two"]]),
    ({"pkg/__init__.py": "", "pkg/registry.py": "import pkg.sets\n",
      "pkg/sets/__init__.py": "from importlib import import_module\nimport pkgutil\n"
                              "for _, name, _ in pkgutil.iter_modules(__path__):\n"
                              "    import_module(f'{__package__}.{name}')\n",
      "pkg/sets/one.py": "from pkg import registry\n"}, [["pkg.registry", "pkg.sets", "pkg.sets.one"]]),
    # a walk over another folder, or outside a package's __init__, is no edge
    ({"pkg/__init__.py": "", "pkg/registry.py": "import pkg.sets\n",
      "pkg/sets/__init__.py": "import importlib, pkgutil\nfor m in pkgutil.iter_modules(['elsewhere']):\n"
                              "    importlib.import_module(f'{__name__}.{m.name}')\n",
      "pkg/sets/one.py": "from pkg import registry\n"}, []),
    # a string that is not spelled out, or that names no module of the package, is no edge
    ({"pkg/__init__.py": "", "pkg/a.py": "import importlib, logging\nlog = logging.getLogger('pkg.b')\n"
                                         "def f(name):\n    importlib.import_module(name)\n",
      "pkg/b.py": "from pkg import a\n"}, []),
])
def test_the_cycle_finder_finds_what_python_would_run_into(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cycles(import_graph(tmp_path, "pkg")) == expected


def test_nothing_below_the_console_scripts_imports_them():
    """quest.cli sits above the library (it wraps the entry points, as `python -m quest.<x>`'s __main__ modules do); a
    library module importing it would tie the library to Hydra's command line and to every app it wraps."""
    graph = import_graph(ROOT, "quest")
    assert "quest.cli" in graph and "quest.config.files" in graph["quest.cli"]
    assert sorted(m for m, deps in graph.items() if "quest.cli" in deps and m != "quest.cli"
                  and not m.endswith(".__main__")) == []


def _unscoped_warning_filters(tree: ast.AST) -> list[int]:
    """Lines of warnings.filterwarnings / simplefilter calls not inside a ``with warnings.catch_warnings():``."""
    scoped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any("catch_warnings" in ast.unparse(i.context_expr) for i in node.items):
            scoped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and id(n) not in scoped
            and ast.unparse(n.func) in ("warnings.filterwarnings", "warnings.simplefilter")]


def test_importing_quest_changes_no_process_wide_warning_filter():
    found = {str(path.relative_to(ROOT)): lines for path in module_files(ROOT, "quest").values()
             if (lines := _unscoped_warning_filters(ast.parse(path.read_text())))}
    assert found == {}, f"warning filters outside `with warnings.catch_warnings()`: {found}"
    assert _unscoped_warning_filters(ast.parse("import warnings\nwarnings.filterwarnings('ignore')\n")) == [2]
