"""The command line as users, editors and CI scripts see it: flags, formats, config, suppression, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainlint import __version__
from trainlint.cli import run
from trainlint.rule import registry

BAD = textwrap.dedent(
    """\
    import torch
    from torch.utils.checkpoint import checkpoint


    def forward(block, x):
        return checkpoint(block, x)
    """
)
BAD_LINE = 6  # the checkpoint() call in BAD
GOOD = "import torch\n\nx = torch.ones(3)\n"
REENTRANT = "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x, use_reentrant=True)\n"


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "bad.py").write_text(BAD)
    (tmp_path / "src" / "good.py").write_text(GOOD)
    return tmp_path


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str, stdin: str | None = None) -> tuple[int, str, str]:
    code = run(list(argv), stdin=stdin)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def json_run(capsys, *argv: str, stdin: str | None = None) -> tuple[int, dict]:
    code, out, _ = run_cli(capsys, "--format", "json", "--no-cache", *argv, stdin=stdin)
    return code, json.loads(out)


# -- exit codes and the text format ------------------------------------------------------------------


def test_text_output_has_location_code_frame_and_summary(project, capsys) -> None:
    code, out, err = run_cli(capsys, "--no-cache", "src")
    assert code == 1
    assert f"src/bad.py:{BAD_LINE}:12: TL201" in out
    assert "return checkpoint(block, x)" in out  # the code frame
    assert "^^^^" in out
    assert "Found 1 finding (1 warning) in 1 file (2 files checked)." in out
    assert err == ""


def test_clean_tree_exits_zero(project, capsys) -> None:
    code, out, _ = run_cli(capsys, "--no-cache", "src/good.py")
    assert code == 0
    assert "All checks passed!" in out


def test_exit_zero_keeps_findings_but_exits_zero(project, capsys) -> None:
    code, out, _ = run_cli(capsys, "--no-cache", "--exit-zero", "src")
    assert code == 0
    assert "TL201" in out


def test_missing_path_is_a_usage_error(project, capsys) -> None:
    code, out, err = run_cli(capsys, "does/not/exist.py")
    assert code == 2
    assert "does/not/exist.py: no such file or folder" in err
    assert "Traceback" not in err + out


def test_bad_flag_is_a_usage_error(project, capsys) -> None:
    code, _, err = run_cli(capsys, "--format", "xml", "src")
    assert code == 2
    assert "invalid choice" in err


def test_default_path_is_the_current_folder(project, capsys) -> None:
    code, out, _ = run_cli(capsys, "--no-cache")
    assert code == 1
    assert "src/bad.py" in out


def test_quiet_prints_findings_without_summary(project, capsys) -> None:
    code, out, _ = run_cli(capsys, "--no-cache", "--quiet", "src")
    assert code == 1
    assert "TL201" in out
    assert "Found" not in out


def test_statistics_counts_per_rule(project, capsys) -> None:
    (project / "src" / "more.py").write_text(BAD + "\ny = checkpoint(block, x)\n" + REENTRANT)
    code, out, _ = run_cli(capsys, "--no-cache", "--statistics", "src")
    assert code == 1
    lines = [line.split("\t") for line in out.strip().splitlines()]
    assert [(parts[0].strip(), parts[1]) for parts in lines] == [("3", "TL201"), ("1", "TL202")]


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        run(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"trainlint {__version__}"


def test_python_dash_m_entry_point(project) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "trainlint", "--no-cache", "src"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 1
    assert "TL201" in proc.stdout


# -- selection -----------------------------------------------------------------------------------------


def test_select_ignore_extend_select(project, capsys) -> None:
    (project / "src" / "reentrant.py").write_text(REENTRANT)
    _, data = json_run(capsys, "src")
    assert sorted(f["rule"] for f in data["findings"]) == ["TL201", "TL202"]
    _, data = json_run(capsys, "--select", "TL202", "src")
    assert [f["rule"] for f in data["findings"]] == ["TL202"]
    _, data = json_run(capsys, "--ignore", "TL20", "src")
    assert data["findings"] == []
    _, data = json_run(capsys, "--select", "TL201", "--extend-select", "TL202", "src")
    assert sorted(f["rule"] for f in data["findings"]) == ["TL201", "TL202"]


def test_unknown_rule_selector_is_an_error(project, capsys) -> None:
    code, _, err = run_cli(capsys, "--select", "XX1", "src")
    assert code == 2
    assert "unknown rule id or prefix 'XX1'" in err


# -- configuration -------------------------------------------------------------------------------------


def test_pyproject_configuration_is_applied(project, capsys) -> None:
    (project / "src" / "reentrant.py").write_text(REENTRANT)
    (project / "pyproject.toml").write_text(
        '[tool.trainlint]\nignore = ["TL202"]\nseverity = { TL201 = "error" }\n'
    )
    _, data = json_run(capsys, "src")
    assert [(f["rule"], f["severity"]) for f in data["findings"]] == [("TL201", "error")]


def test_trainlint_toml_wins_over_pyproject(project, capsys) -> None:
    (project / "pyproject.toml").write_text('[tool.trainlint]\nselect = ["TL201"]\n')
    (project / "trainlint.toml").write_text('select = ["TL202"]\n')
    (project / "src" / "reentrant.py").write_text(REENTRANT)
    _, data = json_run(capsys, "src")
    assert [f["rule"] for f in data["findings"]] == ["TL202"]


def test_exclude_and_per_file_ignores(project, capsys) -> None:
    (project / "tests").mkdir()
    (project / "tests" / "test_x.py").write_text(BAD)
    (project / "legacy").mkdir()
    (project / "legacy" / "old.py").write_text(BAD)
    (project / "pyproject.toml").write_text(
        '[tool.trainlint]\nextend-exclude = ["legacy"]\nper-file-ignores = { "tests/*" = ["TL2"] }\n'
    )
    _, data = json_run(capsys, ".")
    assert sorted(f["path"] for f in data["findings"]) == ["src/bad.py"]


def test_explicit_file_is_linted_even_when_excluded(project, capsys) -> None:
    (project / "pyproject.toml").write_text('[tool.trainlint]\nextend-exclude = ["src"]\n')
    _, data = json_run(capsys, ".")
    assert data["findings"] == []
    _, data = json_run(capsys, "src/bad.py")
    assert [f["path"] for f in data["findings"]] == ["src/bad.py"]


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[tool.trainlint]\nselct = ["TL2"]\n', "unknown key 'selct'"),
        ('[tool.trainlint]\nselect = ["TL999"]\n', "unknown rule id or prefix 'TL999'"),
        ('[tool.trainlint]\nseverity = { TL201 = "fatal" }\n', "expected error, warning or info"),
        ('[tool.trainlint]\nselect = "TL2"\n', "expected a list of strings"),
        ('[tool.trainlint.verify]\ndevise = "cpu"\n', "unknown key 'devise'"),
        ("[tool.trainlint\n", "cannot parse TOML"),
    ],
)
def test_configuration_errors_exit_2_with_one_line(project, capsys, toml: str, message: str) -> None:
    (project / "pyproject.toml").write_text(toml)
    code, out, err = run_cli(capsys, "src")
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert out == ""


# -- suppression ---------------------------------------------------------------------------------------


def test_noqa_with_code_bare_and_other_code(project, capsys) -> None:
    src = project / "src"
    (src / "bad.py").write_text(BAD.replace("checkpoint(block, x)", "checkpoint(block, x)  # noqa: TL201"))
    (src / "bare.py").write_text(BAD.replace("checkpoint(block, x)", "checkpoint(block, x)  # noqa"))
    (src / "other.py").write_text(BAD.replace("checkpoint(block, x)", "checkpoint(block, x)  # noqa: E501"))
    (src / "many.py").write_text(
        BAD.replace("checkpoint(block, x)", "checkpoint(block, x)  # noqa: TL203, TL201")
    )
    _, data = json_run(capsys, "src")
    assert [f["path"] for f in data["findings"]] == ["src/other.py"]


def test_disable_file_comment(project, capsys) -> None:
    (project / "src" / "bad.py").write_text("# trainlint: disable-file=TL2\n" + BAD)
    (project / "src" / "other.py").write_text("# trainlint: disable-file=TL202\n" + BAD)
    _, data = json_run(capsys, "src")
    assert [f["path"] for f in data["findings"]] == ["src/other.py"]


# -- stdin for editors ---------------------------------------------------------------------------------


def test_stdin_is_reported_under_the_given_filename(project, capsys) -> None:
    code, data = json_run(capsys, "-", "--stdin-filename", "src/unsaved.py", stdin=BAD)
    assert code == 1
    assert [(f["path"], f["line"]) for f in data["findings"]] == [("src/unsaved.py", BAD_LINE)]
    assert data["summary"]["files"] == 1


def test_stdin_respects_per_file_ignores(project, capsys) -> None:
    (project / "pyproject.toml").write_text(
        '[tool.trainlint]\nper-file-ignores = { "tests/*" = ["TL201"] }\n'
    )
    code, data = json_run(capsys, "-", "--stdin-filename", "tests/test_a.py", stdin=BAD)
    assert code == 0
    assert data["findings"] == []


def test_stdin_mixed_with_paths_is_an_error(project, capsys) -> None:
    code, _, err = run_cli(capsys, "-", "src", stdin=BAD)
    assert code == 2
    assert "stdin" in err


# -- parse problems among good files -------------------------------------------------------------------


def test_syntax_error_file_is_reported_and_others_still_linted(project, capsys) -> None:
    (project / "src" / "broken.py").write_text("def train(:\n    pass\n")
    code, data = json_run(capsys, "src")
    assert code == 1
    rules = sorted((f["path"], f["rule"]) for f in data["findings"])
    assert rules == [("src/bad.py", "TL201"), ("src/broken.py", "TL901")]
    broken = next(f for f in data["findings"] if f["rule"] == "TL901")
    assert broken["line"] == 1
    assert data["errors"] == []
    assert data["summary"]["files"] == 3


def test_undecodable_file_is_tl902(project, capsys) -> None:
    (project / "src" / "latin.py").write_bytes(b"# -*- coding: utf-8 -*-\nname = '\xe9t\xe9'\n")
    code, data = json_run(capsys, "src")
    assert code == 1
    assert ("src/latin.py", "TL902") in {(f["path"], f["rule"]) for f in data["findings"]}


# -- JSON, SARIF, GitHub -------------------------------------------------------------------------------


def test_json_schema_1(project, capsys) -> None:
    code, data = json_run(capsys, "src")
    assert code == 1
    assert set(data) == {"tool", "version", "schema", "findings", "errors", "summary"}
    assert (data["tool"], data["version"], data["schema"]) == ("trainlint", __version__, 1)
    (finding,) = data["findings"]
    assert finding["rule"] == "TL201"
    assert finding["name"] == "checkpoint-use-reentrant"
    assert finding["severity"] == "warning"
    assert finding["path"] == "src/bad.py"
    # `checkpoint(block, x)` starts at column 12 of line 6 and is 20 characters long
    assert (finding["line"], finding["column"], finding["end_line"], finding["end_column"]) == (6, 12, 6, 32)
    assert finding["fix"]["applicability"] == "unsafe"
    assert finding["fix"]["edits"] == [
        {"line": 6, "column": 31, "end_line": 6, "end_column": 31, "content": ", use_reentrant=False"}
    ]
    assert "verify" not in finding
    assert data["summary"]["files"] == 2
    assert data["summary"]["findings"] == 1
    assert data["summary"]["by_rule"] == {"TL201": 1}
    assert isinstance(data["summary"]["elapsed_s"], float)


def test_sarif_has_the_structure_github_reads(project, capsys) -> None:
    (project / "src" / "reentrant.py").write_text(REENTRANT)
    code, out, _ = run_cli(capsys, "--format", "sarif", "--no-cache", "src")
    assert code == 1
    log = json.loads(out)
    assert log["version"] == "2.1.0"
    assert log["$schema"].endswith("sarif-2.1.0.json")
    (sarif_run,) = log["runs"]
    driver = sarif_run["tool"]["driver"]
    assert driver["name"] == "trainlint"
    rule_ids = [r["id"] for r in driver["rules"]]
    assert rule_ids == registry().ids()
    for rule in driver["rules"]:
        assert rule["shortDescription"]["text"]
        assert rule["fullDescription"]["text"]
        assert rule["help"]["text"] and rule["help"]["markdown"].startswith(f"# {rule['id']}")
        assert rule["defaultConfiguration"]["level"] in ("error", "warning", "note")
    results = sarif_run["results"]
    assert sorted(r["ruleId"] for r in results) == ["TL201", "TL202"]
    for result in results:
        assert driver["rules"][result["ruleIndex"]]["id"] == result["ruleId"]
        assert result["message"]["text"]
        assert result["level"] in ("error", "warning", "note")
        (location,) = result["locations"]
        physical = location["physicalLocation"]
        uri = physical["artifactLocation"]["uri"]
        assert uri.startswith("src/") and not uri.startswith("/")
        region = physical["region"]
        assert region["startLine"] >= 1 and region["startColumn"] >= 1
        assert (region["endLine"], region["endColumn"]) >= (region["startLine"], region["startColumn"])


def test_github_annotations_are_well_formed_and_escaped(project, capsys) -> None:
    weird = project / "src" / "a,b:c%.py"
    weird.write_text(BAD)
    code, out, _ = run_cli(capsys, "--format", "github", "--no-cache", "src")
    assert code == 1
    lines = out.strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        assert line.startswith("::warning file=")
        props, message = line[len("::warning ") :].split("::", 1)
        keys = [p.split("=", 1)[0] for p in props.split(",")]
        assert keys == ["file", "line", "col", "endLine", "endColumn", "title"]
        assert message.startswith("TL201 ")
        assert "\n" not in message
    assert "file=src/a%2Cb%3Ac%25.py," in out


# -- rule documentation --------------------------------------------------------------------------------


def test_list_rules_shows_every_rule(capsys) -> None:
    code, out, _ = run_cli(capsys, "--list-rules")
    assert code == 0
    header, *rows = out.strip().splitlines()
    assert header.split()[:5] == ["id", "name", "severity", "fix", "probe"]
    assert [row.split()[0] for row in rows] == registry().ids()
    tl201 = next(row.split() for row in rows if row.startswith("TL201"))
    assert tl201[1:4] == ["checkpoint-use-reentrant", "warning", "yes"]


def test_explain_prints_the_documented_sections(capsys) -> None:
    code, out, _ = run_cli(capsys, "--explain", "tl201")
    assert code == 0
    assert out.startswith("# TL201 (checkpoint-use-reentrant)")
    for section in (
        "## What it does",
        "## Why is this bad?",
        "## Example",
        "## Use instead",
        "## Fix safety",
    ):
        assert section in out


def test_explain_unknown_rule(capsys) -> None:
    code, _, err = run_cli(capsys, "--explain", "TL000")
    assert code == 2
    assert "unknown rule 'TL000'" in err


# -- fixes -----------------------------------------------------------------------------------------------


def test_diff_shows_unsafe_fix_and_changes_nothing(project, capsys) -> None:
    before = (project / "src" / "bad.py").read_text()
    code, out, _ = run_cli(capsys, "--no-cache", "--diff", "src")
    assert code == 0 and out == ""  # the only fix is unsafe
    code, out, _ = run_cli(capsys, "--no-cache", "--diff", "--unsafe-fixes", "src")
    assert code == 1
    assert "-    return checkpoint(block, x)\n+    return checkpoint(block, x, use_reentrant=False)\n" in out
    assert (project / "src" / "bad.py").read_text() == before


def test_fix_with_unsafe_fixes_rewrites_the_file(project, capsys) -> None:
    code, out, _ = run_cli(capsys, "--no-cache", "--fix", "--unsafe-fixes", "src")
    assert code == 0
    assert "Fixed 1 finding." in out
    assert "return checkpoint(block, x, use_reentrant=False)" in (project / "src" / "bad.py").read_text()
    code, _, _ = run_cli(capsys, "--no-cache", "src")
    assert code == 0


def test_fix_on_stdin_prints_the_fixed_source(project, capsys) -> None:
    code, out, _ = run_cli(capsys, "-", "--fix", "--unsafe-fixes", "--stdin-filename", "x.py", stdin=BAD)
    assert code == 0
    assert out == BAD.replace("checkpoint(block, x)", "checkpoint(block, x, use_reentrant=False)")


# -- cache and jobs --------------------------------------------------------------------------------------


def test_cache_is_written_and_reused(project, capsys) -> None:
    code1, out1, _ = run_cli(capsys, "--format", "json", "src")
    assert not (project / ".trainlint_cache").exists()  # per user, outside the linted tree
    code2, out2, _ = run_cli(capsys, "--format", "json", "src")
    strip = lambda s: {k: v for k, v in json.loads(s).items() if k != "summary"}  # noqa: E731
    assert code1 == code2 == 1
    assert strip(out1) == strip(out2)


def test_jobs_give_the_same_findings(project, capsys) -> None:
    for i in range(8):
        (project / "src" / f"copy{i}.py").write_text(BAD)
    _, one = json_run(capsys, "--jobs", "1", "src")
    _, two = json_run(capsys, "--jobs", "2", "src")
    assert one["findings"] == two["findings"]
    assert len(one["findings"]) == 9


def test_config_flag_points_at_a_file(project, capsys) -> None:
    (project / "custom.toml").write_text('select = ["TL202"]\n')
    (project / "src" / "reentrant.py").write_text(REENTRANT)
    _, data = json_run(capsys, "--config", "custom.toml", "src")
    assert [f["rule"] for f in data["findings"]] == ["TL202"]
    code, _, err = run_cli(capsys, "--config", "missing.toml", "src")
    assert code == 2
    assert "missing.toml: no such configuration file" in err


def test_cache_dir_flag(project, capsys) -> None:
    code, _, _ = run_cli(capsys, "--cache-dir", "elsewhere", "src")
    assert code == 1
    assert list((project / "elsewhere").rglob("*.json"))
    assert not (project / ".trainlint_cache").exists()


def test_noqa_takes_full_codes_only(project, capsys) -> None:
    src = project / "src"
    (src / "bad.py").write_text(BAD.replace("checkpoint(block, x)", "checkpoint(block, x)  # noqa: TL"))
    (src / "prefix.py").write_text(BAD.replace("checkpoint(block, x)", "checkpoint(block, x)  # noqa: TL2"))
    _, data = json_run(capsys, "src")
    assert sorted(f["path"] for f in data["findings"]) == ["src/bad.py", "src/prefix.py"]


def test_severity_override_applies_to_parse_problems(project, capsys) -> None:
    (project / "src" / "broken.py").write_text("def (:\n")
    (project / "pyproject.toml").write_text('[tool.trainlint]\nseverity = { TL901 = "warning" }\n')
    _, data = json_run(capsys, "src")
    assert {f["rule"]: f["severity"] for f in data["findings"]}["TL901"] == "warning"


def test_nul_bytes_on_stdin_are_tl902_as_for_a_file(project, capsys) -> None:
    _, data = json_run(capsys, "-", "--stdin-filename", "x.py", stdin="x = 1\x00\n")
    assert [f["rule"] for f in data["findings"]] == ["TL902"]


def test_jobs_below_one_is_a_usage_error(project, capsys) -> None:
    code, _, err = run_cli(capsys, "--jobs", "0", "src")
    assert code == 2
    assert "--jobs must be at least 1" in err


def test_unusual_literals_do_not_crash_rules(project, capsys) -> None:
    (project / "src" / "odd.py").write_text(
        "import torch\nimport torch.nn as nn\n\n"
        "class A(nn.Module):\n    def forward(self, q, k, v):\n"
        "        s = q @ k.transpose(0x2, 0x3)\n        return s.softmax(-1) @ v\n\n"
        "def train(model, loader, opt, accum_steps):\n    for x, y in loader:\n"
        "        loss = model(x, labels=y).loss\n        loss = loss * (0b1 / accum_steps)\n"
        "        loss.backward()\n        opt.step()\n"
        "        torch.nn.utils.clip_grad_norm_(model.parameters(), float(b'inf'))\n"
    )
    code, data = json_run(capsys, "src/odd.py")
    assert data["errors"] == []
    assert code == 1  # TL405 on the hand-written attention


def test_errors_without_findings_do_not_say_all_checks_passed(project, capsys, monkeypatch) -> None:
    from trainlint.rules.checkpoint import tl201_checkpoint_use_reentrant as checkpoint_rules

    def boom(self, model):
        raise RuntimeError("rule bug")

    monkeypatch.setattr(checkpoint_rules.CheckpointUseReentrant, "check", boom)
    code, out, err = run_cli(capsys, "--no-cache", "src")
    assert code == 2
    assert "All checks passed" not in out
    assert "internal error in TL201" in err
