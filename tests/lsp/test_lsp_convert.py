"""Position conversion and LSP object building of ``trainlint server``, without a server process."""

from __future__ import annotations

import pytest

pytest.importorskip("lsprotocol")

from lsprotocol import types as lsp

from trainlint.lsp import convert
from trainlint.rule import Finding, Severity

ASTRAL = "\U0001d518"  # one code point, two UTF-16 units, four UTF-8 bytes


def finding(line: int, column: int, end_line: int, end_column: int, rule: str = "TL201") -> Finding:
    return Finding(rule, "name", Severity.WARNING, "f.py", line, column, end_line, end_column, "message")


@pytest.mark.parametrize(
    ("encoding", "expected"),
    [
        # the units of `s = "` (5), of the character, and of `"` (1)
        (lsp.PositionEncodingKind.Utf16, 5 + 2 + 1),
        (lsp.PositionEncodingKind.Utf8, 5 + 4 + 1),
        (lsp.PositionEncodingKind.Utf32, 5 + 1 + 1),
    ],
)
def test_columns_convert_both_ways_in_each_encoding(encoding: str, expected: int) -> None:
    doc = convert.Document(f'x\ns = "{ASTRAL}" + y\n', encoding)
    column = len('s = "' + ASTRAL + '"') + 1  # code points before `" + y`, 1-based: where ` + y` starts
    assert column == 8
    position = doc.position(2, column)
    assert position == lsp.Position(line=1, character=expected)
    assert doc.point(position) == (2, column)


def test_positions_past_the_end_are_clamped() -> None:
    doc = convert.Document("ab\ncd")
    assert doc.position(5, 1) == lsp.Position(line=1, character=2)
    assert doc.point(lsp.Position(line=9, character=9)) == (2, 3)
    assert doc.point(lsp.Position(line=0, character=99)) == (1, 3)


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"])
def test_noqa_edit_appends_before_the_line_break(newline: str) -> None:
    text = newline.join(["a = 1", "y = cp.checkpoint(f, x)   ", "b = 2", ""])
    doc = convert.Document(text)
    edit = convert.noqa_edit(finding(2, 5, 2, 24), doc)
    # trailing blanks are replaced, the line break is kept
    assert edit.range == lsp.Range(lsp.Position(1, 23), lsp.Position(1, 26))
    assert edit.new_text == "  # noqa: TL201"


def test_noqa_edit_completes_an_empty_list() -> None:
    doc = convert.Document("y = cp.checkpoint(f, x)  # noqa:\n")
    edit = convert.noqa_edit(finding(1, 5, 1, 24), doc)
    assert edit.new_text == "# noqa: TL201"
    assert edit.range == lsp.Range(lsp.Position(0, 25), lsp.Position(0, 32))


def test_fix_all_edit_covers_only_what_changed() -> None:
    before = f"# {ASTRAL}\na = f(x)\nb = 2\n"
    after = f"# {ASTRAL}\na = f(x, k=1)\nb = 2\n"
    (edit,) = convert.fix_all_action(convert.Document(before), "file:///f.py", after).edit.changes[
        "file:///f.py"
    ]
    assert edit.range == lsp.Range(lsp.Position(1, 7), lsp.Position(1, 7))
    assert edit.new_text == ", k=1"


def test_hover_needs_the_cursor_on_a_finding() -> None:
    doc = convert.Document("a = 1\nb = f(x)\n")
    found = [finding(2, 5, 2, 9)]
    docs = {"TL201": "# TL201 docs"}
    assert convert.hover(found, doc, lsp.Position(0, 2), docs) is None
    assert convert.hover(found, doc, lsp.Position(1, 2), docs) is None
    inside = convert.hover(found, doc, lsp.Position(1, 6), docs)
    assert inside is not None and inside.contents.value == "# TL201 docs"
