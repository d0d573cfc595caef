"""Data parallelism for TL501 and TL502: a real two-process gloo group on the loopback interface.

When its job holds a data-parallel probe, the probe's child forks two worker processes (ranks 0 and 1)
before it runs any user code (as soon as the parent names such a probe, while the child waits for its
job): they start with torch already imported, and join their group while the probes are being built. Every data-parallel probe of the child is a job of
that pair, run on both ranks, and rank 0's verdict is reported. A pair that failed or ran out of time
is replaced by a fresh Python started with the package's ``BOOT`` (the child is no longer clean enough
to fork from once user code has run in it).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time
import traceback

import torch

from . import BOOT, capture, state
from .bypass import BYPASS_JOBS
from .compare import (
    FLOAT32_SUMS,
    FixWording,
    compare,
    fixed_outcome,
    loop_comparison,
    not_executable,
    note_text,
    num,
    pct,
    reference_evidence,
    result,
    verdict,
)
from .ds_engine import DEEPSPEED_JOBS
from .fsdp import FSDP_JOBS
from .sandbox import VariantFailed, close_private_fds, exec_program, seed, setup_process
from .standins import concat_batches, token_batches
from .variants import run_variants

DIST_WORLD = 2
DIST_TIMEOUT_S = 15.0  # a collective that waits longer than this fails (a rank that stopped early)
TOKENS_FIX = FixWording.max_rel(
    "with the count all-reduced (and the loss multiplied by the world size)",
    raises="with the count all-reduced it raises {failure}",
)
_LOOPBACK = "lo0" if sys.platform == "darwin" else "lo"
# gloo (and tensorpipe) bound to the loopback interface: nothing of the group leaves the machine
GROUP_ENV = {"GLOO_SOCKET_IFNAME": _LOOPBACK, "MASTER_ADDR": "127.0.0.1", "TP_SOCKET_IFNAME": _LOOPBACK}
# what every data-parallel job imports: loaded before the workers are forked
WARM_MODULES = (
    "torch.distributed",
    "torch.nn.parallel.distributed",
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
    "torch._dynamo",
)
_sync_plan: dict[int, bool] | None = None
_pool = None


class DistUnavailable(Exception):
    """The two-process group could not run the job (a worker died, or it ran out of time)."""


class _Pool:
    """Two worker processes (ranks 0 and 1) in one gloo process group, kept for the probes of this
    child. Jobs and results travel through files in a private directory; the group's rendezvous is a
    ``FileStore`` there, and gloo is bound to the loopback interface: nothing leaves the machine."""

    def __init__(self, fork: bool = False) -> None:
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="trainlint-dist-", dir=os.getcwd())
        self.jobs = 0
        self.started = time.monotonic()
        self.procs: list = []
        for rank in range(DIST_WORLD):
            self.procs.append(self._fork(rank) if fork else self._spawn(rank))

    def _spawn(self, rank: int):
        import subprocess

        env = dict(os.environ, **GROUP_ENV)
        package = os.path.dirname(os.path.abspath(__file__))
        command = [sys.executable, "-c", BOOT, package, "--worker", str(rank), str(DIST_WORLD), self.dir]
        with open(os.path.join(self.dir, f"stderr{rank}"), "wb") as err:
            return subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=self.dir
            )

    def _fork(self, rank: int) -> _Forked:
        """A worker forked from this process (clean: no user code has run in it yet)."""
        read_end, write_end = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            os.close(read_end)
            return _Forked(pid, write_end)
        code = 1
        try:
            # nothing of the child's may reach the worker's user code: the results and job pipes, the
            # job pipes of the other worker, this pipe's write end
            close_private_fds()
            os.close(write_end)
            for proc in self.procs:
                proc.stdin.close()
            os.dup2(read_end, 0)
            os.close(read_end)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            err = os.open(
                os.path.join(self.dir, f"stderr{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600
            )
            os.dup2(err, 2)
            os.close(null)
            os.close(err)
            os.chdir(self.dir)
            os.environ.update(GROUP_ENV)
            code = serve(rank, DIST_WORLD, self.dir)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)  # never back into the child's own probe loop

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def _tail(self) -> str:
        lines: list[str] = []
        for rank in range(DIST_WORLD):
            try:
                with open(os.path.join(self.dir, f"stderr{rank}"), encoding="utf-8", errors="replace") as fh:
                    lines.extend(ln for ln in fh.read().splitlines() if ln.strip())
            except OSError:
                pass
        return " | ".join(lines[-2:])[-300:]

    def run(self, job: dict, budget: float) -> list[dict]:
        number = self.jobs
        self.jobs += 1
        path = os.path.join(self.dir, f"job{number}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(job, fh)
        os.replace(path + ".tmp", path)
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(f"{number}\n".encode())
            proc.stdin.flush()
        deadline = time.monotonic() + budget
        results: list[dict | None] = [None] * DIST_WORLD
        while True:
            for rank in range(DIST_WORLD):
                out = os.path.join(self.dir, f"result{number}-{rank}.json")
                if results[rank] is None and os.path.exists(out):
                    with open(out, encoding="utf-8") as fh:
                        results[rank] = json.load(fh)
            if all(r is not None for r in results):
                return results  # type: ignore[return-value]
            if not self.alive():
                raise DistUnavailable(
                    f"a data-parallel worker process stopped ({self._tail() or 'no message'})"
                )
            if time.monotonic() > deadline:
                raise DistUnavailable(f"the two-process run did not finish within {budget:g}s")
            time.sleep(0.02)

    def close(self) -> None:
        import shutil

        for proc in self.procs:
            try:
                proc.kill()
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except Exception:
                pass
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        shutil.rmtree(self.dir, ignore_errors=True)


class _Forked:
    """A forked worker, seen through the part of ``subprocess.Popen`` the pool uses."""

    def __init__(self, pid: int, stdin_fd: int) -> None:
        self.pid = pid
        self.stdin = os.fdopen(stdin_fd, "wb")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.returncode


def close_pool() -> None:
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None


def _can_fork() -> bool:
    """Forking is safe only from a process with one thread (a lock another thread holds would stay
    held in the copy); where the threads cannot be counted, the workers are started afresh."""
    if not hasattr(os, "fork") or not sys.platform.startswith("linux"):
        return False
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def warm_pool(probes: list[dict]) -> None:
    """Start the pair now, by forking this still clean process, when a probe of the job will need it:
    the workers skip importing torch and join their group while the other probes run.

    What every data-parallel job imports (``DistributedDataParallel`` imports the compiler when it
    wraps a module) is imported here once, before the fork, not again in each worker."""
    global _pool
    if _pool is not None or not any(p.get("driver") in DIST_JOBS for p in probes):
        return
    fork = _can_fork()
    if fork:
        for name in WARM_MODULES:
            importlib.import_module(name)
        fork = _can_fork()  # no import above may have started a thread
    _pool = _Pool(fork=fork)


def run_distributed(job: dict) -> list[dict]:
    """Run ``job`` on both ranks; the pool is started on first use (unless ``warm_pool`` started it)
    and replaced after a failure. The probe's own alarm ends a run that takes too long (the pool's
    deadline is only a fallback)."""
    global _pool
    remaining = signal.getitimer(signal.ITIMER_REAL)[0]
    budget = (remaining + 5.0) if remaining > 0 else 60.0
    if _pool is None or not _pool.alive():
        close_pool()
        _pool = _Pool()
    try:
        results = _pool.run(job, budget)
    except BaseException:
        close_pool()
        raise
    failed = [r for r in results if r.get("failed")]
    same = all(
        (r.get("status"), r.get("detail")) == (results[0].get("status"), results[0].get("detail"))
        for r in results
    )
    if failed and (not same or any(r.get("status") == "error" for r in failed)):
        close_pool()  # the ranks may disagree about which collectives ran: start afresh
    return results


def ddp(module: torch.nn.Module) -> torch.nn.Module:
    """The module in a real ``DistributedDataParallel`` over the gloo group; counts the gradient
    all-reduces (one per bucket and synchronised backward) and, for the reference run, switches
    gradient synchronisation on only for the microbatches after which the optimizer steps."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    class CountingDDP(DistributedDataParallel):
        def forward(self, *args, **kwargs):
            index = capture.current_loop.get("forwards", 0)
            capture.current_loop["forwards"] = index + 1
            if _sync_plan is not None:
                self.require_backward_grad_sync = bool(_sync_plan.get(index, True))
            return super().forward(*args, **kwargs)

    wrapped = CountingDDP(module)

    def hook(state, bucket):
        capture.current_loop["allreduces"] = capture.current_loop.get("allreduces", 0) + 1
        return allreduce_hook(state, bucket)

    wrapped.register_comm_hook(None, hook)
    return wrapped


