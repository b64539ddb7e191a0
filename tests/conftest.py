import functools
import inspect
import logging
import os
import re
import subprocess
import sys

# No test may reach the network.
os.environ["WANDB_MODE"] = "offline"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HYDRA_FULL_ERROR", "1")
# Inductor's cache does not key its compiled kernels by ATEN_CPU_CAPABILITY: kernels built for AVX-512 and reused
# under a capped dispatch fail to compile ("'at::vec' has not been declared"). A capped run (CI reruns the numerical
# tests under ATEN_CPU_CAPABILITY=default) gets a cache of its own, for this process and the ones it starts.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import getpass
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ['ATEN_CPU_CAPABILITY']}")

# The suite is the CPU's: its tests leave trainer.device and eval.device at auto and compare numbers, speeds and
# memory taken on the CPU, so on a machine with a GPU they would train there and assert the wrong things. The GPU is
# hidden from this process and every process it starts (set before torch first asks CUDA), unless QUEST_TEST_GPU=1,
# which runs the tests marked `cuda` instead and skips the rest (docs/testing.md, "On a machine with a GPU").
GPU_TIER = os.environ.get("QUEST_TEST_GPU") == "1"
if not GPU_TIER:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

# quest's Triton kernels (quest.attention.fused) run on CPU tensors in Triton's interpreter, which Triton decides when
# it is imported: wherever the GPU is hidden; under QUEST_TEST_GPU=1 on a machine with an NVIDIA GPU they run on it
# (tests/attention/test_fused_kernels.py)
if not (GPU_TIER and os.path.exists("/dev/nvidiactl")):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# xdist's workers share the machine's cores: each with torch's default (one intra-op thread per core) would run more
# threads than cores, whose OpenMP threads spin while they wait for each other (quest/train/compute.py measured
# 5-15x slower steps that way). Each worker computes with its share of the cores; a test that sets its own count
# (a run's trainer.torch_threads) still does.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _WORKERS))
from hypothesis import settings  # noqa: E402

# CI draws the same examples every run (a failure found once is found again, and nothing depends on luck);
# a contributor's default profile explores new ones and keeps failures in the example database.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield


_ROOT_HANDLERS_AT_START = list(logging.getLogger().handlers)  # the root logger as the suite found it


@pytest.fixture(autouse=True)
def _logging_as_it_was():
    """Every test ends with the root logger as the suite found it. An app a test runs in this process configures
    the root logger (Hydra's console handler, bound to the sys.stdout of that moment: a test's captured stream,
    closed once that test ends), and a later test that logs without an app of its own would write into it. A
    command's log file (train.log, eval.log, toy.log) left attached after its command is that test's failure: an
    error path skipped stop_log_file, and the next command's lines would land in that file."""
    yield
    from quest.run.outputs import LOG_FORMAT

    root = logging.getLogger()
    added = [h for h in root.handlers if h not in _ROOT_HANDLERS_AT_START
             and not type(h).__module__.startswith("_pytest")]  # pytest's capture handlers are pytest's to remove
    left = [h for h in added if isinstance(h, logging.FileHandler) and getattr(h.formatter, "_fmt", None) == LOG_FORMAT]
    for handler in added:
        root.removeHandler(handler)
        handler.close()
    for handler in _ROOT_HANDLERS_AT_START:
        if handler not in root.handlers:
            root.addHandler(handler)
    assert not left, f"log files left attached after the test: {[h.baseFilename for h in left]}"


# A test that compares floats against a reference (assert_close, allclose, isclose, pytest.approx) is marked
# `numerics`: CI runs these a second time under another CPU kernel path (ATEN_CPU_CAPABILITY=default), where a
# float32 comparison across batch shapes or summation orders that only held on one machine's kernels fails.
# Marked from the test's own source, so that a new test is covered without anyone remembering to mark it; a test
# that compares through a helper is marked by hand (@pytest.mark.numerics).
_FLOAT_COMPARISON = re.compile(r"assert_close|allclose|isclose|approx\(")


# The fast tier (-m "not e2e") leaves out whole-app runs: a test that starts an interpreter, needs Slurm, or is marked
# slow is end-to-end without anyone remembering to say so.
_END_TO_END = ("process", "slurm", "slow")


