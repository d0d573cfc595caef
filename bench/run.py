#!/usr/bin/env python3
"""Benchmark: trainlint (cold and warm cache) against TorchFix 0.7, Fixit 2 and libcst parsing alone.

    python bench/run.py                      # default corpus: torch's distributed, optim and amp folders
    python bench/run.py PATH --rounds 5      # any folder
    python bench/run.py --tools trainlint,libcst PATH   # no comparison venv, no network (CI smoke run)

Every tool runs on the same copy of the corpus (its ``.py`` files only, in a temporary folder, so no
project configuration, cache or exclusion rule of the original tree changes what a tool sees), one
after another in each round. Each run is timed from outside (wall clock) in a small wrapper process
that also reads the run's CPU time and the peak resident memory of its largest process
(``getrusage(RUSAGE_CHILDREN)``: the tool and every worker it started). The table shows medians over the
rounds, the largest peak memory seen, and ratios trainlint cold / other.

TorchFix and Fixit are installed into ``bench/.venv-compare`` on first use (never into the project's
environment). trainlint and the libcst parse script run in the interpreter running this script.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV = HERE / ".venv-compare"
COMPARE_PACKAGES = ("torchfix==0.7.0", "fixit==2.2.1")
TOOLS = ("trainlint", "libcst", "torchfix", "fixit")
LIMITS = {"cold_vs_torchfix": 0.05, "warm_vs_cold": 0.05, "peak_mib": 250.0}

# Runs one command and reports, as JSON on stdout: wall time, exit code, CPU time and peak RSS (KiB)
# of the command's largest process. A separate process so that RUSAGE_CHILDREN covers this run only.
# The timeout is a timer that kills the command, not ``subprocess.run(timeout=...)``: that one polls
# with sleeps of up to 50 ms, which added tens of milliseconds to sub-second runs (the warm cache).
_MEASURE = r"""
import json, resource, subprocess, sys, threading, time
spec = json.loads(sys.argv[1])
with open(spec["out"], "wb") as out, open(spec["err"], "wb") as err:
    start = time.perf_counter()
    proc = subprocess.Popen(spec["cmd"], cwd=spec["cwd"], env=spec["env"], stdout=out, stderr=err,
                            stdin=subprocess.DEVNULL)
    expired = []
    timer = threading.Timer(spec["timeout"], lambda: (expired.append(True), proc.kill()))
    timer.start()
    rc = proc.wait()  # a blocking waitpid: returns as soon as the command exits
    wall = time.perf_counter() - start
    timer.cancel()
    if expired:
        rc = "timeout"
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"wall": wall, "rc": rc, "cpu": usage.ru_utime + usage.ru_stime,
                  "maxrss_kib": usage.ru_maxrss}))
