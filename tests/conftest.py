"""Shared helpers for the tests."""

from __future__ import annotations

import textwrap

import pytest

from trainlint.engine import lint_source
from trainlint.rule import Finding


def findings_for(code: str, *rule_ids: str) -> list[Finding]:
    """Findings of the given rules (all rules when none) on dedented code."""
    return lint_source(textwrap.dedent(code), "snippet.py", rule_ids or None)


@pytest.fixture
def lint():
    return findings_for
