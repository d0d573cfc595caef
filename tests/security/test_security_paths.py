"""Attacks through paths and ``--fix``: committed links leading out of the tree, a file edited while
``--fix`` runs, a full disk and a kill in the middle of writing a fix."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import trainlint.fix
from trainlint.cli import run

BAD = textwrap.dedent(
    """\
    from torch.utils.checkpoint import checkpoint


    def forward(block, x):
        return checkpoint(block, x)
    """
)
FIXED = BAD.replace("checkpoint(block, x)", "checkpoint(block, x, use_reentrant=False)")
SECRET = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAAAAAAtopsecret\n"


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "pyproject.toml").write_text("[tool.trainlint]\n")
    monkeypatch.chdir(root)
    return root


def lint(capsys, *argv: str) -> tuple[int, dict, str]:
    code = run(["--format", "json", "--no-cache", "--jobs", "1", *argv])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def text_run(capsys, *argv: str) -> tuple[int, str, str]:
    code = run(["--no-cache", "--jobs", "1", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- links ------------------------------------------------------------------------------------------


def test_a_linked_folder_leading_outside_is_not_walked(repo, tmp_path, capsys) -> None:
    outside = tmp_path / "usr-lib"
    outside.mkdir()
    (outside / "lib.py").write_text(BAD)
    (repo / "vendor").symlink_to(outside)
    (repo / "own.py").write_text(BAD)
    code, data, err = lint(capsys, ".")
    assert code == 1
    assert [f["path"] for f in data["findings"]] == ["own.py"]
    assert "vendor: the symbolic link leads outside the linted folders; skipped" in err


def test_a_linked_file_leading_to_a_secret_is_never_shown(repo, tmp_path, capsys) -> None:
    key = tmp_path / "id_rsa"
    key.write_text(SECRET)
    (repo / "model.py").symlink_to(key)
    for argv in [(".",), ("model.py",)]:
        code, out, err = text_run(capsys, *argv)
        assert "topsecret" not in out + err
        assert "model.py: the symbolic link leads outside the linted folders; skipped" in err
        assert code == 0


def test_a_link_inside_the_tree_gets_no_code_frame_for_tl901(repo, capsys) -> None:
    (repo / "data").mkdir()
    (repo / "data" / "notes.txt").write_text(SECRET)
    (repo / "model.py").symlink_to(repo / "data" / "notes.txt")
    code, out, _ = text_run(capsys, ".")
    assert code == 1
    assert "model.py:1:" in out and "TL901" in out
    assert "topsecret" not in out


def test_fix_never_writes_outside_the_tree(repo, tmp_path, capsys) -> None:
    outside = tmp_path / "other" / "train.py"
    outside.parent.mkdir()
    outside.write_text(BAD)
    (repo / "train.py").symlink_to(outside)
    (repo / "lib").symlink_to(outside.parent)
    run(["--no-cache", "--fix", "--unsafe-fixes", "."])
    capsys.readouterr()
    assert outside.read_text() == BAD


def test_fix_through_a_link_inside_the_tree_keeps_the_link(repo, capsys) -> None:
    (repo / "real.py").write_text(BAD)
    (repo / "alias.py").symlink_to("real.py")
    run(["--no-cache", "--fix", "--unsafe-fixes", "alias.py"])
    capsys.readouterr()
    assert (repo / "alias.py").is_symlink()
    assert (repo / "real.py").read_text() == FIXED


# -- atomic fixes -----------------------------------------------------------------------------------


def test_a_file_edited_during_fix_keeps_the_edit(repo, monkeypatch, capsys) -> None:
    target = repo / "train.py"
    target.write_text(BAD)
    edited = BAD + "\n# the user's edit, saved while trainlint was fixing\n"
    real_write_fixed = trainlint.fix.write_fixed

    def race_and_write(*args, **kwargs):
        target.write_text(edited)  # the editor saves between linting and writing the fix
        return real_write_fixed(*args, **kwargs)

    monkeypatch.setattr(trainlint.fix, "write_fixed", race_and_write)
    code, _, err = text_run(capsys, "--fix", "--unsafe-fixes", "train.py")
    assert target.read_text() == edited
    assert "train.py: fix not applied: the file changed since it was linted" in err
    assert code == 1  # its finding is still reported


def test_the_fixed_file_keeps_its_mode(repo, capsys) -> None:
    target = repo / "train.py"
    target.write_text(BAD)
    target.chmod(0o751)
    run(["--no-cache", "--fix", "--unsafe-fixes", "train.py"])
    capsys.readouterr()
    assert target.read_text() == FIXED
    assert target.stat().st_mode & 0o777 == 0o751
    assert [p.name for p in repo.iterdir() if "tmp" in p.name] == []


def _fix_under_size_limit(repo: Path, limit: int, ignore_signal: bool) -> subprocess.CompletedProcess:
    def limited() -> None:
        if ignore_signal:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails: a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    command = [sys.executable, "-m", "trainlint", "--no-cache", "--jobs", "1", "--fix", "--unsafe-fixes", "."]
    return subprocess.run(
        command, cwd=repo, env=env, capture_output=True, text=True, preexec_fn=limited, timeout=120
    )


def test_a_full_disk_leaves_the_file_whole_and_fixes_the_others(repo) -> None:
    big = BAD + "".join(f"# padding line {i}\n" for i in range(400))
    (repo / "a_big.py").write_text(big)
    (repo / "b_small.py").write_text(BAD)
    done = _fix_under_size_limit(repo, 4096, ignore_signal=True)
    assert (repo / "a_big.py").read_text() == big
    assert (repo / "b_small.py").read_text() == FIXED
    assert "a_big.py: fix not applied: cannot write the file: file too large" in done.stderr
    assert "a_big.py:5:12: TL201" in done.stdout
    assert done.returncode == 1


# Killed (as by SIGKILL: no clean-up runs) at the first write into a file opened for writing after
# linting, whether it is the file itself or a temporary one (opened by descriptor).
DIE_AT_FIRST_WRITE = """
import io, os, sys
real_open = io.open


class Dying:
    def __init__(self, handle):
        self.handle = handle

    def write(self, data):
        os._exit(137)

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)


def dying_open(file, mode="r", *args, **kwargs):
    handle = real_open(file, mode, *args, **kwargs)
    writing = any(m in mode for m in "wa+")
    if writing and (isinstance(file, int) or os.fspath(file).endswith("train.py")):
        return Dying(handle)
    return handle


io.open = dying_open
from trainlint.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_kill_while_writing_a_fix_leaves_the_old_file(repo) -> None:
    (repo / "train.py").write_text(BAD)
    done = subprocess.run(
        [sys.executable, "-c", DIE_AT_FIRST_WRITE, "--no-cache", "--fix", "--unsafe-fixes", "train.py"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 137, done.stderr
    assert (repo / "train.py").read_text() == BAD
