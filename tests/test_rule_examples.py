"""Runs every rule's embedded valid/invalid examples (Fixit style): adding a rule adds its tests."""

from __future__ import annotations

import pytest

from trainlint.engine import LintOptions, lint_text
from trainlint.rule import Rule, registry

RULES = [r for r in registry() if not r.engine_only]


def _cases(kind: str):
    for rule in RULES:
        for i, example in enumerate(getattr(rule, kind)):
            yield pytest.param(rule, example, id=f"{rule.id}-{kind}-{i}")


def _run(rule: type[Rule], code: str):
    result = lint_text(code, "example.py", LintOptions(rule_ids=(rule.id,)))
    assert not result.errors, result.errors
    return result.findings


@pytest.mark.parametrize(("rule", "code"), list(_cases("valid")))
def test_valid_examples_are_not_reported(rule: type[Rule], code: str) -> None:
    assert _run(rule, code) == []


@pytest.mark.parametrize(("rule", "example"), list(_cases("invalid")))
def test_invalid_examples_are_reported(rule: type[Rule], example) -> None:
    findings = _run(rule, example.code)
    assert len(findings) == example.count, [f.message for f in findings]
    assert {f.rule for f in findings} == {rule.id}
    if example.line is not None:
        assert findings[0].line == example.line


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.id)
def test_every_rule_is_documented_and_has_examples(rule: type[Rule]) -> None:
    assert rule.doc is not None
    assert rule.tokens, "a rule must declare prefilter tokens"
    assert rule.valid and rule.invalid
    text = rule.explain()
    for section in ("What it does", "Why is this bad?", "Example", "Use instead", "Fix safety"):
        assert f"## {section}" in text


@pytest.mark.parametrize(("rule", "example"), list(_cases("invalid")))
def test_prefilter_tokens_cover_invalid_examples(rule: type[Rule], example) -> None:
    """Without the rule's tokens the engine would skip the file: that must never hide a finding."""
    assert any(token in example.code for token in rule.tokens)
    for group in rule.requires:
        assert any(token in example.code for token in group), group
    assert rule.can_fire(example.code)


def test_registry_ids_are_unique_and_well_formed() -> None:
    ids = registry().ids()
    assert len(ids) == len(set(ids))
    assert all(len(i) == 5 and i.startswith("TL") and i[2:].isdigit() for i in ids)
    assert {"TL201", "TL202", "TL901", "TL902"} <= set(ids)
