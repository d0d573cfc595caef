"""Runs every rule's embedded valid/invalid examples (Fixit style): adding a rule adds its tests."""

from __future__ import annotations

import pytest

from trainlint.engine import LintOptions, lint_text
from trainlint.rule import Rule, group_matches, registry

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
    assert len(findings) == 1, [f.message for f in findings]
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
        assert group_matches(group, example.code), group
    assert rule.can_fire(example.code)


def test_registry_ids_are_unique_and_well_formed() -> None:
    ids = registry().ids()
    assert len(ids) == len(set(ids))
    assert all(len(i) == 5 and i.startswith("TL") and i[2:].isdigit() for i in ids)
    assert {"TL201", "TL202", "TL901", "TL902"} <= set(ids)


# -- the prefilter's groups follow the rules' own name lists -----------------------------------------
# A group written out by hand in a rule (``requires``) must keep covering the names the rule accepts:
# a name added to one of these lists and not to the group would make the prefilter skip files the
# rule can fire on.
def _parts_covered(rule_id: str, names: list[str], *, each_part: bool = False) -> None:
    rule = registry().get(rule_id)
    assert rule is not None
    probes = [n.split(".") if each_part else [n] for n in names]
    groups = [
        g
        for g in rule.requires
        # the group for this list (``("torch",)`` is another one: it matches any torch name)
        if any(group_matches(g, p) for parts in probes for p in parts) and not group_matches(g, "torch")
    ]
    assert groups, f"{rule_id}: no prefilter group covers any of {names[:3]}..."
    for group in groups:
        missed = [
            n
            for n, parts in zip(names, probes, strict=True)
            if not any(group_matches(group, p) for p in parts)
        ]
        assert not missed, f"{rule_id}: prefilter group {group} misses {missed}"


def test_prefilter_groups_cover_the_rules_name_lists() -> None:
    from trainlint.model.vocab import (
        DATA_PARALLEL,
        GRAD_SCALERS,
        OPTIMIZER_PREFIXES,
        PADDING_DATA,
        PADDING_WORDS,
    )

    _parts_covered("TL502", [q.rsplit(".", 1)[-1] for q in sorted(DATA_PARALLEL)])
    for rule_id in ("TL105", "TL404"):
        _parts_covered(rule_id, [p.rstrip(".") for p in OPTIMIZER_PREFIXES], each_part=True)
    _parts_covered("TL301", sorted(PADDING_WORDS | PADDING_DATA))
    for rule_id in ("TL103", "TL104"):
        _parts_covered(rule_id, [q.rsplit(".", 1)[-1] for q in sorted(GRAD_SCALERS)])


# -- the prefilter does not depend on layout --------------------------------------------------------
_LAYOUTS = (
    (r"\.(\w+)\(", r". \1 ("),  # blanks around the dot and before the parenthesis
    (r"\.(\w+)\(", ".\\1\t("),
    (r"\.(\w+)\(", ".\\1 \\\\\n("),  # a continuation line before the parenthesis
    (r"(\w+)\(", r"(\1)("),  # a parenthesised callee
)


@pytest.mark.parametrize(("rule", "example"), list(_cases("invalid")))
def test_prefilter_holds_for_other_layouts_of_each_invalid_example(rule: type[Rule], example) -> None:
    """Rewritten with other (valid) spacing, an example the rule still reports must pass the prefilter."""
    import ast
    import re

    checked = 0
    for pattern, replacement in _LAYOUTS:
        code = re.sub(pattern, replacement, example.code)
        try:
            ast.parse(code)
        except SyntaxError:
            continue  # the rewrite broke this example (a keyword, a string): not a layout of it
        reported = lint_text(code, "example.py", LintOptions(rule_ids=(rule.id,), prefilter=False)).findings
        if reported:
            assert rule.can_fire(code), (pattern, code)
            checked += 1
    assert checked or not example.code.count("(")
