"""``python -m trainlint.memory.cli`` ends as ``trainlint memory`` does when the reader of its output
goes away: the usage error's exit code, no traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import closed_pipe_run


@pytest.mark.slow  # (imports torch in a fresh process)
@pytest.mark.parametrize("stderr_closed", [True, False])
def test_memory_module_keeps_its_exit_code_when_the_reader_goes_away(
    tmp_path: Path, stderr_closed: bool
) -> None:
    pytest.importorskip("torch")
    command = [sys.executable, "-m", "trainlint.memory.cli", "--no-such-option"]
    proc = closed_pipe_run(command, tmp_path, stderr_closed)
    assert proc.returncode == 2, proc.stderr
    assert b"Traceback" not in (proc.stderr or b"") and b"Exception ignored" not in (proc.stderr or b"")
