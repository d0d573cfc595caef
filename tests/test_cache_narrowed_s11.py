"""A file the gate keeps only for cross-file candidates with callees (``Rule.project_callees``) is keyed on
the imports reached through those callees, not on every import, when their facts choose no rule: a cold
run summarises no other imported module for it and never lints it. Its entry stays valid while an
unreached import changes; a change to a reached one that makes a finding possible is linted afresh."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import age, touch, write_project

from trainlint import engine
from trainlint.cli import run
from trainlint.model import project as project_module
from trainlint.model.project import forget_indexes

# `Net` converts itself when built (a fact TL105 wants), but is built here and never trained; the
# callee whose result is trained is `to_half`, which (here) converts nothing
TRAIN = """\
import torch
from nets import Net
from helpers import to_half

def main():
    runner = Net()
    model = torch.nn.Linear(4, 4)
    model = to_half(model)
    opt = torch.optim.AdamW(model.parameters())
    runner.log(opt)
"""
NETS = """\
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.half()
"""
KEEPS = "def to_half(m):\n    return m\n"
CONVERTS = "def to_half(m):\n    m.half()\n    return m\n"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = write_project(tmp_path / "p", {"train.py": TRAIN, "nets.py": NETS, "helpers.py": KEEPS})
    age(root)
    return root


def _lint(root: Path, capsys, monkeypatch) -> tuple[list[str], list[str]]:
    """A run of a new process on train.py with a cache beside the project: TL105's findings, and the
    files whose summaries the run asked for."""
    forget_indexes()
    engine._VERDICTS.clear()
    summarised: list[str] = []
    summary = project_module.ProjectIndex.summary

    def noted(self, path, *args, **kwargs):
        summarised.append(Path(path).name)
        return summary(self, path, *args, **kwargs)

    monkeypatch.setattr(project_module.ProjectIndex, "summary", noted)
    capsys.readouterr()
    cache = root.parent / "cache"
    code = run(
        ["--jobs", "1", "--select", "TL105", "--format", "json", "--cache-dir", str(cache), "train.py"]
    )
    assert code in (0, 1)
    findings = json.loads(capsys.readouterr().out)["findings"]
    monkeypatch.setattr(project_module.ProjectIndex, "summary", summary)
    return [f["rule"] for f in findings], summarised


def test_an_unreached_import_is_not_summarised_and_the_file_not_linted(project, capsys, monkeypatch) -> None:
    monkeypatch.chdir(project)
    monkeypatch.setattr(engine, "_lint_parsed", lambda *a, **k: pytest.fail("linted"))
    findings, summarised = _lint(project, capsys, monkeypatch)
    assert findings == [] and "helpers.py" in summarised and "nets.py" not in summarised


def test_without_callees_every_import_counts(project, capsys, monkeypatch) -> None:
    monkeypatch.chdir(project)
    monkeypatch.setattr(engine, "callees_asked", lambda name, tree: None)  # any import may count
    findings, summarised = _lint(project, capsys, monkeypatch)
    assert findings == [] and "nets.py" in summarised  # (`Net`'s facts are wanted: libcst parses it)


def test_an_unreached_import_changed_keeps_the_entry(project, capsys, monkeypatch) -> None:
    monkeypatch.chdir(project)
    _lint(project, capsys, monkeypatch)
    (project / "nets.py").write_text(NETS.replace("self.half()", "self.float()"))
    touch(project / "nets.py")
    monkeypatch.setattr(engine, "_code_gate", lambda *a: pytest.fail("gated again"))
    assert _lint(project, capsys, monkeypatch) == ([], [])


def test_a_reached_import_that_now_converts_is_linted_afresh(project, capsys, monkeypatch) -> None:
    monkeypatch.chdir(project)
    assert _lint(project, capsys, monkeypatch)[0] == []
    (project / "helpers.py").write_text(CONVERTS)
    touch(project / "helpers.py")
    assert _lint(project, capsys, monkeypatch)[0] == ["TL105"]
    assert _lint(project, capsys, monkeypatch)[0] == ["TL105"]  # (from the entry of the full key)


def test_a_narrowed_record_does_not_answer_the_store_of_a_lint(project, monkeypatch) -> None:
    """The key a linted result is stored under (``gate=False``) is never the narrowed one: a narrowed
    key covers a no-finding outcome only."""
    from trainlint.model.dependency_keys import dependency_key, recorded_dependency_key

    forget_indexes()
    store, main, text = project.parent / "store", str(project / "train.py"), TRAIN
    narrowed = dependency_key(main, text, store, only=["helpers.to_half"])
    full = dependency_key(main, text, store)
    assert narrowed != full
    dependency_key(main, text, store, only=["helpers.to_half"])  # (the record is the narrowed one again)
    forget_indexes()
    assert recorded_dependency_key(main, text, store) is None
    assert recorded_dependency_key(main, text, store, narrowed=True) == narrowed
