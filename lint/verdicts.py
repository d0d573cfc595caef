"""What ``--fix`` and ``--diff`` tell about verdicts and fixes that were not applied: the ``--verify``
verdicts carried over to the findings left after fixing, and why ``--diff`` showed nothing."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from trainlint.report import RunReport
from trainlint.rule import Finding


def unsafe_hint(report: RunReport) -> None:
    """``--diff`` with nothing to show: say when that is because every fix there is unsafe."""
    from trainlint.fix import applicable

    unsafe = sum(1 for f in report.findings if applicable(f, True))
    if unsafe:
        print(
            f"trainlint: no safe fixes; {unsafe} unsafe fix{'es' if unsafe != 1 else ''} "
            "can be shown with --unsafe-fixes",
            file=sys.stderr,
        )


def carry_verdicts(left: list[Finding], found: list[Finding], before: str, after: str) -> list[Finding]:
    """The findings left after fixing, with the ``--verify`` verdicts of the same findings before the
    fix: the same rule and message on a line of the same text (fixes move lines, not findings)."""
    from trainlint.model.text import split_lines

    verdicts: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    old_lines, new_lines = split_lines(before), split_lines(after)
    for f in found:
        if f.verify is not None and f.line <= len(old_lines):
            verdicts.setdefault((f.rule, f.message, old_lines[f.line - 1].strip()), []).append(f.verify)
    if not verdicts:
        return left
    out = []
    for f in left:
        line = new_lines[f.line - 1].strip() if f.line <= len(new_lines) else ""
        queue = verdicts.get((f.rule, f.message, line))
        out.append(dataclasses.replace(f, verify=queue.pop(0)) if queue else f)
    return out