@functools.cache
def _permissions_bind() -> bool:
    """Whether a file without read permission is unreadable to this process: not for root with CAP_DAC_OVERRIDE
    (CI runs the `unprivileged` tests again with that capability dropped, as root's `setpriv --bounding-set`)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        locked = os.path.join(tmp, "locked")
        with open(locked, "w") as f:
            f.write("x")
        os.chmod(locked, 0)
        try:
            open(locked).close()
        except PermissionError:
            return True
        return False


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device; runs only under QUEST_TEST_GPU=1 (tests/conftest.py)")
    config.addinivalue_line("markers", "kernels: a Triton kernel against its reference: on the GPU under "
                                       "QUEST_TEST_GPU=1, in Triton's interpreter otherwise")


def pytest_collection_modifyitems(config, items):
    # the kernel compile's tests last: their compile runs meanwhile (pytest_xdist_node_collection_finished)
    items.sort(key=lambda item: item.nodeid.startswith(_KERNEL_TESTS))
    sources: dict[object, bool] = {}
    for item in items:
        if item.get_closest_marker("cuda") and not GPU_TIER:
            item.add_marker(pytest.mark.skip(reason="needs a GPU, which the suite hides from the CPU tests: "
                                                    "QUEST_TEST_GPU=1 python -m pytest -m cuda runs it"))
        elif item.get_closest_marker("cuda") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="QUEST_TEST_GPU=1, but torch sees no CUDA device"))
        elif GPU_TIER and not (item.get_closest_marker("cuda") or item.get_closest_marker("kernels")):
            item.add_marker(pytest.mark.skip(reason="a CPU test: under QUEST_TEST_GPU=1 only the cuda tests run; "
                                                    "the suite without it runs this one with the GPU hidden"))
        if item.get_closest_marker("unprivileged") and not _permissions_bind():
            item.add_marker(pytest.mark.skip(reason="file permissions do not bind this user (root): .ci/run runs "
                                                    "this again without the capability to override them"))
        if any(item.get_closest_marker(name) for name in _END_TO_END):
            item.add_marker(pytest.mark.e2e)
        function = getattr(item, "function", None)
        if function is None or "numerics" in item.keywords:
            continue
        if function not in sources:
            try:
                sources[function] = bool(_FLOAT_COMPARISON.search(inspect.getsource(function)))
            except (OSError, TypeError):
                sources[function] = False
        if sources[function]:
            item.add_marker(pytest.mark.numerics)


# A test that starts a Python interpreter (python, torchrun, a quest-* script, a Slurm job) pays 5-10 s of imports
# before any work, so it must say that the process boundary is its point: @pytest.mark.process. Everything else
# runs in-process, or through tests.warm.run_app (a fork of a warm zygote, no new interpreter). Counted, not timed:
# a busy machine cannot make this check pass or fail.
_INTERPRETER = re.compile(r"(^|/)(python[\d.]*|torchrun|sbatch|srun|salloc|quest-[a-z]+)$")


def _starts_an_interpreter(args) -> bool:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args or [])
    if not argv:
        return False
    first = os.fsdecode(argv[0]).split()[0] if isinstance(argv[0], (str, bytes)) else os.fsdecode(argv[0])
    return first == sys.executable or bool(_INTERPRETER.search(first))


_PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _started_by_this_project() -> bool:
    """Whether the code that asked for the process is quest's, a test's or a bench script's, not a library's own
    helper (inductor test-loads a compiled kernel in ``python -c`` on a cold cache: its business, not the test's)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == subprocess.__file__:
        frame = frame.f_back
    filename = os.path.abspath(frame.f_code.co_filename) if frame is not None else ""
    return filename.startswith(_PROJECT + os.sep) and f"{os.sep}site-packages{os.sep}" not in filename


@pytest.fixture(autouse=True)
def _interpreters_started_only_by_process_tests(request, monkeypatch):
    if request.node.get_closest_marker("process"):
        yield
        return
    started: list[str] = []
    original = subprocess.Popen.__init__

    def counting_init(self, args, *a, **k):
        if _starts_an_interpreter(args) and _started_by_this_project():
            started.append(" ".join(map(str, [args] if isinstance(args, str) else args))[:200])
        original(self, args, *a, **k)

    monkeypatch.setattr(subprocess.Popen, "__init__", counting_init)
    yield
    if started:
        pytest.fail(f"this test started {len(started)} interpreter(s) without @pytest.mark.process "
                    f"(first: {started[0]}); run the app through tests.warm.run_app, or mark the test if the "
                    "process boundary is what it proves", pytrace=False)


# The offline kernel compile (tests.kernel_compile, about a minute of one core) started by xdist's controller as soon
# as a worker has collected its tests, in a thread of its own: the workers run other tests meanwhile, where the
# first to need it compiled it and the other waited on its lock, idle (tests/attention/test_kernel_compile.py).
_KERNEL_TESTS = "tests/attention/test_kernel_compile.py::"
_compiling: list = []


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    if _compiling or GPU_TIER or not any(i.startswith(_KERNEL_TESTS) for i in ids):
        return
    import threading

    from tests import kernel_compile

    out = node.config._tmp_path_factory.getbasetemp() / kernel_compile.RESULTS_NAME

    def compile_quietly() -> None:
        try:
            kernel_compile.compiled_once(out)
        except Exception:  # noqa: BLE001 (the fixture compiles again under the lock and fails with the error)
            pass

    _compiling.append(threading.Thread(target=compile_quietly, name="kernel-compile", daemon=True))
    _compiling[0].start()


def pytest_sessionfinish(session):
    for thread in _compiling:
        thread.join()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report):
    """A test's captured output as text xdist can send from its worker: a file name that is not UTF-8 (the faults
    matrix makes them) reaches the captured log as a surrogate escape, which execnet refuses to encode, ending the
    worker instead of reporting the test."""
    report.sections = [(title, text.encode("utf-8", "backslashreplace").decode("utf-8"))
                       for title, text in report.sections]
