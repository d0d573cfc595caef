#!/usr/bin/env python3
"""Benchmark: trainlint (cold and warm cache) against TorchFix 0.7, Fixit 2 and libcst parsing alone.

    python bench/run.py                      # default corpus: torch's distributed, optim and amp folders
    python bench/run.py PATH --rounds 5      # any folder
    python bench/run.py --corpus subset      # nanoGPT, pytorch/examples, accelerate, Lightning
    python bench/run.py --corpus big --rounds 1   # + torchtitan, the installed torch, diffusers
    python bench/run.py --tools trainlint,libcst PATH   # no comparison venv, no network (CI smoke run)
    python bench/run.py --corpus subset --snapshot   # a copy of the code: others' edits cannot interfere

The named corpora are extracted from bare git mirrors (``--mirrors``, default /work/.mirror, one
``<owner>+<name>/repo`` each) at their HEAD; the commits are printed with the table. Besides the tools,
``stdin`` times ``trainlint -`` on a file the prefilter rejects (median of 20 runs) and ``index`` runs
trainlint cold in one process with the project index's functions timed: its share of the run's CPU.

Every tool runs on the same copy of the corpus (its ``.py`` files only, in a temporary folder, so no
project configuration, cache or exclusion rule of the original tree changes what a tool sees), left to
age 2.5 s (``RACY_SECONDS``) and then run one tool after another in each round. Each run is timed from outside (wall clock) in a small wrapper process
that also reads the run's CPU time and the peak resident memory of its largest process
(``getrusage(RUSAGE_CHILDREN)``: the tool and every worker it started). The table shows medians over the
rounds, the largest peak memory seen, and ratios trainlint cold / other.

TorchFix and Fixit are installed into ``bench/.venv-compare`` on first use (never into the project's
environment). trainlint and the libcst parse script run in the interpreter running this script.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV = HERE / ".venv-compare"
COMPARE_PACKAGES = ("torchfix==0.7.0", "fixit==2.2.1")
TOOLS = ("trainlint", "libcst", "libcst-par", "torchfix", "fixit", "stdin", "index")
LIMITS = {
    "cold_vs_torchfix": 0.03,
    "cold_vs_libcst": 0.5,
    "warm_vs_cold": 0.05,
    "peak_mib": 250.0,
    "index_share": 0.10,
    "stdin_s": 0.150,
}
MIRRORS = Path("/work/.mirror")
SUBSET = ("karpathy/nanoGPT", "pytorch/examples", "huggingface/accelerate", "Lightning-AI/pytorch-lightning")
CORPORA = {"subset": SUBSET, "big": (*SUBSET, "pytorch/torchtitan", "torch", "huggingface/diffusers")}
STDIN_RUNS = 20

# Runs one command and reports, as JSON on stdout: wall time, exit code, CPU time and peak RSS (KiB)
# of the command's largest process. A separate process so that RUSAGE_CHILDREN covers this run only.
# The timeout is a timer that kills the command, not ``subprocess.run(timeout=...)``: that one polls
# with sleeps of up to 50 ms, which added tens of milliseconds to sub-second runs (the warm cache).
_MEASURE = r"""
import json, resource, subprocess, sys, threading, time
spec = json.loads(sys.argv[1])
with open(spec["out"], "wb") as out, open(spec["err"], "wb") as err:
    start = time.perf_counter()
    stdin = open(spec["stdin"], "rb") if spec.get("stdin") else subprocess.DEVNULL
    proc = subprocess.Popen(spec["cmd"], cwd=spec["cwd"], env=spec["env"], stdout=out, stderr=err,
                            stdin=stdin)
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


def torch_root() -> Path:
    spec = importlib.util.find_spec("torch")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            "bench: torch is not installed, so the corpus (its distributed, optim and amp folders, or all "
            "of it) is missing. Install the verify extra (pip install -e '.[verify]') or give a folder."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def default_corpus() -> list[Path]:
    root = torch_root()
    return [root / name for name in ("distributed", "optim", "amp")]


def materialize(name: str, mirrors: Path, into: Path) -> tuple[list[Path], dict[str, str]]:
    """The folders of a named corpus, each repository's ``.py`` files extracted from its bare mirror at
    HEAD (``torch``: the installed package), and the commit (or version) of each."""
    sources: list[Path] = []
    commits: dict[str, str] = {}
    for repo in CORPORA[name]:
        if repo == "torch":
            sources.append(torch_root())
            commits["torch (installed)"] = importlib.metadata.version("torch")
            continue
        git_dir = mirrors / repo.replace("/", "+") / "repo"
        if not git_dir.is_dir():
            sys.exit(f"bench: no mirror of {repo} at {git_dir}")
        target = into / repo.replace("/", "+")
        target.mkdir(parents=True)
        git = ["git", f"--git-dir={git_dir}"]
        commits[repo] = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        archive = subprocess.Popen([*git, "archive", "HEAD", "--", "*.py"], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(target)], stdin=archive.stdout, check=True)
        if archive.wait() != 0:
            sys.exit(f"bench: git archive failed for {repo}")
        sources.append(target)
    return sources, commits


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


