"""Running probe programs in a child process: isolation, resource limits, timeout, and recovery.

``--verify`` runs the repository's own code (definitions, constructors, imports, the flagged
statements), so the child is treated as hostile:

- it gets an allow-listed environment (no CI secrets), a temporary folder as its working folder, HOME
  and TMPDIR;
- hard resource limits equal to the soft ones (it cannot raise them): CPU time, file size, core
  dumps, process count, data segment on every device and address space on the CPU;
- no network: where the kernel lets an unprivileged user create namespaces, the child runs in a new
  user, network and PID namespace (``unshare``, or ``bwrap`` when installed), which also kills every
  process it started, ``setsid`` or not, when it ends; elsewhere the weaker mode (a Python-level
  block) is named on stderr;
- it dies with trainlint (``PR_SET_PDEATHSIG``) and its whole process group is killed at the end;
- results come back over a pipe (not a file the snippet could append to) and are validated: one
  result per started probe, in order, of a known status; anything else is an error for that probe;
- the configured timeout is capped.

All probes of a run go to one child (torch is imported once); each gets its own time limit inside the
child. The child is started before its job is known (``start_child``): it imports torch while the
parent builds the probes, then waits until the job file is released through a pipe. If the child dies
or hangs, the probe it was running is reported and the probes after it run in a fresh child. The parent
never imports torch and never crashes because of user code.
"""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trainlint.procs import die_with_parent
from trainlint.verify.child import BOOT

# The child runs the package ``trainlint.verify.child`` loaded by path (see its ``BOOT``): it imports
# torch, and nothing of the parent side.
CHILD = Path(__file__).with_name("child")
STARTUP_S = 60.0  # importing torch (and CUDA initialisation) before the first probe
GRACE_S = 3.0  # beyond a probe's own timeout before the parent kills the child
POLL_S = 0.1
MAX_TIMEOUT_S = 600.0  # a repository's configuration cannot keep the child for longer per probe
MEMORY_LIMIT = 8 * 1024**3
FILE_SIZE_LIMIT = 256 * 1024**2
EXTRA_TASKS = 512  # processes and threads the child may add to what this user already runs
MAX_RESULT_BYTES = 16 * 1024**2
STATUSES = frozenset({"confirmed", "not-reproduced", "not-executable", "error"})
# What the child may see of the environment: how to find Python, its packages and the GPU, and the
# locale. Everything else (tokens, keys, CI secrets) stays behind.
ENV_ALLOWED = frozenset(
    {
        "PATH",
        "LANG",
        "LANGUAGE",
        "TZ",
        "PYTHONPATH",
        "PYTHONNOUSERSITE",
        "VIRTUAL_ENV",
        "CONDA_PREFIX",
        "LD_LIBRARY_PATH",
        "CUDA_HOME",
        "CUDA_PATH",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "NVIDIA_VISIBLE_DEVICES",
        "NVIDIA_DRIVER_CAPABILITIES",
        "SYSTEMROOT",
    }
)
ISOLATION_WEAK = (
    "trainlint: warning: --verify runs the repository's code without a network namespace (this system "
    "does not allow unprivileged user namespaces and bubblewrap is not installed): its network is only "
    "blocked inside Python, and processes it detaches may outlive the run"
)


def _set_hard(kind: int, value: int) -> None:
    """Soft and hard limit both ``value`` (or the current hard limit, when lower): the child can
    neither raise nor lift it."""
    import resource

    try:
        _, hard = resource.getrlimit(kind)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(kind, (value, value))
    except (ValueError, OSError):
        pass


def _user_tasks() -> int:
    """Processes and threads this user runs now (``RLIMIT_NPROC`` counts them all)."""
    uid = os.getuid()
    count = 0
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0
    for entry in entries:
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                continue
    return count


