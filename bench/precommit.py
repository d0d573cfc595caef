"""Pre-commit's case: one file changed in a 2,000-file project whose cache is warm.

Builds a project of real files (every ``*.py`` of a repository at a commit, read from a local git
mirror, topped up with copies of its own files when it has fewer than ``--files``), with a
``pyproject.toml`` and an empty ``.git`` so that root detection sees a repository. Then:

1. warms the cache: ``trainlint --cache-dir C .`` over the whole tree (not timed, only reported);
2. for each round, appends a distinct comment to the chosen file (its text changes, the facts other
   files read from it do not) and times ``trainlint --cache-dir C --force-exclude <that file>``, as
   the hook runs it, pinned to one core (``taskset -c 0``): wall time and the child's CPU time;
3. times the same command once more on the unchanged file (a cache hit).

Byte code is written (``PYTHONDONTWRITEBYTECODE`` is dropped from the children's environment), as
for a hook installed by pip.

The target of README is at most 0.5 s for step 2 on one core. Results go to stdout as a Markdown
table (paste into bench/PRECOMMIT_RESULTS.md).

    python bench/precommit.py [--mirror DIR] [--commit REV] [--file PATH] [--files 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_MIRROR = Path("/work/.mirror/huggingface+diffusers/repo")
DEFAULT_FILE = "examples/text_to_image/train_text_to_image.py"


def build_tree(mirror: Path, commit: str, dest: Path, count: int) -> int:
    """Materialise the commit's Python files under ``dest``; returns how many files it holds."""
    listing = subprocess.run(
        ["git", "-C", str(mirror), "ls-tree", "-r", "-z", commit], capture_output=True, check=True
    ).stdout.decode(errors="surrogateescape")
    blobs = []
    for entry in listing.split("\0"):
        meta, _, name = entry.partition("\t")
        if name.endswith(".py") and meta.split()[1] == "blob":
            blobs.append((meta.split()[2], name))
    cat = subprocess.run(
        ["git", "-C", str(mirror), "cat-file", "--batch"],
        input="".join(f"{sha}\n" for sha, _ in blobs).encode(),
        capture_output=True,
        check=True,
    )
    data, pos, written = cat.stdout, 0, []
    for _sha, name in blobs:
        header_end = data.index(b"\n", pos)
        header = data[pos:header_end].split()
        if header[-1] == b"missing":
            pos = header_end + 1
            continue
        size = int(header[2])
        body = data[header_end + 1 : header_end + 1 + size]
        pos = header_end + 1 + size + 1
        path = dest / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
        written.append(path)
    # top up with copies of real files (under copies/, a package of their own) to reach ``count``
    index = 0
    while len(written) < count and written:
        source = written[index % len(written)]
        copy = dest / "copies" / f"c{index // len(written)}" / source.relative_to(dest)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, copy)
        written.append(copy)
        index += 1
    (dest / "pyproject.toml").write_text('[project]\nname = "precommit-bench"\nversion = "0"\n')
    (dest / ".git").mkdir(exist_ok=True)
    return len(written)


def timed(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[float, float, int]:
    """Wall and CPU seconds (user + system of the child) and the exit code of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, check=False, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode not in (0, 1):
        sys.exit(f"trainlint failed ({done.returncode}): {done.stderr.decode(errors='replace')[-2000:]}")
    return wall, cpu, done.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mirror", type=Path, default=DEFAULT_MIRROR)
    parser.add_argument("--commit", default="HEAD")
    parser.add_argument("--file", default=DEFAULT_FILE, help="the changed file, relative to the tree")
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keep", type=Path, help="build the tree here and keep it (default: a temp folder)")
    parser.add_argument(
        "--linter",
        type=Path,
        help="a folder holding a `trainlint` package to run (default: the installed one)",
    )
    args = parser.parse_args(argv)

    work = args.keep or Path(tempfile.mkdtemp(prefix="trainlint-precommit-"))
    tree, cache = work / "tree", work / "cache"
    if not (tree / "pyproject.toml").exists():
        shutil.rmtree(tree, ignore_errors=True)
        count = build_tree(args.mirror, args.commit, tree, args.files)
    else:
        count = sum(1 for _ in tree.rglob("*.py"))
    target = tree / args.file
    if not target.is_file():
        sys.exit(f"no {args.file} in the tree")
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    # -P: the tree is the working folder and must never shadow a module trainlint imports
    trainlint = [sys.executable, "-P", "-m", "trainlint", "--cache-dir", str(cache), "--exit-zero"]
    env = dict(os.environ)
    # byte code is written by the warm-up and read by the rounds, as in an installed hook (pip compiles
    # it at install time); without it every round compiles trainlint's modules again (about 45 ms)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if args.linter is not None:  # a fixed copy: edits elsewhere must not change the cache's fingerprint
        env["PYTHONPATH"] = str(args.linter.resolve())
    try:
        warm_wall, warm_cpu, _ = timed([*trainlint, "--quiet", "."], tree, env)
        original = target.read_text(encoding="utf-8")
        rows = []
        for round_ in range(args.rounds):
            target.write_text(
                original + f"\n# precommit bench edit {round_} {time.time_ns()}\n", encoding="utf-8"
            )
            rows.append(timed([*pin, *trainlint, "--force-exclude", args.file], tree, env))
        hit = timed([*pin, *trainlint, "--force-exclude", args.file], tree, env)
        target.write_text(original, encoding="utf-8")
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    walls, cpus = [r[0] for r in rows], [r[1] for r in rows]
    print(f"tree: {count} files ({args.mirror.parent.name}@{args.commit}); changed file: {args.file}")
    print(
        f"load average at the end: {os.getloadavg()[0]:.2f}; one core: {'yes' if pin else 'no (no taskset)'}"
    )
    print(f"warm-up (whole tree, cold cache, all cores): {warm_wall:.1f} s wall, {warm_cpu:.1f} s CPU\n")
    print("| run | wall s (median, max) | CPU s (median, max) |")
    print("|---|---:|---:|")
    print(
        f"| one changed file, warm cache ({args.rounds} rounds) | {statistics.median(walls):.3f}, "
        f"{max(walls):.3f} | {statistics.median(cpus):.3f}, {max(cpus):.3f} |"
    )
    print(f"| the same file unchanged (cache hit) | {hit[0]:.3f} | {hit[1]:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
