"""Containment of the runtime check: user code runs in a temporary folder with bounded memory, and the
user's own files are left alone."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from trainlint.engine import lint_source
from trainlint.verify import torch_available, verify_findings

pytestmark = pytest.mark.skipif(not torch_available(), reason="--verify needs torch")

SNIPPET = textwrap.dedent(
    """
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint


    def scribble(x):
        with open("escaped.txt", "w") as fh:
            fh.write("written by the user's code")
        return x * 2


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return checkpoint(scribble, self.fc(x))
    """
)


def test_user_code_writes_land_in_a_temporary_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    user_file = tmp_path / "train.py"
    user_file.write_text(SNIPPET)
    findings = lint_source(SNIPPET, "train.py", ["TL201"])
    assert len(findings) == 1
    (scribble,) = (
        f.verify for f in verify_findings(findings, {"train.py": SNIPPET}, device="cpu", timeout=20)
    )
    # the probe ran (its write succeeded somewhere), but not in the user's folder
    assert scribble["status"] in ("confirmed", "not-reproduced"), scribble
    assert not (tmp_path / "escaped.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]
    assert user_file.read_text() == SNIPPET


def test_probe_children_have_bounded_memory() -> None:
    """The limits the runner puts on each probe's child: a 64 GiB allocation fails inside it."""
    import subprocess
    import sys

    from trainlint.verify.runner import MEMORY_LIMIT, _limits

    assert MEMORY_LIMIT < 64 * 1024**3
    code = "try:\n    bytearray(64 * 1024**3)\nexcept MemoryError:\n    print('bounded')\n"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=_limits(30, "cpu"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip() == "bounded"