def unwrap(module):
    return getattr(module, "module", module)


def rank_batch() -> dict:
    """This rank's token batch: the ranks hold different numbers of valid tokens."""
    return token_batches(state.WORLD)[state.RANK]


def all_ranks_batch() -> dict:
    """Every rank's batch in one (the single-process reference)."""
    return concat_batches(token_batches(DIST_WORLD))


def global_count(value):
    """A token count summed over the ranks (what the documented fix all-reduces)."""
    import torch.distributed as dist

    count = torch.as_tensor(value, device=state.DEVICE).detach().clone().float()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(count)
    return count


def _windows(steps: list[dict]) -> list[int]:
    out, before = [], 0
    for step in steps:
        out.append(step["allreduces"] - before)
        before = step["allreduces"]
    return out


def _job_sync(probe: dict) -> dict:
    """TL501 on one rank: the loop as written, then with synchronisation only on the microbatches
    after which the optimizer steps (what ``no_sync`` on the others gives)."""
    global _sync_plan

    def measure(ns: dict) -> dict:
        run = capture.loop_result(ns)
        run["forwards"] = capture.current_loop.get("forwards", 0)
        return run

    def plan(name: str, runs: dict[str, dict]) -> None:
        global _sync_plan
        if name == "reference":
            stepped = {s["forwards"] - 1 for s in runs["as_written"]["steps"]}
            _sync_plan = {j: j in stepped for j in range(runs["as_written"]["forwards"])}

    try:
        runs, failed = run_variants(probe, {"as_written": "", "reference": "with no_sync, "}, measure, plan)
    finally:
        _sync_plan = None
    if failed is not None:
        return failed
    aw, ref = runs["as_written"], runs["reference"]
    if not aw["steps"]:
        return not_executable("the optimizer never stepped in the loop with the stand-ins")
    tol = FLOAT32_SUMS
    cev, parts, differs = loop_comparison(aw, ref, tol)
    per_aw, per_ref = _windows(aw["steps"]), _windows(ref["steps"])
    ev = {
        "world_size": state.WORLD,
        "backend": "gloo",
        "iterations": probe.get("iterations"),
        "allreduces_per_step": {"as_written": per_aw, "with_no_sync": per_ref},
        "tolerance": tol.as_evidence(),
        **cev,
    }
    notes = note_text(probe.get("notes", []))
    same = "the gradients applied are the same" if not differs else "; ".join(parts)
    max_rel = max([0.0, *(x for x in cev.get("applied_gradient_max_rel", []) if isinstance(x, float))])
    counts = ", ".join(str(c) for c in per_aw)
    if sum(per_aw) > sum(per_ref):
        detail = (
            f"on {state.WORLD} processes (gloo), the {len(per_aw)} optimizer step(s) were preceded by {counts} gradient "
            f"all-reduce(s) each as written vs {', '.join(str(c) for c in per_ref)} with synchronisation only on "
            f"the last microbatch (no_sync on the others); {same} (max rel {num(max_rel)})"
        )
        return result("confirmed", detail + notes, ev)
    return result(
        "not-reproduced",
        f"on {state.WORLD} processes (gloo), as written each optimizer step needs {counts} all-reduce(s), as many as "
        f"with no_sync: every microbatch ends an accumulation window here" + notes,
        ev,
    )


