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

ROOT = Path(__file__).resolve().parent.parent
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
    assert 'pip install "trainlint[verify]"' in err


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
def test_device_cuda_without_cuda_says_it_ran_on_cpu(monkeypatch, capsys) -> None:
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
    run(
        [
            "--no-cache",
            "--verify",
            "--device",
            "cuda",
            "--select",
            "TL301",
            "--format",
            "json",
            "fixtures/bad_finetune_half.py",
        ]
    )
    (finding,) = json.loads(capsys.readouterr().out)["findings"]
    assert finding["verify"]["device"] == "cpu"
    assert finding["verify"]["detail"].startswith("--device cuda was asked for but CUDA is not available")
