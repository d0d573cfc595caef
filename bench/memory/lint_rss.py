#!/usr/bin/env python3
"""Where trainlint's own process holds memory during a run (issue 20: "peak memory per process").

Runs ``trainlint ARGS`` in this process (use ``--jobs 1`` to keep every file in it), samples the resident
set size every 10 ms together with the file being linted, and prints the peak, the file linted when
it happened, the resident size at the end, the files during which it rose most, and how it grew over
the run. With ``--live N`` it also traces Python allocations (``tracemalloc``: several times slower)
and lists the N source lines holding the most memory when the run ends.

    python bench/memory/lint_rss.py -- --jobs 1 --cache-dir /tmp/c --exit-zero --format json CORPUS

(This folder's other scripts measure ``trainlint memory``, the training-memory estimate; this one
measures the linter.)
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import sys
import threading
import time
import tracemalloc
from typing import Any

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_mib() -> float:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--live", type=int, default=0, help="trace allocations; list the N largest sites")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="trainlint's arguments (after --)")
    opts = parser.parse_args()
    args = [a for a in opts.args if a != "--"] if opts.args[:1] == ["--"] else opts.args
    if opts.live:
        tracemalloc.start(4)
    import trainlint.cli as cli

    current = ["<start>"]
    samples: list[tuple[float, float, str]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append((time.monotonic(), resident_mib(), current[0]))
            time.sleep(0.01)

    real = cli._lint_one

    def traced(job: Any, cache: Any = None, **options: Any) -> Any:
        current[0] = job[1]
        try:
            return real(job, cache, **options)
        finally:
            current[0] = "<between files>"

    cli._lint_one = traced
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = cli.main(args)
    current[0] = "<end>"
    time.sleep(0.05)
    done.set()
    sampler.join()
    report(samples, code)
    if opts.live:
        live(opts.live)
    return 0


def report(samples: list[tuple[float, float, str]], code: int) -> None:
    peak = max(samples, key=lambda s: s[1])
    start = samples[0][0]
    out = sys.stderr
    print(
        f"exit {code}; peak RSS (getrusage) {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB",
        file=out,
    )
    print(f"peak sampled {peak[1]:.0f} MiB at {peak[0] - start:.1f} s, linting {peak[2]}", file=out)
    print(f"at the end {samples[-1][1]:.0f} MiB", file=out)
    rises: dict[str, float] = {}
    for before, after in itertools.pairwise(samples):
        if after[2] == before[2]:
            rises[after[2]] = rises.get(after[2], 0.0) + max(0.0, after[1] - before[1])
    print("largest rises while one file was linted:", file=out)
    for name, rise in sorted(rises.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  +{rise:6.1f} MiB  {name}", file=out)
    print("over the run (seconds, MiB):", file=out)
    step = max(1, len(samples) // 20)
    print("  " + "  ".join(f"{t - start:.0f}:{r:.0f}" for t, r, _ in samples[::step]), file=out)


def live(count: int) -> None:
    import gc

    gc.collect()
    snapshot = tracemalloc.take_snapshot()
    print(
        f"traced Python memory alive at the end: {tracemalloc.get_traced_memory()[0] / 2**20:.1f} MiB",
        file=sys.stderr,
    )
    for stat in snapshot.statistics("traceback")[:count]:
        print(f"  {stat.size / 2**20:7.1f} MiB in {stat.count} blocks", file=sys.stderr)
        for line in stat.traceback.format()[-8:]:
            print("      " + line, file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
