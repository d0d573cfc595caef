"""Regression tests for the file model's shared facts: line numbering when the text holds characters
that ``str.splitlines`` treats as line breaks but the parser does not, and the loop a site belongs to
when it sits in a loop's ``else:``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rich.console import Console

from trainlint.engine import lint_source
from trainlint.fix import fix_text
from trainlint.model import FileModel
from trainlint.report import RunReport
from trainlint.report.text import render_text
from trainlint.verify.harness import build_probe
from trainlint.verify.source import Tree

# Every character ``str.splitlines`` breaks at that Python's tokenizer does not (``\n``, ``\r`` and
# ``\r\n`` are line breaks for both).
SEPARATORS = ("\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")
assert all(len(("a" + s + "b").splitlines()) == 2 for s in SEPARATORS)

# TL101 with a late ``unscale_``: the fix moves that line before the clip. The comment line above the
# loop holds the separator (``{sep}``), so every line after it is off by one for ``splitlines``.
MOVE_FIX = """\
import torch


def step(model, opt, scaler, loader):
    # scaled{sep}gradients below
    for x in loader:
        loss = loss_fn(model(x))
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
"""


def _pair(sep: str) -> tuple[str, str]:
    """The snippet with the separator, and the same snippet with a plain space in its place."""
    return MOVE_FIX.replace("{sep}", sep), MOVE_FIX.replace("{sep}", " ")


@pytest.mark.parametrize("sep", SEPARATORS, ids=[f"U+{ord(s):04X}" for s in SEPARATORS])
def test_separator_leaves_findings_and_fix_alone(sep: str) -> None:
    text, plain = _pair(sep)
    found, expected = lint_source(text, "t.py", ["TL101"]), lint_source(plain, "t.py", ["TL101"])
    assert [(f.line, f.column, f.end_line, f.end_column) for f in found] == [(9, 9, 9, 64)]
    assert [f.to_json() for f in found] == [f.to_json() for f in expected]
    result = fix_text(text, lambda t: lint_source(t, "t.py", ["TL101"]), unsafe=False).text
    assert result.count("clip_grad_norm_") == 1
    assert result.count("unscale_") == 1
    assert result.count(".backward()") == 1
    assert (
        result.replace(sep, " ")
        == fix_text(plain, lambda t: lint_source(t, "t.py", ["TL101"]), unsafe=False).text
    )
    assert result.index("unscale_") < result.index("clip_grad_norm_")


@pytest.mark.parametrize("sep", SEPARATORS, ids=[f"U+{ord(s):04X}" for s in SEPARATORS])
def test_separator_code_frame_marks_the_reported_line(sep: str) -> None:
    text, _ = _pair(sep)
    findings = lint_source(text, "t.py", ["TL101"])
    console = Console(record=True, width=200, color_system=None)
    render_text(RunReport(findings, [], 1, 0.0, {"t.py": text}), console, quiet=True)
    marked = [line for line in console.export_text().splitlines() if line.lstrip().startswith(">")]
    assert len(marked) == 1
    assert "clip_grad_norm_" in marked[0]


@pytest.mark.parametrize("sep", SEPARATORS, ids=[f"U+{ord(s):04X}" for s in SEPARATORS])
def test_separator_leaves_the_probe_alone(sep: str) -> None:
    """The TL101 probe (the program ``--verify`` runs) is the same with and without the separator."""
    probes = []
    for text in _pair(sep):
        (finding,) = lint_source(text, "t.py", ["TL101"])
        model = FileModel.from_source(text, "t.py")
        probes.append(json.dumps(build_probe(finding, model, Tree(model)), sort_keys=True))
    assert probes[0].replace(json.dumps(sep)[1:-1], " ") == probes[1]


def test_separators_through_the_command_line(tmp_path: Path) -> None:
    """``trainlint --fix`` on files holding each separator: every file gets the fix the plain one gets."""
    for index, sep in enumerate(SEPARATORS):
        (tmp_path / f"t{index}.py").write_text(_pair(sep)[0], encoding="utf-8", newline="")
    (tmp_path / "plain.py").write_text(_pair(" ")[0], encoding="utf-8", newline="")
    subprocess.run(
        [sys.executable, "-m", "trainlint", str(tmp_path), "--no-cache", "--fix"],
        capture_output=True,
        check=False,
    )
    plain = (tmp_path / "plain.py").read_text(encoding="utf-8")
    assert "scaler.unscale_(opt)\n        torch.nn.utils.clip_grad_norm_" in plain
    for index, sep in enumerate(SEPARATORS):
        fixed = (tmp_path / f"t{index}.py").open(encoding="utf-8", newline="").read()
        assert fixed.replace(sep, " ") == plain, f"U+{ord(sep):04X}"


def _tl103(code: str) -> list[int]:
    return [f.line for f in lint_source(textwrap.dedent(code), "t.py", ["TL103"])]


def test_tl103_update_in_the_loops_else_runs_once() -> None:
    assert (
        _tl103(
            """
            import torch
            scaler = torch.amp.GradScaler()
            for i, x in enumerate(data):
                scaler.scale(loss).backward()
                if (i + 1) % accum == 0:
                    scaler.step(opt)
            else:
                scaler.update()
            """
        )
        == []
    )


def test_tl103_update_in_an_inner_loops_else_runs_per_outer_iteration() -> None:
    # The inner loop's ``else:`` runs once per iteration of the outer loop, whose step is conditional.
    assert _tl103(
        """
        import torch
        scaler = torch.amp.GradScaler()
        for i, batch in enumerate(loader):
            for x in batch:
                scaler.scale(loss_fn(x)).backward()
            else:
                scaler.update()
            if (i + 1) % accum == 0:
                scaler.step(opt)
        """
    ) == [8]
