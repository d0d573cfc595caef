"""``--list-rules`` and ``--explain``: the rules themselves, as a table, as JSON, or one rule's page."""

from __future__ import annotations

import json
from typing import Any

from trainlint.report import make_console, rule_url
from trainlint.rule import Rule, registry


def find_rule(wanted: str) -> type[Rule] | None:
    """A rule by id (``tl201``) or by name (``checkpoint-use-reentrant``)."""
    by_name = {r.name: r for r in registry()}
    return registry().get(wanted) or by_name.get(wanted.strip().lower())


def rule_entry(rule: type[Rule]) -> dict[str, Any]:
    """One rule of ``--list-rules --format json``."""
    return {
        "id": rule.id,
        "name": rule.name,
        "severity": rule.severity.value,
        "fix": rule.has_fix,
        "probe": rule.has_probe(),
        "summary": rule.summary,
        "url": rule_url(rule.id),
    }


def list_rules(*, as_json: bool = False) -> None:
    if as_json:
        print(json.dumps([rule_entry(r) for r in registry()], indent=2))
        return
    columns = ("id", "name", "severity", "fix", "probe", "summary")
    rows = [
        (
            r.id,
            r.name,
            r.severity.value,
            "yes" if r.has_fix else "no",
            "yes" if r.has_probe() else "no",
            r.summary,
        )
        for r in registry()
    ]
    console = make_console()
    if not console.is_terminal:  # pipes and CI logs: one unwrapped line per rule
        widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns[:-1])]
        for row in [columns, *rows]:
            print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=False)) + "  " + row[-1])
        return
    from rich.table import Table

    table = Table()
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*row)
    console.print(table)
