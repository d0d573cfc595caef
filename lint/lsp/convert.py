"""Findings as LSP objects: diagnostics, quick fixes, ``# noqa`` actions, fix-all, hover.

trainlint positions are 1-based lines and 1-based code-point columns with exclusive ends; LSP positions
are 0-based lines and 0-based columns counted in the negotiated encoding's code units (UTF-16 unless the
client offers another), so a character outside the Basic Multilingual Plane is two columns to most
editors and one to trainlint.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from pathlib import Path

from lsprotocol import types as lsp

from trainlint.fix import newline_of
from trainlint.model import line_starts, split_lines
from trainlint.rule import Applicability, Edit, Finding, Related, Severity
from trainlint.suppress import NOQA

SOURCE = "trainlint"
FIX_ALL = "source.fixAll.trainlint"
VERIFY_COMMAND = "trainlint.verify"

_SEVERITY = {
    Severity.ERROR: lsp.DiagnosticSeverity.Error,
    Severity.WARNING: lsp.DiagnosticSeverity.Warning,
    Severity.INFO: lsp.DiagnosticSeverity.Information,
}


def units(text: str, encoding: str) -> int:
    """The length of ``text`` in the code units of an LSP position encoding."""
    if encoding == lsp.PositionEncodingKind.Utf8:
        return len(text.encode("utf-8", "surrogatepass"))
    if encoding == lsp.PositionEncodingKind.Utf32:
        return len(text)
    return len(text) + sum(1 for char in text if ord(char) > 0xFFFF)


class Document:
    """One document's text, for converting positions both ways."""

    def __init__(self, text: str, encoding: str = lsp.PositionEncodingKind.Utf16) -> None:
        self.text = text
        self.encoding = encoding
        self.lines = split_lines(text)
        self.starts = line_starts(text)

    def position(self, line: int, column: int) -> lsp.Position:
        """A trainlint position (1-based line, 1-based code-point column) as an LSP position."""
        index = min(max(line, 1), len(self.lines)) - 1
        prefix = self.lines[index][: max(column, 1) - 1] if line <= len(self.lines) else self.lines[index]
        return lsp.Position(line=index, character=units(prefix, self.encoding))

    def point(self, position: lsp.Position) -> tuple[int, int]:
        """An LSP position as a trainlint one; a column past the line's end means its end."""
        index = min(position.line, len(self.lines) - 1)
        count = 0
        for column, char in enumerate(self.lines[index]):
            if count >= position.character:
                return index + 1, column + 1
            count += units(char, self.encoding)
        return index + 1, len(self.lines[index]) + 1

    def range(self, line: int, column: int, end_line: int, end_column: int) -> lsp.Range:
        return lsp.Range(start=self.position(line, column), end=self.position(end_line, end_column))

    def at_offset(self, offset: int) -> lsp.Position:
        index = bisect.bisect_right(self.starts, offset) - 1
        return self.position(index + 1, offset - self.starts[index] + 1)


def finding_range(finding: Finding, doc: Document) -> lsp.Range:
    return doc.range(finding.line, finding.column, finding.end_line, finding.end_column)


def key(finding: Finding) -> dict[str, object]:
    """What a diagnostic carries in ``data`` to find its finding again in a code action request."""
    return {"rule": finding.rule, "line": finding.line, "column": finding.column}


def _other_file(path: str, encoding: str) -> Document | None:
    """Another file a related location points into (a cross-file finding), as it is on disk."""
    try:
        return Document(Path(path).read_text(encoding="utf-8"), encoding)
    except (OSError, UnicodeDecodeError):
        return None


def _related_range(r: Related, doc: Document | None) -> lsp.Range:
    end_line, end_column = r.end_line or r.line, r.end_column or r.column
    if doc is None:  # an unreadable file: code points as units, exact for ASCII lines
        return lsp.Range(lsp.Position(r.line - 1, r.column - 1), lsp.Position(end_line - 1, end_column - 1))
    return doc.range(r.line, r.column, end_line, end_column)


def diagnostic(finding: Finding, doc: Document, uri: str, url: str | None) -> lsp.Diagnostic:
    related = []
    others: dict[str, Document | None] = {}
    for r in finding.related:
        if r.path == finding.path:
            where, text = uri, doc
        else:
            where = Path(r.path).absolute().as_uri()
            if r.path not in others:
                others[r.path] = _other_file(r.path, doc.encoding)
            text = others[r.path]
        location = lsp.Location(where, _related_range(r, text))
        related.append(lsp.DiagnosticRelatedInformation(location, r.message))
    return lsp.Diagnostic(
        range=finding_range(finding, doc),
        message=finding.message,
        severity=_SEVERITY[finding.severity],
        code=finding.rule,
        code_description=lsp.CodeDescription(href=url) if url else None,
        source=SOURCE,
        related_information=related or None,
        data=key(finding),
    )


