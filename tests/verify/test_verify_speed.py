"""How the ``--verify`` child starts: deterministic mode without importing the compiler, one child for
every probe of a run, and one pair of data-parallel workers forked from the clean child, fed probe after
probe and replaced after a probe broke it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainlint.engine import lint_source
from trainlint.rule import Finding, Severity
from trainlint.verify import harness, torch_available, verify_findings
from trainlint.verify.runner import CHILD

pytestmark = pytest.mark.skipif(not torch_available(), reason="--verify needs torch")

# loads the child package by path, as ``BOOT`` does, without running its probe loop
LOADER = textwrap.dedent(
    f"""
    import importlib, importlib.util, json, os, sys
    spec = importlib.util.spec_from_file_location(
        "trainlint_verify_child", os.path.join({str(CHILD)!r}, "__init__.py"),
        submodule_search_locations=[{str(CHILD)!r}],
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = package
    spec.loader.exec_module(package)
    sandbox = importlib.import_module("trainlint_verify_child.sandbox")
    import torch
    """
)


def in_child(body: str, cwd: Path) -> dict:
    """Run ``body`` after loading the child package in a fresh Python; it prints one JSON object."""
    # the thread limits the parent gives the child (runner._environment): without them numpy's
    # OpenBLAS (installed with the deepspeed extra) starts a thread pool when torch imports it, and a
    # process with threads never forks its data-parallel workers
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", LOADER + textwrap.dedent(body)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_child_is_deterministic_without_importing_the_compiler(tmp_path: Path) -> None:
    got = in_child(
        """
        sandbox.setup_process("cpu")
        print(json.dumps({
            "on": torch.are_deterministic_algorithms_enabled(),
            "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "loaded": sorted(m for m in ("torch._inductor", "torch._dynamo") if m in sys.modules),
        }))
        """,
        tmp_path,
    )
    assert got == {"on": True, "warn_only": True, "loaded": []}


def test_a_compiler_imported_later_is_deterministic_too(tmp_path: Path) -> None:
    """User code that compiles after the start-up meets the same mode the public call gives."""
    got = in_child(
        """
        sandbox.setup_process("cpu")
        import torch._inductor.config as inductor_config
        print(json.dumps({"inductor": inductor_config.deterministic}))
        """,
        tmp_path,
    )
    assert got == {"inductor": True}


def test_with_the_compiler_already_loaded_the_public_call_is_made(tmp_path: Path) -> None:
    """The compiler reads the variable only when first imported: loaded before the start-up (by
    whatever), it still ends up deterministic."""
    got = in_child(
        """
        import torch._inductor.config as inductor_config
        sandbox.setup_process("cpu")
        print(json.dumps({
            "on": torch.are_deterministic_algorithms_enabled(),
            "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "inductor": inductor_config.deterministic,
        }))
        """,
        tmp_path,
    )
    assert got == {"on": True, "warn_only": True, "inductor": True}


def test_every_probe_of_a_run_goes_to_one_child(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def fake_run(probes, device, timeout, child=None):
        calls.append(len(probes))
        return {p["id"]: {"status": "confirmed", "detail": "", "evidence": {}} for p in probes}

    monkeypatch.setattr(harness, "run_probes", fake_run)
    monkeypatch.setattr(harness, "start_child", lambda device, timeout, count: None)
    monkeypatch.setattr(harness, "build_probe", lambda finding, model, tree: {"driver": "grads"})
    code = "import torch\n"
    findings = [Finding("TL201", "n", Severity.ERROR, "a.py", n, 1, n, 2, "m") for n in range(1, 101)]
    out = verify_findings(findings, {"a.py": code}, device="cpu", timeout=5)
    assert calls == [100]
    assert [f.verify["status"] for f in out] == ["confirmed"] * 100


POOL = """
distributed = importlib.import_module("trainlint_verify_child.distributed")
read_end, write_end = os.pipe()
pipe = os.fstat(write_end)
sandbox.results_channel(f"fd:{write_end}")
os.close(read_end)  # the parent's end


def opens_the_pipe(fd):
    try:
        found = os.fstat(int(fd))
    except OSError:
        return False
    return (found.st_dev, found.st_ino) == (pipe.st_dev, pipe.st_ino)


def report(job):
    reachable = any(opens_the_pipe(fd) for fd in os.listdir("/proc/self/fd"))
    return {"pid": os.getpid(), "results_pipe": reachable, "cwd": os.getcwd(),
            "gloo": os.environ.get("GLOO_SOCKET_IFNAME"), "dynamo": "torch._dynamo" in sys.modules}


distributed.DIST_JOBS["report"] = report
distributed.warm_pool([{"driver": "grads"}])
none_needed = distributed._pool is None
distributed.warm_pool([{"driver": "grads"}, {"driver": "report"}])
pool = distributed._pool
forked = [type(p).__name__ for p in pool.procs]
first = distributed.run_distributed({"driver": "report"})
second = distributed.run_distributed({"driver": "report"})
print(json.dumps({"none_needed": none_needed, "forked": forked, "first": first, "second": second,
                  "same_pool": distributed._pool is pool, "dir": pool.dir}))
distributed.close_pool()
"""


def test_the_data_parallel_pair_is_forked_once_and_reused(tmp_path: Path) -> None:
    got = in_child(POOL, tmp_path)
    assert got["none_needed"], "a job without data-parallel probes starts no workers"
    assert got["forked"] == ["_Forked", "_Forked"]
    first, second = got["first"], got["second"]
    assert [r["pid"] for r in first] == [r["pid"] for r in second], "the same two workers ran both probes"
    assert len({r["pid"] for r in first}) == 2 and got["same_pool"]
    for rank in first:
        # the results pipe is the child's alone: user code in a worker cannot forge a result
        assert rank["results_pipe"] is False
        assert rank["cwd"] == got["dir"] and rank["gloo"] in ("lo", "lo0")
        assert rank["dynamo"], "imported once before the fork, not in each worker"


DDP_PAIR = """
import os

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def boundary(i, accum):
{breaks}


def train_broken(net, loader, accum=4):
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for i, (x, y) in enumerate(loader):
        loss = F.cross_entropy(model(x), y) / accum
        loss.backward()
        if (i + 1) % accum == 0 and boundary(i, accum):
            opt.step()
            opt.zero_grad()


def train(net, loader, accum=4):
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for i, (x, y) in enumerate(loader):
        loss = F.cross_entropy(model(x), y) / accum
        loss.backward()
        if (i + 1) % accum == 0:
            opt.step()
            opt.zero_grad()
"""


@pytest.mark.parametrize(
    ("breaks", "timeout", "expected"),
    [
        ("    os._exit(7)", 60, "a data-parallel worker process stopped"),
        ("    while True:\n        pass", 20, "did not finish within 20s"),
    ],
    ids=["worker-dies", "worker-hangs"],
)
def test_a_probe_that_breaks_the_pair_gets_its_verdict_and_the_next_a_fresh_pair(
    breaks: str, timeout: float, expected: str
) -> None:
    code = DDP_PAIR.format(breaks=breaks)
    findings = lint_source(code, "ddp.py", ["TL501"])
    assert len(findings) == 2
    broken, fine = (
        f.verify for f in verify_findings(findings, {"ddp.py": code}, device="cpu", timeout=timeout)
    )
    assert broken["status"] == "not-executable" and expected in broken["detail"]
    assert fine["status"] == "confirmed", fine["detail"]


def test_a_driver_named_while_the_child_waits_starts_the_pair(tmp_path: Path) -> None:
    """The parent names each kind of probe as it builds it; the waiting child forks the workers then,
    before the job (and any user code) arrives."""
    got = in_child(
        """
        distributed = importlib.import_module("trainlint_verify_child.distributed")
        main = importlib.import_module("trainlint_verify_child.main")
        read_end, write_end = os.pipe()
        os.write(write_end, b"grads\\n")
        os.close(write_end)
        main._wait_for_job(read_end)
        after_grads = distributed._pool
        read_end, write_end = os.pipe()
        pipe = os.fstat(read_end)

        def holds_the_job_pipe(job):
            found = []
            for fd in os.listdir("/proc/self/fd"):
                try:
                    found.append(os.fstat(int(fd)))
                except OSError:
                    pass
            return {"holds": any((f.st_dev, f.st_ino) == (pipe.st_dev, pipe.st_ino) for f in found)}

        distributed.DIST_JOBS["holds"] = holds_the_job_pipe
        os.write(write_end, b"grads\\nddp_sync\\nddp_tokens\\n")
        os.close(write_end)
        main._wait_for_job(read_end)
        pool = distributed._pool
        holds = [r["holds"] for r in distributed.run_distributed({"driver": "holds"})]
        print(json.dumps({"after_grads": after_grads is None,
                          "procs": [type(p).__name__ for p in pool.procs], "holds": holds}))
        distributed.close_pool()
        """,
        tmp_path,
    )
    assert got == {"after_grads": True, "procs": ["_Forked", "_Forked"], "holds": [False, False]}


def test_a_child_started_early_runs_the_probes_or_is_ended_unused(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainlint.verify import runner

    started: list[runner.Child] = []

    def spy(device, timeout, count):
        child = runner.start_child(device, timeout, count)
        started.append(child)
        return child

    monkeypatch.setattr(harness, "start_child", spy)
    code = textwrap.dedent(
        """
        import torch.nn as nn
        from torch.utils.checkpoint import checkpoint


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                return checkpoint(self.fc, x)
        """
    )
    findings = lint_source(code, "net.py", ["TL201"])
    (ran,) = verify_findings(findings, {"net.py": code}, device="cpu", timeout=30)
    assert ran.verify["status"] == "confirmed"
    # no probe can be built (the source is missing): the child started for it is ended, its folder gone
    (unbuilt,) = verify_findings(findings, {}, device="cpu", timeout=30)
    assert unbuilt.verify["detail"] == "source not available"
    assert len(started) == 2
    for child in started:
        assert child.closed and child.proc.poll() is not None and not child.workdir.exists()