def _job_tokens(probe: dict) -> dict:
    """TL502 on one rank: this rank's batch through the user's loss code under DDP (as written and
    with the token count all-reduced), and on rank 0 the single-process reference over every rank's
    batch."""
    runs: dict[str, dict] = {}
    failures: dict[str, str] = {}
    tokens = 0
    averaged = 0  # the targets the loss averaged over as written (after a label shift, fewer)
    for name in ("as_written", "fixed", "reference"):
        program = probe["programs"].get(name)
        if program is None or (name == "reference" and state.RANK != 0):
            continue
        try:
            capture.counting_pass(True)
            ns = exec_program(program, name)
            runs[name] = {"grads": capture.module_grads(ns, unwrap)}
            if name == "as_written":  # the count as the user's code computed it
                seen = [x for x in capture.records.get("tokens", []) if x is not None]
                tokens = num(seen[0]) if seen else capture.batch_valid.get(state.RANK, 0)
                averaged = sum(capture.tokens_seen.values())
        except VariantFailed as exc:
            if name == "fixed":
                failures[name] = str(exc)
                continue
            return {"failed": True, "tokens": tokens, **not_executable(str(exc))}
        finally:
            capture.counting_pass(False)
    if state.RANK != 0:
        return {"tokens": tokens, "averaged": averaged}
    cmp = compare(runs["as_written"]["grads"], runs["reference"]["grads"], FLOAT32_SUMS)
    fixed = fixed_outcome(runs, failures, ("grads",), FLOAT32_SUMS, TOKENS_FIX)
    ev = {"world_size": state.WORLD, "backend": "gloo", **reference_evidence(cmp, FLOAT32_SUMS, fixed)}
    if cmp["match"]:
        detail = (
            f"the averaged gradient matches the global token mean over all ranks (max rel {cmp['max_rel']})"
        )
    else:
        detail = (
            f"the gradient DDP averages differs from the global token mean by {pct(cmp['max_rel'])} (max rel)"
        )
    return {
        "tokens": tokens,
        "averaged": averaged,
        **verdict(not cmp["match"], detail, ev, fixed, probe.get("notes", [])),
    }


