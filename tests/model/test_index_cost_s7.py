"""The project index's cost in a cold run (issue 20): a text the index summarised is one CPython parsed,
so the lint of a file no rule can run on does not parse it again; the gate's verdict kept for the
lint carries the text's outline, so the project is asked without a parse; the root search and the
facts digests are answered once per batch (afresh in the next), and each file's summary once per lint."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from conftest import counting

import trainlint.engine as engine
from trainlint.engine import lint_text, outcome_needs_no_project
from trainlint.model import stamps as stamps_module
from trainlint.model.project import Project, ProjectIndex, dependency_key, forget_indexes
from trainlint.model.stamps import find_root, parsed_before, text_digest
from trainlint.results import LintOptions
from trainlint.rule import registry

OPTIONS = LintOptions(tuple(registry().ids()))
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "project"
PLAIN = "def helper(x):\n    return x + 1\n"  # no rule can run on it
BROKEN = "def helper(x)\n    return x + 1\n"


@pytest.fixture(autouse=True)
def fresh(monkeypatch) -> None:
    monkeypatch.setattr(stamps_module, "_PARSED", set())
    engine._VERDICTS.clear()
    forget_indexes()


def test_a_summarised_text_is_known_to_parse(tmp_path: Path) -> None:
    index = ProjectIndex(tmp_path)
    assert not parsed_before(text_digest(PLAIN)) and not parsed_before()
    index.summary_of(PLAIN)
    assert parsed_before(text_digest(PLAIN)) and not parsed_before(text_digest(PLAIN + "\n"))
    index.summary_of(BROKEN)  # no summary: CPython rejects it
    assert not parsed_before(text_digest(BROKEN))


def test_the_lint_of_a_summarised_text_no_rule_runs_on_parses_nothing(tmp_path: Path, monkeypatch) -> None:
    ProjectIndex(tmp_path).summary_of(PLAIN)
    parses = counting(monkeypatch, engine, "_cpython_parse")
    result = lint_text(PLAIN, "plain.py", OPTIONS)
    assert result.findings == [] and result.errors == [] and parses == []
    # a text the index has not summarised is parsed (its syntax error must be reported)
    broken = lint_text(BROKEN, "broken.py", OPTIONS)
    assert [f.rule for f in broken.findings] == ["TL901"] and parses


def test_the_kept_verdict_asks_the_project_without_a_parse(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "p"
    shutil.copytree(FIXTURES / "fp16_helper", root)
    path = root / "src" / "trainer" / "bad_train.py"
    text = path.read_text()
    expected = lint_text(text, str(path), OPTIONS).findings
    assert [f.rule for f in expected] == ["TL105"]  # (it rests on convert.py's facts)
    forget_indexes()
    assert not outcome_needs_no_project(text, OPTIONS)  # (the lookup's gate: its verdict is kept)
    (verdict,) = engine._VERDICTS.values()
    assert [g.id for g in verdict.crossfile] == ["TL105"] and verdict.imports is not None
    parses = counting(monkeypatch, engine, "_cpython_parse")
    outlines = counting(monkeypatch, ProjectIndex, "outline_of")
    assert lint_text(text, str(path), OPTIONS).findings == expected
    assert parses == [] and outlines == [] and engine._VERDICTS == {}


# -- stat calls answered once per batch, and afresh in the next --------------------------------------------
def test_the_root_search_asks_each_folder_once_per_batch(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "pyproject.toml").write_text("")
    sub = tmp_path / "pkg" / "sub"
    sub.mkdir(parents=True)
    first, second = sub / "a.py", sub / "b.py"
    batch = object()
    asked = counting(monkeypatch, os.path, "exists")
    assert find_root(first, batch) == tmp_path
    before = len(asked)
    assert find_root(second, batch) == tmp_path and len(asked) == before  # (the same folders)
    # a marker added between runs: the next batch (and a call with none) sees it
    (tmp_path / "pkg" / "setup.cfg").write_text("")
    assert find_root(first, batch) == tmp_path  # (within the batch: as it was)
    assert find_root(first, object()) == tmp_path / "pkg"
    assert find_root(first) == tmp_path / "pkg"


def test_a_facts_digest_is_taken_once_per_batch(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "pyproject.toml").write_text("")
    helper = tmp_path / "helpers.py"
    helper.write_text("def convert(m):\n    m.half()\n")
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text("from helpers import convert\n")
    digests = counting(monkeypatch, ProjectIndex, "_facts_digest")
    batch = object()
    first = dependency_key(str(tmp_path / "a.py"), "from helpers import convert\n", None, batch)
    dependency_key(str(tmp_path / "b.py"), "from helpers import convert\n", None, batch)
    assert [str(call[1]) for call in digests] == [str(helper)]
    helper.write_text("def convert(m):\n    m.float()\n")  # new facts: the next batch digests afresh
    assert dependency_key(str(tmp_path / "a.py"), "from helpers import convert\n", None, object()) != first
    assert len(digests) == 2


def test_a_lint_asks_each_files_summary_once_per_name(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "pyproject.toml").write_text("")
    helpers = tmp_path / "helpers.py"
    helpers.write_text("import torch\n\ndef convert(m):\n    m.half()\n\ndef other(m):\n    pass\n")
    user = tmp_path / "train.py"
    user.write_text("from helpers import convert, other\n")
    project = Project.for_file(str(user))
    assert project is not None
    summaries = counting(monkeypatch, ProjectIndex, "summary")
    fact = project.lookup("helpers.convert")
    assert fact is not None and project.lookup("helpers.other") is not None
    assert project.lookup("helpers.convert") == fact
    assert project.resolve_in(fact, "torch") == "torch"
    # one question per name (its definition alone: issue 20), one for the whole summary (its imports)
    assert len(summaries) == 3
    # another file's lint asks the same: answered from memory, by the file's stamp (no read)
    reads = counting(monkeypatch, Path, "read_text")
    again = Project.for_file(str(tmp_path / "train.py"))
    assert again is not None and again.lookup("helpers.convert") == fact
    assert again.lookup("helpers.other") is not None and again.resolve_in(fact, "torch") == "torch"
    assert [call for call in reads if call[0] == helpers] == []
