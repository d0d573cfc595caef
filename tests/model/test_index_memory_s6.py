"""The index holds only its latest used summaries as data, the others as JSON text (issue 20's memory
bound): answers, keys and findings are those of an index holding every summary as data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import callers_project

from trainlint.engine import lint_text
from trainlint.model import project as project_module
from trainlint.model.index_memory import Shelf
from trainlint.model.project import dependency_key, forget_indexes, index_for
from trainlint.model.summary import summarize
from trainlint.results import LintOptions
from trainlint.rule import registry

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = LintOptions(tuple(registry().ids()))
SOURCES = sorted((ROOT / "fixtures" / "project").rglob("*.py"))


def test_the_shelf_keeps_its_latest_summaries_as_data_and_gives_back_the_same_data() -> None:
    shelf = Shelf(kept=3)
    texts = [path.read_text(encoding="utf-8") for path in SOURCES[:10]]
    summaries = [summarize(text) for text in texts]
    for index, summary in enumerate(summaries):
        shelf.put(f"d{index}", summary, json.dumps(summary) if index % 2 else None)
    shelf.put("broken", None)
    assert len(shelf._decoded) == 3 and len(shelf) == 11
    for index, summary in enumerate(summaries):
        assert f"d{index}" in shelf
        again = shelf.get(f"d{index}")
        assert again == summary and json.dumps(again) == json.dumps(summary)  # (the same order too)
    assert "broken" in shelf and shelf.get("broken") is None and "other" not in shelf
    assert len(shelf._decoded) == 3  # (decoding one again keeps the bound)


@pytest.fixture
def one_kept(monkeypatch) -> None:
    """Every index holds one summary as data: each question about another decodes it again."""
    monkeypatch.setattr(project_module, "Shelf", lambda: Shelf(kept=1))
    forget_indexes()
    yield
    forget_indexes()


def findings() -> list[tuple[str, str, int, str]]:
    out = []
    for path in SOURCES:
        result = lint_text(path.read_text(encoding="utf-8"), str(path), OPTIONS)
        out += [(path.name, f.rule, f.line, f.message) for f in result.findings]
    return out


def test_findings_across_files_do_not_depend_on_how_many_summaries_are_held(monkeypatch) -> None:
    forget_indexes()
    every = findings()
    assert {rule for _, rule, _, _ in every} >= {"TL101", "TL105", "TL203", "TL204", "TL301", "TL302"}
    with monkeypatch.context() as patched:
        patched.setattr(project_module, "Shelf", lambda: Shelf(kept=1))
        forget_indexes()
        assert findings() == every
    forget_indexes()


def test_keys_do_not_depend_on_how_many_summaries_are_held(tmp_path: Path, monkeypatch) -> None:
    def keys(store: Path) -> list[str]:
        forget_indexes()
        return [dependency_key(str(p), p.read_text(encoding="utf-8"), store) for p in SOURCES]

    every = keys(tmp_path / "a")
    assert any(every)
    with monkeypatch.context() as patched:
        patched.setattr(project_module, "Shelf", lambda: Shelf(kept=1))
        assert keys(tmp_path / "b") == every  # made afresh
        assert keys(tmp_path / "b") == every  # read from the store
    forget_indexes()


def test_an_index_holds_at_most_its_bound_as_data(one_kept: None) -> None:
    root = ROOT / "fixtures" / "project"
    index = index_for(str(root))
    for path in SOURCES:
        assert index.summary(path) == summarize(path.read_text(encoding="utf-8"))
    distinct = {path.read_text(encoding="utf-8") for path in SOURCES}
    assert len(index._by_hash._decoded) == 1 and len(index._by_hash) == len(distinct)


def test_the_callers_question_decodes_only_summaries_naming_the_function(tmp_path: Path, monkeypatch) -> None:
    root = callers_project(tmp_path / "p")
    monkeypatch.setattr(project_module, "Shelf", lambda: Shelf(kept=1))
    forget_indexes()
    project = project_module.Project.for_file(str(root / "train.py"))
    assert project is not None
    for path in sorted(root.rglob("*.py")):
        assert project.index.summary(path) is not None  # every summary held, the last one as data
    decoded: list[str] = []
    original = Shelf.get
    monkeypatch.setattr(Shelf, "get", lambda self, digest: decoded.append(digest) or original(self, digest))
    calls = project.callers(root / "train.py", "scaled_step")
    assert [(Path(path).name, call["callee"]) for path, call in calls] == [("a.py", "scaled_step")]
    assert len(decoded) == 1  # a.py's: the others' texts do not name the function
    forget_indexes()
