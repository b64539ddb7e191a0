"""Every argparse command's ``--help`` describes it in whole sentences: a description taken from a docstring is its
first paragraph (quest.runtime.errors.doc_summary), never its first source line, which ends wherever the source was
wrapped (quest-plot's said "...; ``perf``: the"). quest-train's and quest-eval's pages: tests/config/test_config_help.py."""
from __future__ import annotations

from collections.abc import Callable

import pytest

import quest.report.__main__ as report_module
import quest.report.plot as plot_module
from quest.runtime.errors import doc_summary
from quest.tools.data_check import main as data_main
from quest.tools.export import main as export_main
from quest.tools.make_shards import main as shards_main

COMMANDS: dict[str, tuple[Callable[..., object], list[str]]] = {
    "quest-plot": (plot_module.main, []),
    "quest-plot diagnostics": (plot_module.main, ["diagnostics"]),
    "quest-plot perf": (plot_module.main, ["perf"]),
    "quest-plot explain": (plot_module.main, ["explain"]),
    "quest-report": (report_module.main, []),
    "quest-export": (export_main, []),
    "quest-data": (data_main, []),
    "quest-data check": (data_main, ["check"]),
    "quest-data cap": (data_main, ["cap"]),
    "make_shards": (shards_main, []),
    "make_shards convert": (shards_main, ["convert"]),
    "make_shards index": (shards_main, ["index"]),
}


def _description(main: Callable[..., object], argv: list[str], capsys) -> str:
    """The paragraph after the usage of ``main``'s --help, on one line ("" when the parser has none)."""
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    second = capsys.readouterr().out.split("\n\n")[1]
    return "" if second.startswith(("positional arguments:", "options:")) else " ".join(second.split())


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_command_description_is_whole_sentences(command, capsys):
    text = _description(*COMMANDS[command], capsys)
    assert text.endswith((".", ".)")) and "``" not in text, text


@pytest.mark.parametrize("module", [plot_module, report_module], ids=["quest-plot", "quest-report"])
def test_a_description_from_a_docstring_is_its_whole_first_paragraph(module, capsys):
    assert _description(module.main, [], capsys) == doc_summary(module.__doc__)


@pytest.mark.parametrize("doc, expected", [
    (None, ""),
    ("One line.", "One line."),
    ("Wrapped over\n    two lines; ``literal`` kept as text.\n\n    Second paragraph.", "Wrapped over two lines; "
                                                                                     "literal kept as text."),
    ("See :func:`quest.x.y` and :class:`~quest.z.Z`.", "See quest.x.y and quest.z.Z."),
])
def test_doc_summary_is_the_first_paragraph_as_plain_text(doc, expected):
    assert doc_summary(doc) == expected