def _limits(cpu_seconds: int, device: str, parent: int | None = None):
    """The ``preexec_fn`` of the child: limits, and death with ``parent``."""
    import ctypes  # noqa: F401 - imported before the fork: ``die_with_parent`` uses it after
    import resource

    tasks = _user_tasks() + EXTRA_TASKS  # counted here, before the fork: /proc is slow after it

    def apply() -> None:
        if parent is not None:
            die_with_parent(parent)
        _set_hard(resource.RLIMIT_CORE, 0)
        _set_hard(resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT)
        _set_hard(resource.RLIMIT_CPU, cpu_seconds)
        if hasattr(resource, "RLIMIT_NPROC") and tasks > EXTRA_TASKS:
            _set_hard(resource.RLIMIT_NPROC, tasks)
        # RLIMIT_DATA counts what the process really writes (heap, anonymous mappings), not the
        # address space CUDA reserves without using it: a memory bound on every device
        if hasattr(resource, "RLIMIT_DATA"):
            _set_hard(resource.RLIMIT_DATA, MEMORY_LIMIT)
        if device == "cpu":  # CUDA reserves a huge virtual address space: no address limit there
            _set_hard(resource.RLIMIT_AS, MEMORY_LIMIT)

    return apply


def _environment(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in ENV_ALLOWED or k.startswith("LC_")}
    env.update(
        {
            "HOME": str(home),
            "TMPDIR": str(home),
            "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONNOUSERSITE": "1",
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "WANDB_MODE": "disabled",
            "http_proxy": "http://127.0.0.1:9",
            "https_proxy": "http://127.0.0.1:9",
            "HTTP_PROXY": "http://127.0.0.1:9",
            "HTTPS_PROXY": "http://127.0.0.1:9",
        }
    )
    return env


