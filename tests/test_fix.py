"""Applying fixes: exact before/after text, idempotence, line endings, tabs, BOM, unparsable results."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from trainlint.cli import run
from trainlint.engine import lint_source
from trainlint.fix import apply_edits, fix_text
from trainlint.rule import Applicability, Edit, Finding, Fix, Severity

ROOT = Path(__file__).resolve().parent.parent

BEFORE = """\
import torch.utils.checkpoint as cp


def forward(blocks, x):
    for block in blocks:
        # keep activations small
        x = cp.checkpoint(block, x)  # recompute in backward
        y = cp.checkpoint(
            block,
            x,
        )
    return x, y
"""
AFTER = """\
import torch.utils.checkpoint as cp


def forward(blocks, x):
    for block in blocks:
        # keep activations small
        x = cp.checkpoint(block, x, use_reentrant=False)  # recompute in backward
        y = cp.checkpoint(
            block,
            x, use_reentrant=False,
        )
    return x, y
"""


def lint_all(path: str = "f.py"):
    return lambda text: lint_source(text, path)


def test_tl201_fix_before_after_written_by_hand() -> None:
    outcome = fix_text(BEFORE, lint_all(), unsafe=True)
    assert outcome.text == AFTER
    assert outcome.fixed == 2
    assert [f.rule for f in lint_source(outcome.text)] == []


def test_unsafe_fixes_are_not_applied_without_the_flag() -> None:
    outcome = fix_text(BEFORE, lint_all(), unsafe=False)
    assert outcome.text == BEFORE
    assert outcome.fixed == 0


def test_fixing_twice_changes_nothing_the_second_time() -> None:
    once = fix_text(BEFORE, lint_all(), unsafe=True).text
    twice = fix_text(once, lint_all(), unsafe=True)
    assert twice.text == once
    assert twice.fixed == 0


def test_crlf_tabs_and_bom_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    source = BEFORE.replace("    ", "\t").replace("\n", "\r\n")
    expected = AFTER.replace("    ", "\t").replace("\n", "\r\n")
    path = tmp_path / "train.py"
    path.write_bytes(b"\xef\xbb\xbf" + source.encode())
    code = run(["--no-cache", "--fix", "--unsafe-fixes", "train.py"])
    capsys.readouterr()
    assert code == 0
    assert path.read_bytes() == b"\xef\xbb\xbf" + expected.encode()


def test_declared_encoding_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    source = "# -*- coding: latin-1 -*-\n# caf\xe9\n" + BEFORE
    path = tmp_path / "train.py"
    path.write_bytes(source.encode("latin-1"))
    assert run(["--no-cache", "--fix", "--unsafe-fixes", "train.py"]) == 0
    capsys.readouterr()
    assert path.read_bytes() == ("# -*- coding: latin-1 -*-\n# caf\xe9\n" + AFTER).encode("latin-1")


def _finding(edits: tuple[Edit, ...]) -> Finding:
    return Finding(
        rule="TL201",
        name="checkpoint-use-reentrant",
        severity=Severity.WARNING,
        path="f.py",
        line=1,
        column=1,
        end_line=1,
        end_column=1,
        message="m",
        fix=Fix(Applicability.SAFE, "d", edits),
    )


def test_a_fix_that_would_break_the_file_is_dropped_and_reported() -> None:
    text = "x = 1\n"
    broken = _finding((Edit(1, 1, 1, 1, "def ("),))
    outcome = fix_text(text, lambda _t: [broken], unsafe=False)
    assert outcome.text == text
    assert outcome.fixed == 0
    assert outcome.dropped and "unparsable" in outcome.dropped[0]


def test_overlapping_fixes_apply_one_per_round() -> None:
    text = "abc\n"
    first = (Edit(1, 1, 1, 3, "X"),)
    second = (Edit(1, 2, 1, 4, "Y"),)
    assert apply_edits(text, [first, second]) == ("Xc\n", 1)


def test_multi_line_edit_offsets_follow_parser_lines() -> None:
    # a form feed is not a line break for the parser; str.splitlines would say it is
    text = "a = 1\x0c\nb = 2\r\nc = 3\n"
    edited, applied = apply_edits(text, [(Edit(3, 1, 3, 2, "d"),)])
    assert applied == 1
    assert edited == "a = 1\x0c\nb = 2\r\nd = 3\n"


def test_fix_over_fixtures_leaves_only_findings_without_a_fix(tmp_path: Path, monkeypatch, capsys) -> None:
    shutil.copytree(ROOT / "fixtures", tmp_path / "fixtures")
    monkeypatch.chdir(tmp_path)
    run(["--no-cache", "--fix", "--unsafe-fixes", "fixtures"])
    first = {p.name: p.read_text() for p in (tmp_path / "fixtures").glob("*.py")}
    capsys.readouterr()
    run(["--no-cache", "--format", "json", "fixtures"])
    import json

    data = json.loads(capsys.readouterr().out)
    assert all(f["fix"] is None for f in data["findings"])
    run(["--no-cache", "--fix", "--unsafe-fixes", "fixtures"])
    second = {p.name: p.read_text() for p in (tmp_path / "fixtures").glob("*.py")}
    assert first == second
    # comments around the edits are preserved
    assert "# expect: TL201" in first["bad_gpt_amp.py"]


def test_delete_lines_edit_removes_whole_lines_including_the_break() -> None:
    import libcst as cst

    from trainlint.engine import _to_edit
    from trainlint.model import FileModel
    from trainlint.rule import TextEditSpec

    text = "a = 1\nif a:\n    b = 2\n    c = 3\nd = 4"
    model = FileModel(cst.parse_module(text), "f.py", text)
    body = model.module.body[1].body.body  # the two statements inside the if
    middle = _to_edit(model, TextEditSpec(body[0], "delete_lines", ""))
    assert apply_edits(text, [(middle,)]) == ("a = 1\nif a:\n    c = 3\nd = 4", 1)
    last_line = _to_edit(model, TextEditSpec(model.module.body[2], "delete_lines", ""))
    assert apply_edits(text, [(last_line,)]) == ("a = 1\nif a:\n    b = 2\n    c = 3\n", 1)
