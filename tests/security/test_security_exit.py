"""Exit codes and process hygiene under attack or in a pipeline: a reader that stops reading, SIGTERM
from CI's ``timeout``, configuration above the repository, and configuration files built to break the
parser."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainlint.cli import main

BAD = "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x)\n"
COMMAND = [sys.executable, "-m", "trainlint", "--no-cache"]
# TL102 (``optimizer.step()`` beside a GradScaler): a finding that ``--fix`` leaves in place
SCALED_LOOP = """import torch
scaler = torch.cuda.amp.GradScaler()
for batch in loader:
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    optimizer.step()
"""


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "repo"
    (root / ".git").mkdir(parents=True)
    (root / "train.py").write_text(BAD)
    monkeypatch.chdir(root)
    return root


@pytest.mark.parametrize("fmt", ["json", "github", "text"])
def test_a_broken_pipe_keeps_the_exit_code_of_the_findings(repo, fmt) -> None:
    calls = "".join(f"y{i} = checkpoint(f, x)\n" for i in range(3000))
    (repo / "train.py").write_text("from torch.utils.checkpoint import checkpoint\n" + calls)
    proc = subprocess.Popen(
        [*COMMAND, "--format", fmt, "."], cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline()  # `trainlint . | head -1`
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 1, err
    assert b"Traceback" not in err and b"Exception ignored" not in err


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["--diff", "--unsafe-fixes", "."], 1),  # `trainlint --diff . | head -1`
        (["--fix", "--unsafe-fixes", "--stdin-filename", "train.py", "-"], 1),  # what is left unfixed
        (["--select", "TL9999", "."], 2),  # a usage error on stderr, `2>&1 | head`
        ([".", "missing.py"], 2),  # a fatal problem on stderr before the findings
    ],
)
def test_a_reader_gone_before_any_output_keeps_the_exit_code(repo, args, code) -> None:
    """Stdout and stderr are a pipe nobody reads (`trainlint ... 2>&1 | true`): the first write of any
    output fails, whatever the pipe's size or the timing."""
    stdin = BAD + SCALED_LOOP
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([*COMMAND, *args], cwd=repo, stdout=write, stderr=write, input=stdin.encode())
    finally:
        os.close(write)
    read_normally = subprocess.run([*COMMAND, *args], cwd=repo, capture_output=True, input=stdin.encode())
    assert read_normally.returncode == code, read_normally.stderr
    assert proc.returncode == code


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])  # CI's `timeout`, then `timeout -s KILL`
def test_a_killed_run_leaves_no_worker_behind(repo, sig) -> None:
    body = "".join(f"def f{i}(block, x):\n    return checkpoint(block, x) * {i}\n" for i in range(1500))
    for i in range(6):  # big enough for worker processes, slow enough to be caught linting
        (repo / f"m{i}.py").write_text("from torch.utils.checkpoint import checkpoint\n" + body)
    proc = subprocess.Popen(
        [*COMMAND, "-j2", "."], cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 and proc.poll() is None and time.monotonic() < deadline:
            workers = _children(proc.pid)
            time.sleep(0.05)
        assert len(workers) >= 2, "the run never started its workers"
        proc.send_signal(sig)
        proc.wait(timeout=120)
        deadline = time.monotonic() + 60
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [w for w in workers if _alive(w)]
        assert proc.returncode in (-sig, 128 + sig)
    finally:
        for pid in [proc.pid, *workers]:  # only what this test started
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.wait()


def test_the_configuration_search_stops_at_the_repository_root(repo, capsys) -> None:
    (repo.parent / "pyproject.toml").write_text('[tool.trainlint]\nselect = ["TL9"]\n')  # hides TL201
    assert main(["--no-cache", "."]) == 1
    assert "TL201" in capsys.readouterr().out


def test_a_toml_nested_thousands_deep_is_a_config_error(repo, capsys) -> None:
    (repo / "pyproject.toml").write_text("[tool.trainlint]\nselect = " + "[" * 3000 + "]" * 3000 + "\n")
    assert main(["--no-cache", "."]) == 2
    err = capsys.readouterr().err
    assert "cannot parse TOML" in err and "internal error" not in err


def test_a_huge_configuration_file_is_refused_before_parsing(repo, capsys) -> None:
    padding = "# " + "x" * 1000 + "\n"
    (repo / "pyproject.toml").write_text("[tool.trainlint]\n" + padding * 3000)
    assert main(["--no-cache", "."]) == 2
    assert "pyproject.toml: cannot read: too large (over 1048576 bytes)" in capsys.readouterr().err
