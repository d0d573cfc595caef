"""A failure of the result cache's own code on one file (its key's computation, the recording of what
the lint asks of the project, the store) costs that file its cache, never the run: the file is linted
and reported as without a cache, one warning line says so, and every other file keeps the cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import age, write_project

from trainlint import cache as cache_module
from trainlint.cli import run
from trainlint.model.project import forget_indexes

CHECKPOINTED = """\
import torch.utils.checkpoint as cp


def forward(block, x):
    return cp.checkpoint(block, x)
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch) -> Path:
    root = write_project(tmp_path / "p", {"a.py": CHECKPOINTED, "b.py": CHECKPOINTED})
    age(root)
    monkeypatch.chdir(root)
    return root


def _run(root: Path, capsys) -> tuple[int, list[str], str]:
    """A new process's run over the project with its cache: the exit code, the files with a finding,
    the warnings."""
    forget_indexes()
    capsys.readouterr()
    argv = [
        "--jobs",
        "1",
        "--select",
        "TL201",
        "--format",
        "json",
        "--cache-dir",
        str(root.parent / "c"),
        ".",
    ]
    code = run(argv)
    out = capsys.readouterr()
    return code, sorted(f["path"] for f in json.loads(out.out)["findings"]), out.err


def _failing_for(name: str, original):
    def failing(path, *args, **kwargs):
        if Path(path).name == name:
            raise RuntimeError("a bug in the key")
        return original(path, *args, **kwargs)

    return failing


@pytest.mark.parametrize("where", ["recorded_dependency_key", "recording", "recorded_lint_key"])
def test_a_fault_on_one_file_costs_that_file_its_cache(project, capsys, monkeypatch, where: str) -> None:
    original = getattr(cache_module, where)
    if where == "recorded_lint_key":  # (the store's key: called with the lint's recording first)

        def failing(found, text, *args, **kwargs):
            if found.project.path.name == "a.py":
                raise RuntimeError("a bug in the key")
            return original(found, text, *args, **kwargs)

        monkeypatch.setattr(cache_module, where, failing)
    else:
        monkeypatch.setattr(cache_module, where, _failing_for("a.py", original))
    code, found, err = _run(project, capsys)
    assert code == 1 and found == ["a.py", "b.py"]
    (warning,) = err.splitlines()
    assert warning.startswith("trainlint: warning: the result cache failed on a.py (RuntimeError: a bug")
    # b.py was stored, a.py was not: without the fault, b.py is a hit and a.py is linted (and stored)
    monkeypatch.setattr(cache_module, where, original)
    linted: list[str] = []
    lint_one = cache_module.ResultCache.store

    def noted(self, job, *args, **kwargs):
        linted.append(Path(job[0]).name)
        return lint_one(self, job, *args, **kwargs)

    monkeypatch.setattr(cache_module.ResultCache, "store", noted)
    assert _run(project, capsys) == (1, ["a.py", "b.py"], "")
    assert linted == ["a.py"]
