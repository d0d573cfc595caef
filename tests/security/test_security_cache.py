"""Attacks on the result cache, built as a pull request would carry them: a committed cache folder
with entries computed on the attacker's machine, a planted ``rule-ids.json``, committed links.

Each test runs the real command line in a project whose user cache (``$XDG_CACHE_HOME``) is a
folder of the test, so the victim's and the attacker's machines are two folders."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

import trainlint.cache
from trainlint.cli import run

BAD = textwrap.dedent(
    """\
    from torch.utils.checkpoint import checkpoint


    def forward(block, x):
        return checkpoint(block, x)
    """
)


def use_machine(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """Make ``home`` this user's cache folder (and forget the secret of the previous machine)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    secret = getattr(trainlint.cache, "user_secret", None)
    if secret is not None:
        secret.cache_clear()


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "pyproject.toml").write_text("[tool.trainlint]\n")
    (repo / "src" / "bad.py").write_text(BAD)
    monkeypatch.chdir(repo)
    use_machine(monkeypatch, tmp_path / "victim-cache")
    yield repo
    use_machine(monkeypatch, tmp_path / "after")


def lint(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict, str]:
    code = run(["--format", "json", "--jobs", "1", *argv])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def rules(data: dict) -> list[str]:
    return [f["rule"] for f in data["findings"]]


def committed_cache(repo: Path, tmp_path: Path, monkeypatch, capsys) -> Path:
    """What an attacker commits: a cache filled on their machine inside the repository, every entry
    rewritten to say the file is clean."""
    use_machine(monkeypatch, tmp_path / "attacker-cache")
    lint(capsys, "--cache-dir", ".trainlint_cache", "src")
    entries = [p for p in (repo / ".trainlint_cache").rglob("*.json") if p.name != "rule-ids.json"]
    assert entries
    for entry in entries:
        payload = json.loads(entry.read_text())
        payload["findings"] = []
        entry.write_text(json.dumps(payload))
    use_machine(monkeypatch, tmp_path / "victim-cache")
    return repo / ".trainlint_cache"


def version_folder(repo: Path) -> Path:
    folder = repo / ".trainlint_cache" / trainlint.cache.code_fingerprint()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_the_default_cache_is_outside_the_tree(project, tmp_path, capsys) -> None:
    code, data, _ = lint(capsys, "src")
    assert code == 1 and rules(data) == ["TL201"]
    assert not (project / ".trainlint_cache").exists()
    assert [p for p in (tmp_path / "victim-cache").rglob("*.json") if p.name != "rule-ids.json"]
    code, data, _ = lint(capsys, "src")  # served from the user cache
    assert code == 1 and rules(data) == ["TL201"]


@pytest.mark.parametrize("argv", [(), ("--cache-dir", ".trainlint_cache")])
def test_a_committed_cache_saying_clean_hides_nothing(project, tmp_path, monkeypatch, capsys, argv) -> None:
    committed_cache(project, tmp_path, monkeypatch, capsys)
    code, data, _ = lint(capsys, *argv, "src")
    assert code == 1
    assert rules(data) == ["TL201"]


@pytest.mark.parametrize(
    "recorded",
    [
        ["TLX"],
        {"ids": ["TLX"], "mac": "0" * 64},
        ["TL901", "TL902", "x" * 100_000],  # too big to be ours, and it would narrow the selection
    ],
)
def test_a_planted_rule_id_record_never_narrows_the_selection(project, capsys, recorded) -> None:
    (version_folder(project) / "rule-ids.json").write_text(json.dumps(recorded))
    for argv in [("--cache-dir", ".trainlint_cache"), ()]:
        code, data, _ = lint(capsys, *argv, "src")
        assert code == 1
        assert rules(data) == ["TL201"]


def test_a_linked_rule_id_record_is_not_followed(project, tmp_path, capsys) -> None:
    outside = tmp_path / "ids.json"
    outside.write_text(json.dumps(["TL901", "TL902"]))
    (version_folder(project) / "rule-ids.json").symlink_to(outside)
    code, data, _ = lint(capsys, "--cache-dir", ".trainlint_cache", "src")
    assert code == 1 and rules(data) == ["TL201"]
    assert json.loads(outside.read_text()) == ["TL901", "TL902"]


@pytest.mark.parametrize("argv", [(), ("--cache-dir", ".trainlint_cache")])
def test_a_linked_cache_folder_is_refused_and_nothing_is_written_through_it(
    project, tmp_path, capsys, argv
) -> None:
    other = tmp_path / "otherrepo"
    other.mkdir()
    (project / ".trainlint_cache").symlink_to(other)
    code, data, err = lint(capsys, *argv, "src")
    assert code == 1 and rules(data) == ["TL201"]
    assert list(other.iterdir()) == []
    if argv:
        assert "symbolic link" in err


def test_a_dangling_gitignore_link_in_the_cache_is_not_written_through(project, tmp_path, capsys) -> None:
    target = tmp_path / "global-gitignore"
    (project / ".trainlint_cache").mkdir()
    (project / ".trainlint_cache" / ".gitignore").symlink_to(target)
    code, _, _ = lint(capsys, "--cache-dir", ".trainlint_cache", "src")
    assert code == 1
    assert not target.exists()


def test_a_linked_entry_folder_is_not_read_or_written(project, tmp_path, monkeypatch, capsys) -> None:
    """Every entry folder replaced by a link to a folder of clean entries the attacker controls."""
    planted = committed_cache(project, tmp_path, monkeypatch, capsys)
    version = next(p for p in planted.iterdir() if p.is_dir())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for sub in [p for p in version.iterdir() if p.is_dir()]:
        sub.rename(elsewhere / sub.name)
        sub.symlink_to(elsewhere / sub.name)
    before = sorted(p.name for p in elsewhere.rglob("*"))
    use_machine(monkeypatch, tmp_path / "attacker-cache")  # even with the secret that wrote them
    code, data, _ = lint(capsys, "--cache-dir", ".trainlint_cache", "src")
    assert code == 1 and rules(data) == ["TL201"]
    assert sorted(p.name for p in elsewhere.rglob("*")) == before


def test_the_secret_is_private(project, tmp_path, capsys) -> None:
    lint(capsys, "src")
    secret = tmp_path / "victim-cache" / "trainlint" / "secret"
    assert secret.is_file()
    assert os.stat(secret).st_mode & 0o077 == 0
