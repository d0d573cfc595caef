"""Issue 17, items 1-8: trainlint as editors, CI and pre-commit call it."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import pytest

import trainlint.cli
import trainlint.verify
from trainlint.cli import run
from trainlint.rule import Applicability, registry

BAD = textwrap.dedent(
    """\
    import torch
    from torch.utils.checkpoint import checkpoint


    def forward(block, x):
        return checkpoint(block, x)
    """
)
FIXED = BAD.replace("checkpoint(block, x)", "checkpoint(block, x, use_reentrant=False)")
REENTRANT = "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x, use_reentrant=True)\n"


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "bad.py").write_text(BAD)
    return tmp_path


def run_cli(capsys, *argv: str, stdin: str | None = None) -> tuple[int, str, str]:
    code = run(list(argv), stdin=stdin)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def json_run(capsys, *argv: str, stdin: str | None = None) -> tuple[int, dict]:
    code, out, err = run_cli(capsys, "--format", "json", "--no-cache", *argv, stdin=stdin)
    assert out, err
    return code, json.loads(out)


# -- 1: --fix --verify applies what --verify verified, and keeps the verdicts ----------------------------


@pytest.fixture
def fake_verify(monkeypatch):
    """--verify without a child process: every fix is marked verified, every finding gets a verdict
    (what the real harness does when the probe's fixed run matches the reference)."""

    def verify(findings, sources, device="auto", timeout=60.0, early=None):  # early: ended by the CLI
        out = []
        for f in findings:
            fix = f.fix and dataclasses.replace(f.fix, applicability=Applicability.VERIFIED)
            verdict = {"status": "confirmed", "device": "cpu", "torch": "x", "detail": "seen", "evidence": {}}
            out.append(dataclasses.replace(f, fix=fix, verify=verdict))
        return out

    monkeypatch.setattr(trainlint.verify, "torch_available", lambda: True)
    monkeypatch.setattr(trainlint.verify, "verify_findings", verify)


def test_fix_verify_applies_verified_fixes(project, capsys, fake_verify) -> None:
    code, out, _ = run_cli(capsys, "--no-cache", "--verify", "--fix", "src")
    assert (project / "src" / "bad.py").read_text() == FIXED
    assert "Fixed 1 finding." in out
    assert code == 0


def test_fix_verify_keeps_the_verify_lines_of_what_is_left(project, capsys, fake_verify) -> None:
    # TL201 is fixed (verified); TL202 has no fix and stays, re-linted in the fixed file
    (project / "src" / "bad.py").write_text(BAD + "\ny = checkpoint(block, x, use_reentrant=True)\n")
    code, data = json_run(capsys, "--verify", "--fix", "src")
    assert code == 1
    assert [f["rule"] for f in data["findings"]] == ["TL202"]
    assert data["findings"][0]["verify"]["status"] == "confirmed"
    assert "use_reentrant=False" in (project / "src" / "bad.py").read_text()


def test_diff_with_only_unsafe_fixes_says_so(project, capsys) -> None:
    code, out, err = run_cli(capsys, "--no-cache", "--diff", "src")
    assert code == 0 and out == ""
    assert "--unsafe-fixes" in err


# -- 2: the configuration is found from the files ---------------------------------------------------------


def _subproject(root: Path) -> Path:
    proj = root / "proj"
    (proj / "pkg").mkdir(parents=True)
    (proj / "pkg" / "bad.py").write_text(BAD)
    (proj / "pyproject.toml").write_text('[tool.trainlint]\nignore = ["TL201"]\n')
    return proj


def test_closest_config_above_each_file_applies(project, capsys) -> None:
    _subproject(project)
    code, data = json_run(capsys, "proj", "src")
    assert code == 1
    assert [f["path"] for f in data["findings"]] == ["src/bad.py"]


def test_config_flag_pins_one_configuration(project, capsys) -> None:
    _subproject(project)
    (project / "none.toml").write_text("select = ['TL1']\n")
    _, data = json_run(capsys, "proj")
    assert data["findings"] == []
    _, data = json_run(capsys, "--config", "none.toml", "--extend-select", "TL201", "proj")
    assert [f["rule"] for f in data["findings"]] == ["TL201"]


def test_stdin_filename_from_root_uses_the_projects_config(project, capsys, monkeypatch) -> None:
    proj = _subproject(project)
    monkeypatch.chdir("/")
    target = str(proj / "pkg" / "bad.py")
    _, data = json_run(capsys, "-", "--stdin-filename", target, stdin=BAD)
    assert data["findings"] == []


def test_per_file_ignores_are_relative_to_the_files_config(project, capsys) -> None:
    proj = _subproject(project)
    (proj / "pyproject.toml").write_text('[tool.trainlint]\nper-file-ignores = { "pkg/*" = ["TL2"] }\n')
    _, data = json_run(capsys, "proj")
    assert data["findings"] == []


# -- 3 and 4: excludes ----------------------------------------------------------------------------------------


def test_force_exclude_skips_excluded_files_named_on_the_command_line(project, capsys) -> None:
    (project / "pyproject.toml").write_text('[tool.trainlint]\nextend-exclude = ["src"]\n')
    code, data = json_run(capsys, "--force-exclude", "src/bad.py")
    assert data["findings"] == [] and code == 0
    code, _, _ = run_cli(capsys, "--no-cache", "--force-exclude", "--fix", "--unsafe-fixes", "src/bad.py")
    assert (project / "src" / "bad.py").read_text() == BAD


def test_force_exclude_applies_to_stdin_filename(project, capsys) -> None:
    (project / "pyproject.toml").write_text('[tool.trainlint]\nextend-exclude = ["src"]\n')
    _, data = json_run(capsys, "-", "--force-exclude", "--stdin-filename", "src/bad.py", stdin=BAD)
    assert data["findings"] == []


def test_hooks_pass_force_exclude() -> None:
    hooks = (Path(__file__).resolve().parent.parent / ".pre-commit-hooks.yaml").read_text()
    entries = [
        line.split(":", 1)[1].strip() for line in hooks.splitlines() if line.strip().startswith("entry:")
    ]
    assert len(entries) == 2
    assert all("--force-exclude" in entry for entry in entries)


@pytest.mark.parametrize("folder", ["dist", "build"])
def test_dist_and_build_packages_are_linted(project, capsys, folder: str) -> None:
    (project / "src" / folder).mkdir()
    (project / "src" / folder / "mod.py").write_text(BAD)
    _, data = json_run(capsys, "src")
    assert sorted(f["path"] for f in data["findings"]) == ["src/bad.py", f"src/{folder}/mod.py"]


def test_a_run_that_skipped_files_says_how_many(project, capsys) -> None:
    (project / "src" / "legacy").mkdir()
    (project / "src" / "legacy" / "old.py").write_text(BAD)
    (project / "src" / "gen.py").write_text(BAD)
    (project / "pyproject.toml").write_text('[tool.trainlint]\nextend-exclude = ["src/legacy", "gen.py"]\n')
    code, out, _ = run_cli(capsys, "--no-cache", "src")
    assert code == 1
    assert "2 paths excluded" in out
    _, data = json_run(capsys, "src")
    assert data["summary"]["excluded"] == 2


# -- 6: rule documentation URLs everywhere -------------------------------------------------------------


def test_json_findings_carry_the_rule_url(project, capsys) -> None:
    _, data = json_run(capsys, "src")
    (finding,) = data["findings"]
    assert finding["url"] and finding["url"].endswith("docs/rules/TL201.md")


def test_github_annotation_carries_the_verify_verdict(project, capsys, fake_verify) -> None:
    code, out, _ = run_cli(capsys, "--no-cache", "--verify", "--format", "github", "src")
    assert code == 1
    assert "verify: confirmed on cpu" in out


# -- 8: papercuts ----------------------------------------------------------------------------------------------


def test_explain_by_rule_name(capsys) -> None:
    code, out, _ = run_cli(capsys, "--explain", "checkpoint-use-reentrant")
    assert code == 0
    assert out.startswith("# TL201 (checkpoint-use-reentrant)")


def test_list_rules_as_json(capsys) -> None:
    code, out, _ = run_cli(capsys, "--list-rules", "--format", "json")
    assert code == 0
    rules = json.loads(out)
    assert [r["id"] for r in rules] == registry().ids()
    tl201 = next(r for r in rules if r["id"] == "TL201")
    assert tl201["name"] == "checkpoint-use-reentrant" and tl201["fix"] is True
    assert tl201["url"].endswith("docs/rules/TL201.md")


@pytest.mark.parametrize("flag", ["--select", "--extend-select", "--ignore"])
def test_empty_selector_flag_is_an_error(project, capsys, flag: str) -> None:
    code, _, err = run_cli(capsys, "--no-cache", flag, "", "src")
    assert code == 2
    assert flag in err


def test_device_cuda_without_cuda_is_an_error(project, capsys, monkeypatch) -> None:
    monkeypatch.setattr(trainlint.verify, "torch_available", lambda: True)
    monkeypatch.setattr(trainlint.cli, "_cuda_available", lambda: False)
    code, _, err = run_cli(capsys, "--no-cache", "--verify", "--device", "cuda", "src")
    assert code == 2
    assert "CUDA" in err


def test_summary_counts_the_files_with_findings(project, capsys) -> None:
    (project / "src" / "good.py").write_text("x = 1\n")
    (project / "src" / "good2.py").write_text("x = 1\n")
    _, out, _ = run_cli(capsys, "--no-cache", "src")
    assert "Found 1 finding (1 warning) in 1 file (3 files checked)." in out


def test_carets_sit_under_wide_characters(project, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    (project / "src" / "bad.py").write_text(
        BAD.replace("    return checkpoint(block, x)", "    z = '日本語'; return checkpoint(block, x)")
    )
    _, out, _ = run_cli(capsys, "--no-cache", "src")
    lines = out.splitlines()
    code_line = next(i for i, line in enumerate(lines) if "日本語" in line and "│" in line)
    caret_line = lines[code_line + 1]
    code_text = lines[code_line]
    # in terminal cells: each of the three wide characters takes two
    cells = code_text.index("checkpoint(") + 3
    assert caret_line.index("^") == cells


def test_related_locations_have_end_positions(project, capsys) -> None:
    (project / "src" / "twice.py").write_text(
        textwrap.dedent(
            """\
            import torch
            scaler = torch.cuda.amp.GradScaler()
            for x in data:
                loss = model(x)
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
            """
        )
    )
    _, data = json_run(capsys, "src/twice.py")
    related = [r for f in data["findings"] for r in f["related"]]
    assert related
    for r in related:
        assert (r["end_line"], r["end_column"]) > (r["line"], r["column"])


# -- 6: SARIF that validates and carries fixes, help URIs and verify results --------------------------------

SARIF_SCHEMA = Path(__file__).resolve().parent / "data" / "sarif-schema-2.1.0.json"


def test_sarif_validates_and_carries_fixes_help_and_verify(project, capsys, fake_verify) -> None:
    """The schema is OASIS's sarif-2.1/schema/sarif-schema-2.1.0.json (oasis-tcs/sarif-spec), vendored."""
    jsonschema = pytest.importorskip("jsonschema")
    (project / "src" / "we ird#日本.py").write_text(
        "z = '日本語'; " + REENTRANT.replace("\n", "\nz = 1\n", 1)
    )
    code, out, _ = run_cli(capsys, "--no-cache", "--verify", "--format", "sarif", "src")
    assert code == 1
    log = json.loads(out)
    jsonschema.validate(log, json.loads(SARIF_SCHEMA.read_text()))
    (sarif_run,) = log["runs"]
    assert sarif_run["columnKind"] == "unicodeCodePoints"
    for rule in sarif_run["tool"]["driver"]["rules"]:
        assert rule["helpUri"].endswith(f"docs/rules/{rule['id']}.md")
    results = sarif_run["results"]
    assert all(r["properties"]["verify"]["status"] == "confirmed" for r in results)
    fixed = next(r for r in results if r["ruleId"] == "TL201")
    (change,) = fixed["fixes"][0]["artifactChanges"]
    assert change["replacements"][0]["insertedContent"]["text"]
    uris = {r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for r in results}
    assert "src/we%20ird%23%E6%97%A5%E6%9C%AC.py" in uris


# -- 7: notebooks ------------------------------------------------------------------------------------------------


def _notebook(*cells: tuple[str, str]) -> str:
    return json.dumps(
        {
            "cells": [
                {"cell_type": kind, "metadata": {}, "source": source.splitlines(keepends=True)}
                | ({"outputs": [], "execution_count": None} if kind == "code" else {})
                for kind, source in cells
            ],
            "metadata": {},
            "nbformat": 4,
            "nbformat_minor": 5,
        }
    )


NOTEBOOK = _notebook(
    ("markdown", "# Training\n"),
    ("code", "%matplotlib inline\nimport torch\nfrom torch.utils.checkpoint import checkpoint\n"),
    ("code", "!pip install foo\n\ndef forward(block, x):\n    return checkpoint(block, x)\n"),
)


def test_notebook_code_cells_are_linted_with_cell_positions(project, capsys) -> None:
    (project / "src" / "train.ipynb").write_text(NOTEBOOK)
    code, data = json_run(capsys, "src/train.ipynb")
    (finding,) = data["findings"]
    assert (finding["rule"], finding["cell"], finding["line"], finding["column"]) == ("TL201", 2, 4, 12)
    code, out, _ = run_cli(capsys, "--no-cache", "src/train.ipynb")
    assert code == 1
    assert "src/train.ipynb:cell 2:4:12: TL201" in out
    assert "return checkpoint(block, x)" in out  # the frame comes from the cell


def test_notebooks_in_a_folder_are_linted(project, capsys) -> None:
    (project / "src" / "train.ipynb").write_text(NOTEBOOK)
    _, data = json_run(capsys, "src")
    assert sorted(f["path"] for f in data["findings"]) == ["src/bad.py", "src/train.ipynb"]


def test_a_broken_notebook_is_tl902(project, capsys) -> None:
    (project / "src" / "broken.ipynb").write_text("{not json")
    _, data = json_run(capsys, "src/broken.ipynb")
    assert [f["rule"] for f in data["findings"]] == ["TL902"]


def test_a_file_deep_in_a_project_from_root_gets_the_projects_config(project, capsys, monkeypatch) -> None:
    proj = _subproject(project)
    monkeypatch.chdir("/")
    _, data = json_run(capsys, str(proj / "pkg" / "bad.py"))
    assert data["findings"] == []
    _, data = json_run(capsys, str(project / "src" / "bad.py"))
    assert [f["rule"] for f in data["findings"]] == ["TL201"]
