"""Issue 17, "done when": a user's repository whose .pre-commit-config.yaml points at this repository (a
path and a commit) runs both hooks, and they honour extend-exclude, per-file-ignores and ``# noqa``.

The hooks' repository is this working tree as it stands (tracked and new files, as a commit would hold
them), committed into a scratch repository: pre-commit installs a hook from a commit, and the test must
check the code under test, not the last commit. Building the hook's environment installs trainlint from
the package index, so the test is marked slow.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

REPORTED = "from torch.utils.checkpoint import checkpoint\n\ny = checkpoint(f, x)\n"  # TL201, unsafe fix
SILENCED = "from torch.utils.checkpoint import checkpoint\n\ny = checkpoint(f, x)  # noqa: TL201\n"
STACKED = textwrap.dedent(
    """\
    import torch

    losses = []
    for x, y in loader:
        loss = crit(model(x), y)
        loss.backward()
        losses.append(loss)
    epoch_loss = torch.stack(losses).mean().item()
    """
)  # TL302 with a safe fix
CONFIG = """\
[tool.trainlint]
extend-exclude = ["legacy"]
per-file-ignores = { "tests/*" = ["TL2"] }
"""


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _commit_all(repo: Path) -> str:
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "ci@example.invalid")
    _git(repo, "config", "user.name", "ci")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "snapshot")
    return _git(repo, "rev-parse", "HEAD").strip()


def _snapshot_of_this_repository(target: Path) -> str:
    """This working tree's files (what ``git add -A`` would commit) in a new repository; its commit."""
    names = _git(ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    for name in filter(None, names):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return _commit_all(target)


def _user_repository(repo: Path, hooks: Path, rev: str) -> None:
    files = {
        "pyproject.toml": CONFIG,
        "src/train.py": REPORTED,
        "src/quiet.py": SILENCED,
        "src/acc.py": STACKED,
        "tests/test_train.py": REPORTED,
        "legacy/old.py": REPORTED,
        "legacy/acc.py": STACKED,
        ".pre-commit-config.yaml": (
            f"repos:\n  - repo: {hooks}\n    rev: {rev}\n    hooks:\n"
            "      - id: trainlint-fix\n      - id: trainlint\n"
        ),
    }
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    _commit_all(repo)


@pytest.mark.slow
def test_both_hooks_from_a_path_and_commit_honour_the_configuration(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.fail("git is required for the pre-commit test")
    hooks = tmp_path / "trainlint"
    rev = _snapshot_of_this_repository(hooks)
    repo = tmp_path / "user-repo"
    _user_repository(repo, hooks, rev)
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PRE_COMMIT_HOME": str(tmp_path / "pre-commit"),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pre_commit", "run", "--all-files", "--verbose"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    # trainlint-fix applied the safe fix, and only outside the excluded folder
    assert "losses.append(loss.detach())" in (repo / "src" / "acc.py").read_text(), out
    assert (repo / "legacy" / "acc.py").read_text() == STACKED, out
    # what is left: the one finding no exclude, per-file ignore or noqa covers
    assert "src/train.py:3:5: TL201" in out, out
    for silenced in ("legacy/", "tests/test_train.py", "src/quiet.py"):
        assert silenced not in out.replace("- hook id", ""), silenced
