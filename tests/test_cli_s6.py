"""Session 6 command-line leftovers: ``trainlint memory`` and ``trainlint run`` keep their exit code when
the reader of their output goes away, as the lint command does; ``--diff`` exits 2 on a fatal problem;
a notebook whose JSON nests too deep for the parser is TL902, not an internal error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import closed_pipe_run

from trainlint.cli import run
from trainlint.rule import registry

COMMAND = [sys.executable, "-m", "trainlint"]
BAD = "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x)\n"


@pytest.mark.slow  # (each imports torch in a fresh process)
@pytest.mark.parametrize(
    ("args", "stderr_too", "code"),
    [
        # the script fails: exit 1, whether or not anybody reads the report (before: 0)
        (["run", "--no-lint", "--", "python", "fail.py"], False, 1),
        (["run", "--no-lint", "--", "python", "fail.py"], True, 1),
        # a usage error nobody reads (`2>&1 | true`) is still exit 2 (before: 0)
        (["run", "--steps", "0", "--", "python", "fail.py"], True, 2),
        (["memory", "--no-such-option"], True, 2),
    ],
)
def test_subcommands_keep_their_exit_code_when_the_reader_goes_away(
    tmp_path: Path, args: list[str], stderr_too: bool, code: int
) -> None:
    (tmp_path / "fail.py").write_text("raise ValueError('planted')\n")
    proc = closed_pipe_run([*COMMAND, *args], tmp_path, stderr_too)
    assert proc.returncode == code, proc.stderr
    assert b"Traceback" not in (proc.stderr or b"") and b"Exception ignored" not in (proc.stderr or b"")


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / ".git").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("fixable", [True, False])
def test_diff_exits_2_on_a_fatal_problem(
    repo: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fixable: bool
) -> None:
    (repo / "crash.py").write_text(BAD)
    if fixable:
        (repo / "train.py").write_text(BAD)
    rule = registry().get("TL201")
    assert rule is not None
    real_check = rule.check

    def check(self, model):
        if model.path.endswith("crash.py"):
            raise ZeroDivisionError("planted bug")
        return real_check(self, model)

    monkeypatch.setattr(rule, "check", check)
    code = run(["--no-cache", "--jobs", "1", "--diff", "--unsafe-fixes", "."])
    out, err = capsys.readouterr()
    assert "internal error in TL201" in err
    assert ("+++ b/train.py" in out) is fixable  # the diff of the other file is still shown
    assert code == 2  # before: 1 with a diff, 0 without


def test_a_notebook_nested_beyond_the_parser_is_tl902(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (repo / "deep.ipynb").write_text('{"cells": ' + "[" * 100_000 + "]" * 100_000 + "}")
    (repo / "ok.ipynb").write_text(json.dumps({"cells": [{"cell_type": "code", "source": BAD}]}))
    code = run(["--format", "json", "--no-cache", "--jobs", "1", "."])
    data = json.loads(capsys.readouterr().out)
    assert data["errors"] == []  # before: "internal error: RecursionError"
    found = {(f["path"], f["rule"]) for f in data["findings"]}
    assert found == {("deep.ipynb", "TL902"), ("ok.ipynb", "TL201")}
    deep = next(f for f in data["findings"] if f["path"] == "deep.ipynb")
    assert "nests too deep" in deep["message"]
    assert code == 1


def test_fixing_stdin_exits_2_on_a_fatal_problem(
    repo: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rule = registry().get("TL203")
    assert rule is not None

    def check(self, model):
        raise ZeroDivisionError("planted bug")

    monkeypatch.setattr(rule, "check", check)
    code = run(["--no-cache", "--fix", "--unsafe-fixes", "--stdin-filename", "train.py", "-"], stdin=BAD)
    out, err = capsys.readouterr()
    assert "internal error in TL203" in err
    assert "use_reentrant=False" in out  # TL201's fix still applied
    assert code == 2  # before: 0 (every finding fixed)
