"""The summary's walks skip the leaves (names, constants, operators) and the fields that hold no node
(issue 20: the index's cost): every summary is the one the full walk gives."""

from __future__ import annotations

import json
from pathlib import Path

from trainlint.model import summary as summary_module
from trainlint.model.summary import summarize

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(ROOT / "fixtures").rglob("*.py"), *(ROOT / "lint").rglob("*.py")])


def test_the_summaries_are_those_of_the_full_walk(monkeypatch) -> None:
    texts = [path.read_text(encoding="utf-8") for path in SOURCES]
    quick = [json.dumps(summarize(text)) for text in texts]
    with monkeypatch.context() as patched:
        patched.setattr(summary_module, "_LEAVES", frozenset())
        patched.setattr(summary_module, "_SCALAR_FIELDS", frozenset({"ctx"}))
        patched.setattr(summary_module, "_branches", summary_module._walk)
        patched.setattr(summary_module, "_FIELDS", {})
        full = [json.dumps(summarize(text)) for text in texts]
    assert sum(1 for s in full if s != "null") > 100
    for path, a, b in zip(SOURCES, quick, full, strict=True):
        assert a == b, path


def test_the_leaves_are_the_nodes_without_children() -> None:
    import ast

    for kind in summary_module._LEAVES:
        fields = [f for f in kind._fields if f not in summary_module._SCALAR_FIELDS]
        assert kind in (ast.Name, ast.Constant) or not fields, kind
