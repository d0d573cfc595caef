"""Injection through what trainlint prints: a crafted file name and a crafted string in the flagged
code must not reach a terminal or a CI log as control characters or as a line GitHub Actions reads
as a workflow command (``::error``, ``::set-output``, ``::stop-commands::``)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from urllib.parse import unquote

import pytest

from trainlint.cli import main

BAD = "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x)\n"
CRAFTED_STRING = textwrap.dedent(
    '''\
    import torch
    from torch.utils.checkpoint import checkpoint
    def f(x):
        stats["""
    ::stop-commands::pwned
    \x1b[2J\x9b31m"""].append(x)
        return x * 2
    y = checkpoint(f, x, use_reentrant=False)
    '''
)
CRAFTED_NAME = "evil\n::error file=x::pwned\x1b[31m\x9b2J\u202e.py"
FORMATS = ["text", "github", "json", "sarif"]


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text("[tool.trainlint]\n")
    return tmp_path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["--no-cache", "--jobs", "1", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_inert(output: str, legit: tuple[str, ...] = ()) -> None:
    """No raw control character but the line breaks, and no workflow command but the reporter's own."""
    assert not [c for c in output if c not in "\n" and (ord(c) < 32 or 0x7F <= ord(c) <= 0x9F)]
    assert "\u202e" not in output
    for line in output.splitlines():
        if line.lstrip().startswith("::"):
            assert line.startswith(legit), line


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_crafted_string_in_the_code_is_not_printed_raw(repo, capsys, fmt) -> None:
    (repo / "train.py").write_text(CRAFTED_STRING)
    code, out, err = run(capsys, "--format", fmt, "train.py")
    assert code == 1
    assert_inert(out, ("::warning file=train.py,", "::error file=train.py,", "::notice file=train.py,"))
    assert_inert(err)
    assert "::stop-commands::pwned" not in out


def test_a_message_quotes_at_most_one_line_of_code(repo, capsys) -> None:
    (repo / "train.py").write_text(CRAFTED_STRING)
    _, out, _ = run(capsys, "--format", "json", "train.py")
    messages = [f["message"] for f in json.loads(out)["findings"]]
    assert messages and all("\n" not in m and "pwned" not in m for m in messages)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_crafted_file_name_is_escaped(repo, capsys, fmt) -> None:
    (repo / CRAFTED_NAME).write_text(BAD)
    code, out, err = run(capsys, "--format", fmt, ".")
    assert code == 1
    assert_inert(out, ("::warning file=evil",))
    assert_inert(err)
    if fmt == "json":  # JSON escapes but keeps the data: a tool can still open the file
        assert [f["path"] for f in json.loads(out)["findings"]] == [CRAFTED_NAME]
    if fmt == "sarif":
        location = json.loads(out)["runs"][0]["results"][0]["locations"][0]["physicalLocation"]
        uri = location["artifactLocation"]["uri"]
        assert unquote(uri) == CRAFTED_NAME
        assert all(c.isascii() and c.isprintable() for c in uri)


def test_a_crafted_name_on_stderr_is_escaped(repo, capsys) -> None:
    loop = repo / "loop\n::error::pwned\x1b[2J.py"
    loop.symlink_to(loop.name)  # a link to itself: reported on stderr with its name
    _, out, err = run(capsys, ".")
    assert "the symbolic link loops" in err
    assert_inert(err)
    assert_inert(out)
