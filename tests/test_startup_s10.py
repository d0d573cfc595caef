"""Session 10, an editor's keystroke (``trainlint --no-cache - --stdin-filename x.py``) on a file the
prefilter rejects: the run needs neither the project index, the result cache, the version pins, the
notebook reader nor libcst, so it must not pay for importing them.

Each check runs in a fresh interpreter: this test process has imported everything already."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# names of the training loop in the docstring and comments only: the prefilter passes on the raw
# text, CPython's tree rules every rule out (as bench/run.py's ``REJECTED``)
REJECTED = (
    '"""Data helpers. The training loop (loss.backward(), scaler.step(opt), zero_grad()) is elsewhere."""\n'
    "import json\n"
    "import os\n"
    "\n\n"
    "def load(path):\n"
    "    # read before the backward pass\n"
    "    with open(os.path.join(path, 'shard.json')) as f:\n"
    "        return json.load(f)\n"
)

NOT_NEEDED = (
    "trainlint.model.project",
    "trainlint.model.pyast",
    "trainlint.model.summary",
    "trainlint.cache",
    "trainlint.model.pins",
    "trainlint.notebook",
    "libcst",
    # what only a file with findings needs: its suppression comments, its messages' escaping
    "trainlint.suppress",
    "trainlint.report.escape",
)

# Runs the command in this process on stdin, then prints its exit code and which of the modules
# named in argv[1] it loaded (its report goes to stdout first: the driver's line comes last).
DRIVER = textwrap.dedent(
    """
    import json, sys
    from trainlint.cli import main

    watched = json.loads(sys.argv[1])
    code = main(sys.argv[2:])
    print(json.dumps({"code": code, "loaded": [m for m in watched if m in sys.modules]}))
    """
)


def _run(tmp_path: Path, text: str, argv: list[str], watched: tuple[str, ...] = NOT_NEEDED) -> dict:
    done = subprocess.run(
        [sys.executable, "-P", "-c", DRIVER, json.dumps(watched), *argv],
        cwd=tmp_path,
        input=text,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report, _, last = done.stdout.strip().rpartition("\n")
    out = json.loads(last)
    out["report"] = report
    return out


def test_stdin_of_a_rejected_file_loads_no_index_cache_pins_notebook_or_parser(tmp_path: Path) -> None:
    out = _run(tmp_path, REJECTED, ["--no-cache", "-", "--stdin-filename", "x.py"])
    assert out["code"] == 0 and "All checks passed" in out["report"]
    # before: the cache, the project index (with the summaries), the pins and the notebook reader,
    # through cli and engine
    assert out["loaded"] == []


def test_stdin_of_a_rejected_file_with_a_project_configuration(tmp_path: Path) -> None:
    # a configuration above the file is read (the editor's usual case): still nothing of the above
    (tmp_path / "pyproject.toml").write_text('[tool.trainlint]\nignore = ["TL101"]\n')
    (tmp_path / "pkg").mkdir()
    out = _run(tmp_path, REJECTED, ["--no-cache", "-", "--stdin-filename", "pkg/x.py"])
    assert out["code"] == 0
    assert out["loaded"] == []


@pytest.mark.parametrize("argv", [["--no-cache", "-", "--stdin-filename", "x.py"], ["--no-cache", "x.py"]])
def test_a_file_that_needs_its_rules_still_gets_them(tmp_path: Path, argv: list[str]) -> None:
    # the lazily loaded modules are still reached where a rule runs: the finding is made
    text = "from torch.utils.checkpoint import checkpoint\n\n\ndef f(b, x):\n    return checkpoint(b, x)\n"
    (tmp_path / "x.py").write_text(text)
    out = _run(tmp_path, text, argv, watched=("libcst", "trainlint.model.project"))
    assert out["code"] == 1 and "TL201" in out["report"]
    assert out["loaded"] == ["libcst", "trainlint.model.project"]


def test_a_cached_run_still_loads_the_cache(tmp_path: Path) -> None:
    (tmp_path / "x.py").write_text(REJECTED)
    argv = ["--cache-dir", str(tmp_path / "cache"), "x.py"]
    out = _run(tmp_path, "", argv, watched=("trainlint.cache",))
    assert out["code"] == 0 and out["loaded"] == ["trainlint.cache"]
    assert (tmp_path / "cache").is_dir()


def test_the_moved_names_are_still_reachable_where_they_were() -> None:
    # other modules and tests import these names from the engine and the command line
    probe = textwrap.dedent(
        """
        import trainlint.engine as engine
        from trainlint.model.project import Project
        from trainlint.model.summary import Summary, outline
        print(engine.Project is Project, engine.Summary is Summary, engine.outline is outline)
        """
    )
    done = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "True"]


def test_building_the_parser_loads_no_shutil() -> None:
    # argparse makes a formatter for every argument it adds; one without a width imports shutil
    probe = textwrap.dedent(
        """
        import sys
        import argparse
        before = "shutil" in sys.modules
        from trainlint.cli import build_parser
        build_parser().parse_args(["--no-cache", "-"])
        print(before, "shutil" in sys.modules)
        """
    )
    done = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    before, after = done.stdout.split()
    assert after == before  # before the change: True where argparse alone had not loaded it


@pytest.mark.parametrize("columns", [None, "60", "200", "0", "-5", "wide"])
def test_the_help_is_as_wide_as_shutil_says(monkeypatch: pytest.MonkeyPatch, columns: str | None) -> None:
    import shutil

    import trainlint.cli as cli

    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    assert cli._terminal_columns() == shutil.get_terminal_size().columns
    ours = cli.build_parser().format_help()
    monkeypatch.setattr(cli, "_terminal_columns", lambda: shutil.get_terminal_size().columns)
    assert ours == cli.build_parser().format_help()
