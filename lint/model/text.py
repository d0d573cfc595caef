"""Source text as the parser numbers it: the one line splitter, line offsets, indentation, block text.

Python breaks lines only at ``\\r\\n``, ``\\r`` and ``\\n``; ``str.splitlines`` also breaks at form
feeds, ``\\x0b``, ``\\x1c``-``\\x1e``, ``\\x85``, ``\\u2028`` and ``\\u2029``, so indexing its lines with
the parser's line numbers picks the wrong line. Every piece of code that maps a position to text goes
through this module.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a run answered from the cache splits lines for code frames without loading libcst
    import libcst as cst

    from trainlint.model.filemodel import FileModel

# Where the parser breaks lines.
LINE_BREAK = re.compile(r"\r\n|\r|\n")


def split_lines(text: str, *, keepends: bool = False) -> list[str]:
    """The lines of ``text`` as the parser numbers them. Without ``keepends`` a text ending in a line
    break has a last, empty line (``"a\\n"`` -> ``["a", ""]``); with it, that empty line is left out
    and joining the lines gives ``text`` back."""
    if not keepends:
        return LINE_BREAK.split(text)
    out, start = [], 0
    for match in LINE_BREAK.finditer(text):
        out.append(text[start : match.end()])
        start = match.end()
    if start < len(text):
        out.append(text[start:])
    return out


def line_starts(text: str) -> list[int]:
    """The offset of the first character of each line (1-based line ``n`` starts at ``[n - 1]``)."""
    return [0, *(m.end() for m in LINE_BREAK.finditer(text))]


def line_of(model: FileModel, node: cst.CSTNode) -> int:
    return model.position(node).start.line


def indentation(model: FileModel, statement: cst.CSTNode) -> str | None:
    """The whitespace before ``statement`` on its first line, or None if it does not start a line."""
    pos = model.position(statement)
    lines = model.lines
    if pos.start.line - 1 >= len(lines):
        return None
    prefix = lines[pos.start.line - 1][: pos.start.column]
    return prefix if prefix.strip() == "" else None


def source_text(model: FileModel, node: cst.CSTNode) -> str:
    """The exact source text of ``node``'s range (without leading lines or a trailing comment)."""
    pos = model.position(node)
    starts = model.line_starts
    return model.source[
        starts[pos.start.line - 1] + pos.start.column : starts[pos.end.line - 1] + pos.end.column
    ]


def whole_lines(model: FileModel, node: cst.CSTNode) -> list[str]:
    """The physical lines ``node`` spans, trailing comment included, without their line breaks."""
    pos = model.position(node)
    return model.lines[pos.start.line - 1 : pos.end.line]


def ends_file(model: FileModel, node: cst.CSTNode) -> bool:
    """``node`` sits on the file's last line and that line has no line break."""
    return model.position(node).end.line == len(model.lines) and model.lines[-1] != ""


def line_indent(model: FileModel, node: cst.CSTNode) -> str | None:
    """The whitespace before ``node`` on its first line, or None when something else precedes it."""
    prefix = whole_lines(model, node)[0][: model.position(node).start.column]
    return prefix if prefix.strip(" \t\f") == "" else None


def reindented(model: FileModel, statement: cst.CSTNode, indent: str) -> str | None:
    """The whole lines of ``statement`` (trailing comment included), each line that starts with the
    statement's own indentation moved to ``indent``, each ending in a newline: the content of a
    ``delete_lines`` edit that puts the statement somewhere else. None when the statement does not
    start its line or a string literal spans lines (re-indenting would change the string)."""
    import libcst as cst

    from trainlint.model.syntax import walk

    own = line_indent(model, statement)
    if own is None:
        return None
    for node in walk(statement):
        if isinstance(node, cst.SimpleString | cst.FormattedString) and LINE_BREAK.search(model.code(node)):
            return None
    lines = whole_lines(model, statement)
    return "".join((indent + line[len(own) :] if line.startswith(own) else line) + "\n" for line in lines)
