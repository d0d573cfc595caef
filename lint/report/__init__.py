"""Reporters: turn a finished run (findings, errors, summary) into text, JSON, SARIF or GitHub lines.

A reporter never re-reads a file: code frames come from the sources the engine already read.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from trainlint.rule import Finding


@dataclass
class RunReport:
    findings: list[Finding]
    errors: list[dict[str, str]]
    files: int
    elapsed_s: float
    sources: dict[str, str] = field(default_factory=dict)  # path -> text, for code frames
    fixed: int = 0

    def by_rule(self) -> dict[str, int]:
        return dict(sorted(Counter(f.rule for f in self.findings).items()))
