"""The suite's own rules (tests/conftest.py): a test that starts an interpreter says so, the end-to-end tier is
derived from the markers, and CI runs the README's install and test commands as written."""
from __future__ import annotations

import re
import shlex
import sys

import pytest

from ..conftest import _starts_an_interpreter
from ..helpers import ROOT

pytest_plugins = ["pytester"]


@pytest.mark.parametrize("argv, starts", [
    ([sys.executable, "-c", "pass"], True),
    (["python3", "train.py"], True),
    (["/usr/bin/python3.11", "-m", "quest.toy"], True),
    ("python -c pass", True),  # a shell string: its first word
    (["torchrun", "--nproc-per-node=2", "train.py"], True),
    (["sbatch", "--parsable", "launch/train.sbatch"], True),
    (["/venv/bin/quest-train", "trainer.epochs=1"], True),
    (["gcc", "--version"], False),  # the compiler torch.compile starts: not an interpreter
    (["mount", "-t", "tmpfs"], False),
    (["scontrol", "show", "hostnames"], False),
    (["/opt/pythonic/tool"], False),
])
def test_what_counts_as_starting_an_interpreter(argv, starts):
    assert _starts_an_interpreter(argv) is starts


@pytest.mark.process  # the inner test really starts one interpreter: that is what the conftest must catch
def test_an_unmarked_test_that_starts_an_interpreter_fails_and_a_marked_one_passes(pytester):
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_inner=f"""
import subprocess, sys, pytest

def test_unmarked():
    subprocess.run([{sys.executable!r}, "-c", "pass"], check=True)

@pytest.mark.process
def test_marked():
    subprocess.run([{sys.executable!r}, "-c", "pass"], check=True)

def test_other_programs_are_free():
    subprocess.run(["true"], check=True)

def test_a_librarys_own_helper_interpreter_is_its_business():  # as inductor's test-load of a compiled kernel
    code = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass'], check=True)"
    exec(compile(code, "/usr/lib/python3/dist-packages/some_library/helper.py", "exec"))
""")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-q")
    # the unmarked test's body ran; its teardown reports the interpreter as an error, which fails the run
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_unmarked*",
                                 "this test started 1 interpreter(s) without @pytest.mark.process*"])
    assert result.ret != 0


def test_the_end_to_end_tier_holds_every_process_slurm_and_slow_test(pytester):
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    process: p\n    slurm: s\n    slow: l\n    e2e: e\n    numerics: n\n"
                     "    unprivileged: u\n")
    pytester.makepyfile(test_inner="""
import pytest

@pytest.mark.process
def test_a(): pass

@pytest.mark.slurm
def test_b(): pass

@pytest.mark.slow
def test_c(): pass

def test_d(): pass
""")
    fast = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-m", "not e2e")
    fast.assert_outcomes(passed=1, deselected=3)
    slow = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-m", "e2e")
    slow.assert_outcomes(passed=3, deselected=1)


def test_the_cpu_tests_never_see_a_gpu_and_quest_test_gpu_runs_only_the_cuda_ones(pytester, monkeypatch):
    """On a machine with a GPU the suite must pass or skip with a reason: its tests leave trainer.device=auto and
    assert the CPU's numbers, so the conftest hides the GPU (CUDA_VISIBLE_DEVICES, inherited by every process a test
    starts); QUEST_TEST_GPU=1 shows it and runs only the tests marked cuda. Here on any machine: the outer session
    already hid its GPU, so the cuda test is skipped in both runs, each time with its reason."""
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_inner="""
import os, pytest, torch

def test_on_the_cpu():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available()

@pytest.mark.cuda
def test_on_the_gpu():
    assert torch.cuda.is_available()
""")
    monkeypatch.delenv("QUEST_TEST_GPU", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the conftest sets it
    cpu = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-rs")
    cpu.assert_outcomes(passed=1, skipped=1)
    cpu.stdout.fnmatch_lines(["*needs a GPU, which the suite hides*QUEST_TEST_GPU=1 python -m pytest -m cuda*"])
    monkeypatch.setenv("QUEST_TEST_GPU", "1")
    gpu = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-rs")
    gpu.assert_outcomes(skipped=2)
    gpu.stdout.fnmatch_lines(["*a CPU test: under QUEST_TEST_GPU=1 only the cuda tests run*",
                              "*QUEST_TEST_GPU=1, but torch sees no CUDA device*"])


def _readme_block(section: str) -> list[str]:
    """The commands of the first bash block under a README heading."""
    text = (ROOT / "README.md").read_text()
    body = text[text.index(f"## {section}\n"):]
    block = re.search(r"```bash\n(.*?)```", body, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_ci_runs_the_readme_install_and_test_commands():
    ci = (ROOT / ".ci" / "run").read_text()
    (test,) = _readme_block("Test")
    assert test.startswith("python -m pytest")
    # the README's test command, with only output options added (-q, the junit XML, the durations, the cache)
    ci_line = next(line for line in ci.splitlines() if line.startswith("python -m pytest"))
    ci_test = [arg for arg in shlex.split(ci_line.rstrip("\\ ")) if not re.match(r"\d?>", arg)]  # not redirections
    extra = set(ci_test) - set(shlex.split(test))
    assert all(arg.startswith(("-q", "-p", "no:cacheprovider", "--durations", "--junitxml")) for arg in extra), extra
    assert set(shlex.split(test)) <= set(ci_test)
    install = next(line for line in _readme_block("Install") if "pip install" in line)
    assert install.split("pip install", 1)[1].strip() in ci, install


def test_every_test_module_lives_in_the_folder_of_its_concern():
    """tests/<concern>/test_*.py, <concern> a package of quest, bench/ (the bench scripts) or suite/ (the suite's and
    the house's rules), each folder a package so that its tests import the helpers at tests/ (docs/testing.md,
    "Layout"): a test module anywhere else is named."""
    tests = ROOT / "tests"
    concerns = {p.name for p in (ROOT / "quest").iterdir() if (p / "__init__.py").is_file()} | {"bench", "suite"}
    modules = list(tests.rglob("test_*.py"))
    assert len(modules) > 100  # the whole suite was found
    misplaced = sorted(str(p.relative_to(tests)) for p in modules
                       if p.parent.parent != tests or p.parent.name not in concerns
                       or not (p.parent / "__init__.py").is_file())
    assert misplaced == [], f"test modules outside tests/<concern>/ (concerns: {sorted(concerns)}): {misplaced}"
