"""Wall clock and CPU time of `trainlint --verify` on a folder, for two versions of trainlint side by side.

Each version is a tree laid out like this repository (``lint/`` and ``rules/``): a git revision
(``git:REF``, extracted with ``git archive``) or a folder (``.`` is the working tree). Both are copied
into a temporary folder as the package ``trainlint`` and run with ``PYTHONPATH`` pointing there, on the
same input, with the cache off; the rounds alternate between the two versions, so that drift in the
machine's load hits both alike. CPU is user + system time of the run and every process it waited for
(the verify child and its workers). The findings and verify verdicts (status, detail, evidence without
timings) of the two versions are compared.

    python bench/verify_speed.py [--before git:HEAD] [--after .] [--rounds 3] [--path fixtures/]
                                 [--out bench/VERIFY_RESULTS.md]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RUN = "import sys; from trainlint.cli import main; sys.argv[0] = 'trainlint'; main()"


def install(source: str, into: Path) -> Path:
    """``into/trainlint`` from the tree ``source`` (``git:REF`` or a folder); returns ``into``."""
    package = into / "trainlint"
    if source.startswith("git:"):
        data = subprocess.run(
            ["git", "archive", source[4:], "lint", "rules"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        tree = into / "tree"
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(tree, filter="data")
    else:
        tree = (ROOT / source).resolve()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(tree / "lint", package, ignore=ignore)
    shutil.copytree(tree / "rules", package / "rules", ignore=ignore)
    return into


def adopt_orphans() -> None:
    """Make this process the reaper of the run's descendants whose parent ends first (a child killed
    once its last result is in leaves its workers behind): their CPU time then reaches
    ``RUSAGE_CHILDREN`` when ``reap_orphans`` waits for them. Linux only; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def reap_orphans(limit_s: float = 30.0) -> None:
    """Wait for every adopted descendant of the last run to end."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # none left
        if pid == 0:
            time.sleep(0.05)


def run_once(pythonpath: Path, path: str) -> tuple[float, float, dict[str, Any]]:
    """(wall seconds, CPU seconds, the JSON report) of one ``--verify`` run."""
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", RUN, "--verify", "--no-cache", "--format", "json", path],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    reap_orphans()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if not done.stdout.strip():
        raise SystemExit(f"the run printed no report (exit {done.returncode}): {done.stderr[-2000:]}")
    return wall, cpu, json.loads(done.stdout)


def verdicts(report: dict[str, Any]) -> list[tuple]:
    """What must not change: each finding and its verify verdict (timings left out)."""
    out = []
    for f in report["findings"]:
        verify = dict(f.get("verify") or {})
        evidence = {k: v for k, v in (verify.pop("evidence", None) or {}).items() if k != "elapsed_s"}
        fix = json.dumps(f.get("fix"), sort_keys=True)
        verdict, shown = json.dumps(verify, sort_keys=True), json.dumps(evidence, sort_keys=True)
        out.append((f["path"], f["rule"], f["line"], f["column"], f["message"], verdict, shown, fix))
    return out


def differences(a: list[tuple], b: list[tuple]) -> list[str]:
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    return [f"before only: {x[0]}:{x[2]} {x[1]} {x[5][:160]}" for x in only_a] + [
        f"after only: {x[0]}:{x[2]} {x[1]} {x[5][:160]}" for x in only_b
    ]


def table(names: tuple[str, str], runs: dict[str, list[tuple[float, float]]]) -> list[str]:
    lines = [
        "| version | wall (median) | wall, each run | CPU (median) | CPU, each run |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        walls = [w for w, _ in runs[name]]
        cpus = [c for _, c in runs[name]]
        lines.append(
            f"| {name} | {statistics.median(walls):.2f} s | {', '.join(f'{w:.2f}' for w in walls)} | "
            f"{statistics.median(cpus):.2f} s | {', '.join(f'{c:.2f}' for c in cpus)} |"
        )
    med = {
        n: (statistics.median(w for w, _ in runs[n]), statistics.median(c for _, c in runs[n])) for n in names
    }
    (wall_a, cpu_a), (wall_b, cpu_b) = med[names[0]], med[names[1]]
    lines.append(f"| after / before | {wall_b / wall_a:.2f}x | | {cpu_b / cpu_a:.2f}x | |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="git:HEAD", help="git:REF or a folder with lint/ and rules/")
    parser.add_argument("--after", default=".", help="git:REF or a folder with lint/ and rules/")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--path", default="fixtures/")
    parser.add_argument("--out", help="write the results as Markdown to this file")
    args = parser.parse_args()
    names = (f"before ({args.before})", f"after ({args.after})")
    adopt_orphans()
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="trainlint-verify-bench-") as tmp:
        trees = {}
        for name, source in zip(names, (args.before, args.after), strict=True):
            trees[name] = install(source, Path(tmp) / ("before" if name == names[0] else "after"))
        runs: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        reports: dict[str, dict[str, Any]] = {}
        for _ in range(args.rounds):
            for name in names:
                wall, cpu, reports[name] = run_once(trees[name], args.path)
                runs[name].append((wall, cpu))
                print(f"{name}: {wall:.2f} s wall, {cpu:.2f} s CPU", file=sys.stderr)
    load.append(os.getloadavg()[0])
    diff = differences(verdicts(reports[names[0]]), verdicts(reports[names[1]]))
    checked = sum(1 for f in reports[names[1]]["findings"] if f.get("verify"))
    lines = [
        f"`trainlint --verify --no-cache {args.path}`, median of {args.rounds} alternating rounds; "
        f"{os.cpu_count()} CPUs, load average {load[0]:.1f} before and {load[1]:.1f} after.",
        "",
        *table(names, runs),
        "",
        "Findings and verify verdicts (status, detail, evidence without timings) of the last rounds: "
        + ("identical" if not diff else f"{len(diff)} differ")
        + f" ({len(reports[names[1]]['findings'])} findings, {checked} with a verdict).",
        *(f"- {d}" for d in diff[:40]),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