"""


@dataclass
class Run:
    round: int
    wall: float
    cpu: float
    peak_mib: float
    findings: int | None


@dataclass
class Row:
    name: str
    label: str
    runs: list[Run] = field(default_factory=list)
    error: str | None = None

    def median(self, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in self.runs)

    @property
    def peak(self) -> float:
        return max(r.peak_mib for r in self.runs)


def default_corpus() -> list[Path]:
    spec = importlib.util.find_spec("torch")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            "bench: torch is not installed, so the default corpus (its distributed, optim and amp "
            "folders) is missing. Install the verify extra (pip install -e '.[verify]') or give a folder."
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    return [root / name for name in ("distributed", "optim", "amp")]


def copy_corpus(sources: list[Path], into: Path) -> tuple[int, int, int]:
    """Copy the ``.py`` files under ``sources`` into ``into``; returns (files, lines, bytes)."""
    files = lines = size = 0
    for source in sources:
        source = source.resolve()
        if source.is_file():
            pairs = [(source, into / source.name)]
        else:
            pairs = [
                (p, into / source.name / p.relative_to(source))
                for p in sorted(source.rglob("*.py"))
                if "__pycache__" not in p.parts and p.is_file()
            ]
        for src, dst in pairs:
            dst.parent.mkdir(parents=True, exist_ok=True)
            data = src.read_bytes()
            dst.write_bytes(data)
            files += 1
            lines += data.count(b"\n")
            size += len(data)
    return files, lines, size


def ensure_compare_venv() -> Path:
    """bench/.venv-compare with TorchFix and Fixit, created and filled on first use."""
    python = VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    check = (
        "import importlib.metadata as m; "
        "print(m.version('torchfix'), m.version('fixit'), m.version('libcst'), m.version('flake8'))"
    )
    if python.exists():
        probe = subprocess.run([str(python), "-c", check], capture_output=True, text=True)
        wanted = [p.split("==")[1] for p in COMPARE_PACKAGES]
        if probe.returncode == 0 and probe.stdout.split()[:2] == wanted:
            return python
    print(f"bench: installing {', '.join(COMPARE_PACKAGES)} into {VENV} ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *COMPARE_PACKAGES],
        check=True,
    )
    return python


def tool_version(python: str, package: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    # Measure as users run the tools: byte-code cached after the first run.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    env["NO_COLOR"] = "1"
    return env


def measure(cmd: list[str], cwd: Path, work: Path, timeout: float) -> tuple[dict, str, str]:
    out, err = work / "stdout.txt", work / "stderr.txt"
    spec = {
        "cmd": cmd,
        "cwd": str(cwd),
        "env": child_env(),
        "out": str(out),
        "err": str(err),
        "timeout": timeout,
    }
    wrapper = subprocess.run(
        [sys.executable, "-c", _MEASURE, json.dumps(spec)], capture_output=True, text=True, check=True
    )
    result = json.loads(wrapper.stdout)
    return (
        result,
        out.read_text(encoding="utf-8", errors="replace"),
        err.read_text(encoding="utf-8", errors="replace"),
    )


def count_findings(name: str, stdout: str) -> int | None:
    if name.startswith("trainlint"):
        try:
            return len(json.loads(stdout)["findings"])
        except (ValueError, KeyError, TypeError):
            return None
    if name == "torchfix":
        return sum(1 for line in stdout.splitlines() if ": TOR" in line)
    if name == "fixit":
        return sum(1 for line in stdout.splitlines() if "@" in line and ": " in line)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Benchmark trainlint against TorchFix, Fixit and libcst parsing alone."
    )
    parser.add_argument(
        "paths", nargs="*", type=Path, help="folders or files (default: torch's distributed, optim, amp)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every tool (default: 3)")
    parser.add_argument(
        "--tools",
        default=",".join(TOOLS),
        help=f"comma-separated subset of {','.join(TOOLS)} (default: all)",
    )
    parser.add_argument(
        "--jobs", "-j", type=int, help="worker processes for trainlint, TorchFix and the parallel libcst run"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per run")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed first trainlint run")
    parser.add_argument("--json", type=Path, help="also write the results as JSON to this file")
    args = parser.parse_args(argv)

    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = sorted(set(tools) - set(TOOLS))
    if unknown or not tools:
        parser.error(f"unknown tool(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(TOOLS)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    jobs = args.jobs or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    jobs = max(1, jobs or 1)
    sources = args.paths or default_corpus()
    for source in sources:
        if not source.exists():
            parser.error(f"{source}: no such file or folder")

    compare_python = ensure_compare_venv() if {"torchfix", "fixit"} & set(tools) else None
    bindir = compare_python.parent if compare_python else None

    with tempfile.TemporaryDirectory(prefix="trainlint-bench-") as tmp_name:
        tmp = Path(tmp_name)
        corpus = tmp / "corpus"
        corpus.mkdir()
        n_files, n_lines, n_bytes = copy_corpus(sources, corpus)
        if n_files == 0:
            sys.exit("bench: no .py files in the given paths")
        work = tmp / "work"
        work.mkdir()
        jobs_flag = ["--jobs", str(args.jobs)] if args.jobs else []
        trainlint = [sys.executable, "-m", "trainlint", "--exit-zero", "--format", "json", *jobs_flag]

        rows: dict[str, Row] = {}
        plan: list[tuple[str, str]] = []
        if "trainlint" in tools:
            plan += [("trainlint-cold", "trainlint, cold cache"), ("trainlint-warm", "trainlint, warm cache")]
        if "libcst" in tools:
            plan.append(("libcst-1", "libcst parse only, 1 process"))
            if jobs > 1:
                plan.append((f"libcst-{jobs}", f"libcst parse only, {jobs} processes"))
        if "torchfix" in tools:
            plan.append(("torchfix", "TorchFix 0.7 (default rules)"))
        if "fixit" in tools:
            plan.append(("fixit", "Fixit 2 (default rules)"))
        for name, label in plan:
            rows[name] = Row(name, label)

        def command(name: str, cache_dir: Path) -> list[str]:
            if name.startswith("trainlint"):
                return [*trainlint, "--cache-dir", str(cache_dir), "corpus"]
            if name.startswith("libcst"):
                n = name.split("-")[1]
                return [sys.executable, str(HERE / "libcst_parse.py"), "--jobs", n, "corpus"]
            assert bindir is not None
            if name == "torchfix":
                return [str(bindir / "torchfix"), *jobs_flag, "corpus"]
            return [str(bindir / "fixit"), "lint", "corpus"]

        if "trainlint" in tools and not args.no_warmup:
            # Untimed: compiles trainlint's byte code and warms the file cache, as a second run would.
            measure(command("trainlint-cold", tmp / "warmup-cache"), tmp, work, args.timeout)

        for round_no in range(1, args.rounds + 1):
            cache_dir = tmp / f"cache-{round_no}"  # fresh each round: the cold run fills it
            for name, _label in plan:
                row = rows[name]
                if row.error:
                    continue
                result, stdout, stderr = measure(command(name, cache_dir), tmp, work, args.timeout)
                ok_codes = (0,) if name.startswith(("trainlint", "libcst")) else (0, 1)
                if result["rc"] not in ok_codes:
                    row.error = f"exit {result['rc']}: {stderr.strip()[-500:]}"
                    continue
                run = Run(round_no, result["wall"], result["cpu"], result["maxrss_kib"] / 1024, None)
                run.findings = count_findings(name, stdout)
                row.runs.append(run)
                print(
                    f"round {round_no}: {name:<15} {run.wall:8.2f} s wall {run.cpu:8.2f} s cpu "
                    f"{run.peak_mib:7.1f} MiB",
                    file=sys.stderr,
                    flush=True,
                )

    machine = machine_info()
    versions = {
        "python": platform.python_version(),
        "libcst": tool_version(sys.executable, "libcst"),
        "trainlint": tool_version(sys.executable, "trainlint"),
    }
    if compare_python:
        for package in ("torchfix", "fixit", "flake8"):
            versions[package] = tool_version(str(compare_python), package)
        versions["libcst (comparison venv)"] = tool_version(str(compare_python), "libcst")
    report = render(rows, args, jobs, sources, (n_files, n_lines, n_bytes), machine, versions)
    print(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "corpus": {
                "paths": [str(s) for s in sources],
                "files": n_files,
                "lines": n_lines,
                "bytes": n_bytes,
            },
            "rounds": args.rounds,
            "jobs": jobs,
            "machine": machine,
            "versions": versions,
            "rows": {
                name: {"label": r.label, "error": r.error, "runs": [vars(x) for x in r.runs]}
                for name, r in rows.items()
            },
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return 1 if any(r.error for r in rows.values()) else 0


def machine_info() -> dict[str, str]:
    info = {"cores": str(os.cpu_count()), "platform": platform.platform()}
    if hasattr(os, "sched_getaffinity"):
        info["usable cores"] = str(len(os.sched_getaffinity(0)))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory"] = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
                break
    except OSError:
        pass
    try:
        info["load average"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        pass
    return info


def round_ratio(top: Row, bottom: Row) -> float | None:
    """Median over the rounds of top/bottom wall time, each round against itself: the load of a
    shared machine changes between rounds more than between two tools of the same round."""
    walls = {r.round: r.wall for r in bottom.runs}
    ratios = [r.wall / walls[r.round] for r in top.runs if r.round in walls and walls[r.round] > 0]
    return statistics.median(ratios) if ratios else None


def render(
    rows: dict[str, Row],
    args: argparse.Namespace,
    jobs: int,
    sources: list[Path],
    corpus: tuple[int, int, int],
    machine: dict[str, str],
    versions: dict[str, str],
) -> str:
    cold = rows.get("trainlint-cold")
    cold_wall = cold.median("wall") if cold and cold.runs else None
    lines = [
        f"Corpus: {corpus[0]} files, {corpus[1]:,} lines, {corpus[2] / 1e6:.1f} MB "
        f"({', '.join(str(s) for s in sources)})",
        f"Rounds: {args.rounds}; worker processes: {jobs}; times are medians of the rounds, peak memory the "
        "largest seen; wall ratios are medians of per-round ratios",
        "Machine: " + "; ".join(f"{k} {v}" for k, v in machine.items()),
        "Versions: " + "; ".join(f"{k} {v}" for k, v in versions.items()),
        "",
        "| tool | wall s (median) | min-max | CPU s (median) | peak RSS / process | findings "
        "| trainlint cold / tool (wall) | same, CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows.values():
        if row.error or not row.runs:
            lines.append(f"| {row.label} | failed: {row.error} | | | | | | |")
            continue
        wall = row.median("wall")
        walls = [r.wall for r in row.runs]
        found = row.runs[-1].findings
        ratio = cpu_ratio = ""
        if cold and cold.runs and not row.name.startswith("trainlint"):
            ratio = f"{round_ratio(cold, row):.3f}"
            cpu_ratio = f"{cold.median('cpu') / row.median('cpu'):.3f}"
        lines.append(
            f"| {row.label} | {wall:.2f} | {min(walls):.2f}-{max(walls):.2f} | {row.median('cpu'):.2f} "
            f"| {row.peak:.0f} MiB | {'' if found is None else found} | {ratio} | {cpu_ratio} |"
        )
    lines.append("")
    checks = []
    if cold_wall is not None:
        assert cold is not None
        tf = rows.get("torchfix")
        if tf and tf.runs:
            r = round_ratio(cold, tf) or 0.0
            checks.append(("cold <= 0.05 x TorchFix", f"{r:.3f}", r <= LIMITS["cold_vs_torchfix"]))
        for name in [n for n in rows if n.startswith("libcst")]:
            lib = rows[name]
            if lib.runs:
                r = round_ratio(cold, lib) or 0.0
                checks.append((f"cold <= {lib.label}", f"{r:.2f}", r <= 1.0))
        warm = rows.get("trainlint-warm")
        if warm and warm.runs:
            r = round_ratio(warm, cold) or 0.0
            checks.append(("warm <= 0.05 x cold", f"{r:.3f}", r <= LIMITS["warm_vs_cold"]))
        peak = max(rows[n].peak for n in ("trainlint-cold", "trainlint-warm") if n in rows and rows[n].runs)
        checks.append(("peak RSS <= 250 MiB per process", f"{peak:.0f} MiB", peak <= LIMITS["peak_mib"]))
    for what, value, ok in checks:
        lines.append(f"- {what}: {value} ({'met' if ok else 'NOT met'})")
    lines.append("")
    lines.append("Command: " + " ".join(["python", "bench/run.py", *(sys.argv[1:])]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
