"""Session 7, pre-commit's one-file run (issue 13): what the command does around linting.

The command leaves without tearing the interpreter down (``trainlint.__main__.exit_now``), once its
output is flushed and the exit handlers have run; where something may still need the teardown it
exits as Python does. Witnessed by an object whose finalizer prints: the teardown runs it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BAD = "from torch.utils.checkpoint import checkpoint\n\n\ndef f(block, x):\n    return checkpoint(block, x)\n"

# a run of the command as the console script runs it, with a witness of the teardown and an exit
# handler; ``{setup}`` may start a thread or a profiler first
SCRIPT = """
import atexit, os, sys


class Witness:
    # os.write, kept here: by the time the teardown clears this module, sys.stdout may be gone
    def __del__(self, write=os.write):
        write(1, b"torn down\\n")


witness = Witness()
atexit.register(print, "handler ran")
{setup}
sys.argv = {argv}
from trainlint.__main__ import entry

entry()
"""


def run_command(
    tmp_path: Path, setup: str = "", argv: tuple[str, ...] = ("--no-cache", "bad.py")
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "bad.py").write_text(BAD)
    script = SCRIPT.format(setup=textwrap.dedent(setup), argv=["trainlint", *argv])
    return subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )


def test_the_command_skips_the_teardown_but_not_its_output_nor_the_exit_handlers(tmp_path: Path) -> None:
    proc = run_command(tmp_path)
    assert proc.returncode == 1, proc.stderr  # a finding
    # the report sat in the pipe's buffer: flushed before leaving
    assert "bad.py:5:12: TL201" in proc.stdout and "Found 1 finding" in proc.stdout
    assert "handler ran" in proc.stdout
    assert "torn down" not in proc.stdout
    assert proc.stderr == ""


@pytest.mark.parametrize(
    "setup",
    [
        # a thread still running (until the main thread has finished): Python waits for it, and so
        # does the command
        "import threading, time\n"
        "alive = threading.main_thread().is_alive\n"
        "threading.Thread(target=lambda: [time.sleep(0.01) for _ in iter(alive, False)]).start()\n",
        # a profiler (``python -m cProfile -m trainlint``) writes its report once the module returns
        "sys.setprofile(lambda *args: None)\n",
    ],
    ids=["thread", "profiler"],
)
def test_the_ordinary_exit_where_something_may_still_need_it(tmp_path: Path, setup: str) -> None:
    proc = run_command(tmp_path, setup)
    assert proc.returncode == 1, proc.stderr
    assert "TL201" in proc.stdout and "handler ran" in proc.stdout
    assert "torn down" in proc.stdout


def test_a_subcommand_exits_as_python_does(tmp_path: Path) -> None:
    # `trainlint run` executes the user's script in this process: what it left open is flushed by the
    # teardown (a usage error stands in for a run: the same way out, without importing torch)
    proc = run_command(tmp_path, argv=("server", "--no-such-option"))
    assert proc.returncode == 2 and "--no-such-option" in proc.stderr
    assert "handler ran" in proc.stdout and "torn down" in proc.stdout


def test_python_m_trainlint_exits_with_the_commands_code(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text(BAD)
    (tmp_path / "good.py").write_text("x = 1\n")
    command = [sys.executable, "-m", "trainlint", "--no-cache"]
    bad = subprocess.run([*command, "bad.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    good = subprocess.run([*command, "good.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    usage = subprocess.run(
        [*command, "--no-such-flag"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert (bad.returncode, good.returncode, usage.returncode) == (1, 0, 2)
    assert "TL201" in bad.stdout and "All checks passed" in good.stdout and "--no-such-flag" in usage.stderr


def fresh_python(code: str, cwd: Path) -> str:
    """What ``code`` prints, run in a new interpreter (nothing imported before it)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_importing_the_command_runs_no_collection_and_leaves_the_collector_on(tmp_path: Path) -> None:
    out = fresh_python(
        """
        import gc
        runs = []
        gc.callbacks.append(lambda phase, info: runs.append(phase) if phase == "start" else None)
        import trainlint.__main__
        print(len(runs), gc.isenabled())
        """,
        tmp_path,
    )
    collections, enabled = out.split()
    # none (one where this module's byte code is stale: Python compiles it before running it); before: 18
    assert int(collections) <= 1 and enabled == "True"


def test_the_rules_modules_are_found_without_importing_their_families(tmp_path: Path) -> None:
    out = fresh_python(
        """
        import sys
        from trainlint.rule import _rule_modules
        found = _rule_modules()
        print(sorted({name.split(".")[2] for name in found.values()}))
        print(sorted(name for name in sys.modules if name.startswith("trainlint.rules.")))
        """,
        tmp_path,
    )
    families, imported = out.splitlines()
    assert "checkpoint" in families and "parse" in families
    assert imported == "[]"  # before: every family's package (pkgutil imports them to list them)


def test_a_lint_converts_no_rule_examples_until_they_are_read(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text(BAD)
    out = fresh_python(
        """
        import trainlint.rule as rule
        calls = []
        convert = rule.example_text
        rule.example_text = lambda block: calls.append(block) or convert(block)
        from trainlint.engine import lint_source
        found = lint_source(open("bad.py").read(), "bad.py", ["TL201"])
        print([f.rule for f in found], len(calls))
        from trainlint.rule import load_rule
        examples = load_rule("TL201").invalid
        print(len(calls) > 0, examples[0].code == convert(examples[0].code), examples[0].code[0] != " ")
        """,
        tmp_path,
    )
    linted, read = out.splitlines()
    assert linted == "['TL201'] 0"  # before: every loaded rule's examples, at its class's creation
    assert read == "True True True"


def test_a_quiet_run_without_findings_does_not_load_rich(tmp_path: Path) -> None:
    (tmp_path / "good.py").write_text("x = 1\n")
    out = fresh_python(
        """
        import sys
        from trainlint.cli import main
        code = main(["--no-cache", "--quiet", "good.py"])
        print(code, "rich" in sys.modules)
        """,
        tmp_path,
    )
    assert out.split() == ["0", "False"]  # before: rich loaded, to print nothing


def test_one_file_costs_no_collection_and_no_trim_where_more_files_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc

    import trainlint.cli as cli

    calls: list[str] = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or collect(*a))
    monkeypatch.setattr(gc, "get_freeze_count", lambda: calls.append("count") or 1)
    monkeypatch.setattr(cli, "give_back_memory", lambda: calls.append("trim"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.py").write_text(BAD)
    (tmp_path / "b.py").write_text(BAD)
    assert cli.main(["--no-cache", "--quiet", "--jobs", "1", "a.py"]) == 1
    assert calls == []  # before: a collection, the frozen heap counted, a trim after the only file
    assert cli.main(["--no-cache", "--quiet", "--jobs", "1", "a.py", "b.py"]) == 1
    assert calls == ["collect", "trim"]  # the run's garbage collected; memory given back between files
