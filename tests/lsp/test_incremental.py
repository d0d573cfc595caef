"""The language server's partial re-parse (``trainlint.incremental``) against whole parses.

Random edits of the bundled fixtures' concatenation, as an editor sends them one after the other: one
line changed, lines inserted, deleted, pasted, indented, syntax broken and repaired. After each, the
module built from the last one must equal libcst's parse of the whole text node for node, every node's
position must equal the whole module's position pass, and the findings must equal ``lint_text``'s.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import libcst as cst
import pytest

from trainlint.engine import lint_text
from trainlint.incremental import Documents, PieceUnparsable, parse_full, reparse
from trainlint.model.filemodel import _PositionState
from trainlint.results import LintOptions
from trainlint.rule import registry

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = LintOptions(tuple(registry().ids()))


@pytest.fixture(scope="module")
def corpus() -> str:
    return "".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "fixtures").glob("*.py")))


def _one_line(lines: list[str], k: int, rng: random.Random) -> None:
    line = lines[k]
    cut = rng.randrange(len(line))  # before the line break
    inserted = rng.choice(["x", " ", "(", ")", ":", '"', "'''", "\\", "#", "\t", "    ", "1 +", ","])
    lines[k] = line[:cut] + inserted + line[cut:]


_INSERTED = [
    "y = 1\n",
    "    y = 2\n",
    "def g():\n    return 1\n",
    "@dec\n",
    "if y:\n",
    "        # deep\n",
    "\n",
]


def _edit(text: str, rng: random.Random) -> str:
    lines = text.splitlines(keepends=True)
    k = rng.randrange(len(lines))
    kind = rng.choice(
        ["line", "line", "line", "insert", "delete", "paste", "cut", "indent", "dedent", "ends"]
    )
    if kind == "line":
        _one_line(lines, k, rng)
    elif kind == "insert":
        lines.insert(k, rng.choice(_INSERTED))
    elif kind == "delete":
        del lines[k]
    elif kind == "paste":
        lines[k:k] = lines[rng.randrange(len(lines)) :][: rng.randrange(1, 12)]
    elif kind == "cut":
        del lines[k : k + rng.randrange(1, 12)]
    elif kind == "indent":
        lines[k] = "    " + lines[k]
    elif kind == "dedent":
        lines[k] = lines[k].removeprefix("    ")
    elif rng.random() < 0.5:
        lines.insert(0, rng.choice(["# top\n", "\n", "import os\n", '"""doc"""\n']))
    else:
        lines.append(rng.choice(["# end\n", "\n", "x = 1\n", "    # deep\n", "def h():\n    return 1\n"]))
    return "".join(lines)


def _whole_positions(module: cst.Module) -> dict[cst.CSTNode, object]:
    state = _PositionState(module.default_indent, module.default_newline)
    module._codegen(state)
    return state.computed


def _walk(corpus: str, seed: int, steps: int, check: Callable[[str, str | None], None]) -> int:
    """Edit the corpus ``steps`` times from its last text that parsed (as the server keeps it); call
    ``check(text, reason_for_no_parse)``. Returns how many edited texts did parse."""
    rng = random.Random(seed)
    good, parsed = corpus, 0
    for _ in range(steps):
        text = _edit(good, rng)
        try:
            module = cst.parse_module(text)
        except cst.ParserSyntaxError:
            check(text, "syntax error")
            continue
        if module.code != text:  # libcst 1.9 drops the second of two indented comments at the end
            check(text, "libcst does not reproduce it")
            continue
        check(text, None)
        good, parsed = text, parsed + 1
    return parsed


@pytest.mark.parametrize("seed", [0, 1])
def test_partial_parses_equal_whole_parses_tree_and_positions(corpus: str, seed: int) -> None:
    state = {"old": parse_full(corpus)}
    partial = 0

    def check(text: str, broken: str | None) -> None:
        nonlocal partial
        try:  # as the server does: a text ``parse_full`` leaves to ``lint_text`` has nothing to edit
            got = reparse(state["old"], text) if state["old"] is not None else None
        except PieceUnparsable:
            got = None
        if broken is not None:
            assert got is None  # a text libcst rejects (or cannot reproduce) is never pieced together
            return
        if got is None:  # a fallback: allowed, but it must stay rare (counted below)
            state["old"] = parse_full(text)
            return
        partial += 1
        whole = cst.parse_module(text)
        assert got.module.code == text
        assert got.module.deep_equals(whole)
        expected = _whole_positions(got.module)
        positions = got.positions()
        assert {node: positions[node] for node in expected} == expected
        assert len(positions) == len(expected)
        state["old"] = got

    parsed = _walk(corpus, seed, 50, check)
    assert parsed >= 15 and partial >= parsed * 0.8


def test_findings_equal_lint_text_after_each_edit(corpus: str) -> None:
    documents = Documents()
    assert documents.lint("doc.py", corpus, OPTIONS).findings == lint_text(corpus, "doc.py", OPTIONS).findings

    def check(text: str, _broken: str | None) -> None:
        assert documents.lint("doc.py", text, OPTIONS).findings == lint_text(text, "doc.py", OPTIONS).findings

    parsed = _walk(corpus, 7, 16, check)
    assert parsed >= 5 and documents.reused >= parsed * 0.8


def test_broken_then_repaired_is_parsed_in_part_again(corpus: str) -> None:
    documents = Documents()
    documents.lint("doc.py", corpus, OPTIONS)
    lines = corpus.splitlines(keepends=True)
    k = next(
        i for i, line in enumerate(lines) if line.startswith("    ") and "(" in line and i > len(lines) // 2
    )
    broken = "".join([*lines[:k], lines[k].replace("(", "((", 1), *lines[k + 1 :]])
    repaired = "".join([*lines[:k], lines[k].rstrip("\n") + "  # fixed\n", *lines[k + 1 :]])
    found = documents.lint("doc.py", broken, OPTIONS).findings
    assert [f.rule for f in found] == ["TL901"]
    assert found == lint_text(broken, "doc.py", OPTIONS).findings
    assert (
        documents.lint("doc.py", repaired, OPTIONS).findings
        == lint_text(repaired, "doc.py", OPTIONS).findings
    )
    assert documents.reused == 1  # the repaired text was compared with the last text that parsed


def test_windows_line_breaks_and_edits_at_both_ends(corpus: str) -> None:
    text = corpus.replace("\n", "\r\n")
    old = parse_full(text)
    assert old is not None
    for new in (
        "# top\r\n" + text,
        text + "def tail():\r\n    return 1\r\n",
        text[: text.index("\r\n") + 2] + "\r\n" + text[text.index("\r\n") + 2 :],
        text.rstrip("\r\n"),
    ):
        got = reparse(old, new)
        assert got is not None and got.module.deep_equals(cst.parse_module(new)) and got.module.code == new


def test_a_change_of_the_indentation_unit_parses_the_whole_text() -> None:
    # libcst records blocks indented by the module's unit (its first block's) without their indent:
    # re-indenting the first block changes the unit, so the untouched blocks must be parsed again
    old = parse_full("import os\n\ndef f():\n    return 1\n\ndef g():\n    return 2\n")
    assert old is not None
    new = "import os\n\ndef f():\n  return 1\n\ndef g():\n    return 2\n"
    got = reparse(old, new)
    assert got is None or got.module.deep_equals(cst.parse_module(new))
    assert got is None


def test_the_servers_linter_reparses_an_edited_document_in_part(corpus: str) -> None:
    from trainlint.lsp.link import Linter

    linter = Linter(ROOT)
    options = linter.settings(None).options(None)
    linter.lint(corpus, None, "doc.py")
    k = corpus.index("\n", len(corpus) // 2)
    edited = corpus[:k] + "  # typed" + corpus[k:]
    assert linter.lint(edited, None, "doc.py") == lint_text(edited, "doc.py", options).findings
    assert linter.documents.reused == 1


def test_a_broken_text_is_not_parsed_whole_twice(corpus: str, monkeypatch) -> None:
    import trainlint.incremental

    documents = Documents()
    documents.lint("doc.py", corpus, OPTIONS)
    calls: list[str] = []
    whole = trainlint.incremental.parse_full
    monkeypatch.setattr(trainlint.incremental, "parse_full", lambda text: calls.append(text) or whole(text))
    k = corpus.index("\ndef ", len(corpus) // 2) + 1
    broken = corpus[:k] + "x = (\n" + corpus[k:]
    assert [f.rule for f in documents.lint("doc.py", broken, OPTIONS).findings] == ["TL901"]
    assert calls == []  # lint_text's own parse says where it fails; a whole parse first would repeat it


def test_a_string_spanning_statements_parses_whole_then_in_part_again() -> None:
    # the edited statement alone does not parse (its string closes in a later statement), the whole
    # text does: it is linted whole and kept, so that the next edit is re-parsed in part again
    head = (ROOT / "fixtures" / "bad_amp_loops.py").read_text(encoding="utf-8")
    text = head + '\nx = ""  # """\n\ny = 2\n\nz = 3  # """\n'
    documents = Documents()
    documents.lint("doc.py", text, OPTIONS)
    spanning = text.replace('x = ""  # """', 'x = "" """')
    found = documents.lint("doc.py", spanning, OPTIONS).findings
    assert found == lint_text(spanning, "doc.py", OPTIONS).findings and found
    assert documents.reused == 0
    edited = spanning.replace("\n", "  # typed\n", 1)  # far from the string: only the first line's statement
    assert documents.lint("doc.py", edited, OPTIONS).findings == lint_text(edited, "doc.py", OPTIONS).findings
    assert documents.reused == 1
