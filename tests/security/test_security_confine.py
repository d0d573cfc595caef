"""The write guard of the ``--verify`` child (``child/confine.py``), called directly: what it refuses
and what the harness itself still needs (its own folder, /dev/null, its data-parallel workers). The
attack through a real child is in test_security_verify.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from trainlint.verify.child import BOOT
from trainlint.verify.child.confine import Guard

CHILD = str(Path(__file__).resolve().parents[2] / "lint" / "verify" / "child")


@pytest.fixture
def hook(tmp_path: Path):
    (tmp_path / "run").mkdir()
    return Guard([str(tmp_path / "run")])


def test_writes_inside_the_folder_and_reads_anywhere_pass(hook, tmp_path: Path) -> None:
    hook("open", (str(tmp_path / "run" / "x"), "w", os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
    hook("open", (str(tmp_path / "outside"), "r", os.O_RDONLY))
    hook("open", (os.devnull, None, os.O_WRONLY))
    hook("open", (3, "w", os.O_WRONLY))  # an open descriptor
    hook("os.rename", (str(tmp_path / "run" / "a"), str(tmp_path / "run" / "b"), -1, -1))
    hook("socket.bind", (None, ("127.0.0.1", 0)))
    hook("socket.bind", (None, "\0abstract"))  # no file


@pytest.mark.parametrize(
    ("event", "args"),
    [
        ("open", ("{out}/x", "w", os.O_WRONLY | os.O_CREAT)),
        ("open", ("{out}/x", "a", os.O_WRONLY | os.O_APPEND)),
        ("open", ("{out}/x", None, os.O_RDWR)),
        ("open", (b"{out}/x", "r+", os.O_RDWR)),
        ("os.remove", ("{out}/x", -1)),
        ("os.rename", ("{run}/a", "{out}/b", -1, -1)),  # moved out
        ("os.rename", ("{out}/a", "{run}/b", -1, -1)),  # taken away
        ("os.mkdir", ("{out}/d", 0o777, -1)),
        ("os.symlink", ("/etc", "{out}/l", -1)),
        ("os.link", ("{out}/x", "{run}/x", -1, -1, True)),  # a hard link in, to write through
        ("os.truncate", ("{out}/x", 0)),
        ("os.chmod", ("{out}/x", 0o777, -1)),
        ("shutil.rmtree", ("{out}", None)),
        ("shutil.copyfile", ("{run}/a", "{out}/b")),
        ("sqlite3.connect", ("{out}/db",)),
        ("socket.bind", (None, "{out}/sock")),  # an AF_UNIX socket file
        ("open", ("{run}/../x", "w", os.O_WRONLY)),  # ``..`` out of the folder
        ("open", ("{run}/up/x", "w", os.O_WRONLY)),  # a link inside leading out
        ("os.system", (b"touch /tmp/x",)),
        ("subprocess.Popen", ("sh", ["sh", "-c", "touch /tmp/x"], None, None)),
        ("subprocess.Popen", (None, [sys.executable, "-c", "open('/tmp/x', 'w')"], None, None)),
        ("os.exec", ("/bin/sh", ["sh"], {})),
        ("os.posix_spawn", ("/bin/sh", ["sh"], {})),
    ],
)
def test_changes_outside_and_new_programs_are_refused(hook, tmp_path: Path, event, args) -> None:
    (tmp_path / "run" / "up").symlink_to(tmp_path)
    fill = {"out": str(tmp_path / "outside"), "run": str(tmp_path / "run")}
    args = tuple(
        a.format(**fill)
        if isinstance(a, str)
        else a.decode().format(**fill).encode()
        if isinstance(a, bytes)
        else a
        for a in args
    )
    with pytest.raises(PermissionError, match="trainlint --verify"):
        hook(event, args)


def test_the_harness_may_start_its_own_workers(hook) -> None:
    worker = [sys.executable, "-c", BOOT, CHILD, "--worker", "0", "2", "/tmp/dir"]
    hook("subprocess.Popen", (None, worker, None, None))
    with pytest.raises(PermissionError):  # the harness's command, but another package folder
        hook("subprocess.Popen", (None, [sys.executable, "-c", BOOT, "/tmp/evil", "--worker"], None, None))
