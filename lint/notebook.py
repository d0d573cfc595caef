"""Jupyter notebooks: the code cells of an ``.ipynb`` file linted as one module (a training loop in one
cell uses the optimizer made in another), positions reported as (cell, line) as Ruff reports them:
``cell`` counts code cells from 1, ``line`` counts the lines of that cell from 1.

IPython syntax (``%magic``, ``!shell``, ``%%cell_magic``) is not Python: those lines are blanked, so
every other line keeps its number.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass

from trainlint.files import NOTEBOOK
from trainlint.results import FileResult, LintOptions
from trainlint.rule import Finding, Fix, Related

SUFFIX = NOTEBOOK
# Outputs (plots, tables) make notebooks large; only the code is parsed, and it is held to the limit
# of a source file (files.MAX_SOURCE_BYTES) once extracted.
MAX_NOTEBOOK_BYTES = 64 * 1024 * 1024
_IPYTHON_LINE = re.compile(r"^\s*(?:%|!)")


class NotANotebook(ValueError):
    """The file is not a notebook trainlint can read; the message says why."""


@dataclass(frozen=True)
class Notebook:
    code: str  # the code cells, joined by line breaks
    starts: tuple[int, ...]  # line of ``code`` where each code cell begins (1-based)
    ipython: frozenset[int] = frozenset()  # lines of ``code`` blanked because they were IPython syntax

    def cell_lines(self, cell: int) -> list[str]:
        """The lines of code cell ``cell`` (1-based), as linted."""
        lines = self.code.split("\n")
        end = self.starts[cell] - 1 if cell < len(self.starts) else len(lines)
        return lines[self.starts[cell - 1] - 1 : end]

    def size(self, cell: int) -> int:
        """How many lines of ``code`` code cell ``cell`` has."""
        end = self.starts[cell] if cell < len(self.starts) else self.code.count("\n") + 1
        return end - self.starts[cell - 1]

    def locate(self, line: int) -> tuple[int, int]:
        """(cell, line in that cell) of a line of ``code``."""
        cell = 0
        while cell + 1 < len(self.starts) and self.starts[cell + 1] <= line:
            cell += 1
        return cell + 1, line - self.starts[cell] + 1


def _cell_source(cell: object) -> str | None:
    if not isinstance(cell, dict) or cell.get("cell_type") != "code":
        return None
    source = cell.get("source", "")
    if isinstance(source, list) and all(isinstance(s, str) for s in source):
        source = "".join(source)
    if not isinstance(source, str):
        raise NotANotebook("a code cell's source is neither a string nor a list of strings")
    return source


def _python_only(source: str) -> tuple[str, list[int]]:
    """The cell's Python, and the indexes of the lines blanked because they are IPython's syntax."""
    lines = source.replace("\r\n", "\n").split("\n")
    if lines and lines[0].lstrip().startswith("%%"):  # a cell magic: the whole cell is another language
        return "\n" * (len(lines) - 1), list(range(len(lines)))
    blanked = [k for k, line in enumerate(lines) if _IPYTHON_LINE.match(line)]
    return "\n".join("" if _IPYTHON_LINE.match(line) else line for line in lines), blanked


def read_notebook(text: str) -> Notebook:
    """The code of a notebook's JSON text; raises ``NotANotebook``."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise NotANotebook(f"not a notebook: invalid JSON ({exc})") from None
    except RecursionError:  # (CPython's decoder recurses once per level)
        raise NotANotebook("not a notebook: its JSON nests too deep to read") from None
    cells = data.get("cells") if isinstance(data, dict) else None
    if not isinstance(cells, list):
        raise NotANotebook("not a notebook: no list of cells")
    parts: list[str] = []
    starts: list[int] = []
    ipython: set[int] = set()
    line = 1
    for cell in cells:
        source = _cell_source(cell)
        if source is None:
            continue
        code, blanked = _python_only(source)
        code = code.rstrip("\n")
        starts.append(line)
        parts.append(code)
        ipython.update(line + k for k in blanked)
        line += code.count("\n") + 1
    return Notebook("\n".join(parts) + "\n" if parts else "", tuple(starts), frozenset(ipython))


def _cell_fix(fix: Fix | None, notebook: Notebook, cell: int) -> Fix | None:
    """The fix with its lines counted within ``cell``, as the finding's; None when an edit leaves the
    cell or touches a blanked IPython line (``fix_notebook`` applies the edits to the cell's source).
    An edit may end at the start of the line after the cell (whole lines deleted)."""
    if fix is None:
        return None
    first, size = notebook.starts[cell - 1], notebook.size(cell)
    edits = []
    for edit in fix.edits:
        past = edit.end_line == first + size and edit.end_column == 1
        if not first <= edit.line <= edit.end_line < first + size + past:
            return None
        if any(line in notebook.ipython for line in range(edit.line, min(edit.end_line + 1, first + size))):
            return None
        edits.append(
            dataclasses.replace(edit, line=edit.line - first + 1, end_line=edit.end_line - first + 1)
        )
    return dataclasses.replace(fix, edits=tuple(edits))


def to_cells(finding: Finding, notebook: Notebook) -> Finding:
    """The finding with its lines counted within its cell, and ``cell`` set; so are its fix's edits
    (dropped when they would leave the cell)."""
    cell, line = notebook.locate(finding.line)
    end_cell, end_line = notebook.locate(finding.end_line)
    if end_cell != cell:  # a range running past its cell ends with it
        end_line, end_column = len(notebook.cell_lines(cell)), len(notebook.cell_lines(cell)[-1]) + 1
    else:
        end_column = finding.end_column
    related = tuple(_related_to_cells(r, finding.path, notebook) for r in finding.related)
    return dataclasses.replace(
        finding,
        line=line,
        end_line=end_line,
        end_column=end_column,
        related=related,
        fix=_cell_fix(finding.fix, notebook, cell),
        cell=cell,
    )


def _related_to_cells(related: Related, path: str, notebook: Notebook) -> Related:
    if related.path != path:
        return related
    cell, line = notebook.locate(related.line)
    end_line = related.end_line
    if end_line is not None:
        end_cell, end_line = notebook.locate(end_line)
        if end_cell != cell:
            end_line = None
    end_column = related.end_column if end_line is not None else None
    return dataclasses.replace(related, line=line, end_line=end_line, end_column=end_column, cell=cell)


def lint_notebook(text: str, shown: str, options: LintOptions) -> FileResult:
    """Lint the code cells of a notebook's JSON text; a file that is not a notebook is TL902."""
    from trainlint.engine import lint_text, unreadable, with_configured_severity
    from trainlint.files import MAX_SOURCE_BYTES, too_large

    try:
        notebook = read_notebook(text)
    except NotANotebook as exc:
        reason = str(exc)
    else:
        size = len(notebook.code.encode("utf-8", "surrogatepass"))
        if size <= MAX_SOURCE_BYTES:
            result = lint_text(notebook.code, shown, options)
            result.findings = [to_cells(f, notebook) for f in result.findings]
            return result
        reason = f"its code cells are too large: {too_large(size)}"
    result = FileResult(shown)
    if "TL902" in options.rule_ids:
        result.findings.append(with_configured_severity(unreadable(shown, reason), options))
    return result
