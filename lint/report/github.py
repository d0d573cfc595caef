"""GitHub Actions workflow commands (``::error file=...::message``), escaped as the runner expects."""

from __future__ import annotations

from trainlint.report import RunReport, describe_verify, rule_url
from trainlint.report.escape import escape_controls
from trainlint.rule import Severity

LEVELS = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "notice"}


def escape_data(text: str) -> str:
    text = escape_controls(text, keep="\r\n")  # ANSI sequences; newlines are escaped below
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def render_github(report: RunReport) -> str:
    lines = []
    for f in report.findings:
        props = ",".join(
            [
                f"file={escape_property(f.path)}",
                f"line={f.line}",
                f"col={f.column}",
                f"endLine={f.end_line}",
                f"endColumn={f.end_column}",
                f"title={escape_property(f'{f.rule} ({f.name})')}",
            ]
        )
        # a notebook's lines count within a cell: the annotation's line cannot point into the JSON
        message = f"{f.rule} {f'(cell {f.cell}, line {f.line}) ' if f.cell is not None else ''}{f.message}"
        if f.verify:
            message += f" (verify: {describe_verify(f.verify)})"
        message += f" {rule_url(f.rule)}"
        lines.append(f"::{LEVELS[f.severity]} {props}::{escape_data(message)}")
    for e in report.errors:
        where = f" file={escape_property(e.path)}" if e.path else ""
        lines.append(f"::error{where}::{escape_data('trainlint: ' + e.message)}")
    return "\n".join(lines)
