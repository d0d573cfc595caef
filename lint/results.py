"""What linting one file takes and gives: light types shared by the engine, the cache and the CLI.

Kept apart from the engine so that a run answered from the result cache imports neither libcst nor
the rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainlint.rule import Finding

__all__ = ["FileResult", "LintOptions"]


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
