"""What linting one file takes and gives: light types shared by the engine, the cache and the CLI.

Kept apart from the engine so that a run answered from the result cache imports neither libcst nor
the rules.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum

from trainlint.rule import Finding

__all__ = ["FileResult", "LintOptions", "Problem", "ProblemKind", "frame_text"]


class ProblemKind(Enum):
    """What went wrong, as data: it decides the exit code and whether an outcome may be cached.

    A file that cannot be parsed or read is not a problem of the run but a finding (TL901, TL902)."""

    USAGE = "usage"  # the command line itself
    CONFIG = "config"  # the configuration file or a selector
    SKIPPED = "skipped"  # a path that is not linted: a looping link, a device, a notebook
    UNANALYSABLE = "unanalysable"  # parsed, but beyond what the file model can analyse
    FIX = "fix"  # a fix that was not applied
    INTERNAL = "internal"  # trainlint's own failure: a crash in the engine, a rule or a worker

    @property
    def fatal(self) -> bool:
        """The run cannot be trusted (exit 2) whatever the findings say."""
        return self in (ProblemKind.USAGE, ProblemKind.CONFIG, ProblemKind.INTERNAL)

    @property
    def cacheable(self) -> bool:
        """The same text and options give the same problem again (the tool's own failures may not)."""
        return self is not ProblemKind.INTERNAL


@dataclass(frozen=True)
class Problem:
    """Something that kept part of a run from happening; ``path`` is empty when no file is meant."""

    kind: ProblemKind
    path: str
    message: str
    rule: str | None = None  # the rule that failed, for an internal error in a rule

    def to_json(self) -> dict[str, str]:
        """The entry of the JSON report's ``errors`` list (schema 1: no kind)."""
        data = {"path": self.path}
        if self.rule is not None:
            data["rule"] = self.rule
        data["message"] = self.message
        return data

    def to_cache(self) -> dict[str, str]:
        return {"kind": self.kind.value, **self.to_json()}

    @classmethod
    def from_cache(cls, data: dict[str, str]) -> Problem:
        return cls(ProblemKind(data["kind"]), data["path"], data["message"], data.get("rule"))


def internal_error(path: str, exc: BaseException, where: str = "", rule: str | None = None) -> Problem:
    """The engine (or the part ``where`` names) failed on this file: reported, never cached."""
    prefix = f"internal error {where}" if where else "internal error"
    return Problem(ProblemKind.INTERNAL, path, f"{prefix}: {type(exc).__name__}: {exc}", rule)


@dataclass
class FileResult:
    path: str
    findings: list[Finding] = field(default_factory=list)
    errors: list[Problem] = field(default_factory=list)
    parsed: bool = False

    @property
    def cacheable(self) -> bool:
        return all(problem.kind.cacheable for problem in self.errors)


@dataclass(frozen=True)
class LintOptions:
    """What the engine needs to lint one file; picklable, so it travels to worker processes."""

    rule_ids: tuple[str, ...]
    severity: tuple[tuple[str, str], ...] = ()
    prefilter: bool = True


def frame_text(path: str, findings: list[Finding], text: str) -> str | None:
    """The text code frames are drawn from, or None: none when there is nothing to draw, and none for
    TL901/TL902 of a file reached through a link (the frame would print bytes the file does not own,
    such as a key a committed link points at)."""
    if not findings:
        return None
    if os.path.islink(path) and any(f.rule in ("TL901", "TL902") for f in findings):
        return None
    return text
