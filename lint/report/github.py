"""GitHub Actions workflow commands (``::error file=...::message``), escaped as the runner expects."""

from __future__ import annotations

from trainlint.report import RunReport
from trainlint.rule import Severity

LEVELS = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "notice"}


def escape_data(text: str) -> str:
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
        lines.append(f"::{LEVELS[f.severity]} {props}::{escape_data(f'{f.rule} {f.message}')}")
    for e in report.errors:
        where = f" file={escape_property(e.path)}" if e.path else ""
        lines.append(f"::error{where}::{escape_data('trainlint: ' + e.message)}")
    return "\n".join(lines)