def _text_edit(edit: Edit, doc: Document, newline: str) -> lsp.TextEdit:
    span = doc.range(edit.line, edit.column, edit.end_line, edit.end_column)
    return lsp.TextEdit(range=span, new_text=edit.content.replace("\n", newline))


def _workspace_edit(uri: str, edits: list[lsp.TextEdit]) -> lsp.WorkspaceEdit:
    return lsp.WorkspaceEdit(changes={uri: edits})


def quick_fix(finding: Finding, doc: Document, uri: str, diag: lsp.Diagnostic) -> lsp.CodeAction | None:
    """The finding's own fix; the title says when it is unsafe (it may change behaviour)."""
    fix = finding.fix
    if fix is None:
        return None
    label = {Applicability.UNSAFE: " (unsafe)", Applicability.VERIFIED: " (verified by --verify)"}
    newline = newline_of(doc.text)
    return lsp.CodeAction(
        title=f"Fix {finding.rule}: {fix.description}{label.get(fix.applicability, '')}",
        kind=lsp.CodeActionKind.QuickFix,
        diagnostics=[diag],
        is_preferred=fix.applicability is not Applicability.UNSAFE,
        edit=_workspace_edit(uri, [_text_edit(e, doc, newline) for e in fix.edits]),
    )


def noqa_edit(finding: Finding, doc: Document) -> lsp.TextEdit:
    """Add the rule to the reported line's ``# noqa: ...`` list, or append one to the line."""
    line = doc.lines[finding.line - 1]
    match = NOQA.search(line)
    if match is not None and match.group("ids"):
        at, new = match.end("ids"), f", {finding.rule}"
        start = end = doc.position(finding.line, at + 1)
    elif match is not None:  # a noqa comment with a colon but no ids suppresses nothing: complete it
        start, end = (
            doc.position(finding.line, match.start() + 1),
            doc.position(finding.line, match.end() + 1),
        )
        new = f"# noqa: {finding.rule}"
    else:
        body = line.rstrip()
        start = doc.position(finding.line, len(body) + 1)
        end = doc.position(finding.line, len(line) + 1)
        new = f"  # noqa: {finding.rule}"
    return lsp.TextEdit(range=lsp.Range(start=start, end=end), new_text=new)


def noqa_action(finding: Finding, doc: Document, uri: str, diag: lsp.Diagnostic) -> lsp.CodeAction:
    return lsp.CodeAction(
        title=f"Disable {finding.rule} for this line (# noqa: {finding.rule})",
        kind=lsp.CodeActionKind.QuickFix,
        diagnostics=[diag],
        edit=_workspace_edit(uri, [noqa_edit(finding, doc)]),
    )


def verify_action(finding: Finding, uri: str, diag: lsp.Diagnostic) -> lsp.CodeAction:
    """Runs ``--verify`` on this one finding (the ``trainlint.verify`` command)."""
    title = f"Verify {finding.rule} by running it (trainlint --verify)"
    return lsp.CodeAction(
        title=title,
        kind=lsp.CodeActionKind.QuickFix,
        diagnostics=[diag],
        command=lsp.Command(
            title=title, command=VERIFY_COMMAND, arguments=[uri, finding.rule, finding.line, finding.column]
        ),
    )


def fix_all_action(doc: Document, uri: str, fixed: str) -> lsp.CodeAction:
    """One edit covering what the safe fixes changed (the common start and end of the text are kept,
    so the editor keeps the cursor and folds where they were)."""
    before = doc.text
    start = 0
    limit = min(len(before), len(fixed))
    while start < limit and before[start] == fixed[start]:
        start += 1
    end = 0
    while end < limit - start and before[-1 - end] == fixed[-1 - end]:
        end += 1
    edit = lsp.TextEdit(
        range=lsp.Range(start=doc.at_offset(start), end=doc.at_offset(len(before) - end)),
        new_text=fixed[start : len(fixed) - end],
    )
    return lsp.CodeAction(
        title="trainlint: apply every safe fix",
        kind=FIX_ALL,
        edit=_workspace_edit(uri, [edit]),
    )


def contains(finding: Finding, line: int, column: int) -> bool:
    """Whether a trainlint position lies within the finding's range (its end included, so that a
    cursor right after the flagged text still counts)."""
    return (finding.line, finding.column) <= (line, column) <= (finding.end_line, finding.end_column)


def hover(
    findings: Iterable[Finding], doc: Document, position: lsp.Position, docs: dict[str, str]
) -> lsp.Hover | None:
    """The documentation of the rules reported under the cursor (``docs``: rule id -> Markdown)."""
    line, column = doc.point(position)
    here = [f for f in findings if contains(f, line, column)]
    texts = list(dict.fromkeys(docs[f.rule] for f in here if f.rule in docs))
    if not texts:
        return None
    return lsp.Hover(
        contents=lsp.MarkupContent(kind=lsp.MarkupKind.Markdown, value="\n\n---\n\n".join(texts)),
        range=finding_range(here[0], doc),
    )
