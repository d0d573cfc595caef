"""docs/rules/: one page per rule, generated from its RuleDoc, kept current; every output links to it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from trainlint.report import DOCS_URL, rule_url
from trainlint.rule import registry

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "rules"


def _generator():
    spec = importlib.util.spec_from_file_location("generate_rule_docs", DOCS / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_rule_has_a_current_page() -> None:
    expected = _generator().expected()
    for rule in registry():
        text = (DOCS / f"{rule.id}.md").read_text(encoding="utf-8")
        assert rule.explain() in text, f"docs/rules/{rule.id}.md is stale: run python docs/rules/generate.py"
    for name, text in expected.items():
        assert (DOCS / name).read_text(encoding="utf-8") == text, (
            f"run python docs/rules/generate.py ({name})"
        )
    pages = {p.name for p in DOCS.glob("TL*.md")}
    assert pages == {f"{r.id}.md" for r in registry()}


def test_rule_urls_point_at_the_pages() -> None:
    assert DOCS_URL.endswith("/docs/rules/")
    for rule in registry():
        assert rule_url(rule.id).rsplit("/", 3)[-3:] == ["docs", "rules", f"{rule.id}.md"]
        assert (DOCS / f"{rule.id}.md").is_file()
