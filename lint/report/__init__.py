"""Reporters: turn a finished run (findings, errors, summary) into text, JSON, SARIF or GitHub lines.

A reporter never re-reads a file: code frames come from the sources the engine already read. A new
output format is one module here and one entry in ``REPORTERS``; ``--format`` offers exactly its keys.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trainlint.results import Problem
from trainlint.rule import Finding

if TYPE_CHECKING:
    from rich.console import Console

# The renderers are imported when used: a run answered from the cache with nothing to draw never
# loads rich.


@dataclass
class RunReport:
    findings: list[Finding]
    errors: list[Problem]
    files: int
    elapsed_s: float
    sources: dict[str, str] = field(default_factory=dict)  # path -> text, for code frames
    fixed: int = 0
    excluded: int = 0  # paths the excludes skipped: a run that skipped files says so

    def by_rule(self) -> dict[str, int]:
        return dict(sorted(Counter(f.rule for f in self.findings).items()))

    def checked(self) -> str:
        """``3 files checked`` and, when the excludes skipped any, how many paths they skipped."""
        text = f"{self.files} file{'s' if self.files != 1 else ''} checked"
        if self.excluded:
            text += f", {self.excluded} path{'s' if self.excluded != 1 else ''} excluded"
        return text


# Every rule's page, generated from its RuleDoc into docs/rules/ (tests/test_integration_docs.py keeps them
# current); the one place that says where they are published.
DOCS_URL = "https://github.com/trainlint/trainlint/blob/main/docs/rules/"


def rule_url(rule_id: str) -> str:
    return f"{DOCS_URL}{rule_id}.md"


def describe_verify(verify: dict) -> str:
    """A ``--verify`` verdict in one line: ``confirmed on cpu: <detail>``."""
    status = verify.get("status", "?")
    device = verify.get("device", "?")
    detail = verify.get("detail", "")
    return f"{status} on {device}" + (f": {detail}" if detail else "")


@dataclass(frozen=True)
class OutputOptions:
    """The command-line switches that shape the output (only the text format reads them today)."""

    quiet: bool = False
    statistics: bool = False
    unsafe_fixes: bool = False


Reporter = Callable[[RunReport, OutputOptions], None]


def make_console(stderr: bool = False) -> Console:
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def plain(stream: object) -> bool:
    """Output rich would print without colour: not a terminal, and colour not forced."""
    isatty = getattr(stream, "isatty", None)
    tty = bool(isatty()) if callable(isatty) else False
    return not tty and not os.environ.get("FORCE_COLOR") and not os.environ.get("TTY_COMPATIBLE")


def _text(report: RunReport, options: OutputOptions) -> None:
    if options.quiet and not report.findings and not options.statistics:
        return  # --quiet prints the findings alone: nothing to draw, no rich to load (pre-commit's run)
    quiet_run = not (report.findings or report.errors or report.fixed or options.statistics or options.quiet)
    if quiet_run and plain(sys.stdout):
        # nothing to draw: no need to load rich for one uncoloured line (pre-commit, CI logs)
        print(f"All checks passed! ({report.checked()})")
        return
    from trainlint.report.text import render_statistics, render_text

    if options.statistics:
        render_statistics(report, make_console())
    else:
        render_text(report, make_console(), quiet=options.quiet, unsafe_fixes=options.unsafe_fixes)


def _json(report: RunReport, _options: OutputOptions) -> None:
    from trainlint.report.json_format import render_json

    print(render_json(report))


def _sarif(report: RunReport, _options: OutputOptions) -> None:
    from trainlint.report.sarif import render_sarif

    print(render_sarif(report))


def _github(report: RunReport, _options: OutputOptions) -> None:
    from trainlint.report.github import render_github

    text = render_github(report)
    if text:
        print(text)


REPORTERS: dict[str, Reporter] = {"text": _text, "json": _json, "sarif": _sarif, "github": _github}
