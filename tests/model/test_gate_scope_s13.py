"""What the gate spends on one file (session 13):

- a file outside any project has no cross-file candidates: no other file's facts can be asked for it
  (``Project.for_file`` is None), so the rules' project checks, the costliest of the gate, are not
  asked of it, and its findings stay what they were;
- once a file's gate has answered, no walk keeps the file's tree (a kept tree is scanned, node by
  node, by the garbage collector's young generations: about 5 % of a cold run)."""

from __future__ import annotations

import gc
import textwrap
import weakref
from pathlib import Path

import pytest
from test_gate_half_params import NETS  # (a class that converts itself when built)

from trainlint import engine, gates
from trainlint.engine import lint_text
from trainlint.results import LintOptions

OPTIONS = LintOptions(("TL105",))
PROJECT_CHECK = "gate_half_params.may_train_parameters_converted_elsewhere"

TRAIN = """
import torch
from nets import Net

def main():
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
"""


def _write(folder: Path, marker: bool) -> tuple[Path, str]:
    folder.mkdir()
    if marker:
        (folder / "pyproject.toml").write_text("")
    (folder / "nets.py").write_text(textwrap.dedent(NETS).lstrip())
    path = folder / "train.py"
    path.write_text(textwrap.dedent(TRAIN).lstrip())
    return path, path.read_text()


def _asked_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    asked: list[str] = []
    original = gates._asked

    def recording(name: str, tree: object) -> bool:
        asked.append(name)
        return original(name, tree)  # type: ignore[arg-type]

    monkeypatch.setattr(gates, "_asked", recording)
    return asked


def test_a_file_outside_any_project_is_not_asked_the_project_checks(tmp_path, monkeypatch) -> None:
    path, text = _write(tmp_path / "scripts", marker=False)
    asked = _asked_checks(monkeypatch)
    result = lint_text(text, str(path), OPTIONS)
    assert result.findings == []
    assert PROJECT_CHECK not in asked
    # the text alone (no path: the result cache's question, or a string) keeps its candidates
    assert [g.id for g in engine._code_gate(text, OPTIONS)[1]] == ["TL105"]


def test_the_same_file_in_a_project_is_asked_them_and_reported(tmp_path, monkeypatch) -> None:
    path, text = _write(tmp_path / "project", marker=True)
    asked = _asked_checks(monkeypatch)
    result = lint_text(text, str(path), OPTIONS)
    assert PROJECT_CHECK in asked
    assert [f.rule for f in result.findings] == ["TL105"]


def test_no_walk_keeps_a_tree_once_the_gate_has_answered(monkeypatch) -> None:
    trees: list[weakref.ref] = []
    parse = engine._cpython_parse

    def kept(text: str):  # type: ignore[no-untyped-def]
        tree, exc = parse(text)
        if tree is not None:
            trees.append(weakref.ref(tree))
        return tree, exc

    monkeypatch.setattr(engine, "_cpython_parse", kept)
    options = LintOptions(("TL105", "TL204", "TL301", "TL302"))
    text = textwrap.dedent(TRAIN).lstrip() + "    loss = model(x).half().mean() / 4\n    loss.backward()\n"
    crossfile = engine._code_gate(text, options)[1]  # (the tree it returns is let go here)
    assert crossfile  # (the walks of the project checks were asked)
    gc.collect()
    assert trees and all(ref() is None for ref in trees)
