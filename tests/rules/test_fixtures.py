"""End to end on the bundled fixtures: each planted mistake (`# expect: TLxxx` on its line) is
reported exactly once, and nothing else is reported."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from trainlint.cli import run

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"
EXPECT = re.compile(r"#\s*expect:\s*(?P<ids>TL\d{3}(?:\s*,\s*TL\d{3})*)")


def expected_findings() -> list[tuple[str, int, str]]:
    out = []
    for path in sorted(FIXTURES.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            match = EXPECT.search(line)
            if match:
                for rule in re.split(r"\s*,\s*", match.group("ids")):
                    out.append((f"fixtures/{path.relative_to(FIXTURES).as_posix()}", number, rule))
    return sorted(out)


@pytest.fixture
def in_root(monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(ROOT)
    return ROOT


def test_fixtures_report_each_planted_mistake_once_and_nothing_else(in_root, capsys) -> None:
    code = run(["--format", "json", "--no-cache", "fixtures"])
    data = json.loads(capsys.readouterr().out)
    found = sorted((f["path"], f["line"], f["rule"]) for f in data["findings"])
    assert found == expected_findings()
    assert data["errors"] == []
    assert code == 1


def test_fixtures_include_clean_and_planted_files() -> None:
    expected = expected_findings()
    planted = {path for path, _, _ in expected}
    names = {f"fixtures/{p.relative_to(FIXTURES).as_posix()}" for p in FIXTURES.rglob("*.py")}
    assert planted and names - planted, "fixtures need both files with mistakes and clean files"
    assert {p for p in names if Path(p).name.startswith("bad_")} == planted
    # the five mission rules each have a planted mistake
    assert {"TL101", "TL105", "TL201", "TL203", "TL301"} <= {rule for _, _, rule in expected}


def test_readme_demo_command_prints_code_frames_and_exits_1(in_root, capsys) -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- demo-command -->")[1].split("<!-- /demo-command -->")[0]
    assert "trainlint fixtures/" in block
    code = run(["--no-cache", "fixtures/"])
    out = capsys.readouterr().out
    assert code == 1
    assert " │ " in out and "^" in out  # code frames
    assert re.search(r"Found \d+ findings", out)
