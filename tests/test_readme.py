"""README.md stays true: its rule table matches the registry, and its commands are the ones CI runs."""

from __future__ import annotations

from pathlib import Path

from trainlint.rule import registry

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _between(text: str, marker: str) -> str:
    return text.split(f"<!-- {marker} -->")[1].split(f"<!-- /{marker} -->")[0]


def expected_rule_table() -> str:
    rows = [
        "| id | name | severity | fix | probe | what it reports |",
        "|---|---|---|---|---|---|",
    ]
    for r in registry():
        fix = "yes" if r.has_fix else ""
        probe = "yes" if r.has_probe() else ""
        rows.append(f"| {r.id} | {r.name} | {r.severity.value} | {fix} | {probe} | {r.summary} |")
    return "\n".join(rows)


def test_rule_table_matches_the_registry() -> None:
    assert _between(README, "rules-table").strip() == expected_rule_table(), (
        "README's rule table is out of date; replace it with:\n" + expected_rule_table()
    )


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "<!-- test-command -->" in ci  # CI reads the command from README, never a copy
    command = _between(README, "test-command")
    assert "pip install torch==2.13.0" in command
    # torch first: the extras (verify, deepspeed) would otherwise let pip resolve a CUDA build
    assert command.index("torch==2.13.0") < command.index(".[test,verify,deepspeed]")
    assert "pytest" in command
