"""``--fix`` and ``--verify`` on Jupyter notebooks (their linting: tests/test_integration.py).

The expected cells after a fix are the rule's own hand-written example (``Invalid.fix``), split into
cells as the input is; the JSON around them must come back byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import trainlint.verify
from trainlint.cli import run
from trainlint.fix import apply_edits
from trainlint.notebook import _cell_fix, lint_notebook, read_notebook
from trainlint.notebook_fix import _within, back_in_cells, for_verify
from trainlint.results import LintOptions
from trainlint.rule import Applicability, Edit, Fix, registry

needs_torch = pytest.mark.skipif(not trainlint.verify.torch_available(), reason="--verify needs torch")


def _example(rule: str):
    (found,) = [ex for ex in registry().get(rule).invalid if ex.fix][:1]  # type: ignore[union-attr]
    return found


def _notebook(*sources: str, indent: int | None = 1, listed: bool = True) -> str:
    """A notebook as Jupyter writes it: a markdown cell, then one code cell per source."""
    cells = [{"cell_type": "markdown", "metadata": {}, "source": ["# Training\n"]}]
    for source in sources:
        cells.append(
            {
                "cell_type": "code",
                "execution_count": None,
                "metadata": {},
                "outputs": [],
                "source": source.splitlines(keepends=True) if listed else source,
            }
        )
    data = {
        "cells": cells,
        "metadata": {"kernelspec": {"name": "python3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    return json.dumps(data, indent=indent, ensure_ascii=False) + "\n"


def _split(code: str, lines: int) -> tuple[str, str]:
    parts = code.splitlines(keepends=True)
    return "".join(parts[:lines]), "".join(parts[lines:])


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = run(["--no-cache", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("listed", [True, False], ids=["lines", "string"])
def test_fix_applies_the_safe_fix_inside_the_cell_and_keeps_the_rest(tmp_path: Path, capsys, listed) -> None:
    example = _example("TL302")
    head, loop = _split(example.code, 2)
    fixed_head, fixed_loop = _split(example.fix, 2)
    assert head == fixed_head and loop != fixed_loop  # the fix is in the second cell
    magic = "%matplotlib inline\n"
    path = tmp_path / "train.ipynb"
    path.write_text(_notebook(magic + head, loop.rstrip("\n"), listed=listed), encoding="utf-8")
    code, _, err = _run(capsys, "--fix", str(path))
    assert err == ""
    # the same notebook written from the expected cells: the JSON layout and the other cells unchanged
    assert path.read_text(encoding="utf-8") == _notebook(magic + head, fixed_loop.rstrip("\n"), listed=listed)
    assert code == 0


def test_diff_shows_the_notebook_change_and_writes_nothing(tmp_path: Path, capsys) -> None:
    example = _example("TL302")
    path = tmp_path / "train.ipynb"
    before = _notebook(example.code)
    path.write_text(before, encoding="utf-8")
    code, out, _ = _run(capsys, "--diff", str(path))
    assert code == 1 and path.read_text(encoding="utf-8") == before
    assert "loss.detach()" in out and "train.ipynb" in out


@pytest.mark.parametrize(
    ("source", "expected"),
    [("a = 1\nb = 2", "a = 1"), ("a = 1\nb = 2\n", "a = 1\n"), ("a = 1\r\nb = 2", "a = 1")],
    ids=["no-final-break", "final-break", "crlf"],
)
def test_deleting_a_cells_last_line_leaves_no_empty_line(source: str, expected: str) -> None:
    # a statement's lines are deleted up to the start of the next line, which a cell's source without
    # a final line break does not have: the break before the line goes instead
    edits = _within((Edit(2, 1, 3, 1, ""),), source)
    assert apply_edits(source, [edits]) == (expected, 1)


def test_a_fix_touching_an_ipython_line_is_not_offered() -> None:
    notebook = read_notebook(_notebook("import torch\n%time x = 1\ny = 2\n"))
    inside = Fix(Applicability.SAFE, "d", (Edit(3, 1, 3, 2, "z"),))
    across = Fix(Applicability.SAFE, "d", (Edit(1, 1, 3, 1, ""),))
    assert _cell_fix(inside, notebook, 1) == Fix(Applicability.SAFE, "d", (Edit(3, 1, 3, 2, "z"),))
    assert _cell_fix(across, notebook, 1) is None


def test_a_notebook_whose_layout_cannot_be_kept_is_left_alone_and_says_why(tmp_path: Path, capsys) -> None:
    path = tmp_path / "odd.ipynb"
    text = _notebook(_example("TL302").code).replace('"cells": [', '"cells" :  [')
    path.write_text(text, encoding="utf-8")
    code, _, err = _run(capsys, "--fix", str(path))
    assert path.read_text(encoding="utf-8") == text
    assert "notebooks are fixed only when" in err and code == 1


def test_verify_positions_are_the_joined_code_and_back() -> None:
    text = _notebook("%load_ext foo\nimport torch\n", "\n" + _example("TL302").code.split("\n", 2)[2])
    options = LintOptions(tuple(registry().ids()))
    found = lint_notebook(text, "nb.ipynb", options).findings
    assert found and all(f.cell == 2 for f in found)
    in_code, sources = for_verify(found, {"nb.ipynb": text})
    code = read_notebook(text).code
    assert sources == {"nb.ipynb": code}
    # what the harness gets is what linting the joined code finds, fixes included
    from trainlint.engine import lint_text

    assert in_code == lint_text(code, "nb.ipynb", options).findings
    verdicts = [f.__class__(**{**f.__dict__, "verify": {"status": "confirmed"}}) for f in in_code]
    assert back_in_cells(verdicts, found) == [
        f.__class__(**{**f.__dict__, "verify": {"status": "confirmed"}}) for f in found
    ]


@needs_torch
def test_verify_runs_a_notebooks_finding_on_its_cells(tmp_path: Path, capsys) -> None:
    example = _example("TL302")
    head, loop = _split(example.code, 2)
    path = tmp_path / "train.ipynb"
    path.write_text(_notebook("%matplotlib inline\n" + head, loop), encoding="utf-8")
    code, out, _ = _run(capsys, "--verify", "--device", "cpu", "--format", "json", str(path))
    assert code == 1
    (finding,) = json.loads(out)["findings"]
    assert (finding["rule"], finding["cell"]) == ("TL302", 2)
    assert finding["verify"]["status"] == "confirmed", finding["verify"]


def test_sarif_gives_a_notebooks_finding_its_cell_and_no_file_edits(tmp_path: Path, capsys) -> None:
    # SARIF's replacements address the file (the JSON); a notebook's edits count lines within a cell
    path = tmp_path / "train.ipynb"
    path.write_text(_notebook(_example("TL302").code), encoding="utf-8")
    _, out, _ = _run(capsys, "--format", "sarif", str(path))
    (result,) = json.loads(out)["runs"][0]["results"]
    assert result["properties"]["cell"] == 1 and "fixes" not in result
