"""``--fix`` and ``--verify`` on notebooks.

Fixes are applied inside the code cells' sources, as Ruff does: a notebook's findings carry their fix
with lines counted within the cell (``notebook.to_cells``), the edits go into that cell's source, and
the JSON is written back in the layout it was read in (indentation, key order, escaping, a final line
break), so that only the changed cells' sources differ. A notebook whose layout trainlint cannot
reproduce is left as it is, with a message.

``--verify`` runs a notebook's findings on its code cells joined into one module, the text the
findings were made from: the probes see what ``trainlint nb.ipynb`` linted.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any

from trainlint.fix import MAX_ROUNDS, FixOutcome, _offsets, applicable, apply_edits, fix_text
from trainlint.notebook import SUFFIX, NotANotebook, Notebook, read_notebook
from trainlint.results import FileResult, LintOptions
from trainlint.rule import Edit, Finding, Fix

_LINE = re.compile(r"[^\n]*\n|[^\n]+")  # nbformat's list of lines: split after each "\n"


def is_notebook(path: str) -> bool:
    return path.endswith(SUFFIX)


def fix_file(path: str, text: str, lint: Callable[[str], list[Finding]], unsafe: bool) -> FixOutcome:
    """``fix_text`` for a Python file, ``fix_notebook`` for a notebook (``lint`` lints the file's text)."""
    return (fix_notebook if is_notebook(path) else fix_text)(text, lint, unsafe)


def _indents(text: str) -> list[int | str | None]:
    """The indentation the JSON text was written with, as ``json.dumps`` takes it."""
    match = re.match(r"\{\r?\n([ \t]+)\"", text)
    if match is None:
        return [None]  # all on one line
    unit = match.group(1)
    return [len(unit)] if unit.strip(" ") == "" else [unit]


def _layout(text: str, data: Any) -> dict[str, Any] | None:
    """The ``json.dumps`` arguments that write ``data`` back as ``text`` exactly (``json.loads``
    keeps the key order), or None. Jupyter writes ``indent=1, ensure_ascii=False`` and a line break."""
    for indent in _indents(text):
        for ensure_ascii in (False, True):
            for separators in [None] if indent is not None else [None, (",", ":")]:
                dumped = json.dumps(data, indent=indent, ensure_ascii=ensure_ascii, separators=separators)
                end = text[len(dumped) :]
                if text.startswith(dumped) and end in ("", "\n", "\r\n"):
                    return {
                        "indent": indent,
                        "ensure_ascii": ensure_ascii,
                        "separators": separators,
                        "end": end,
                    }
    return None


def _dump(data: Any, layout: dict[str, Any]) -> str:
    options = {k: v for k, v in layout.items() if k != "end"}
    return json.dumps(data, **options) + layout["end"]


def _within(edits: tuple[Edit, ...], source: str) -> tuple[Edit, ...]:
    """The edits, with one that deletes the cell's last lines up to the line after them (which a
    cell's source without a final line break does not have) ending with the cell instead."""
    starts = _offsets(source)
    out = []
    for edit in edits:
        if edit.end_line > len(starts):
            last = len(source) - starts[-1]
            edit = dataclasses.replace(edit, end_line=len(starts), end_column=last + 1)
            if edit.content == "" and edit.column == 1 and edit.line > 1:  # the line break before goes
                previous = source[starts[edit.line - 2] : starts[edit.line - 1]]
                edit = dataclasses.replace(edit, line=edit.line - 1, column=len(previous.rstrip("\r\n")) + 1)
        out.append(edit)
    return tuple(out)


def _apply(cells: list[dict[str, Any]], found: list[Finding]) -> int:
    """Apply the fixes of ``found`` (lines within cells) to the code cells' sources; how many applied."""
    by_cell: dict[int, list[tuple[Edit, ...]]] = {}
    for finding in found:
        if finding.fix is not None and finding.cell is not None and 1 <= finding.cell <= len(cells):
            by_cell.setdefault(finding.cell, []).append(finding.fix.edits)
    applied = 0
    for number, fixes in sorted(by_cell.items()):
        cell = cells[number - 1]
        listed = isinstance(cell.get("source"), list)
        source = "".join(cell["source"]) if listed else cell["source"]
        new, count = apply_edits(source, [_within(edits, source) for edits in fixes])
        if count and new != source:
            cell["source"] = _LINE.findall(new) if listed else new
            applied += count
    return applied


def fix_notebook(text: str, lint: Callable[[str], list[Finding]], unsafe: bool) -> FixOutcome:
    """A notebook's text with the applicable fixes applied in its code cells (``lint`` lints a
    notebook's text, as ``lint_notebook``), re-linted until none apply, as ``fix_text``."""
    import libcst as cst

    outcome = FixOutcome(text)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # changed since it was linted: nothing to fix
        return outcome
    layout = _layout(text, data)
    if layout is None:
        outcome.dropped.append(
            "notebooks are fixed only when trainlint can write their JSON back as it was laid out "
            "(as Jupyter writes it: indented, one key per line); this one is left as it is"
        )
        return outcome
    for _ in range(MAX_ROUNDS):
        found = [f for f in lint(outcome.text) if applicable(f, unsafe)]
        cells = [c for c in data.get("cells", []) if isinstance(c, dict) and c.get("cell_type") == "code"]
        applied = _apply(cells, found) if found else 0
        if not applied:
            break
        new_text = _dump(data, layout)
        try:
            cst.parse_module(read_notebook(new_text).code)
        except (cst.ParserSyntaxError, cst.CSTValidationError, NotANotebook, RecursionError, MemoryError):
            rules = ", ".join(sorted({f.rule for f in found}))
            outcome.dropped.append(f"fixes for {rules} would leave the notebook's code unparsable")
            break
        outcome.text = new_text
        outcome.fixed += applied
    return outcome


# -- --verify -----------------------------------------------------------------------------------------


def _in_code(finding: Finding, notebook: Notebook) -> Finding:
    """The finding with lines counted in the joined code (as it was linted), without ``cell``."""

    def line(cell: int, number: int) -> int:
        return notebook.starts[cell - 1] + number - 1

    assert finding.cell is not None
    cell = finding.cell
    related = tuple(
        dataclasses.replace(
            r,
            line=line(r.cell, r.line),
            end_line=None if r.end_line is None else line(r.cell, r.end_line),
            cell=None,
        )
        if r.cell is not None
        else r
        for r in finding.related
    )
    fix = finding.fix
    if fix is not None:
        edits = tuple(
            dataclasses.replace(e, line=line(cell, e.line), end_line=line(cell, e.end_line))
            for e in fix.edits
        )
        fix = dataclasses.replace(fix, edits=edits)
    return dataclasses.replace(
        finding,
        line=line(cell, finding.line),
        end_line=line(cell, finding.end_line),
        related=related,
        fix=fix,
        cell=None,
    )


def for_verify(findings: list[Finding], sources: dict[str, str]) -> tuple[list[Finding], dict[str, str]]:
    """Findings and sources as the verify harness reads a module: a notebook's findings with lines in
    its joined code cells, and that code as its source."""
    notebooks: dict[str, Notebook] = {}
    for path, text in sources.items():
        if is_notebook(path):
            try:
                notebooks[path] = read_notebook(text)
            except NotANotebook:
                continue
    out = [
        _in_code(f, notebooks[f.path]) if f.cell is not None and f.path in notebooks else f for f in findings
    ]
    return out, {**sources, **{path: nb.code for path, nb in notebooks.items()}}


def _verified_fix(original: Fix | None, verified: Fix | None) -> Fix | None:
    if original is None or verified is None:
        return original
    return dataclasses.replace(original, applicability=verified.applicability)


def back_in_cells(verified: list[Finding], original: list[Finding]) -> list[Finding]:
    """The verdicts of ``for_verify``'s findings on the original findings (cell positions kept)."""
    return [
        dataclasses.replace(o, verify=v.verify, fix=_verified_fix(o.fix, v.fix)) if o.cell is not None else v
        for v, o in zip(verified, original, strict=True)
    ]


def lint_file(text: str, path: str, options: LintOptions) -> FileResult:
    """``lint_notebook`` for a notebook's text, ``lint_text`` for a Python file's."""
    from trainlint.engine import lint_text
    from trainlint.notebook import lint_notebook

    return (lint_notebook if is_notebook(path) else lint_text)(text, path, options)


__all__ = ["back_in_cells", "fix_file", "fix_notebook", "for_verify", "is_notebook", "lint_file"]