# The result cache keeps no record resting on a file or folder changed in the last 2 s (a change in
# the same clock tick could go unseen: "racy" stamps, as git treats them), and falls back to keying
# such a file by its imports' whole facts. The corpus was just written: a run started at once would
# time that fallback (0.2 s of index on the subset) instead of a checkout's cold run.
RACY_SECONDS = 2.5

_SNAPSHOT: list[Path] = []  # the copy of trainlint's code the runs import, when --snapshot is given


def take_snapshot(into: Path) -> None:
    """Copy the ``trainlint`` package (``lint/``, with ``rules/`` as its ``rules`` subpackage, as
    pyproject.toml's package-dir maps them) to ``into``; every later run imports it from there."""
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(HERE.parent / "lint", into / "trainlint", ignore=ignore)
    shutil.copytree(HERE.parent / "rules", into / "trainlint" / "rules", ignore=ignore)
    _SNAPSHOT.append(into)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    if _SNAPSHOT:  # (ahead of the editable install's finder, which comes after the path entries)
        env["PYTHONPATH"] = os.pathsep.join([str(_SNAPSHOT[-1]), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
    # Measure as users run the tools: byte-code cached after the first run.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    env["NO_COLOR"] = "1"
    return env


def measure(
    cmd: list[str], cwd: Path, work: Path, timeout: float, stdin: Path | None = None
) -> tuple[dict, str, str]:
    out, err = work / "stdout.txt", work / "stderr.txt"
    spec = {
        "cmd": cmd,
        "cwd": str(cwd),
        "env": child_env(),
        "out": str(out),
        "err": str(err),
        "timeout": timeout,
        "stdin": str(stdin) if stdin else None,
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark trainlint against TorchFix, Fixit and libcst parsing alone."
    )
    parser.add_argument(
        "paths", nargs="*", type=Path, help="folders or files (default: torch's distributed, optim, amp)"
    )
    parser.add_argument("--corpus", choices=sorted(CORPORA), help="a named corpus from the git mirrors")
    parser.add_argument("--mirrors", type=Path, default=MIRRORS, help=f"bare mirrors (default: {MIRRORS})")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every tool (default: 3)")
    parser.add_argument(
        "--compare-rounds", type=int, help="rounds of TorchFix and Fixit (default: --rounds; they are slow)"
    )
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
    parser.add_argument(
        "--snapshot",
        action="store_true",
        help="run a copy of trainlint's code taken at the start: edits made meanwhile (a shared tree)"
        " cannot change the code fingerprint between the cold and the warm run",
    )
    args = parser.parse_args(argv)
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = sorted(set(args.tools) - set(TOOLS))
    if unknown or not args.tools:
        parser.error(f"unknown tool(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(TOOLS)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.corpus and args.paths:
        parser.error("give paths or --corpus, not both")
    for source in args.paths:
        if not source.exists():
            parser.error(f"{source}: no such file or folder")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tools = args.tools
    jobs = args.jobs or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    jobs = max(1, jobs or 1)
    compare_python = ensure_compare_venv() if {"torchfix", "fixit"} & set(tools) else None

    with tempfile.TemporaryDirectory(prefix="trainlint-bench-") as tmp_name:
        tmp = Path(tmp_name)
        commits: dict[str, str] = {}
        if args.corpus:
            sources, commits = materialize(args.corpus, args.mirrors, tmp / "sources")
        else:
            sources = args.paths or default_corpus()
        if args.snapshot:
            take_snapshot(tmp / "snapshot")
        corpus = tmp / "corpus"
        corpus.mkdir()
        sizes = copy_corpus(sources, corpus)
        if sizes[0] == 0:
            sys.exit("bench: no .py files in the given paths")
        time.sleep(RACY_SECONDS)
        rows = plan_rows(tools, jobs)
        run_rounds(rows, args, tmp, compare_python)
        extras = {}
        if "stdin" in tools:
            extras["stdin"] = measure_stdin(tmp, args.timeout)
        if "index" in tools:
            extras["index"] = measure_index(tmp, args.timeout)

    versions = {
        "python": platform.python_version(),
        "libcst": tool_version(sys.executable, "libcst"),
        "trainlint": tool_version(sys.executable, "trainlint"),
    }
    if compare_python:
        for package in ("torchfix", "fixit", "flake8"):
            versions[package] = tool_version(str(compare_python), package)
        versions["libcst (comparison venv)"] = tool_version(str(compare_python), "libcst")
    context = {"sources": sources, "corpus": sizes, "commits": commits, "jobs": jobs}
    report = render(rows, args, context, machine_info(), versions, extras)
    print(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "corpus": {
                "name": args.corpus,
                "paths": [str(s) for s in sources],
                "commits": commits,
                "files": sizes[0],
                "lines": sizes[1],
                "bytes": sizes[2],
            },
            "rounds": args.rounds,
            "jobs": jobs,
            "machine": machine_info(),
            "versions": versions,
            "rows": {
                name: {"label": r.label, "error": r.error, "runs": [vars(x) for x in r.runs]}
                for name, r in rows.items()
            },
            "extras": extras,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return 1 if any(r.error for r in rows.values()) else 0


def plan_rows(tools: list[str], jobs: int) -> dict[str, Row]:
    plan: list[tuple[str, str]] = []
    if "trainlint" in tools:
        plan += [("trainlint-cold", "trainlint, cold cache"), ("trainlint-warm", "trainlint, warm cache")]
    if "libcst" in tools:
        plan.append(("libcst-1", "libcst parse only, 1 process"))
    if "libcst-par" in tools and jobs > 1:
        plan.append((f"libcst-{jobs}", f"libcst parse only, {jobs} processes"))
    if "torchfix" in tools:
        plan.append(("torchfix", "TorchFix 0.7 (default rules)"))
    if "fixit" in tools:
        plan.append(("fixit", "Fixit 2 (default rules)"))
    return {name: Row(name, label) for name, label in plan}


def trainlint_command(args: argparse.Namespace) -> list[str]:
    jobs_flag = ["--jobs", str(args.jobs)] if args.jobs else []
    return [sys.executable, "-m", "trainlint", "--exit-zero", "--format", "json", *jobs_flag]


def run_rounds(
    rows: dict[str, Row], args: argparse.Namespace, tmp: Path, compare_python: Path | None
) -> None:
    """Every row's command, one after another in each round (TorchFix and Fixit in the first
    ``--compare-rounds`` rounds only)."""
    work = tmp / "work"
    work.mkdir()
    bindir = compare_python.parent if compare_python else None
    compare_rounds = args.compare_rounds or args.rounds

    def command(name: str, cache_dir: Path) -> list[str]:
        if name.startswith("trainlint"):
            return [*trainlint_command(args), "--cache-dir", str(cache_dir), "corpus"]
        if name.startswith("libcst"):
            n = name.split("-")[1]
            return [sys.executable, str(HERE / "libcst_parse.py"), "--jobs", n, "corpus"]
        assert bindir is not None
        if name == "torchfix":
            return [str(bindir / "torchfix"), *(["--jobs", str(args.jobs)] if args.jobs else []), "corpus"]
        return [str(bindir / "fixit"), "lint", "corpus"]

    if "trainlint-cold" in rows and not args.no_warmup:
        # Untimed: compiles trainlint's byte code and warms the file cache, as a second run would.
        measure(command("trainlint-cold", tmp / "warmup-cache"), tmp, work, args.timeout)

    for round_no in range(1, args.rounds + 1):
        cache_dir = tmp / f"cache-{round_no}"  # fresh each round: the cold run fills it
        for name, row in rows.items():
            if row.error or (name in ("torchfix", "fixit") and round_no > compare_rounds):
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


# A file the prefilter rejects, as an editor sends it on every keystroke: helpers whose comments and
# docstrings mention training calls (the raw-text prefilter passes, the gate on the tree does not).
REJECTED = "\n".join(
    [
        '"""Data helpers. The training loop (loss.backward(), scaler.step(opt), zero_grad()) is elsewhere."""',
        "import json",
        "import os",
        "",
        *(
            f"def load_{i}(path):\n    # shard {i}: read before the backward pass of step {i}\n"
            f"    with open(os.path.join(path, 'shard{i}.json')) as f:\n        return json.load(f)\n"
            for i in range(19)
        ),
    ]
)


def measure_stdin(tmp: Path, timeout: float) -> dict[str, object]:
    """``trainlint -`` on ``REJECTED``: the median wall time of ``STDIN_RUNS`` runs."""
    source = tmp / "rejected.py"
    source.write_text(REJECTED, encoding="utf-8")
    work = tmp / "work-stdin"
    work.mkdir()
    cmd = [sys.executable, "-m", "trainlint", "--no-cache", "-", "--stdin-filename", "rejected.py"]
    measure(cmd, tmp, work, timeout, stdin=source)  # untimed: byte code compiled, files cached
    runs = [measure(cmd, tmp, work, timeout, stdin=source)[0] for _ in range(STDIN_RUNS)]
    startup = [measure([sys.executable, "-c", "pass"], tmp, work, timeout)[0]["wall"] for _ in range(5)]
    return {
        "lines": REJECTED.count("\n") + 1,
        "wall_median": statistics.median(r["wall"] for r in runs),
        "cpu_median": statistics.median(r["cpu"] for r in runs),
        "rc": sorted({r["rc"] for r in runs}),
        "interpreter_startup": statistics.median(startup),
    }


# trainlint cold in one process, with every function and method of the project index timed (only the
# outermost call counts): the index's share of the run's CPU, and the peak memory of the main process
# and of the children that parse large files. (``pyast``, the tree readings the gate checks share with
# the summaries, counts only where an index function calls it.)
_INDEX = r"""
import json, resource, sys, time
import trainlint.model.project as project
import trainlint.model.dependency_keys as dependency_keys
import trainlint.model.summary as summary
import trainlint.model.index_imports as index_imports
import trainlint.model.index_memory as index_memory
import trainlint.model.stamps as stamps
spent, depth = [0.0], [0]
def timed(fn):
    def wrapper(*a, **k):
        if depth[0]:
            return fn(*a, **k)
        depth[0] += 1
        start = time.process_time()
        try:
            return fn(*a, **k)
        finally:
            spent[0] += time.process_time() - start
            depth[0] -= 1
    return wrapper
originals = {}
for module in (project, dependency_keys, summary, index_imports, index_memory, stamps):
    for name, value in list(vars(module).items()):
        if callable(value) and getattr(value, "__module__", None) == module.__name__ and not isinstance(value, type):
            originals[value] = timed(value)
            setattr(module, name, originals[value])
for owner in (project.Project, project.ProjectIndex, index_memory.Shelf):
    for name, value in list(vars(owner).items()):
        if name.startswith("__"):
            continue
        if isinstance(value, (classmethod, staticmethod)):
            setattr(owner, name, type(value)(timed(value.__func__)))
        elif callable(value):
            setattr(owner, name, timed(value))
for module in [m for n, m in list(sys.modules.items()) if n.startswith("trainlint")]:
    for name, value in list(vars(module).items()):
        if not isinstance(value, type) and callable(value) and value in originals:
            setattr(module, name, originals[value])
from trainlint.cli import main
start = time.process_time()
code = main(sys.argv[1:])
total = time.process_time() - start
children = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": code, "index_cpu": spent[0], "cpu": total + children.ru_utime + children.ru_stime,
                  "main_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "children_peak_mib": children.ru_maxrss / 1024}), file=sys.stderr)
"""


def measure_index(tmp: Path, timeout: float) -> dict[str, object]:
    work = tmp / "work-index"
    work.mkdir()
    cmd = [sys.executable, "-c", _INDEX, "--jobs", "1", "--exit-zero", "--format", "json"]
    result, _, stderr = measure([*cmd, "--cache-dir", str(tmp / "cache-index"), "corpus"], tmp, work, timeout)
    try:
        data = json.loads(stderr.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": stderr[-500:]}
    data["wall"] = result["wall"]
    data["share"] = data["index_cpu"] / data["cpu"] if data["cpu"] else 0.0
    return data


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
    context: dict,
    machine: dict[str, str],
    versions: dict[str, str],
    extras: dict[str, dict],
) -> str:
    files, n_lines, n_bytes = context["corpus"]
    lines = [
        f"Corpus: {args.corpus or 'paths'}, {files} files, {n_lines:,} lines, {n_bytes / 1e6:.1f} MB "
        f"({', '.join(str(s) for s in context['sources'])})",
        *(f"- {repo} at {commit}" for repo, commit in context["commits"].items()),
        f"Rounds: {args.rounds} (TorchFix/Fixit: {args.compare_rounds or args.rounds}); worker processes: "
        f"{context['jobs']}; times are medians of the rounds, peak memory the largest seen; wall ratios are "
        "medians of per-round ratios",
        "Machine: " + "; ".join(f"{k} {v}" for k, v in machine.items()),
        "Versions: " + "; ".join(f"{k} {v}" for k, v in versions.items()),
        "",
        "| tool | wall s (median) | min-max | CPU s (median) | peak RSS / process | findings "
        "| trainlint cold / tool (wall) | same, CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *table_rows(rows),
        "",
        *extra_lines(extras),
    ]
    lines += [f"- {what}: {value} ({'met' if ok else 'NOT met'})" for what, value, ok in checks(rows, extras)]
    lines += ["", "Command: " + " ".join(["python", "bench/run.py", *(sys.argv[1:])])]
    return "\n".join(lines)


def table_rows(rows: dict[str, Row]) -> list[str]:
    cold = rows.get("trainlint-cold")
    out = []
    for row in rows.values():
        if row.error or not row.runs:
            out.append(f"| {row.label} | failed: {row.error} | | | | | | |")
            continue
        walls = [r.wall for r in row.runs]
        found = row.runs[-1].findings
        ratio = cpu_ratio = ""
        if cold and cold.runs and not row.name.startswith("trainlint"):
            ratio = f"{round_ratio(cold, row) or 0.0:.3f}"
            cpu_ratio = f"{cold.median('cpu') / row.median('cpu'):.3f}"
        out.append(
            f"| {row.label} | {row.median('wall'):.2f} | {min(walls):.2f}-{max(walls):.2f} "
            f"| {row.median('cpu'):.2f} | {row.peak:.0f} MiB | {'' if found is None else found} "
            f"| {ratio} | {cpu_ratio} |"
        )
    return out


def extra_lines(extras: dict[str, dict]) -> list[str]:
    out = []
    stdin = extras.get("stdin")
    if stdin:
        out.append(
            f"stdin, a {stdin['lines']}-line file the prefilter rejects: {stdin['wall_median'] * 1000:.0f} ms wall "
            f"(median of {STDIN_RUNS}), {stdin['cpu_median'] * 1000:.0f} ms CPU; the interpreter alone "
            f"starts in {stdin['interpreter_startup'] * 1000:.0f} ms"
        )
    index = extras.get("index")
    if index and "error" not in index:
        out.append(
            f"Project index, cold, 1 process: {index['index_cpu']:.2f} s of {index['cpu']:.2f} s CPU "
            f"({index['share']:.1%}); peak RSS: main process {index['main_peak_mib']:.0f} MiB, "
            f"largest child parsing a large file {index['children_peak_mib']:.0f} MiB"
        )
    elif index:
        out.append(f"Project index: failed: {index['error']}")
    return [*out, ""] if out else out


def checks(rows: dict[str, Row], extras: dict[str, dict]) -> list[tuple[str, str, bool]]:
    out: list[tuple[str, str, bool]] = []
    cold = rows.get("trainlint-cold")
    if cold and cold.runs:
        tf = rows.get("torchfix")
        if tf and tf.runs:
            r = cold.median("cpu") / tf.median("cpu")
            out.append(("cold <= 0.03 x TorchFix (CPU)", f"{r:.3f}", r <= LIMITS["cold_vs_torchfix"]))
        lib = rows.get("libcst-1")
        if lib and lib.runs:
            r = cold.median("cpu") / lib.median("cpu")
            out.append(
                (
                    "cold <= 0.5 x libcst parse only, 1 process (CPU)",
                    f"{r:.2f}",
                    r <= LIMITS["cold_vs_libcst"],
                )
            )
        warm = rows.get("trainlint-warm")
        if warm and warm.runs:
            r = round_ratio(warm, cold) or 0.0
            out.append(("warm <= 0.05 x cold", f"{r:.3f}", r <= LIMITS["warm_vs_cold"]))
        peak = max(rows[n].peak for n in ("trainlint-cold", "trainlint-warm") if n in rows and rows[n].runs)
        out.append(("largest process (a large file's parse child included)", f"{peak:.0f} MiB", True))
    index = extras.get("index")
    if index and "error" not in index:
        main_peak, child = index["main_peak_mib"], index["children_peak_mib"]
        out.append(("main process <= 250 MiB", f"{main_peak:.0f} MiB", main_peak <= LIMITS["peak_mib"]))
        out.append(("a large file's parse child <= its 2 GiB budget", f"{child:.0f} MiB", child <= 2048))
        share = index["share"]
        out.append(("project index <= 10% of a cold run", f"{share:.1%}", share <= LIMITS["index_share"]))
    stdin = extras.get("stdin")
    if stdin:
        wall = stdin["wall_median"]
        out.append(("stdin, rejected file <= 150 ms", f"{wall * 1000:.0f} ms", wall <= LIMITS["stdin_s"]))
    return out


if __name__ == "__main__":
    sys.exit(main())
