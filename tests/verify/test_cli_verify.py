"""`--verify` and `--device` through the command line, and the promise that plain linting never
imports torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import trainlint.verify
from trainlint.cli import run

ROOT = Path(__file__).resolve().parents[2]
needs_torch = pytest.mark.skipif(not trainlint.verify.torch_available(), reason="--verify needs torch")


def test_static_linting_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "from trainlint.cli import run\n"
        "run(['--no-cache', '--format', 'json', 'fixtures'])\n"
        "sys.stderr.write('TORCH=' + str('torch' in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert json.loads(proc.stdout)["findings"], "the fixtures must produce findings"
    assert proc.stderr.strip().endswith("TORCH=False")


def test_verify_without_torch_exits_2_with_the_install_hint(monkeypatch, capsys) -> None:
    monkeypatch.setattr(trainlint.verify, "torch_available", lambda: False)
    code = run(["--no-cache", "--verify", str(ROOT / "fixtures" / "bad_gpt_amp.py")])
    err = capsys.readouterr().err
    assert code == 2
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in err


@needs_torch
def test_verify_json_carries_the_verify_object(monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    code = run(["--no-cache", "--verify", "--device", "cpu", "--format", "json", "fixtures/bad_gpt_amp.py"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1
    by_rule = {f["rule"]: f for f in data["findings"]}
    assert set(by_rule) == {"TL101", "TL201", "TL203", "TL301"}
    for finding in by_rule.values():
        verify = finding["verify"]
        assert verify["status"] == "confirmed", verify
        assert verify["device"] == "cpu"
        assert verify["torch"].startswith("2.")
        assert verify["evidence"]
    # an unsafe fix that the probe showed to match the reference is applied as verified
    assert by_rule["TL201"]["fix"]["applicability"] == "verified"


@needs_torch
def test_verify_text_prints_the_verdict_under_each_finding(monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    code = run(["--no-cache", "--verify", "--device", "cpu", "fixtures/bad_finetune_half.py"])
    out = capsys.readouterr().out
    assert code == 1
    assert out.count("verify: confirmed on cpu") == 2  # TL105 and TL301


def test_verify_leaves_findings_without_a_probe_alone(monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    # TL403 has no probe: no torch is needed to decide that, and no verify object is attached
    code = run(
        [
            "--no-cache",
            "--verify",
            "--select",
            "TL403",
            "--format",
            "json",
            "fixtures/bad_accumulation_loop.py",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    if not trainlint.verify.torch_available():
        assert code == 2
        return
    assert code == 1
    (finding,) = data["findings"]
    assert "verify" not in finding


@needs_torch
def test_device_cuda_without_cuda_is_a_usage_error(monkeypatch, capsys) -> None:
    import importlib.util

    spec = importlib.util.find_spec("torch")
    has_cuda = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    if spec is None or has_cuda == "True":
        pytest.skip("this machine has CUDA")
    monkeypatch.chdir(ROOT)
    code = run(
        ["--no-cache", "--verify", "--device", "cuda", "--select", "TL301", "fixtures/bad_finetune_half.py"]
    )
    captured = capsys.readouterr()
    assert code == 2  # issue 17: an error once, not a note on every finding
    assert "--device cuda: PyTorch sees no CUDA device" in captured.err
    assert captured.out == ""


# -- probes are tied to rules by code --------------------------------------------------------------------


def test_the_rules_that_declare_a_probe_are_exactly_the_keys_of_PROBES() -> None:
    from trainlint.rule import registry
    from trainlint.verify.probes import PROBES

    declared = {rule.id for rule in registry() if rule.has_probe()}
    assert declared == set(PROBES)
    assert all(callable(probe) for probe in PROBES.values())


def test_list_rules_and_the_readme_say_probe_exactly_for_the_rules_in_PROBES(capsys) -> None:
    from trainlint.verify.probes import PROBES

    assert run(["--list-rules"]) == 0
    header, *rows = capsys.readouterr().out.strip().splitlines()
    column = header.split().index("probe")
    listed = {row.split()[0] for row in rows if row.startswith("TL") and row.split()[column] == "yes"}
    assert listed == set(PROBES)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = readme.splitlines()
    start = lines.index("| id | name | severity | fix | probe | what it reports |") + 2
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append(line.split("|"))
    assert len(table) == len(rows), "the README's rule table has a row per rule"
    assert {cells[1].strip() for cells in table if cells[5].strip() == "yes"} == set(PROBES)


def test_a_declared_probe_missing_from_PROBES_is_an_error_not_silence(monkeypatch) -> None:
    from trainlint.engine import lint_source
    from trainlint.verify.probes import PROBES

    path = "fixtures/bad_amp_loops.py"
    text = (ROOT / path).read_text(encoding="utf-8")
    findings = lint_source(text, path, ["TL104"])
    assert findings
    monkeypatch.delitem(PROBES, "TL104")
    out = trainlint.verify.verify_findings(findings, {path: text}, device="cpu", timeout=30)
    for finding in out:
        assert finding.verify is not None and finding.verify["status"] == "error"
        assert "PROBES" in finding.verify["detail"]


def test_verify_imports_no_private_name_of_a_rule_module() -> None:
    import ast

    for path in sorted((ROOT / "lint" / "verify").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainlint.rules"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from {node.module}"


def test_related_labels_survive_the_json_round_trip() -> None:
    from trainlint.engine import lint_source
    from trainlint.rule import Finding
    from trainlint.rules.amp.tl104_unscale_twice import UnscaleTwice

    path = "fixtures/bad_amp_loops.py"
    (finding,) = lint_source((ROOT / path).read_text(encoding="utf-8"), path, ["TL104"])
    assert [r.label for r in finding.related] == [UnscaleTwice.FIRST]
    data = json.loads(json.dumps(finding.to_json()))
    assert Finding.from_json(data) == finding


@needs_torch
def test_rewording_a_related_message_keeps_tl104_confirmed(monkeypatch) -> None:
    """Probes find a related location by the rule's label, not by the words of its message."""
    import dataclasses

    from trainlint.engine import lint_source
    from trainlint.rules.amp.tl104_unscale_twice import UnscaleTwice

    check = UnscaleTwice.check

    def reworded(self, model):
        for diag in check(self, model):
            related = tuple((node, "said differently", *label) for node, _, *label in diag.related)
            yield dataclasses.replace(diag, related=related)

    monkeypatch.setattr(UnscaleTwice, "check", reworded)
    path = "fixtures/bad_amp_loops.py"
    text = (ROOT / path).read_text(encoding="utf-8")
    (finding,) = lint_source(text, path, ["TL104"])
    assert [r.message for r in finding.related] == ["said differently"]
    (out,) = trainlint.verify.verify_findings([finding], {path: text}, device="cpu", timeout=60)
    assert out.verify["status"] == "confirmed", out.verify["detail"]
