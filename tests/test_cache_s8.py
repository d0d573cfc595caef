"""A cold run stores an entry for every file with findings, in 16 folders named by the key's first
character: each folder is made and checked (never a planted link) once per run, not once per entry.
(Files with no finding go to a journal: tests/test_cache_journal_s11.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import counting

import trainlint.cache as cache_module
from trainlint.cli import run


def test_each_entry_folder_is_made_once_per_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    project = tmp_path / "p"
    project.mkdir()
    (project / "pyproject.toml").write_text("")
    for n in range(60):
        (project / f"m{n}.py").write_text(
            f"from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, {n})\n"
        )
    made = counting(monkeypatch, cache_module.os, "makedirs")
    cache = tmp_path / "cache"
    assert run(["--jobs", "1", "--quiet", "--select", "TL201", "--cache-dir", str(cache), str(project)]) == 1
    capsys.readouterr()
    entries = [p for p in cache.rglob("*.json") if len(p.parent.name) == 1 and "summaries" not in p.parts]
    assert len(entries) == 60  # every file was stored (else the count below proves nothing)
    folders = [str(call[0]) for call in made if len(os.path.basename(str(call[0]))) == 1]
    assert sorted(folders) == sorted({str(p.parent) for p in entries})
