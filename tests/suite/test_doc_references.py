"""Every document stands on its own in the repository: no tracked text file a user reads (docs, README, configs,
quest's modules, the entry scripts, bench/, launch/) names a ``shared/`` path or a markdown document that is not in the
repository."""
from __future__ import annotations

import posixpath
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
READ_BY_USERS = ("docs", "configs", "quest", "bench", "launch", "README.md", "train.py", "eval.py", "pyproject.toml")
TEXT = (".md", ".py", ".yaml", ".yml", ".toml", ".txt", ".sh", ".cfg")
# .md files quest writes (report tables, evaluation results, the GPU check) and an upstream file named as a source
# (facebookresearch/deit's README_revenge.md): names of files, not documents of this repository
NOT_DOCUMENTS = {"runs.md", "lr_sensitivity.md", "eval_results.md", "gpu_check.md", "README_revenge.md"}
MD_NAME = re.compile(r"(?<![\w./-])((?:\.{1,2}/)?[\w./-]*[\w-]\.md)\b")


def _git_files(*paths: str) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", *paths], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return out.splitlines()


def _tracked() -> list[Path]:
    return [ROOT / line for line in _git_files(*READ_BY_USERS) if line.endswith(TEXT) and (ROOT / line).is_file()]


def _resolves(name: str, source: str, documents: set[str]) -> bool:
    """A document name as written in ``source`` (a repository path): relative to the file's folder, else from the
    repository root, else (a bare name) in docs/; only tracked files count (a shared/ folder beside a checkout
    does not)."""
    candidates = [posixpath.normpath(posixpath.join(posixpath.dirname(source), name)), posixpath.normpath(name)]
    if "/" not in name:
        candidates.append(f"docs/{name}")
    return any(c in documents for c in candidates)


def _problems(text: str, source: str, documents: set[str]) -> list[str]:
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        if re.search(r"(?<![\w.-])shared/", line):
            problems.append(f"{source}:{number}: names a shared/ path: {line.strip()[:120]}")
        for match in MD_NAME.finditer(line):
            name = match.group(1)
            if Path(name).name in NOT_DOCUMENTS or "*" in name:
                continue
            if not _resolves(name, source, documents):
                problems.append(f"{source}:{number}: names {name}, which is not in the repository")
    return problems


def test_no_user_facing_file_names_a_missing_document_or_shared():
    files = _tracked()
    assert any(p.name == "training.md" for p in files) and any(p.suffix == ".yaml" for p in files)
    documents = {f for f in _git_files() if f.endswith(".md")}
    problems = [problem for path in files
                for problem in _problems(path.read_text(encoding="utf-8", errors="replace"),
                                         path.relative_to(ROOT).as_posix(), documents)]
    assert not problems, "\n".join(problems)


def test_the_check_finds_what_it_looks_for():
    """The scan itself: a missing document, a shared/ path, and names that resolve or are outputs."""
    documents = {"docs/training.md", "docs/evaluation.md", "docs/data.md", "README.md"}
    text = ("see recipes.md and ../shared/spec/recipes.md; training.md#recipes, [x](evaluation.md), "
            "docs/data.md, README.md, ../README.md, runs.md, `eval_results.md`\n")
    found = _problems(text, "docs/probe.md", documents)
    assert len(found) == 3, found
    assert sum("names a shared/ path" in p for p in found) == 1
    assert sum("names recipes.md" in p for p in found) == 1
    assert sum("names ../shared/spec/recipes.md" in p for p in found) == 1
    assert _problems("configs/x: (training.md)", "configs/model/x.yaml", documents) == []
