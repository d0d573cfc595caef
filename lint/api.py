"""The rule author's whole import surface: what a rule in ``trainlint.rules`` may import besides
``trainlint.model`` (the facts about the file it checks)."""

from __future__ import annotations

from trainlint.edits import delete_statement
from trainlint.rule import (
    Applicability,
    Diagnostic,
    FixSpec,
    Invalid,
    Rule,
    RuleDoc,
    Severity,
    TextEditSpec,
    call_pattern,
    called_word,
    imported,
    method_call_pattern,
)

__all__ = [
    "Applicability",
    "Diagnostic",
    "FixSpec",
    "Invalid",
    "Rule",
    "RuleDoc",
    "Severity",
    "TextEditSpec",
    "call_pattern",
    "called_word",
    "delete_statement",
    "imported",
    "method_call_pattern",
]
