"""The command line's seams: the ``memory`` and ``run`` subcommands, the reporter table, and problems
whose kind (not their wording) decides the exit code and the cache."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest

import trainlint.cli as cli
import trainlint.engine
import trainlint.report
from trainlint.cache import ResultCache
from trainlint.results import FileResult, LintOptions, Problem, ProblemKind

# One TL201 finding: a checkpoint call without use_reentrant=.
CHECKPOINT = """\
import torch
from torch.utils.checkpoint import checkpoint
y = checkpoint(f, x)
"""


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _fake_command(monkeypatch: pytest.MonkeyPatch, name: str) -> list[list[str]]:
    """Install a stand-in ``trainlint.<name>.cli`` whose ``main`` records its argv and returns 7."""
    calls: list[list[str]] = []

    def main(argv: list[str]) -> int:
        calls.append(list(argv))
        return 7

    module = types.ModuleType(f"trainlint.{name}.cli")
    module.main = main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, f"trainlint.{name}.cli", module)
    return calls


@pytest.mark.parametrize("name", ["memory", "run"])
def test_a_first_argument_naming_a_command_runs_it(name, tree, monkeypatch, capsys) -> None:
    (tree / name).mkdir()  # a folder of the same name does not turn the command into a path
    (tree / name / "a.py").write_text(CHECKPOINT, encoding="utf-8")
    calls = _fake_command(monkeypatch, name)
    assert cli.main([name, "--flag", "value", "x.py"]) == 7
    assert calls == [["--flag", "value", "x.py"]]
    assert capsys.readouterr().out == ""  # nothing was linted


@pytest.mark.parametrize("name", ["memory", "run"])
def test_a_folder_named_like_a_command_is_linted_when_written_as_a_path(name, tree, monkeypatch, capsys):
    (tree / name).mkdir()
    (tree / name / "a.py").write_text(CHECKPOINT, encoding="utf-8")
    calls = _fake_command(monkeypatch, name)
    for argv in ([f"./{name}"], ["--no-cache", name], [".", name]):
        code = cli.run(["--format", "json", "--no-cache", *argv])
        data = json.loads(capsys.readouterr().out)
        assert code == 1, argv
        assert {(f["path"], f["rule"]) for f in data["findings"]} == {(f"{name}/a.py", "TL201")}, argv
    assert calls == []


def test_a_missing_command_module_is_one_line_and_exit_2(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "trainlint.memory.cli", None)  # makes the import fail
    assert cli.main(["memory", "--help"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "memory" in err and "not available" in err


def test_a_command_missing_a_dependency_names_it(monkeypatch, capsys) -> None:
    def import_module(name: str, package: str | None = None) -> types.ModuleType:
        raise ModuleNotFoundError("No module named 'torchvision'", name="torchvision")

    monkeypatch.setattr("importlib.import_module", import_module)
    assert cli.main(["run", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'torchvision'" in err and "Traceback" not in err


def test_help_tells_how_to_lint_a_folder_named_like_a_command(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.run(["--help"])
    out = capsys.readouterr().out
    assert "./run" in out and "./memory" in out


def test_a_reporter_added_to_the_table_is_a_format(tree, monkeypatch, capsys) -> None:
    (tree / "a.py").write_text(CHECKPOINT, encoding="utf-8")
    seen: list[tuple[str, ...]] = []

    def rules_only(report: trainlint.report.RunReport, options: trainlint.report.OutputOptions) -> None:
        seen.append(tuple(f.rule for f in report.findings))

    monkeypatch.setitem(trainlint.report.REPORTERS, "rules-only", rules_only)
    assert cli.run(["--no-cache", "--format", "rules-only", "a.py"]) == 1
    assert seen == [("TL201",)]


# -- problems: their kind, never their wording, decides ---------------------------------------------


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_a_skipped_path_whose_name_says_internal_error_is_not_a_failure(tree, capsys) -> None:
    (tree / "internal error.py").symlink_to("internal error.py")  # a link that loops
    code = cli.run(["--format", "json", "--no-cache", "."])
    data = json.loads(capsys.readouterr().out)
    assert data["errors"] == [{"path": "", "message": "internal error.py: the symbolic link loops; skipped"}]
    assert code == 0


def test_an_internal_problem_gives_exit_2_and_is_not_cached_whatever_its_words(
    tree, monkeypatch, capsys
) -> None:
    (tree / "a.py").write_text(CHECKPOINT, encoding="utf-8")

    def failing(text: str, path: str, options: LintOptions) -> FileResult:
        return FileResult(path, errors=[Problem(ProblemKind.INTERNAL, path, "the parser gave up")])

    monkeypatch.setattr(trainlint.engine, "lint_text", failing)
    cache = tree / "cache"
    for _ in range(2):
        assert cli.run(["--format", "json", "--jobs", "1", "--cache-dir", str(cache), "a.py"]) == 2
        assert json.loads(capsys.readouterr().out)["errors"] == [
            {"path": "a.py", "message": "the parser gave up"}
        ]
    assert {p.name for p in cache.rglob("*.json")} <= {"rule-ids.json"}  # no entry for a.py


def test_a_cached_problem_keeps_its_kind(tmp_path: Path) -> None:
    path = tmp_path / "a.py"
    path.write_text(CHECKPOINT, encoding="utf-8")
    job = (str(path), "a.py", LintOptions(("TL201",)))
    problem = Problem(ProblemKind.UNANALYSABLE, "a.py", "file model: nested too deeply to analyse")
    cache = ResultCache(tmp_path / "c")
    cache.store(job, CHECKPOINT, FileResult("a.py", errors=[problem], parsed=True))
    hit = cache.get(job)
    assert hit is not None and hit[0].errors == [problem]
