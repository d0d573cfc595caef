"""`trainlint run`: the planted-hazard scripts in fixtures/run/ are reported with their measured
magnitudes, their fixed twins give nothing, and the runner behaves like `python` (argv, -m, --steps,
Ctrl-C, the user's own errors)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

from trainlint.run.cli import main

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "fixtures" / "run"

pytestmark = pytest.mark.filterwarnings("ignore")


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main(["--format", "json", *argv])
    return code, json.loads(capsys.readouterr().out)


def seen(data: dict, rule: str) -> list[dict]:
    """Findings of a rule that the run saw (confirmed static findings and runtime-only ones)."""
    return [f for f in data["findings"] if f["rule"] == rule and f["run"]["status"] != "not-reached"]


@pytest.fixture(autouse=True)
def in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


# rule, planted fixture, line of the static finding the run must confirm
PLANTED = [
    ("TL101", "bad_clip_scaled.py", 16),
    ("TL102", "bad_step_bypass.py", 16),
    ("TL104", "bad_unscale_twice.py", 23),
    ("TL105", "bad_half_model.py", 7),
    ("TL201", "bad_checkpoint_reentrant.py", 15),
    ("TL203", "bad_checkpoint_side_effect.py", 16),
    ("TL204", "bad_checkpoint_rng.py", 25),
    ("TL301", "bad_accumulation_mean.py", 24),
    ("TL302", "bad_running_loss.py", 17),
    ("TL303", "bad_zero_grad_micro.py", 13),
    ("TL401", "bad_memory_readings.py", 18),
    ("TL403", "bad_memory_readings.py", 17),
    ("TL404", "bad_memory_readings.py", 9),
    ("TL402", "bad_timing_no_sync.py", 23),
]
# the DDP fixtures (TL501, TL502) run in subprocesses, in tests/run/test_run_distributed.py


@pytest.mark.parametrize(("rule", "name", "line"), PLANTED)
def test_planted_hazard_is_seen_and_confirms_the_static_finding(capsys, rule, name, line) -> None:
    code, data = run_json(capsys, "--", "python", f"fixtures/run/{name}")
    hits = seen(data, rule)
    assert (f"fixtures/run/{name}", line) in [(f["path"], f["line"]) for f in hits]
    assert {f["run"]["status"] for f in hits} == {"seen"}
    assert all(f["run"]["measured"] for f in hits)
    assert code == 1


@pytest.mark.parametrize("name", sorted(p.name for p in RUN.glob("good_*.py") if "_ddp_" not in p.name))
def test_fixed_twin_gives_nothing(capsys, name) -> None:
    code, data = run_json(capsys, "--", "python", f"fixtures/run/{name}")
    assert data["findings"] == []
    assert data["run"]["ended"] == "finished"
    assert code == 0


def test_every_planted_fixture_has_a_fixed_twin() -> None:
    bad = {p.name.removeprefix("bad_") for p in RUN.glob("bad_*.py")}
    good = {p.name.removeprefix("good_") for p in RUN.glob("good_*.py")}
    assert bad == good


def test_tl101_measures_the_loss_scale_and_both_norms(capsys) -> None:
    _, data = run_json(capsys, "--", "python", "fixtures/run/bad_clip_scaled.py")
    measured = seen(data, "TL101")[0]["run"]["measured"]
    assert measured["loss_scale"] == 65536.0  # the CPU GradScaler's initial scale, 2**16
    assert measured["norm_seen"] / measured["norm_true"] == pytest.approx(65536.0)
    assert measured["norm_true"] > measured["max_norm"]  # the true norm needed clipping as well
    assert seen(data, "TL101")[0]["run"]["count"] == 8  # every iteration


def test_tl301_gives_each_microbatchs_weighting_error(capsys) -> None:
    _, data = run_json(capsys, "--", "python", "fixtures/run/bad_accumulation_mean.py")
    measured = seen(data, "TL301")[0]["run"]["measured"]
    # 4 rows of 3 + 2 * micro valid tokens each; every microbatch weighs 1/4 of the window, while a
    # token-fair weighting gives microbatch i a share n_i / 96: the error is 24 / n_i - 1
    assert measured["tokens"] == [12, 20, 28, 36]
    assert measured["weight_error"] == pytest.approx([24 / n - 1 for n in (12, 20, 28, 36)], rel=1e-4)


def test_tl105_reports_dtypes_and_updates_lost_to_rounding(capsys) -> None:
    _, data = run_json(capsys, "--", "python", "fixtures/run/bad_half_model.py")
    measured = seen(data, "TL105")[0]["run"]["measured"]
    assert measured["param_dtypes"] == {"bfloat16": 4}
    # lr 1e-4 is below half the bf16 spacing of most weights (about 2**-9 relative): most updates vanish
    assert measured["updates_rounded_to_zero"] > 0.5
    assert measured["steps_measured"] == 3


def test_checkpoint_probes_measure_recomputation(capsys) -> None:
    _, data = run_json(capsys, "--", "python", "fixtures/run/bad_checkpoint_side_effect.py")
    changes = seen(data, "TL203")[0]["run"]["measured"]["changes"]
    assert "calls 1 -> 2" in changes and "seen 8 -> 16" in changes
    _, data = run_json(capsys, "--", "python", "fixtures/run/bad_checkpoint_rng.py")
    assert seen(data, "TL204")[0]["run"]["measured"]["max_abs_output_diff"] > 0.01
    _, data = run_json(capsys, "--", "python", "fixtures/run/bad_checkpoint_reentrant.py")
    assert seen(data, "TL201")[0]["run"]["measured"] == {"inputs_requiring_grad": 0, "parameters_inside": 2}


def test_hazard_spanning_two_files_is_runtime_only(capsys) -> None:
    from trainlint.engine import lint_source

    for name in ("crossfile_train.py", "crossfile_helpers.py"):
        assert lint_source((RUN / name).read_text(), name) == []  # neither half is wrong alone
    code, data = run_json(capsys, "--", "python", "fixtures/run/crossfile_train.py")
    hits = seen(data, "TL101")
    assert [(f["path"], f["line"], f["run"]["status"]) for f in hits] == [
        ("fixtures/run/crossfile_helpers.py", 7, "runtime-only")
    ]
    assert code == 1


def test_static_findings_not_reached_are_marked(capsys, tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        (RUN / "good_clip_scaled.py").read_text()
        + textwrap.dedent(
            """
            if len(__import__("sys").argv) > 5:  # never true in this run
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
            """
        )
    )
    code, data = run_json(capsys, "--", "python", str(script))
    assert [(f["rule"], f["run"]["status"]) for f in data["findings"]] == [("TL101", "not-reached")]
    assert code == 0


def test_steps_stops_the_run(capsys) -> None:
    code, data = run_json(capsys, "--steps", "3", "--", "python", "fixtures/run/bad_clip_scaled.py")
    assert data["run"]["ended"] == "stopped"
    assert data["run"]["optimizer_steps"] == 3
    assert seen(data, "TL101")[0]["run"]["count"] == 3
    assert code == 1


def test_nanogpt_style_script_runs_20_steps_clean(capsys) -> None:
    code, data = run_json(
        capsys, "--steps", "20", "--", "python", "fixtures/run/nanogpt/train.py", "--dtype=float32"
    )
    assert data["run"]["ended"] == "stopped"
    assert data["run"]["optimizer_steps"] == 20
    assert data["findings"] == []
    assert code == 0


@pytest.mark.slow
def test_nanogpt_style_script_with_fp16_scaler_runs_clean(capsys) -> None:
    code, data = run_json(
        capsys, "--steps", "5", "--", "python", "fixtures/run/nanogpt/train.py", "--dtype=float16"
    )
    assert data["run"]["optimizer_steps"] == 5
    assert data["findings"] == []
    assert code == 0


def write(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


CLIP_LOOP = """
    import torch
    from torch import nn

    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(3):
        scaler.scale(model(torch.randn(3, 4)).pow(2).mean()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
"""


def test_ctrl_c_still_prints_what_was_seen(capsys, tmp_path) -> None:
    script = write(
        tmp_path, "train.py", CLIP_LOOP + "        if step == 1:\n            raise KeyboardInterrupt\n"
    )
    code, data = run_json(capsys, "--no-lint", "--", "python", str(script))
    assert data["run"]["ended"] == "interrupted"
    assert data["run"]["optimizer_steps"] == 2
    assert seen(data, "TL101")[0]["run"]["count"] == 2
    assert code == 1


def test_text_output_says_it_was_interrupted(capsys, tmp_path) -> None:
    script = write(tmp_path, "train.py", CLIP_LOOP + "        raise KeyboardInterrupt\n")
    assert main(["--no-lint", "--", "python", str(script)]) == 1
    out = capsys.readouterr().out
    assert "interrupted (Ctrl-C) after 1 optimizer step(s)" in out
    assert "TL101" in out and "65536" in out


def test_the_users_error_is_reported_as_theirs(capsys, tmp_path) -> None:
    script = write(
        tmp_path,
        "train.py",
        "import sys\nassert sys.argv[1:] == ['--lr', '3']\nraise ValueError('bad config')\n",
    )
    code, data = run_json(capsys, "--no-lint", "--", "python", str(script), "--lr", "3")
    assert data["run"]["ended"] == "raised"
    assert data["run"]["error"].startswith("ValueError: bad config (at ")
    assert data["run"]["error"].endswith("train.py:3)")
    assert code == 1


def test_sys_exit_zero_is_a_clean_end(capsys, tmp_path) -> None:
    script = write(tmp_path, "train.py", "raise SystemExit(0)\n")
    code, data = run_json(capsys, "--no-lint", "--", "python", str(script))
    assert (code, data["run"]["ended"]) == (0, "finished")


def test_module_form(capsys, tmp_path, monkeypatch) -> None:
    package = tmp_path / "mytrain"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(textwrap.dedent(CLIP_LOOP))
    monkeypatch.chdir(tmp_path)
    code, data = run_json(capsys, "--", "python", "-m", "mytrain")
    assert [(f["path"], f["run"]["status"]) for f in seen(data, "TL101")] == [("mytrain/__main__.py", "seen")]
    assert code == 1


def test_sarif_carries_the_run_status(capsys) -> None:
    assert main(["--format", "sarif", "--", "python", "fixtures/run/bad_clip_scaled.py"]) == 1
    results = json.loads(capsys.readouterr().out)["runs"][0]["results"]
    assert [(r["ruleId"], r["properties"]["run"]["status"]) for r in results] == [("TL101", "seen")]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give the command to run after --"),
        (["--", "python"], "give the command to run after --"),
        (["--", "python", "missing.py"], "missing.py: no such file"),
        (["--", "python", "-m", "no_such_module_xyz"], "no module named 'no_such_module_xyz'"),
        (["--", "python", "-c", "print(1)"], "unsupported python option '-c'"),
        (["--steps", "0", "--", "python", "fixtures/run/good_clip_scaled.py"], "--steps must be at least 1"),
        (["--steps", "x", "--", "python", "fixtures/run/good_clip_scaled.py"], "invalid int value"),
        (["--format", "xml", "--", "python", "fixtures/run/good_clip_scaled.py"], "invalid choice"),
    ],
)
def test_usage_errors_exit_2_with_one_line(capsys, argv, message) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and message in captured.err
    assert "Traceback" not in captured.err


def test_the_monitor_leaves_torch_as_it_found_it(capsys) -> None:
    import time

    import torch
    import torch.utils.checkpoint
    from torch.nn.parallel import DistributedDataParallel as DDP

    before = (
        torch.nn.utils.clip_grad_norm_,
        torch.utils.checkpoint.checkpoint,
        torch.Tensor.backward,
        torch.optim.Optimizer.zero_grad,
        torch.amp.GradScaler.unscale_,
        torch.nn.functional.cross_entropy,
        time.perf_counter,
        torch.Tensor.item,
        DDP.forward,
    )
    run_json(capsys, "--", "python", "fixtures/run/bad_clip_scaled.py")
    after = (
        torch.nn.utils.clip_grad_norm_,
        torch.utils.checkpoint.checkpoint,
        torch.Tensor.backward,
        torch.optim.Optimizer.zero_grad,
        torch.amp.GradScaler.unscale_,
        torch.nn.functional.cross_entropy,
        time.perf_counter,
        torch.Tensor.item,
        DDP.forward,
    )
    assert after == before


def test_static_linting_and_the_plugin_without_the_option_do_not_import_torch() -> None:
    code = (
        "import sys; from trainlint.cli import run; run(['--no-cache', '--quiet', 'fixtures/run']);"
        "import trainlint.run.pytest_plugin, trainlint.run.cli;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
