"""The floor for any libcst-based linter: parse every ``.py`` file under the given folders, nothing else.

Usage: python bench/libcst_parse.py [--jobs N] PATH...   (default: one process)

Prints one line: how many files were parsed and how many libcst rejected.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import libcst as cst


def parse(path: str) -> bool:
    try:
        cst.parse_module(Path(path).read_bytes())
    except Exception:  # a syntax error or a libcst limit: still counted, as a failure
        return False
    return True


def files_under(paths: list[str]) -> list[str]:
    found: list[str] = []
    for given in paths:
        if os.path.isfile(given):
            found.append(given)
            continue
        for folder, dirs, names in os.walk(given):
            dirs.sort()
            found.extend(os.path.join(folder, n) for n in sorted(names) if n.endswith(".py"))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--jobs", "-j", type=int, default=1)
    args = parser.parse_args(argv)
    files = files_under(args.paths)
    if args.jobs > 1:
        files.sort(key=lambda f: -os.path.getsize(f))  # as trainlint schedules: largest first
        context = multiprocessing.get_context("fork") if sys.platform == "linux" else None
        with ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
            ok = list(pool.map(parse, files, chunksize=max(1, len(files) // (args.jobs * 32))))
    else:
        ok = [parse(f) for f in files]
    print(f"parsed {len(files)} files, {ok.count(False)} rejected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
