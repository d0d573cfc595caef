"""Running probe programs in a child process: temp directory, resource limits, timeout, and recovery.

All probes of one file run in one child (torch is imported once); each gets its own time limit inside
the child. If the child dies or hangs, the probe it was running is reported and the probes after it run
in a fresh child. The parent never imports torch and never crashes because of user code.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trainlint.verify.child import BOOT

# The child runs the package ``trainlint.verify.child`` loaded by path (see its ``BOOT``): it imports
# torch, and nothing of the parent side.
CHILD = Path(__file__).with_name("child")
STARTUP_S = 60.0  # importing torch (and CUDA initialisation) before the first probe
GRACE_S = 3.0  # beyond a probe's own timeout before the parent kills the child
POLL_S = 0.1
MEMORY_LIMIT = 8 * 1024**3


def _limits(cpu_seconds: int, device: str):
    def apply() -> None:
        import resource

        def set_limit(kind: int, value: int) -> None:
            try:
                _, hard = resource.getrlimit(kind)
                if hard != resource.RLIM_INFINITY:
                    value = min(value, hard)
                resource.setrlimit(kind, (value, hard))
            except (ValueError, OSError):
                pass

        set_limit(resource.RLIMIT_CORE, 0)
        set_limit(resource.RLIMIT_FSIZE, 256 * 1024**2)
        set_limit(resource.RLIMIT_CPU, cpu_seconds)
        if device == "cpu":  # CUDA reserves a huge virtual address space: no address limit there
            set_limit(resource.RLIMIT_AS, MEMORY_LIMIT)

    return apply


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONSTARTUP", None)
    env.update(
        {
            "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1",
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


def _tail(path: Path, limit: int = 400) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return " | ".join(lines[-3:])[-limit:]


def _watch(proc: subprocess.Popen, results: Path, timeout: float, total: float) -> tuple[int | None, str]:
    """Wait for the child; kill it when one probe runs past ``timeout`` (plus a grace period, for
    a probe whose own alarm could not fire) or the whole batch past ``total``."""
    started = time.monotonic()
    probe_started = None
    seen = 0
    while True:
        try:
            code = proc.wait(timeout=POLL_S)
            # only used when some probe has no result: it ended the process early
            return code, f"the snippet ended the child process (exit code {code}) before giving a result"
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        try:
            size = results.stat().st_size
        except FileNotFoundError:
            size = 0
        if size != seen:
            seen = size
            probe_started = now
        if probe_started is not None and now - probe_started > timeout + GRACE_S:
            return None, f"the snippet did not finish within {timeout:g}s and was killed"
        if probe_started is None and now - started > STARTUP_S:
            return None, f"the verify child process did not start within {STARTUP_S:g}s"
        if now - started > total:
            return None, f"the snippet did not finish within {timeout:g}s and was killed"


def _run_batch(
    probes: list[dict[str, Any]], device: str, timeout: float
) -> tuple[dict[str, dict], str | None, bool]:
    """Run probes in one child; returns the results it wrote and, if it stopped early, why."""
    workdir = Path(tempfile.mkdtemp(prefix="trainlint-verify-"))
    try:
        job = workdir / "job.json"
        results = workdir / "results.jsonl"
        job.write_text(json.dumps({"device": device, "timeout": timeout, "probes": probes}), encoding="utf-8")
        run_dir = workdir / "run"
        run_dir.mkdir()
        total = STARTUP_S + (timeout + GRACE_S) * len(probes)
        with open(workdir / "stdout", "wb") as out, open(workdir / "stderr", "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-c", BOOT, str(CHILD), str(job), str(results)],
                cwd=run_dir,
                env=_environment(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                preexec_fn=_limits(int(total) + 5, device),
            )
            try:
                code, why = _watch(proc, results, timeout, total)
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        found: dict[str, dict] = {}
        started = False
        if results.exists():
            for line in results.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    item = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if item.get("started"):
                    started = True
                else:
                    found[item["id"]] = item
        if why is not None and code is not None and code < 0:
            why = f"the child process was killed by signal {-code} (memory or CPU limit?)"
        if not started:
            why = f"the verify child process failed to start: {_tail(workdir / 'stderr') or why}"
        return found, why, started
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_probes(probes: list[dict[str, Any]], device: str, timeout: float) -> dict[str, dict]:
    """Results keyed by probe id; every probe gets one."""
    results: dict[str, dict] = {}
    pending = list(probes)
    while pending:
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
