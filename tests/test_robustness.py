"""Hostile input never crashes a run and never hides the findings of other files.

Each test lints a small tree through the real command line (``trainlint.cli.run``, or a child
``python -m trainlint`` where a crash would take the test process down) and checks what is reported
for the odd file and that the ordinary files are still reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import trainlint.cli
import trainlint.files
from trainlint.cli import run
from trainlint.engine import LintOptions, lint_text
from trainlint.files import MAX_BRACKET_DEPTH, MAX_SOURCE_BYTES, read_source, scan_nesting
from trainlint.rule import registry

ROOT = Path(__file__).resolve().parent.parent

# One TL201 finding (checkpoint without use_reentrant=) and one TL109 finding (fp16 autocast, no scaler).
GOOD = """\
import torch
from torch.utils.checkpoint import checkpoint
y = checkpoint(f, x)
with torch.autocast("cuda", dtype=torch.float16):
    loss = model(x)
loss.backward()
"""
TL201_AT = (3, 5)  # `checkpoint(` on line 3, after `y = `
TL109_AT = (6, 1)


def lint(capsys, *argv: str) -> tuple[int, dict, str]:
    code = run(["--format", "json", "--no-cache", "--jobs", "1", *argv])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def found(data: dict) -> dict[str, list[tuple[str, int, int]]]:
    out: dict[str, list[tuple[str, int, int]]] = {}
    for f in data["findings"]:
        out.setdefault(f["path"], []).append((f["rule"], f["line"], f["column"]))
    return out


def messages(data: dict, path: str) -> list[str]:
    return [f["message"] for f in data["findings"] if f["path"] == path]


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "good.py").write_text(GOOD, encoding="utf-8")
    return tmp_path


def assert_good_reported(data: dict) -> None:
    assert sorted(found(data)["good.py"]) == sorted([("TL201", *TL201_AT), ("TL109", *TL109_AT)])


# --- syntax errors --------------------------------------------------------------------------------


SYNTAX = {
    # name: (source, expected line, expected column, words in the message)
    "python2.py": ('print "hello"\n', 1, 1, "print("),
    "merge.py": (
        "x = 1\n<<<<<<< HEAD\ny = 2\n=======\ny = 3\n>>>>>>> feature\n",
        2,
        1,
        "merge-conflict marker",
    ),
    "unterminated.py": ('x = 1\ns = "abc\ny = 2\n', 2, 5, "unterminated string"),
    "unterminated3.py": ('x = 1\ns = """abc\ny = 2\n', 2, 5, "unterminated triple-quoted"),
    "unclosed.py": ("x = 1\ny = foo(1,\n", 2, 8, "never closed"),
    "badindent.py": ("def f():\n    x = 1\n      y = 2\n", 3, None, "indent"),  # column: CPython's
}


def test_syntax_errors_are_tl901_at_the_right_place_and_other_files_still_report(tree, capsys) -> None:
    for name, (source, *_rest) in SYNTAX.items():
        (tree / name).write_text(source, encoding="utf-8")
    code, data, err = lint(capsys, ".")
    assert code == 1
    assert data["errors"] == [] and "Traceback" not in err
    assert_good_reported(data)
    for name, (_, line, column, words) in SYNTAX.items():
        ((rule, at_line, at_column),) = found(data)[name]
        assert (rule, at_line, at_column if column else None) == ("TL901", line, column), name
        assert words in messages(data, name)[0], messages(data, name)


def test_the_parse_error_message_is_one_sentence(tree, capsys) -> None:
    (tree / "python2.py").write_text('print "hello"\n', encoding="utf-8")
    _, data, _ = lint(capsys, "python2.py")
    (message,) = messages(data, "python2.py")
    assert message.startswith("Cannot parse this file: ")
    assert not message.endswith("?.") and not message.endswith("..")


# --- encodings and binary content --------------------------------------------------------------------