def _works(command: list[str]) -> bool:
    try:
        done = subprocess.run(command, capture_output=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


@functools.cache
def isolation() -> tuple[str, tuple[str, ...]]:
    """How the child is isolated: ``("namespace", prefix)``, ``("bubblewrap", prefix)``, or
    ``("python", ())`` (no namespace: the weaker mode). ``prefix`` goes before the child's command."""
    if not sys.platform.startswith("linux"):
        return "python", ()
    unshare = shutil.which("unshare")
    if unshare is not None:
        prefix = (unshare, "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child")
        if _works([*prefix, sys.executable, "-c", "pass"]):
            return "namespace", prefix
    bwrap = shutil.which("bwrap")
    if bwrap is not None:
        prefix = (bwrap, "--dev-bind", "/", "/", "--unshare-net", "--unshare-pid", "--die-with-parent", "--")
        if _works([*prefix, sys.executable, "-c", "pass"]):
            return "bubblewrap", prefix
    return "python", ()


@functools.cache
def _warn_weak_isolation() -> None:
    print(ISOLATION_WEAK, file=sys.stderr)


def _tail(path: Path, limit: int = 400) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return " | ".join(lines[-3:])[-limit:]


class _Channel:
    """The parent's end of the results pipe: what the child has sent so far."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.data = bytearray()
        os.set_blocking(fd, False)

    def read(self, wait: float) -> bool:
        """Read what is there (waiting up to ``wait``); whether anything new arrived."""
        ready, _, _ = select.select([self.fd], [], [], wait)
        if not ready:
            return False
        got = False
        while len(self.data) <= MAX_RESULT_BYTES:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            self.data += chunk
            got = True
        return got


def _watch(
    proc: subprocess.Popen, channel: _Channel, timeout: float, total: float, probes: list[dict[str, Any]]
) -> tuple[int | None, str | None]:
    """Wait for the child until every probe has its result or the child ends; kill it when one probe
    runs past ``timeout`` (plus a grace period, for a probe whose own alarm could not fire) or the
    whole batch past ``total``. ``(None, None)``: every result is in."""
    started = time.monotonic()
    probe_started = None
    while True:
        arrived = channel.read(POLL_S)
        if arrived and _all_results(bytes(channel.data), probes):
            # the caller kills the child: its exit (the workers' shutdown, torch's teardown) took
            # 0.5-2 s, all of it after the last result
            return None, None
        code = proc.poll()
        if code is not None:
            channel.read(0)
            # only used when some probe has no result: it ended the process early
            return code, f"the snippet ended the child process (exit code {code}) before giving a result"
        now = time.monotonic()
        if arrived:
            probe_started = now
        if probe_started is not None and now - probe_started > timeout + GRACE_S:
            return None, f"the snippet did not finish within {timeout:g}s and was killed"
        if probe_started is None and now - started > STARTUP_S:
            return None, f"the verify child process did not start within {STARTUP_S:g}s"
        if now - started > total:
            return None, f"the snippet did not finish within {timeout:g}s and was killed"


def _all_results(data: bytes, probes: list[dict[str, Any]]) -> bool:
    """Whether the child has sent a valid result for the last probe (results come in probe order)."""
    if not probes or data.count(b"\n") < 2 * len(probes):
        return False
    found, started, _ = parse_results(data, probes)
    return started == len(probes) and probes[-1]["id"] in found


def parse_results(data: bytes, probes: list[dict[str, Any]]) -> tuple[dict[str, dict], int, set[str]]:
    """The child's messages, checked: a ``started`` line for each probe in order, then at most one
    result for it, of a known status. Returns the results, how many probes started, and the probes
    whose messages broke the protocol (forged by the snippet, or a broken child)."""
    order = [p["id"] for p in probes]
    found: dict[str, dict] = {}
    broken: set[str] = set()
    started = 0
    for line in data.decode("utf-8", "replace").splitlines()[: 4 * len(order) + 8]:
        try:
            item = json.loads(line)
        except (ValueError, RecursionError):
            item = None
        current = order[started - 1] if started else None
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            if current is not None:
                broken.add(current)
            continue
        if item.get("started") is True and started < len(order) and item["id"] == order[started]:
            started += 1
        elif item["id"] == current and current not in found and _valid(item):
            found[current] = item
        elif current is not None:
            broken.add(current)  # a second result, a result for another probe, or a bad one
    return found, started, broken


def _valid(item: dict[str, Any]) -> bool:
    return (
        item.get("status") in STATUSES
        and isinstance(item.get("detail", ""), str)
        and isinstance(item.get("evidence", {}), dict)
    )


def _spawn(
    workdir: Path, job: Path, device: str, total: float, wait: int
) -> tuple[subprocess.Popen, _Channel]:
    """Start the child, isolated as well as this system allows; it inherits two descriptors: the
    write end of the results pipe, and ``wait``, the read end of the pipe whose closing releases
    the job."""
    mode, prefix = isolation()
    if mode == "python":
        _warn_weak_isolation()
    read_end, write_end = os.pipe()
    run_dir = workdir / "run"
    run_dir.mkdir()
    command = [*prefix, sys.executable, "-c", BOOT, str(CHILD), str(job), f"fd:{write_end}", f"wait:{wait}"]
    try:
        with open(workdir / "stdout", "wb") as out, open(workdir / "stderr", "wb") as err:
            proc = subprocess.Popen(
                command,
                cwd=run_dir,
                env=_environment(run_dir),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                pass_fds=(write_end, wait),
                start_new_session=True,
                preexec_fn=_limits(int(total) + 5, device, os.getpid()),
            )
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    return proc, _Channel(read_end)


class Child:
    """A started child waiting for its job (``start_child``); ``close`` ends it (whatever state it
    is in) and removes its folder."""

    def __init__(self, device: str, timeout: float, count: int) -> None:
        self.device, self.timeout, self.capacity = device, timeout, max(count, 1)
        self.workdir = Path(tempfile.mkdtemp(prefix="trainlint-verify-"))
        self.job = self.workdir / "job.json"
        self.total = _batch_limit(timeout, count)
        wait, self._release = os.pipe()
        try:
            self.proc, self.channel = _spawn(self.workdir, self.job, device, self.total, wait)
        except BaseException:
            os.close(self._release)
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        finally:
            os.close(wait)
        self.closed = False
        self._announced: set[str] = set()

    def takes(self, device: str, timeout: float, count: int) -> bool:
        """Whether this child, still waiting for its job, can run ``count`` probes of this device and
        timeout (its CPU limit was set at its start for ``capacity`` of them); if so its limit for the
        whole batch becomes theirs."""
        timeout = min(timeout, MAX_TIMEOUT_S)
        if self.closed or self._release < 0 or self.proc.poll() is not None:
            return False
        if device != self.device or timeout > self.timeout or count > self.capacity:
            return False
        self.total = _batch_limit(timeout, count)
        return True

    def announce(self, driver: str) -> None:
        """Tell the waiting child that a probe of this driver will come (it may prepare for it)."""
        if self._release < 0 or driver in self._announced:
            return
        self._announced.add(driver)
        try:
            os.write(self._release, driver.encode("utf-8", "replace").replace(b"\n", b" ") + b"\n")
        except OSError:  # the child has ended: the batch will say why
            pass

    def release(self, job: dict[str, Any]) -> None:
        """Write the job and let the child read it."""
        self.job.write_text(json.dumps(job), encoding="utf-8")
        os.close(self._release)
        self._release = -1

    def stop(self) -> None:
        """Kill the child's whole process group and keep what it sent."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.channel.read(0)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.stop()
        os.close(self.channel.fd)
        if self._release >= 0:
            os.close(self._release)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _batch_limit(timeout: float, count: int) -> float:
    """Seconds a child may take for ``count`` probes, its start-up included (its CPU limit too)."""
    return STARTUP_S + (timeout + GRACE_S) * max(count, 1)


def start_child(device: str, timeout: float, count: int) -> Child:
    """A child for at most ``count`` probes, started now: it imports torch while the caller builds
    the probes, and runs them once ``run_probes`` releases them."""
    return Child(device, min(timeout, MAX_TIMEOUT_S), count)


# A child started before linting (``--verify``: torch imports while the files are linted) cannot know
# how many probes will come: its CPU limit is set for this many, and a run with more starts its own.
EARLY_PROBES = 64


def start_early(device: str, timeout: float) -> Child:
    """A child started before the findings are known; ``Child.takes`` says whether it fits the job."""
    return start_child(device, timeout, EARLY_PROBES)


def _run_batch(
    probes: list[dict[str, Any]], device: str, timeout: float, child: Child | None = None
) -> tuple[dict[str, dict], str | None, bool]:
    """Run probes in one child (``child``, or a new one); returns the results it sent and, if it
    stopped early, why."""
    if child is None:
        child = start_child(device, timeout, len(probes))
    try:
        child.release({"device": device, "timeout": timeout, "probes": probes})
        try:
            code, why = _watch(child.proc, child.channel, timeout, child.total, probes)
        finally:
            child.stop()
        found, started, broken = parse_results(bytes(child.channel.data), probes)
        for probe_id in broken:
            found[probe_id] = {
                "status": "error",
                "detail": "the child sent an invalid or repeated result (written by the snippet?)",
                "evidence": {},
            }
        if why is not None and code is not None and code < 0:
            why = f"the child process was killed by signal {-code} (memory or CPU limit?)"
        if not started:
            why = f"the verify child process failed to start: {_tail(child.workdir / 'stderr') or why}"
        return found, why, bool(started)
    finally:
        child.close()


def run_probes(
    probes: list[dict[str, Any]], device: str, timeout: float, child: Child | None = None
) -> dict[str, dict]:
    """Results keyed by probe id; every probe gets one. ``child``, started by ``start_child`` for
    this device and timeout, runs the first batch."""
    timeout = min(timeout, MAX_TIMEOUT_S)
    results: dict[str, dict] = {}
    pending = list(probes)
    while pending:
        if child is not None:
            found, why, started = _run_batch(pending, device, timeout, child)
            child = None  # the probes after one that ended it go to a fresh child
        else:
            found, why, started = _run_batch(pending, device, timeout)
        results.update(found)
        rest = [p for p in pending if p["id"] not in found]
        if not rest:
            break
        if not started:  # the child never reached a probe: nothing to blame on user code
            for p in rest:
                results[p["id"]] = {"status": "error", "detail": why or "no result", "evidence": {}}
            break
        culprit = rest[0]
        results[culprit["id"]] = {
            "status": "not-executable",
            "detail": why or "the child process stopped without a result",
            "evidence": {},
        }
        pending = rest[1:]
    return results
