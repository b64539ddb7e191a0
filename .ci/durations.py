"""The time a pytest run spent, from its junit XML: the slowest tests and the total per file, as markdown.

    python .ci/durations.py JUNIT.xml [--slowest 30] [--files N] [--budget SECONDS]

Used by .ci/run after each pytest phase, and for the tables in docs/testing.md. With --budget, prints whether the
run's wall time (the XML's own ``time``) stayed within it; it never fails CI on time (a busy machine is slower).
"""
from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def _file_of(classname: str) -> str:
    """tests.store.test_x.TestY -> tests/store/test_x.py: the dotted path up to the first test module."""
    parts = classname.split(".")
    for i, part in enumerate(parts):
        if part.startswith("test_") or part == "conftest":
            return "/".join(parts[:i + 1]) + ".py"
    return "/".join(parts) + ".py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit")
    parser.add_argument("--slowest", type=int, default=30)
    parser.add_argument("--files", type=int, default=None, help="only the N files that took longest")
    parser.add_argument("--budget", type=float, default=None, help="seconds this phase should take on a quiet 2-core machine")
    args = parser.parse_args()
    root = ET.parse(args.junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    wall = sum(float(s.get("time", 0)) for s in suites)
    cases = []
    for case in root.iter("testcase"):
        file = case.get("file") or _file_of(case.get("classname", ""))
        cases.append((float(case.get("time", 0)), file, f"{case.get('classname', '')}::{case.get('name', '')}"))
    per_file = collections.Counter()
    count = collections.Counter()
    for seconds, file, _ in cases:
        per_file[file] += seconds
        count[file] += 1
    total = sum(s for s, _, _ in cases)
    print(f"{len(cases)} tests, {total:.0f} s of test time, {wall:.0f} s wall")
    print(f"\n| slowest {args.slowest} | s |\n|---|---:|")
    for seconds, _, name in sorted(cases, reverse=True)[:args.slowest]:
        print(f"| `{name}` | {seconds:.1f} |")
    print("\n| file | tests | s |\n|---|---:|---:|")
    for file, seconds in per_file.most_common(args.files):
        print(f"| {file} | {count[file]} | {seconds:.1f} |")
    if args.budget is not None:
        verdict = "within" if wall <= args.budget else "OVER"
        print(f"\nbudget: {wall:.0f} s of {args.budget:.0f} s ({verdict} the budget for a quiet 2-core machine)")


if __name__ == "__main__":
    main()