def test_declared_latin1_encoding_is_decoded_and_linted(tree, capsys) -> None:
    source = "# -*- coding: latin-1 -*-\n# caf\xe9\n" + GOOD
    (tree / "latin.py").write_bytes(source.encode("latin-1"))
    code, data, _ = lint(capsys, "latin.py")
    assert code == 1
    assert found(data)["latin.py"] == [("TL201", TL201_AT[0] + 2, TL201_AT[1]), ("TL109", TL109_AT[0] + 2, 1)]


def test_a_bom_does_not_shift_columns(tree, capsys) -> None:
    (tree / "bom.py").write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    _, data, _ = lint(capsys, "bom.py")
    assert ("TL201", *TL201_AT) in found(data)["bom.py"]


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b's = "caf\xe9"\n', "cannot decode"),  # latin-1 bytes, no declaration
        (b"# -*- coding: no-such-codec -*-\nx = 1\n", "unknown encoding"),
        (b"# coding: ascii\ns = '\xc3\xa9'\n", "cannot decode"),
        (b"x = 1\x00\ny = 2\n", "NUL"),
        (bytes(range(256)) * 4, "NUL"),  # a binary file named .py
    ],
    ids=["undeclared-latin1", "unknown-codec", "wrong-codec", "nul-byte", "binary"],
)
def test_undecodable_files_are_tl902_and_others_still_report(tree, capsys, content, words) -> None:
    (tree / "odd.py").write_bytes(content)
    code, data, err = lint(capsys, ".")
    assert code == 1 and "Traceback" not in err
    assert found(data)["odd.py"] == [("TL902", 1, 1)]
    assert words in messages(data, "odd.py")[0]
    assert_good_reported(data)


@pytest.mark.parametrize("content", ["", "\n\n", "# only a comment\n", "   ", "\ufeff"])
def test_empty_files_are_clean(tree, capsys, content) -> None:
    (tree / "good.py").unlink()
    (tree / "empty.py").write_text(content, encoding="utf-8")
    code, data, _ = lint(capsys, ".")
    assert (code, data["findings"], data["errors"], data["summary"]["files"]) == (0, [], [], 1)


# --- size and nesting ----------------------------------------------------------------------------------


