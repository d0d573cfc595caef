"""The ``--verify`` child package: its shared evidence builder and tolerances, and how it is started
(loaded by path, importing nothing of the parent side)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainlint.verify import torch_available
from trainlint.verify.child import BOOT
from trainlint.verify.runner import CHILD

pytestmark = pytest.mark.skipif(not torch_available(), reason="torch is not installed")


@pytest.fixture(scope="module")
def child():
    import torch

    from trainlint.verify.child import compare

    return torch, compare


def test_compare_uses_the_named_tolerance(child):
    torch, cmp = child
    ref = {"w": torch.full((4,), 4.0)}
    # FLOAT32 allows 1e-7 + 1e-5 * max|ref| = 4.01e-5 here (the relative part scales with |ref|)
    below = cmp.compare({"w": torch.full((4,), 4 + 2e-5)}, ref, cmp.FLOAT32)
    above = cmp.compare({"w": torch.full((4,), 4 + 1e-4)}, ref, cmp.FLOAT32)
    assert below["match"] and below["differing"] == []
    assert not above["match"] and above["differing"] == ["w"]
    # the looser tolerance of many sums accepts what FLOAT32 rejects
    assert cmp.compare({"w": torch.full((4,), 4 + 1e-4)}, ref, cmp.FLOAT32_SUMS)["match"]
    assert cmp.FLOAT32.rtol < cmp.FLOAT32_SUMS.rtol < cmp.AUTOCAST_STEPS.rtol < cmp.HALF_PARAMETERS.rtol


def test_compare_reports_a_missing_gradient(child):
    torch, cmp = child
    got = cmp.compare({"w": None}, {"w": torch.ones(2)}, cmp.FLOAT32)
    assert got["missing"] == ["w"] and not got["match"]


def _runs(torch, fixed_value):
    return {
        "reference": {"grads": {"w": torch.ones(3)}},
        "fixed": {"grads": {"w": torch.full((3,), fixed_value)}},
    }


def test_fixed_outcome_matches_within_the_tolerance_and_differs_above(child):
    torch, cmp = child
    wording = cmp.FixWording.max_rel("with the fix")
    close = cmp.fixed_outcome(_runs(torch, 1 + 1e-6), {}, ("grads",), cmp.FLOAT32, wording)
    far = cmp.fixed_outcome(_runs(torch, 1.5), {}, ("grads",), cmp.FLOAT32, wording)
    assert close is not None and close.matches and close.text.endswith("(matches)")
    assert far is not None and not far.matches
    assert far.text == "with the fix: max rel 0.5 (still differs)"
    assert far.evidence == {"max_abs": 0.5, "max_rel": 0.5}


def test_fixed_outcome_of_a_fix_that_raises_and_of_no_fix(child):
    _, cmp = child
    wording = cmp.FixWording("the fix raises {stripped}", "m", "d")
    raised = cmp.fixed_outcome({}, {"fixed": "ValueError: bad."}, ("grads",), cmp.FLOAT32, wording)
    assert raised is not None and raised.text == "the fix raises ValueError: bad"
    assert raised.evidence == {"exception": "ValueError: bad."} and not raised.matches
    assert cmp.fixed_outcome({"reference": {}}, {}, ("grads",), cmp.FLOAT32, wording) is None


def test_fixed_outcome_takes_the_worse_of_several_fields(child):
    torch, cmp = child
    runs = {
        "reference": {"grads": {"w": torch.ones(2)}, "outputs": {"y": torch.ones(2)}},
        "fixed": {"grads": {"w": torch.ones(2)}, "outputs": {"y": torch.full((2,), 2.0)}},
    }
    out = cmp.fixed_outcome(runs, {}, ("grads", "outputs"), cmp.FLOAT32, cmp.FixWording.max_rel("fix"))
    assert out is not None and not out.matches and out.evidence["max_rel"] == 1.0


def test_evidence_and_verdict_carry_the_fix_and_the_notes(child):
    torch, cmp = child
    c = cmp.compare({"w": torch.full((2,), 3.0)}, {"w": torch.ones(2)}, cmp.AUTOCAST_STEPS)
    fixed = cmp.FixedOutcome({"max_abs": 0.0, "max_rel": 0.0}, "with the fix: ok", True)
    ev = cmp.reference_evidence(c, cmp.AUTOCAST_STEPS, fixed, steps=3)
    assert ev["as_written_vs_reference"] == {"max_abs": 2.0, "max_rel": 2.0}
    assert ev["tolerance"] == {"rtol": cmp.AUTOCAST_STEPS.rtol, "atol": cmp.AUTOCAST_STEPS.atol}
    assert ev["steps"] == 3 and ev["fixed_vs_reference"] == fixed.evidence
    out = cmp.verdict(True, "it differs", ev, fixed, ["a", "b"])
    assert out["status"] == "confirmed" and out["fixed_matches"]
    assert out["detail"] == "it differs; with the fix: ok [a; b]"
    plain = cmp.verdict(False, "same", {}, None, [])
    assert plain == {"status": "not-reproduced", "detail": "same", "evidence": {}, "fixed_matches": False}


def test_child_boots_by_path_without_the_parent_side(tmp_path: Path):
    """The child runs from its folder alone: a probe runs, and neither trainlint's parent-side modules
    nor libcst were imported in the child."""
    program = textwrap.dedent(
        """
        import json, sys
        import torch
        w = torch.nn.Parameter(torch.ones(2))
        def __tl_run__():
            with open("modules.json", "w") as fh:
                json.dump(sorted(sys.modules), fh)
            return w * 2
        """
    )
    probe = {
        "id": "p1",
        "driver": "grads",
        "roots": ["w"],
        "programs": {"reference": program, "as_written": program},
    }
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"device": "cpu", "timeout": 60, "probes": [probe]}), encoding="utf-8")
    results = tmp_path / "results.jsonl"
    proc = subprocess.run(
        [sys.executable, "-c", BOOT, str(CHILD), str(job), str(results)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in results.read_text(encoding="utf-8").splitlines()]
    assert lines[-1]["id"] == "p1" and lines[-1]["status"] == "not-reproduced", lines[-1]
    modules = json.loads((tmp_path / "modules.json").read_text(encoding="utf-8"))
    parent_side = [m for m in modules if m == "trainlint" or m.startswith(("trainlint.", "libcst"))]
    assert parent_side == []
    assert "trainlint_verify_child.drivers" in modules
