"""The pre-commit hook as a user wires it: `pre-commit try-repo` against this repository.

Building the hook's environment installs trainlint and its dependencies from the package index, so
this test is marked slow; it is not skipped in CI.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BAD = "from torch.utils.checkpoint import checkpoint\n\ny = checkpoint(f, x)\n"
GOOD = "import torch\n\nx = torch.ones(2)\n"


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def _try_repo(repo: Path, home: Path, *files: str) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "PRE_COMMIT_HOME": str(home / "pre-commit"),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pre_commit",
            "try-repo",
            str(ROOT),
            "trainlint",
            "--verbose",
            "--files",
            *files,
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


@pytest.mark.slow
def test_pre_commit_hook_fails_on_bad_file_and_passes_on_clean(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.fail("git is required for the pre-commit test")
    repo = tmp_path / "user-repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "ci@example.invalid")
    _git(repo, "config", "user.name", "ci")
    (repo / "bad.py").write_text(BAD)
    (repo / "good.py").write_text(GOOD)
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "init")

    bad = _try_repo(repo, tmp_path, "bad.py")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "TL201" in bad.stdout

    good = _try_repo(repo, tmp_path, "good.py")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "Passed" in good.stdout
