"""``quest-train --help`` / ``quest-eval --help``: the app's own config groups and a one-line description of every key.

A key's description is, in this order: ``field(metadata={"doc": "..."})``; the comment on the field's line(s) in the
schema dataclass (``batch_size: int = 64  # per process``); the comment lines right above the field; for a field that
holds a dataclass, the first paragraph of that class's docstring (quest.runtime.errors.doc_summary).
tests/config/test_config_help.py fails for a schema key with none of these, so a new key cannot arrive undocumented.
Only the standard library, hydra, omegaconf and quest's own light modules are imported here: --help answers
without importing torch for quest-train.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing
from functools import lru_cache
from typing import Any, Iterator

from quest.config.checks import allowed_words, dataclass_of
from quest.runtime.errors import doc_summary

__all__ = ["DOC", "key_docs", "field_doc", "app_help", "data_set_settings", "data_set_keys"]

#: the metadata key of a field's description (where a comment cannot say it)
DOC = "doc"
#: the metadata keys that declare what a value may be (quest.store.records), shown after the description
_DECLARING = ("bounds", "choices", "pattern", "length", "allowed")


@lru_cache(maxsize=None)
def _comments(cls: type) -> dict[str, str]:
    """Field name -> its comment in ``cls``'s own source (trailing, else the block right above), for the fields the
    class body itself annotates."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):  # a class built at run time (make_dataclass): its fields come from its bases
        return {}
    source = textwrap.dedent("".join(lines))
    comment_at: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comment_at[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    tree = ast.parse(source)
    found: dict[str, str] = {}
    for node in tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        trailing = [comment_at[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1) if n in comment_at]
        above: list[str] = []
        line = node.lineno - 1
        while line in comment_at and line not in code_lines:
            above.insert(0, comment_at[line])
            line -= 1
        text = " ".join(trailing or above).strip()
        if text:
            found[node.target.id] = text
    return found


def field_doc(cls: type, name: str) -> str:
    """The description of field ``name`` of dataclass ``cls`` (see the module docstring), or ``""``."""
    fld = cls.__dataclass_fields__[name]
    if fld.metadata.get(DOC):
        return str(fld.metadata[DOC])
    for klass in cls.__mro__:  # the most derived class that says something about it
        if dataclasses.is_dataclass(klass) and name in klass.__dict__.get("__annotations__", {}):
            text = _comments(klass).get(name)
            if text:
                return text
    nested = dataclass_of(typing.get_type_hints(cls).get(name))
    if nested is not None and nested.__doc__ and not nested.__doc__.startswith(f"{nested.__name__}("):
        return doc_summary(nested.__doc__)
    return ""


def key_docs(schema: type, prefix: str = "") -> Iterator[tuple[str, Any, str]]:
    """(dotted key, default, description) for every key of the ``schema`` dataclass tree, depth first; a field
    holding a dataclass is listed itself and then its keys. A field's declared range or choices follow its
    description ("must be in [0, 1]"), in the words a refusal uses."""
    hints = typing.get_type_hints(schema)
    for fld in dataclasses.fields(schema):
        key = f"{prefix}{fld.name}"
        nested = dataclass_of(hints.get(fld.name))
        if fld.default is not dataclasses.MISSING:
            default: Any = fld.default
        elif fld.default_factory is not dataclasses.MISSING and nested is None:
            default = fld.default_factory()
        else:
            default = None if nested is None else "{...}"
        doc = field_doc(schema, fld.name)
        if any(k in fld.metadata for k in _DECLARING):
            must = f"must be {allowed_words(hints[fld.name], fld.metadata)}"
            doc = f"{doc.rstrip('.')}; {must}" if doc.strip() else must
        yield key, default, doc
        if nested is not None:
            yield from key_docs(nested, key + ".")


def _shown(value: Any) -> str:
    from omegaconf import MISSING

    if value == MISSING:
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def app_help(app: str, usage: str, groups: dict[str, list[str]], schema: type, width: int = 118) -> str:
    """The --help text: usage, the app's config groups with their options, every key with its default and
    description, and where Hydra's own flags are."""
    out = [f"{app}: {usage}", "", "Config groups (group=option; the options are configs/<group>/*.yaml):"]
    for group, options in groups.items():
        out.append(textwrap.fill(", ".join(options) or "(any)", width, initial_indent=f"  {group:<12} ",
                                 subsequent_indent=" " * 15))
    out += ["", "Keys (key=value; default in brackets, set by the chosen group options when they say so):"]
    out += _key_lines(key_docs(schema), width)
    if "data" in groups:  # each data set's own options (quest/data/sets/, docs/data.md)
        out += ["", "Each data set's own keys (data=<name> data.<key>=value; the others are refused):"]
        for name, settings in data_set_settings().items():
            out.append(f"  data={name}")
            out += _key_lines(data_set_keys(settings), width) or [" " * 29 + "(none)"]
    out += ["", f"Nested keys are written with dots: {_example(schema)}.",
            f"{app} ... --cfg job prints the composed config of a command; --hydra-help lists Hydra's own flags;",
            f"tab completion: eval \"$({app} -sc install=bash)\"."]
    return "\n".join(out) + "\n"


def _key_lines(docs: Iterator[tuple[str, Any, str]], width: int) -> list[str]:
    out = []
    for key, default, doc in docs:
        depth = key.count(".")
        head = f"{'  ' * depth}  {key.rsplit('.', 1)[-1] if depth else key}"
        out.append(textwrap.fill(f"[{_shown(default)}] {doc}", width, initial_indent=f"{head:<28} ",
                                 subsequent_indent=" " * 29) if len(head) < 28
                   else head + "\n" + textwrap.fill(f"[{_shown(default)}] {doc}", width, initial_indent=" " * 29,
                                                    subsequent_indent=" " * 29))
    return out


def data_set_settings() -> dict[str, type]:
    """Registered data set -> its settings dataclass (quest.data.registry; no torch imported)."""
    from quest.data.registry import get_dataset, list_datasets

    return {name: get_dataset(name).settings for name in list_datasets()}


def data_set_keys(settings: type) -> Iterator[tuple[str, Any, str]]:
    """:func:`key_docs` of a data set's own keys (those the shared DataConfig does not have), as ``data.<key>``."""
    from quest.data.config import DataConfig

    shared = {f.name for f in dataclasses.fields(DataConfig)}
    for key, default, doc in key_docs(settings, "data."):
        if key.split(".")[1] not in shared:
            yield key, default, doc


def _example(schema: type) -> str:
    for key, default, _ in key_docs(schema):
        if "." in key and isinstance(default, (int, float, str)) and not isinstance(default, bool) and default != "???":
            return f"{key}={default}"
    return "group.key=value"
