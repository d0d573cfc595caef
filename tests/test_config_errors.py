"""A bad configuration is one clear line on stderr and exit 2: never a traceback, never ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainlint.cli import run
from trainlint.config import load_config

CASES = {
    # id: (pyproject.toml text, words the one error line must contain)
    "bad-toml": ("[tool.trainlint\nselect = 1\n", "cannot parse TOML"),
    "bad-toml-value": ("[tool.trainlint]\nselect = [TL1]\n", "cannot parse TOML"),
    "duplicate-key": ('[tool.trainlint]\nselect = ["TL1"]\nselect = ["TL2"]\n', "cannot parse TOML"),
    "unknown-key": ("[tool.trainlint]\nselects = ['TL1']\n", "unknown key 'selects'"),
    "unknown-verify-key": ("[tool.trainlint.verify]\ndevices = 'cpu'\n", "unknown key 'devices'"),
    "bad-rule-id": ('[tool.trainlint]\nselect = ["TL999"]\n', "unknown rule id or prefix 'TL999'"),
    "bad-prefix": ('[tool.trainlint]\nignore = ["XY"]\n', "unknown rule id or prefix 'XY'"),
    "bad-extend-select": ('[tool.trainlint]\nextend-select = ["TL0"]\n', "'TL0'"),
    "empty-rule-id": ('[tool.trainlint]\nignore = [""]\n', "empty rule id"),
    "select-not-list": ('[tool.trainlint]\nselect = "TL1"\n', "expected a list of strings"),
    "select-ints": ("[tool.trainlint]\nselect = [101]\n", "expected a list of strings"),
    "exclude-not-list": ('[tool.trainlint]\nexclude = "build"\n', "exclude: expected a list of strings"),
    "pfi-not-table": ('[tool.trainlint]\nper-file-ignores = ["TL1"]\n', "per-file-ignores: expected a table"),
    "pfi-bad-id": ('[tool.trainlint.per-file-ignores]\n"tests/*" = ["TL9999"]\n', "'TL9999'"),
    "pfi-not-list": ('[tool.trainlint.per-file-ignores]\n"tests/*" = "TL1"\n', "expected a list of strings"),
    "severity-bad-level": ('[tool.trainlint.severity]\nTL101 = "fatal"\n', "expected error, warning or info"),
    "severity-bad-type": ("[tool.trainlint.severity]\nTL101 = 2\n", "expected error, warning or info"),
    "severity-bad-id": ('[tool.trainlint.severity]\nTL999 = "error"\n', "unknown rule id 'TL999'"),
    "severity-prefix": ('[tool.trainlint.severity]\nTL1 = "error"\n', "unknown rule id 'TL1'"),
    "severity-not-table": ('[tool.trainlint]\nseverity = "error"\n', "severity: expected a table"),
    "verify-not-table": ('[tool.trainlint]\nverify = "cpu"\n', "verify: expected a table"),
    "device-bad": ('[tool.trainlint.verify]\ndevice = "tpu"\n', "device: expected one of auto, cpu, cuda"),
    "device-type": ("[tool.trainlint.verify]\ndevice = ['cpu']\n", "device: expected one of"),
    "timeout-string": ('[tool.trainlint.verify]\ntimeout = "60"\n', "timeout: expected a positive number"),
    "timeout-negative": ("[tool.trainlint.verify]\ntimeout = -1\n", "timeout: expected a positive number"),
    "timeout-bool": ("[tool.trainlint.verify]\ntimeout = true\n", "timeout: expected a positive number"),
    "timeout-nan": ("[tool.trainlint.verify]\ntimeout = nan\n", "timeout: expected a positive number"),
    "timeout-inf": ("[tool.trainlint.verify]\ntimeout = inf\n", "timeout: expected a positive number"),
    "trainlint-not-table": ("[tool]\ntrainlint = 1\n", "[tool.trainlint] must be a table"),
}


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("x = 1\n", encoding="utf-8")
    return tmp_path


def one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("trainlint: error: ")
    return lines[0]


@pytest.mark.parametrize(("text", "words"), list(CASES.values()), ids=list(CASES))
def test_bad_pyproject_is_one_line_and_exit_2(project, capsys, text: str, words: str) -> None:
    (project / "pyproject.toml").write_text(text, encoding="utf-8")
    assert run(["--no-cache", "train.py"]) == 2
    line = one_error_line(capsys)
    assert words in line
    assert "pyproject.toml" in line


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("select = [\n", "cannot parse TOML"),
        ("bogus = 1\n", "unknown key 'bogus'"),
        ("[verify]\nbogus = 1\n", "[verify]: unknown key 'bogus'"),
        ('select = ["NOPE"]\n', "'NOPE'"),
    ],
)
def test_bad_trainlint_toml(project, capsys, text: str, words: str) -> None:
    (project / "trainlint.toml").write_text(text, encoding="utf-8")
    assert run(["--no-cache", "train.py"]) == 2
    line = one_error_line(capsys)
    assert words in line and "trainlint.toml" in line


def test_config_that_is_not_utf8(project, capsys) -> None:
    (project / "pyproject.toml").write_bytes(b"[tool.trainlint]\n# caf\xe9\n")
    assert run(["--no-cache", "train.py"]) == 2
    assert "not UTF-8" in one_error_line(capsys)


def test_missing_config_given_explicitly(project, capsys) -> None:
    assert run(["--no-cache", "--config", "nope.toml", "train.py"]) == 2
    assert "nope.toml: no such configuration file" in one_error_line(capsys)


def test_explicit_config_with_a_bad_tool_table(project, capsys) -> None:
    (project / "other").mkdir()
    (project / "other" / "pyproject.toml").write_text('tool = "x"\n', encoding="utf-8")
    assert run(["--no-cache", "--config", "other/pyproject.toml", "train.py"]) == 2
    assert "[tool] must be a table" in one_error_line(capsys)


def test_explicit_custom_file_takes_keys_at_the_top(project, capsys) -> None:
    (project / "custom.toml").write_text('tool = "x"\n', encoding="utf-8")
    assert run(["--no-cache", "--config", "custom.toml", "train.py"]) == 2
    assert "custom.toml: unknown key 'tool'" in one_error_line(capsys)


@pytest.mark.parametrize("flag", ["--select", "--ignore", "--extend-select"])
def test_bad_rule_ids_on_the_command_line(project, capsys, flag: str) -> None:
    assert run(["--no-cache", flag, "TL1,ZZ9", "train.py"]) == 2
    assert "unknown rule id or prefix 'ZZ9'" in one_error_line(capsys)


def test_a_pyproject_without_our_table_is_not_an_error(project, capsys) -> None:
    (project / "pyproject.toml").write_text('tool = 1\n[project]\nname = "x"\n', encoding="utf-8")
    assert run(["--no-cache", "train.py"]) == 0
    assert capsys.readouterr().err == ""


def test_valid_configuration_is_accepted(project) -> None:
    (project / "pyproject.toml").write_text(
        """\
[tool.trainlint]
select = ["TL1", "TL2"]
ignore = ["TL107"]
extend-select = ["TL401"]
exclude = ["build"]
extend-exclude = ["gen/*"]
per-file-ignores = {"tests/*" = ["TL4"]}
severity = {TL201 = "error"}

[tool.trainlint.verify]
device = "cpu"
timeout = 30
""",
        encoding="utf-8",
    )
    cfg = load_config(project / "pyproject.toml")
    assert cfg.select == ["TL1", "TL2"] and cfg.ignore == ["TL107"]
    assert cfg.per_file_ignores == {"tests/*": ["TL4"]}
    assert (cfg.verify_device, cfg.verify_timeout) == ("cpu", 30.0)
    assert run(["--no-cache", "train.py"]) == 0
