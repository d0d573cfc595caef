"""A file whose rules run is keyed, in a cold run, on what its lint asked of the project (a depfile, as
build systems keep one), not on the facts of every module it imports: the rules of the subset's active
files look 15 modules up where their imports reach about 60. The record of what was asked decides the
next run's key: a module the lint asked about that changes makes it lint again; one it never asked
about does not. Where the stamps are too recent to tell a later change apart, the outcome is keyed on
every import's facts, as before."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from conftest import age, touch

import trainlint.cache as cache_module
from trainlint import engine
from trainlint.cli import run
from trainlint.model import project as project_module
from trainlint.model.project import forget_indexes

# TL203: the checkpointed block's forward writes to a module-level registry (a fact of blocks.py)
MAIN = """\
from torch import nn
from torch.utils.checkpoint import checkpoint
from blocks import Block
from other import helper

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return checkpoint(self.block, helper(x), use_reentrant=False)
"""
BLOCKS = """\
from torch import nn
CACHE = {}

class Block(nn.Module):
    def forward(self, x):
        out = {}
        %s
        return x
"""
OTHER = "def helper(x):\n    return x\n"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "p"
    root.mkdir()
    (root / "pyproject.toml").write_text("")
    (root / "main.py").write_text(MAIN)
    (root / "blocks.py").write_text(textwrap.dedent(BLOCKS % 'CACHE["a"] = x'))
    (root / "other.py").write_text(OTHER)
    return root


def _run(root: Path, capsys, monkeypatch, linted: list[str]) -> tuple[int, list[str]]:
    """A new process's run on main.py with a cache beside the project: TL203's findings, with the
    files linted and the files summarised noted."""
    forget_indexes()
    engine._VERDICTS.clear()
    cache_module._JOURNALS.clear()
    summarised: list[str] = []
    summary, lint = project_module.ProjectIndex.summary, engine.lint_text

    def noted_summary(self, path, *args, **kwargs):
        summarised.append(Path(path).name)
        return summary(self, path, *args, **kwargs)

    def noted_lint(text, path, options):
        linted.append(Path(path).name)
        return lint(text, path, options)

    monkeypatch.setattr(project_module.ProjectIndex, "summary", noted_summary)
    monkeypatch.setattr(engine, "lint_text", noted_lint)
    capsys.readouterr()
    argv = ["--jobs", "1", "--select", "TL203", "--format", "json", "--cache-dir", str(root.parent / "c")]
    assert run([*argv, "main.py"]) in (0, 1)
    found = json.loads(capsys.readouterr().out)["findings"]
    monkeypatch.setattr(project_module.ProjectIndex, "summary", summary)
    monkeypatch.setattr(engine, "lint_text", lint)
    return len(found), summarised


def test_a_cold_run_summarises_only_what_the_rules_asked(project, capsys, monkeypatch) -> None:
    monkeypatch.chdir(project)
    age(project)
    linted: list[str] = []
    found, summarised = _run(project, capsys, monkeypatch, linted)
    assert found == 1 and linted == ["main.py"]
    assert "blocks.py" in summarised and "other.py" not in summarised


def test_a_module_never_asked_about_changed_keeps_the_entry(project, capsys, monkeypatch) -> None:
    monkeypatch.chdir(project)
    age(project)
    linted: list[str] = []
    _run(project, capsys, monkeypatch, linted)
    (project / "other.py").write_text(OTHER.replace("return x", "return x + 1"))
    touch(project / "other.py")
    assert _run(project, capsys, monkeypatch, linted)[0] == 1
    assert linted == ["main.py"]  # (the first run's lint only)


def test_a_module_asked_about_changed_is_linted_again(project, capsys, monkeypatch) -> None:
    monkeypatch.chdir(project)
    age(project)
    linted: list[str] = []
    assert _run(project, capsys, monkeypatch, linted)[0] == 1
    (project / "blocks.py").write_text(textwrap.dedent(BLOCKS % 'out["a"] = x'))
    touch(project / "blocks.py")
    assert _run(project, capsys, monkeypatch, linted)[0] == 0
    assert linted == ["main.py", "main.py"]
    assert _run(project, capsys, monkeypatch, linted)[0] == 0 and len(linted) == 2  # (kept again)


def test_a_module_added_where_an_import_looks_is_linted_again(project, capsys, monkeypatch) -> None:
    """`from pkg.blocks import Block` found no module: the folder the lookup listed is in the record,
    so a module added there is looked up on the next run."""
    monkeypatch.chdir(project)
    (project / "pkg").mkdir()
    (project / "pkg" / "__init__.py").write_text("")
    main = MAIN.replace("from blocks import Block", "from pkg.blocks import Block")
    (project / "main.py").write_text(main)
    age(project)
    linted: list[str] = []
    assert _run(project, capsys, monkeypatch, linted)[0] == 0  # (pkg.blocks: no such module yet)
    (project / "pkg" / "blocks.py").write_text(textwrap.dedent(BLOCKS % 'CACHE["a"] = x'))
    touch(project / "pkg" / "blocks.py")
    touch(project / "pkg")
    assert _run(project, capsys, monkeypatch, linted)[0] == 1
    assert linted == ["main.py", "main.py"]


def test_stamps_too_recent_fall_back_to_the_key_of_every_import(project, capsys, monkeypatch) -> None:
    """The files were just written: a change in the same clock tick could hide from a record of their
    stamps. The outcome is stored under the key made from every import's facts, which a lookup
    recomputes (noted for the text by ``mark_full``): answered from the cache, never from stamps."""
    monkeypatch.chdir(project)
    linted: list[str] = []
    assert _run(project, capsys, monkeypatch, linted)[0] == 1
    assert _run(project, capsys, monkeypatch, linted)[0] == 1 and linted == ["main.py"]
    (project / "blocks.py").write_text(textwrap.dedent(BLOCKS % 'out["a"] = x'))  # (facts changed)
    assert _run(project, capsys, monkeypatch, linted)[0] == 0