def test_a_5mb_generated_file_is_reported_not_parsed(tree, capsys) -> None:
    block = "def f{i}(x):\n    y = torch.zeros({i}).half()\n    return checkpoint(f, y)\n\n"
    text = "import torch\nfrom torch.utils.checkpoint import checkpoint\n"
    text += "".join(block.format(i=i) for i in range(5_000_000 // len(block) + 1))
    assert len(text) > 5_000_000
    (tree / "generated.py").write_text(text, encoding="utf-8")
    code, data, _ = lint(capsys, ".")
    assert code == 1
    assert found(data)["generated.py"] == [("TL902", 1, 1)]
    assert "over the 2.0 MiB limit" in messages(data, "generated.py")[0]
    assert_good_reported(data)


def test_the_size_limit_applies_to_text_given_directly() -> None:
    text = "x = 1\n" * (MAX_SOURCE_BYTES // 6 + 1)
    result = lint_text(text, "big.py", LintOptions(tuple(registry().ids())))
    assert [f.rule for f in result.findings] == ["TL902"]


def test_read_source_checks_size_before_reading(tmp_path) -> None:
    path = tmp_path / "x.py"
    path.write_text("x = 1\n" * 10, encoding="utf-8")
    assert read_source(path).text == "x = 1\n" * 10
    small = read_source(path, max_bytes=20)
    assert small.text is None and "60 B" not in small.error and "limit" in small.error


def _deep_files() -> dict[str, tuple[str, str | None]]:
    """name -> (source, expected TL901 message words, or None when the file must lint normally)."""
    n = 20_000
    nested_ifs = "".join("    " * i + "if x:\n" for i in range(120)) + "    " * 120 + "pass\n"
    return {
        "brackets.py": ("x = " + "(" * 5000 + "1" + ")" * 5000 + "\n", "levels of brackets"),
        "lists.py": (
            "x = " + "[" * (MAX_BRACKET_DEPTH + 1) + "]" * (MAX_BRACKET_DEPTH + 1) + "\n",
            "brackets",
        ),
        "nots.py": ("x = " + "not " * n + "y\n", "nested too deeply"),
        "negs.py": ("x = " + "-" * n + "1\n", "nested too deeply"),
        "lambdas.py": ("f = " + "lambda: " * n + "0\n", "nested too deeply"),
        "sum.py": ("x = " + " + ".join(["a"] * n) + "\n", "nested too deeply"),
        "attrs.py": ("x = a" + ".b" * n + "\n", "nested too deeply"),
        "calls.py": ("x = f" + "()" * n + "\n", "nested too deeply"),
        "ternary.py": ("x = " + "a if b else " * n + "c\n", "nested too deeply"),
        "elifs.py": ("if a:\n    pass\n" + "elif a:\n    pass\n" * 5000, "nested too deeply"),
        "indent.py": (nested_ifs, "indentation"),
        # Deep for libcst and the visitors, but well within what Python accepts: linted normally.
        "long_sum.py": (GOOD + "total = " + " + ".join(["a"] * 600) + "\n", None),
        "many_elifs.py": (GOOD + "if a:\n    pass\n" + "elif a:\n    pass\n" * 500, None),
        "strings.py": (GOOD + "s = (\n" + '    "abc"\n' * 1500 + ")\n", None),
        "ands.py": (GOOD + "ok = " + " and ".join(["a"] * 800) + "\n", None),
        "parens.py": (GOOD + "x = " + "(" * 190 + "1" + ")" * 190 + "\n", None),
        "table.py": (GOOD + "T = [\n" + "    -1.5e-3, -2, a.b.c, (1, 2),\n" * 1000 + "]\n", None),
    }


def test_deep_nesting_is_tl901_never_a_crash(tmp_path) -> None:
    """In a child process: a parser stack overflow would kill it, and this test would see that."""
    files = _deep_files()
    for name, (source, _) in files.items():
        (tmp_path / name).write_text(source, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "trainlint", "--format", "json", "--no-cache", "--jobs", "2", "."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    data = json.loads(proc.stdout)
    assert data["errors"] == []
    by_path = found(data)
    for name, (_, words) in files.items():
        if words is None:
            assert sorted(by_path[name]) == sorted([("TL201", *TL201_AT), ("TL109", *TL109_AT)]), name
        else:
            assert [r for r, _, _ in by_path[name]] == ["TL901"], name
            assert words in messages(data, name)[0], (name, messages(data, name))


@pytest.mark.parametrize(
    ("source", "brackets", "bound"),
    [
        ("x = f(a[(1)])\n", 3, 3),  # f( [ ( : each bracket is one level
        ("s = '((((' + \"]]]\"  # ((((\n", 0, 1),  # brackets in strings and comments do not count
        ("x = a + b + c\ny = d\n", 0, 2),  # each logical line starts again
        ("x = [-1, -2, -3, -4, -5]\n", 1, 2),  # commas start each element again
        ("x = (a +\n     b +\n     c)\n", 1, 3),  # one logical line across physical lines
        ('x = ("a"\n     "b"  # c\n     "c")\n', 1, 3),  # implicit concatenation nests in libcst
        ("if a:\n    pass\nelif b:\n    pass\nelif c:\n    pass\n", 0, 2),
        ("if a:\n    pass\nelif b:\n    pass\nx = 1\nif c:\n    pass\nelif d:\n    pass\n", 0, 1),
    ],
)
def test_scan_nesting_counts(source: str, brackets: int, bound: int) -> None:
    nesting = scan_nesting(source)
    assert (nesting.brackets, nesting.bound) == (brackets, bound)


# --- links, permissions, missing and vanishing files ---------------------------------------------------


def test_symlink_loops_and_dangling_links(tree, capsys) -> None:
    os.symlink("b.py", tree / "a.py")  # a.py -> b.py -> a.py
    os.symlink("a.py", tree / "b.py")
    os.symlink("nowhere.py", tree / "dangling.py")
    (tree / "pkg").mkdir()
    (tree / "pkg" / "mod.py").write_text(GOOD, encoding="utf-8")
    os.symlink("..", tree / "pkg" / "up")  # a folder loop
    os.symlink(".", tree / "pkg" / "self")
    code, data, err = lint(capsys, ".")
    assert code == 1 and "Traceback" not in err
    broken = [f for f in data["findings"] if "broken symbolic link" in f["message"]]
    assert [(f["rule"], f["line"], f["column"]) for f in broken] == [("TL902", 1, 1)]
    assert_good_reported(data)
    assert len(found(data)["pkg/mod.py"]) == 2  # reported once, not once per path through a link
    assert {e["message"] for e in data["errors"]} == {
        "a.py: the symbolic link loops; skipped",
        "b.py: the symbolic link loops; skipped",
    }
    assert data["summary"]["files"] == 3


def test_a_dangling_link_is_reported_under_its_own_name(tree, capsys) -> None:
    os.symlink("nowhere.py", tree / "dangling.py")
    _, data, _ = lint(capsys, ".")
    assert found(data)["dangling.py"] == [("TL902", 1, 1)]


def test_a_looping_link_given_explicitly(tree, capsys) -> None:
    os.symlink("loop.py", tree / "loop.py")
    code, data, err = lint(capsys, "loop.py", "good.py")
    assert code == 1 and "Traceback" not in err
    assert [e["message"] for e in data["errors"]] == ["loop.py: the symbolic link loops; skipped"]
    assert_good_reported(data)


def _deny(monkeypatch: pytest.MonkeyPatch, name: str, target: str) -> None:
    """Make ``os.<name>`` raise PermissionError for one path (works when the tests run as root)."""
    real = getattr(os, name)

    def denied(path, *args, **kwargs):
        if os.fspath(path).rstrip("/").endswith(target):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, name, denied)


def test_an_unreadable_file_is_tl902(tree, capsys, monkeypatch) -> None:
    (tree / "secret.py").write_text(GOOD, encoding="utf-8")
    _deny(monkeypatch, "open", "secret.py")
    code, data, err = lint(capsys, ".")
    assert code == 1 and "Traceback" not in err
    assert found(data)["secret.py"] == [("TL902", 1, 1)]
    assert messages(data, "secret.py") == ["Cannot lint this file: cannot read: permission denied."]
    assert_good_reported(data)


def test_an_unlistable_folder_is_tl902(tree, capsys, monkeypatch) -> None:
    (tree / "private").mkdir()
    (tree / "private" / "hidden.py").write_text(GOOD, encoding="utf-8")
    _deny(monkeypatch, "scandir", "private")
    code, data, err = lint(capsys, ".")
    assert code == 1 and "Traceback" not in err
    assert found(data)["private"] == [("TL902", 1, 1)]
    assert "cannot list this folder: permission denied" in messages(data, "private")[0]
    assert "private/hidden.py" not in found(data)
    assert_good_reported(data)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads files whatever their mode")
def test_real_permissions(tree, capsys) -> None:
    (tree / "secret.py").write_text(GOOD, encoding="utf-8")
    (tree / "private").mkdir()
    (tree / "private" / "hidden.py").write_text(GOOD, encoding="utf-8")
    (tree / "secret.py").chmod(0)
    (tree / "private").chmod(0)
    try:
        code, data, err = lint(capsys, ".")
    finally:
        (tree / "secret.py").chmod(0o644)
        (tree / "private").chmod(0o755)
    assert code == 1 and "Traceback" not in err
    assert found(data)["secret.py"] == [("TL902", 1, 1)]
    assert found(data)["private"] == [("TL902", 1, 1)]
    assert_good_reported(data)


def test_a_missing_path_is_exit_2_with_one_clear_line(tree, capsys) -> None:
    code = run(["--no-cache", "good.py", "no_such_dir/x.py"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == ["trainlint: error: no_such_dir/x.py: no such file or folder"]


def test_a_file_that_vanishes_during_the_run_is_tl902(tree, capsys, monkeypatch) -> None:
    (tree / "temp.py").write_text(GOOD, encoding="utf-8")
    real = trainlint.cli.discover

    def discover_then_delete(*args, **kwargs):
        paths = list(real(*args, **kwargs))
        (tree / "temp.py").unlink()  # e.g. an editor's temporary file, or a concurrent `git checkout`
        return iter(paths)

    monkeypatch.setattr(trainlint.cli, "discover", discover_then_delete)
    code, data, err = lint(capsys, ".")
    assert code == 1 and "Traceback" not in err
    assert found(data)["temp.py"] == [("TL902", 1, 1)]
    assert "no longer exists" in messages(data, "temp.py")[0]
    assert_good_reported(data)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_named_pipe_is_skipped_not_read(tmp_path) -> None:
    """Reading a FIFO blocks until someone writes: discovery must not hand one to the reader."""
    (tmp_path / "good.py").write_text(GOOD, encoding="utf-8")
    os.mkfifo(tmp_path / "pipe.py")
    proc = subprocess.run(
        [sys.executable, "-m", "trainlint", "--format", "json", "."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    data = json.loads(proc.stdout)
    assert proc.returncode == 1
    assert set(found(data)) == {"good.py"}
    assert data["summary"]["files"] == 1


def test_notebooks_are_linted_like_the_same_code_in_a_file(tree, capsys) -> None:
    cell = {"cell_type": "code", "source": GOOD.splitlines(keepends=True), "metadata": {}, "outputs": []}
    (tree / "nb.ipynb").write_text(json.dumps({"cells": [cell], "nbformat": 4}), encoding="utf-8")
    _, data, _ = lint(capsys, ".")
    assert data["summary"]["files"] == 2 and set(found(data)) == {"good.py", "nb.ipynb"}
    _, data, _ = lint(capsys, "nb.ipynb", "good.py")
    assert found(data)["nb.ipynb"] == found(data)["good.py"]  # one cell: its lines are the file's
    assert data["errors"] == []


def test_stdin_with_hostile_text_does_not_crash(capsys) -> None:
    cases = [
        ("x = " + "(" * 3000 + ")" * 3000, "TL901"),
        ("x = 1\x00\n", "TL902"),  # NUL bytes: binary content, as for a file
        ("print 'x'\n", "TL901"),
        ("s = '\udcff'\n", "TL902"),  # undecodable stdin bytes arrive as lone surrogates
    ]
    for text, rule in cases:
        code = run(["--format", "json", "-", "--stdin-filename", "s.py"], stdin=text)
        captured = capsys.readouterr()
        data = json.loads(captured.out)
        assert code == 1 and "Traceback" not in captured.err
        assert [f["rule"] for f in data["findings"]] == [rule], text[:20]


# --- a rule that crashes ---------------------------------------------------------------------------------


def test_a_rule_crashing_on_one_file_is_an_error_entry_and_everything_else_reports(
    tree, capsys, monkeypatch
) -> None:
    (tree / "other.py").write_text(GOOD, encoding="utf-8")
    rule = registry().get("TL201")
    real_check = rule.check

    def check(self, model):
        if model.path.endswith("good.py"):
            raise ZeroDivisionError("planted bug")
        return real_check(self, model)

    monkeypatch.setattr(rule, "check", check)
    code, data, err = lint(capsys, ".")
    assert code == 2  # the tool's own failure
    assert data["errors"] == [
        {
            "path": "good.py",
            "rule": "TL201",
            "message": "internal error in TL201: ZeroDivisionError: planted bug",
        }
    ]
    assert found(data)["good.py"] == [("TL109", *TL109_AT)]  # the file's other rules still report
    assert sorted(found(data)["other.py"]) == [("TL109", *TL109_AT), ("TL201", *TL201_AT)]
    assert "internal error in TL201" in err and "Traceback" not in err


def test_findings_alone_never_give_exit_2(tree, capsys) -> None:
    (tree / "broken.py").write_text("def f(:\n", encoding="utf-8")
    (tree / "binary.py").write_bytes(b"\x00\x01")
    code, data, _ = lint(capsys, ".")
    assert code == 1
    assert {f["rule"] for f in data["findings"]} >= {"TL901", "TL902"}


def test_a_crash_in_the_file_model_is_reported_for_that_file_only(tree, capsys, monkeypatch) -> None:
    (tree / "other.py").write_text(GOOD, encoding="utf-8")
    import trainlint.engine

    real_model = trainlint.engine.FileModel

    def model(module, path, text):
        if path.endswith("other.py"):
            raise KeyError("planted")
        return real_model(module, path, text)

    monkeypatch.setattr(trainlint.engine, "FileModel", model)
    code, data, err = lint(capsys, ".")
    assert code == 2 and "Traceback" not in err
    assert [e["path"] for e in data["errors"]] == ["other.py"]
    assert "internal error" in data["errors"][0]["message"]
    assert_good_reported(data)


# --- determinism ------------------------------------------------------------------------------------------


def test_output_does_not_depend_on_hash_seed(tmp_path) -> None:
    """Set and dict orders differ between processes; findings must not."""
    examples = tmp_path / "examples"
    examples.mkdir()
    for rule in registry():
        for i, example in enumerate(rule.invalid):
            (examples / f"{rule.id}_{i}.py").write_text(textwrap.dedent(example.code), encoding="utf-8")
    outputs = []
    for seed in ("0", "12345"):
        proc = subprocess.run(
            [sys.executable, "-m", "trainlint", "--format", "json", "--no-cache", str(examples), "fixtures"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        data = json.loads(proc.stdout)
        outputs.append((proc.returncode, data["findings"], data["errors"]))
    assert outputs[0][1], "the examples must produce findings"
    assert outputs[0] == outputs[1]


def test_read_source_never_raises_on_odd_paths(tmp_path) -> None:
    assert "no longer exists" in read_source(tmp_path / "missing.py").error
    assert "folder" in read_source(tmp_path).error
    assert trainlint.files.decode(b"\xff\xfe\x00x").error is not None


def test_folders_above_the_given_path_do_not_exclude_it(tmp_path, capsys, monkeypatch) -> None:
    """Default excludes name folders such as .venv/ and site-packages/: they apply inside what is
    linted, not to the folders a project happens to live in."""
    project = tmp_path / "build" / "site-packages" / "proj"
    (project / ".venv").mkdir(parents=True)
    (project / "train.py").write_text(GOOD, encoding="utf-8")
    (project / ".venv" / "generated.py").write_text(GOOD, encoding="utf-8")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, data, _ = lint(capsys, str(project))
    assert code == 1
    assert data["summary"]["files"] == 1
    assert {Path(p).name for p in found(data)} == {"train.py"}


# --- file names the output cannot encode, files gone before their fix ------------------------------


@pytest.mark.skipif(sys.platform != "linux", reason="needs a file system that takes any bytes as a name")
@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_file_name_the_output_cannot_encode(tmp_path: Path, fmt: str) -> None:
    """A Latin-1 file name under a strict UTF-8 stdout: escaped in the output, never an internal error."""
    (tmp_path / os.fsdecode(b"caf\xe9.py")).write_text(GOOD, encoding="utf-8")
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict", "LC_ALL": "C.UTF-8"}
    done = subprocess.run(
        [sys.executable, "-m", "trainlint", "--no-cache", "--format", fmt, "."],
        cwd=tmp_path,
        capture_output=True,
        env=env,
        timeout=120,
    )
    out, err = done.stdout.decode("utf-8"), done.stderr.decode("utf-8")
    assert done.returncode == 1, err
    assert "internal error" not in err and "Traceback" not in err
    if fmt == "json":
        data = json.loads(out)
        assert {f["path"] for f in data["findings"]} == {os.fsdecode(b"caf\xe9.py")}
    else:
        assert "caf\\udce9.py:3:5: TL201" in out


def test_a_file_deleted_before_its_fix_is_reported(tree: Path, capsys, monkeypatch) -> None:
    real = Path.read_bytes

    def vanished(self: Path) -> bytes:
        if self.name == "good.py":
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", vanished)
    code = run(["--no-cache", "--jobs", "1", "--fix", "--unsafe-fixes", "--format", "json", "."])
    captured = capsys.readouterr()
    assert code == 1  # findings remain; a file that vanished is not the tool's own failure
    data = json.loads(captured.out)
    assert "good.py: fix not applied: cannot read the file: no such file or directory" in captured.err
    assert_good_reported(data)  # its findings are still reported, unfixed
    assert (tree / "good.py").read_text(encoding="utf-8") == GOOD


# --- paths through links, other platforms, several runs in one process -----------------------------


def test_a_path_through_a_linked_folder_is_inside_the_project(tmp_path: Path, capsys, monkeypatch) -> None:
    """Editors pass logical paths (``$PWD/...``) that go through a link to the project: per-file-ignores
    still apply and the path is still shown relative to the working folder."""
    real = tmp_path / "real" / "proj"
    (real / "scripts").mkdir(parents=True)
    (real / "pyproject.toml").write_text('[tool.trainlint.per-file-ignores]\n"scripts/*" = ["TL201"]\n')
    (real / "scripts" / "a.py").write_text(GOOD, encoding="utf-8")
    os.symlink(tmp_path / "real", tmp_path / "link")
    monkeypatch.chdir(tmp_path / "link" / "proj")  # the process sees the physical path
    logical = str(tmp_path / "link" / "proj" / "scripts" / "a.py")
    code, data, _ = lint(capsys, logical)
    assert code == 1
    assert found(data) == {"scripts/a.py": [("TL109", *TL109_AT)]}  # TL201 ignored for scripts/*


def test_default_excludes_on_a_platform_whose_normcase_uses_backslashes(tmp_path: Path, monkeypatch) -> None:
    import ntpath

    (tmp_path / "pkg" / "build").mkdir(parents=True)
    (tmp_path / "pkg" / "__pycache__").mkdir()
    monkeypatch.setattr(os.path, "normcase", ntpath.normcase)
    trainlint.files._exclude_matchers.cache_clear()
    try:
        for name in ("pkg/build", "pkg/__pycache__", "pkg/Build"):
            assert trainlint.files.is_excluded(tmp_path / name, ["build", "__pycache__"], tmp_path), name
        assert not trainlint.files.is_excluded(tmp_path / "pkg", ["build", "__pycache__"], tmp_path)
    finally:
        trainlint.files._exclude_matchers.cache_clear()


def test_a_relative_folder_given_from_two_working_folders(tmp_path: Path, monkeypatch) -> None:
    """The same relative path names different folders from different working folders: nothing about
    the first may be remembered for the second (IDE hosts and tests call ``run`` many times)."""
    for side in ("one", "two"):
        (tmp_path / side / "c").mkdir(parents=True)
        (tmp_path / side / "build" / "target").mkdir(parents=True)
        (tmp_path / side / "build" / "target" / "t.py").write_text("x = 1\n")
    for side in ("one", "two"):
        monkeypatch.chdir(tmp_path / side / "c")
        found = list(trainlint.files.discover([Path("../build/target")], ["build"], Path.cwd(), []))
        assert [p.name for p in found] == ["t.py"], side


def test_rule_ids_installed_by_one_run_do_not_leak_into_the_next(tree: Path, capsys) -> None:
    from trainlint.rule import use_known_ids

    use_known_ids(("TL101",))  # as if an earlier run in this process had read a (stale) record
    code, data, _ = lint(capsys, ".")
    assert code == 1
    assert_good_reported(data)