DIST_JOBS = {"ddp_sync": _job_sync, "ddp_tokens": _job_tokens, **FSDP_JOBS, **BYPASS_JOBS, **DEEPSPEED_JOBS}


def drive_distributed(probe: dict) -> dict:
    """TL501/TL502: run the probe on both ranks of the gloo group and report rank 0's verdict."""
    try:
        results = run_distributed(probe)
    except DistUnavailable as exc:
        return not_executable(f"the two-process gloo run failed: {exc}")
    first = results[0]
    out = {k: v for k, v in first.items() if k not in ("failed", "tokens", "averaged")}
    out["device"] = "cpu"  # the ranks run on the CPU (gloo) whatever device the other probes use
    if "status" not in out:
        return result("error", "rank 0 of the data-parallel run gave no result", {})
    if probe["driver"] == "ddp_tokens" and out["status"] in ("confirmed", "not-reproduced"):
        tokens = [r.get("tokens", 0) for r in results]
        out["evidence"]["valid_tokens_per_rank"] = tokens
        shown = " and ".join(f"{t:g}" for t in tokens)
        averaged = [r.get("averaged", 0) for r in results]
        if all(averaged) and averaged != tokens:  # the count and what the loss averages over differ
            out["evidence"]["loss_targets_per_rank"] = averaged
            over = " and ".join(f"{t:g}" for t in averaged)
            shown += (
                f" (the loss itself averages over {over} targets: the code counts labels its loss leaves out)"
            )
        out["detail"] = f"on {DIST_WORLD} processes (gloo) whose token counts are {shown}: " + out["detail"]
    return out


def worker_main(argv: list[str]) -> int:
    """A rank of the data-parallel pool started afresh (``BOOT ... --worker RANK WORLD DIR``)."""
    return serve(int(argv[0]), int(argv[1]), argv[2])


def serve(rank: int, world: int, directory: str) -> int:
    """One rank of the data-parallel pool: join the group, then run jobs named on stdin."""
    import datetime

    import torch.distributed as dist

    state.RANK, state.WORLD = rank, world
    setup_process("cpu")
    store = dist.FileStore(os.path.join(directory, "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=DIST_TIMEOUT_S)
    )
    for line in sys.stdin:
        number = line.strip()
        if not number.isdigit():
            break
        with open(os.path.join(directory, f"job{number}.json"), encoding="utf-8") as fh:
            job = json.load(fh)
        seed(0)
        started = time.perf_counter()
        try:
            out = DIST_JOBS[job["driver"]](job)
        except BaseException as exc:  # a bug in the harness
            out = {
                "failed": True,
                **result(
                    "error",
                    f"harness error on rank {rank}: {type(exc).__name__}: {exc}",
                    {"traceback": traceback.format_exc()[-2000:]},
                ),
            }
        out["elapsed_s"] = round(time.perf_counter() - started, 3)
        path = os.path.join(directory, f"result{number}-{rank}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(out, fh)
        os.replace(path + ".tmp", path)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    return 0
