"""The per-file pipeline: prefilter, parse, file model, rules, suppressions, findings.

One file's failure (unreadable, unparsable, a rule raising) becomes a finding or an entry in
``errors``; it never stops the other rules or files.
"""

from __future__ import annotations

import ast
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import libcst as cst

from trainlint.model import FileModel
from trainlint.rule import (
    Diagnostic,
    Edit,
    Finding,
    Fix,
    Related,
    Rule,
    Severity,
    TextEditSpec,
    registry,
)
from trainlint.suppress import parse_suppressions


@dataclass
class FileResult:
    path: str
    findings: list[Finding] = field(default_factory=list)
    errors: list[dict[str, str]] = field(default_factory=list)
    parsed: bool = False


@dataclass(frozen=True)
class LintOptions:
    """What the engine needs to lint one file; picklable, so it travels to worker processes."""

    rule_ids: tuple[str, ...]
    severity: tuple[tuple[str, str], ...] = ()
    prefilter: bool = True


def _engine_finding(rule_id: str, path: str, line: int, column: int, message: str) -> Finding:
    rule = registry().get(rule_id)
    assert rule is not None
    return Finding(
        rule=rule.id,
        name=rule.name,
        severity=rule.severity,
        path=path,
        line=line,
        column=column,
        end_line=line,
        end_column=column,
        message=message,
    )


def unreadable(path: str, reason: str) -> Finding:
    return _engine_finding("TL902", path, 1, 1, f"Cannot lint this file: {reason}.")


def _syntax_error(path: str, exc: Exception, source: str = "") -> Finding:
    if isinstance(exc, cst.ParserSyntaxError):
        # CPython's own parser locates most errors where users expect them (libcst often points at
        # the token after); use it when it rejects the file too.
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ast.parse(source)
        except SyntaxError as cpython:
            line, column = cpython.lineno or 1, cpython.offset or 1
            text = f"Cannot parse this file: {cpython.msg}."
        except (ValueError, RecursionError, MemoryError):
            line, column = exc.editor_line, exc.editor_column
            text = f"Cannot parse this file: {exc.message.strip().rstrip('.')}."
        else:
            line, column = exc.editor_line, exc.editor_column
            text = f"Cannot parse this file: {exc.message.strip().rstrip('.')}."
    else:
        line, column = 1, 1
        text = "Cannot parse this file: it is nested too deeply for the parser."
    return _engine_finding("TL901", path, max(line, 1), max(column, 1), text)


def needs_parse(text: str, rules: Iterable[type[Rule]]) -> bool:
    """The prefilter: can any of these rules fire on a file with this text?"""
    return any(any(token in text for token in rule.tokens) for rule in rules if rule.tokens)


def _to_finding(
    model: FileModel, rule: type[Rule], diag: Diagnostic, severity: Severity, path: str
) -> Finding:
    where = model.position(diag.node)
    related = []
    for node, message in diag.related:
        pos = model.position(node)
        related.append(Related(path, pos.start.line, pos.start.column + 1, message))
    fix = None
    if diag.fix is not None:
        fix = Fix(
            diag.fix.applicability,
            diag.fix.description,
            tuple(_to_edit(model, spec) for spec in diag.fix.edits),
        )
    return Finding(
        rule=rule.id,
        name=rule.name,
        severity=severity,
        path=path,
        line=where.start.line,
        column=where.start.column + 1,
        end_line=where.end.line,
        end_column=where.end.column + 1,
        message=diag.message,
        related=tuple(related),
        fix=fix,
    )


def _to_edit(model: FileModel, spec: TextEditSpec) -> Edit:
    pos = model.position(spec.anchor)
    if spec.where == "before":
        start = end = pos.start
    elif spec.where == "after":
        start = end = pos.end
    else:
        start, end = pos.start, pos.end
    return Edit(start.line, start.column + 1, end.line, end.column + 1, spec.content)


def _syntax_ok_fast(text: str) -> bool:
    """CPython's own parser as a quick syntax check for files the prefilter lets skip libcst."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


def lint_text(text: str, path: str, options: LintOptions) -> FileResult:
    """Lint one file's decoded text, reported under ``path``."""
    result = FileResult(path)
    reg = registry()
    rules = [r for r in (reg.get(i) for i in options.rule_ids) if r is not None and not r.engine_only]
    active = [r for r in rules if not options.prefilter or needs_parse(text, [r])]
    if options.prefilter and not active and _syntax_ok_fast(text):
        return result
    try:
        module = cst.parse_module(text)
    except (cst.ParserSyntaxError, RecursionError) as exc:
        if "TL901" in options.rule_ids:
            result.findings.append(_syntax_error(path, exc, text))
        return result
    result.parsed = True
    if not active:
        return result
    try:
        model = FileModel(module, path, text)
    except RecursionError:
        result.errors.append({"path": path, "message": "file model: nested too deeply to analyse"})
        return result
    severity = dict(options.severity)
    suppressions = parse_suppressions(text)
    for rule in active:
        try:
            found = [
                _to_finding(model, rule, diag, Severity(severity.get(rule.id, rule.severity)), path)
                for diag in rule().check(model)
            ]
        except Exception as exc:  # a rule's bug must not hide other rules' findings
            result.errors.append(
                {
                    "path": path,
                    "rule": rule.id,
                    "message": f"internal error in {rule.id}: {type(exc).__name__}: {exc}",
                }
            )
            continue
        seen: set[tuple[int, int, str]] = set()
        for finding in found:
            key = (finding.line, finding.column, finding.message)
            if key in seen or suppressions.suppresses(finding.rule, finding.line):
                continue
            seen.add(key)
            result.findings.append(finding)
    result.findings.sort(key=lambda f: f.sort_key)
    return result


def lint_source(text: str, path: str = "<string>", rule_ids: Sequence[str] | None = None) -> list[Finding]:
    """Convenience for tests and embedding: the findings of the given (or all) rules on a text."""
    ids = tuple(rule_ids) if rule_ids is not None else tuple(registry().ids())
    return lint_text(text, path, LintOptions(rule_ids=ids)).findings
