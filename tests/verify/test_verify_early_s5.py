"""``--verify`` starts its child before the files are linted (torch imports meanwhile), hands it the
probes when they fit what it was started for, and ends it whatever happens."""

from __future__ import annotations

from pathlib import Path

import pytest

import trainlint.cli as cli
from trainlint.verify import harness, runner, torch_available

pytestmark = pytest.mark.skipif(not torch_available(), reason="--verify needs torch")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Every child the run starts, early (before linting) or late (by the harness), and how many had
    been started when linting began."""
    seen: dict[str, list] = {"early": [], "late": [], "at_lint": []}
    real_start = runner.start_child

    def early(device: str, timeout: float, count: int) -> runner.Child:
        child = real_start(device, timeout, count)
        seen["early"].append(child)
        return child

    def late(device: str, timeout: float, count: int) -> runner.Child:
        child = real_start(device, timeout, count)
        seen["late"].append(child)
        return child

    real_jobs = cli._run_jobs

    def run_jobs(*args, **kwargs):
        seen["at_lint"].append(len(seen["early"]) + len(seen["late"]))
        return real_jobs(*args, **kwargs)

    monkeypatch.setattr(runner, "start_child", early)
    monkeypatch.setattr(harness, "start_child", late)
    monkeypatch.setattr(cli, "_run_jobs", run_jobs)
    return seen


def _ended(child: runner.Child) -> bool:
    return child.closed and child.proc.poll() is not None and not child.workdir.exists()


def test_the_child_starts_before_linting_and_runs_the_probes(started, monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    code = cli.run(
        ["--no-cache", "--verify", "--device", "cpu", "--format", "json", "fixtures/bad_gpt_amp.py"]
    )
    assert code == 1
    assert started["at_lint"] == [1]  # already importing torch while the file was linted
    assert started["late"] == []  # and it ran the probes: no second child
    assert '"status": "confirmed"' in capsys.readouterr().out
    assert all(_ended(c) for c in started["early"])


def test_an_early_child_with_nothing_to_verify_is_ended(started, monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    # TL403 has no probe: the child started for the run gets no job
    args = ["--no-cache", "--verify", "--device", "cpu", "--select", "TL403", "fixtures/"]
    cli.run(args)
    capsys.readouterr()
    assert len(started["early"]) == 1 and started["late"] == []
    assert _ended(started["early"][0])


def test_a_child_takes_only_a_job_within_what_it_was_started_for() -> None:
    child = runner.start_child("cpu", 5.0, 2)
    try:
        assert not child.takes("cpu", 5.0, 3)  # its CPU limit was set for two probes
        assert not child.takes("cpu", 6.0, 1)  # a longer time limit per probe
        assert not child.takes("cuda", 5.0, 1)
        assert child.takes("cpu", 4.0, 2)
        assert child.total == runner.STARTUP_S + (4.0 + runner.GRACE_S) * 2
    finally:
        child.close()
    assert _ended(child) and not child.takes("cpu", 4.0, 1)


def test_probe_building_finds_the_same_visitor_methods_and_puts_libcst_back() -> None:
    from libcst import BatchableCSTVisitor
    from libcst.metadata import ExpressionContextProvider, ScopeProvider

    real = BatchableCSTVisitor.get_visitors
    providers = [ScopeProvider(), ExpressionContextProvider()]
    expected = [real(p) for p in providers]
    with harness._visitor_methods_cached():
        assert BatchableCSTVisitor.get_visitors is not real
        for _ in range(2):  # the second time from the cache
            assert [p.get_visitors() for p in providers] == expected
    assert BatchableCSTVisitor.get_visitors is real
