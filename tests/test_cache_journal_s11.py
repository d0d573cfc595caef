"""Files with no finding are kept as keys in a journal per writing process, not as one entry file each:
a cold run creates a handful of files instead of one per linted file, and a warm run reads the
journals once. A key is salted with the user's secret like an entry's, so a planted journal answers
nothing; a journal reached through a link is never read; many journals are merged into one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import trainlint.cache as cache_module
from trainlint import engine
from trainlint.cli import run

QUIET = "def f{n}(x):\n    return x + {n}\n"
FOUND = "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x)\n"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "p"
    root.mkdir()
    (root / "pyproject.toml").write_text("")
    for n in range(20):
        (root / f"m{n}.py").write_text(QUIET.format(n=n))
    (root / "found.py").write_text(FOUND)
    return root


def _lint(project: Path, cache: Path, capsys) -> list[str]:
    cache_module._JOURNALS.clear()  # (as a new process: no journal open yet)
    capsys.readouterr()
    assert run(["--jobs", "1", "--format", "json", "--cache-dir", str(cache), str(project)]) in (0, 1)
    return sorted(f["path"].rpartition("/")[2] for f in json.loads(capsys.readouterr().out)["findings"])


def _entries(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*.json") if len(p.parent.name) == 1 and "summaries" not in p.parts]


def _journals(cache: Path) -> list[Path]:
    return sorted(cache.rglob(f"quiet/*{cache_module._QUIET_SUFFIX}"))


def test_a_quiet_file_is_a_journal_line_and_a_file_with_findings_an_entry(project, tmp_path, capsys) -> None:
    cache = tmp_path / "cache"
    assert _lint(project, cache, capsys) == ["found.py"]
    assert len(_entries(cache)) == 1  # found.py's
    (journal,) = _journals(cache)
    assert len(journal.read_text().split()) == 20


def test_a_warm_run_answers_quiet_files_from_the_journal(project, tmp_path, capsys, monkeypatch) -> None:
    cache = tmp_path / "cache"
    _lint(project, cache, capsys)
    read = cache_module.ResultCache._read
    opened: list[str] = []

    def noted(self, key):
        opened.append(key)
        return read(self, key)

    monkeypatch.setattr(cache_module.ResultCache, "_read", noted)
    monkeypatch.setattr(engine, "lint_text", lambda *a, **k: pytest.fail("linted"))
    assert _lint(project, cache, capsys) == ["found.py"]
    assert len(opened) <= 2  # found.py's entry alone (its no-rules key first)


def test_keys_planted_in_a_journal_answer_nothing(project, tmp_path, capsys) -> None:
    """Another user's journal (another secret) copied in, and a journal that is a link: the files are
    linted, their findings kept."""
    cache = tmp_path / "cache"
    _lint(project, tmp_path / "other", capsys)  # (the same files, another cache: other keys)
    (project / "found.py").write_text(FOUND.replace("x)", "x)  # edited"))
    theirs = _journals(tmp_path / "other")[0].read_text()
    _lint(project, cache, capsys)
    folder = _journals(cache)[0].parent
    for journal in _journals(cache):
        journal.unlink()
    for entry in _entries(cache):
        entry.unlink()
    (folder / "planted.keys").write_text(theirs + "0" * 64 + "\n")
    outside = tmp_path / "outside.keys"
    outside.write_text(theirs)
    (folder / "linked.keys").symlink_to(outside)
    assert _lint(project, cache, capsys) == ["found.py"]
    assert len(_entries(cache)) == 1


def test_many_journals_are_merged_into_one_with_every_key(project, tmp_path, capsys, monkeypatch) -> None:
    cache = tmp_path / "cache"
    _lint(project, cache, capsys)
    (journal,) = _journals(cache)
    keys = journal.read_text().split()
    for n, key in enumerate(keys):  # (one journal per key, as if as many processes wrote them)
        (journal.parent / f"{n}-x.keys").write_text(f"{key}\n")
    journal.unlink()
    monkeypatch.setattr(cache_module, "_JOURNALS_MERGED_AFTER", 8)
    assert _lint(project, cache, capsys) == ["found.py"]
    (merged,) = _journals(cache)
    assert merged.name.startswith("merged-") and set(merged.read_text().split()) == set(keys)


def test_one_journal_per_process_and_cache_however_many_files_it_stores(project, tmp_path, capsys) -> None:
    cache = tmp_path / "cache"
    cache_module._JOURNALS.clear()
    capsys.readouterr()
    assert run(["--jobs", "2", "--format", "json", "--cache-dir", str(cache), str(project)]) == 1
    assert 1 <= len(_journals(cache)) <= 3  # (this process and at most its two workers)
    assert sum(len(p.read_text().split()) for p in _journals(cache)) == 20
    assert os.stat(_journals(cache)[0]).st_mode & 0o777 == 0o600
