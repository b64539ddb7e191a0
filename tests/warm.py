"""Run quest's command-line apps the way a shell runs them, without paying for a new interpreter each time.

``run_app("train.py", *args, cwd=..., env=...)`` behaves like ``subprocess.run([sys.executable, "train.py", *args],
capture_output=True, text=True)``: the same argv, working directory, sys.path (the script's folder, or for ``-m``
the working directory, then the env's PYTHONPATH), environment, exit code, stdout and stderr, in a process of its
own. The process is forked from a warm zygote (multiprocessing's forkserver) that imported torch,
timm, Hydra and quest once per test session and never computed anything, so the child starts in milliseconds
instead of the 5-10 s of imports a fresh interpreter spends, and nothing of the test process (its threads, its
Hydra state, its monkeypatches) leaks into it.

What a forked child cannot show, and where a test must start a real interpreter instead (``@pytest.mark.process``):
the interpreter's start itself (imports, entry scripts, the wheel), environment variables read while the zygote
imported (``ATEN_CPU_CAPABILITY``, ``OMP_NUM_THREADS`` at torch's import), signals to a process group started from
a terminal, and launchers that start interpreters of their own (torchrun, Slurm, submitit).
"""
from __future__ import annotations

import importlib
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the modules every app imports before it does any work: imported once, in the zygote (this module too, so that its
# _START_PATH is the zygote's)
_PRELOAD = ["tests.warm", "tests.warm_preload"]

# the apps by the argv[0] a shell would name, each the function its console script or __main__ runs
APPS = {
    "train.py": ("quest_cli", "train"),
    "eval.py": ("quest_cli", "evaluate"),
    "quest.toy": ("quest_cli", "toy"),
    "quest.report": ("quest_cli", "report"),
    "quest.report.plot": ("quest_cli", "plot"),
    "quest.tools.export": ("quest_cli", "export"),
    "quest.tools.data_check": ("quest_cli", "data"),
}

_context: multiprocessing.context.ForkServerContext | None = None


def _zygote() -> multiprocessing.context.ForkServerContext:
    """multiprocessing's one forkserver, started (once) with the preload imported."""
    global _context
    if _context is None:
        import multiprocessing.forkserver

        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
        # Python 3.11's forkserver starts as ``python -c ...`` and ignores the caller's sys.path: the preload
        # (tests.*) is found through its '' only when it starts in the checkout, and an ImportError there is
        # swallowed (every child would then pay the imports). Start it from the checkout, and say so if it failed.
        here = os.getcwd()
        os.chdir(ROOT)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            os.chdir(here)
    return _context


# sys.path as this module found it. In the zygote (which imports this module with its preload, below) that is the
# interpreter's own path ('' of its ``python -c``, PYTHONPATH, the standard library, site-packages); a child is then
# handed the caller's sys.path by multiprocessing (spawn.prepare), which _set_sys_path replaces with the command's.
_START_PATH = list(sys.path)


def _set_sys_path(app: str, zygote_pythonpath: str, pythonpath: str) -> None:
    """sys.path as an interpreter started for the command builds it: the script's folder (``python -m``: the working
    directory), the command's PYTHONPATH (an empty entry: the working directory), then the interpreter's standard
    library and site-packages. Not the test process's sys.path, which multiprocessing hands every child (with a
    test's monkeypatched entries, and pytest's), nor the zygote's '' and PYTHONPATH: a module is importable in the
    command exactly when it is for ``python <app>`` run with that environment."""
    def entries(value: str) -> list[str]:
        return [os.path.abspath(p) if p else os.getcwd() for p in value.split(os.pathsep)] if value else []

    theirs = set(entries(zygote_pythonpath))
    base = [p for p in _START_PATH if p and os.path.abspath(p) not in theirs]
    first = str(ROOT) if app.endswith(".py") else os.getcwd()
    sys.path[:] = [first, *entries(pythonpath), *base]
    importlib.invalidate_caches()


def _child(app: str, args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """In the forked process: the shell's view of a command (argv, cwd, sys.path, environment, fds 1 and 2), then
    the app."""
    import importlib.util

    if "tests.warm_preload" not in sys.modules:  # the zygote's imports failed: each child would import everything
        os.write(2, b"tests/warm.py: the zygote did not import tests.warm_preload (started outside the checkout?)\n")
        os._exit(70)
    os.chdir(cwd)
    # multiprocessing's start method as a new interpreter has it: the forkserver made this child with its own set
    # ('forkserver'), so every process pool the app starts (the shard pre-flight's) would start a new forkserver
    # and import everything again, 5 s a pool, where the app run by a shell forks
    multiprocessing.set_start_method(None, force=True)
    _set_sys_path(app, os.environ.get("PYTHONPATH", ""), env.get("PYTHONPATH", ""))
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115  (closed with the process)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    module, function = APPS[app]
    # argv[0] as the interpreter sets it: the script's path, or the module's file for ``python -m``
    sys.argv = [str(ROOT / app) if app.endswith(".py") else importlib.util.find_spec(app).origin, *args]
    code = 0
    try:
        getattr(importlib.import_module(module), function)()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # an uncaught exception: the interpreter's own report and exit status
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def run_app(app: str, *args: str, cwd: str | Path, env: dict[str, str] | None = None,
            timeout: float = 900) -> subprocess.CompletedProcess:
    """``python <app> *args`` (``app``: "train.py", "eval.py", or a ``python -m`` module in APPS) in ``cwd``, with
    ``env`` (default: this process's environment), as a CompletedProcess with text stdout and stderr."""
    if app not in APPS:
        raise KeyError(f"no warm app {app!r}; known: {', '.join(APPS)}")
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="warm-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (out, err):
            Path(path).touch()
        proc = _zygote().Process(target=_child, args=(app, list(args), str(cwd), env, out, err))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired([app, *args], timeout, Path(out).read_text(), Path(err).read_text())
        code = proc.exitcode  # -N for a signal, as subprocess reports it
        argv = [sys.executable, *([str(ROOT / app)] if app.endswith(".py") else ["-m", app]), *args]
        return subprocess.CompletedProcess(argv, code, Path(out).read_text(), Path(err).read_text())
