"""Cost of a configuration with very many exclude patterns (issue 18: a pull request can commit one).

Builds a throwaway repository whose pyproject.toml lists ``--patterns`` exclude patterns (or, with
``--key per-file-ignores``, globs of ``per-file-ignores``) of one kind, beside a tree of ``--files``
small Python files in ``--folders`` folders (one folder excluded or ignored by a pattern), and runs
``trainlint --no-cache --select TL201 .`` on it in a fresh process: the wall time and the peak memory
(max RSS) of that process are what a CI job pays. Every run also checks that exactly the files outside
that folder were reported, so a fast wrong answer cannot pass as a result.

    python bench/excludes.py [--patterns 100000] [--kind mixed] [--files 2000] [--folders 100]
                             [--key extend-exclude|per-file-ignores]

Kinds: ``names`` (``g17``), ``paths`` (``d/s17``), ``globs`` (``t17_*``, ``*_17.py``),
``anywhere`` (``*x17*``: fixed text only inside), ``alike`` (``*a*[17]``: all with the same fixed
text, the worst case for indexing: over 2,000 of them are a configuration error), ``mixed`` (a third
each of names, paths and globs, and 1% anywhere). A configuration file is capped at 1 MiB, which holds
about 100,000 short patterns. To compare with another checkout, run it with ``PYTHONPATH`` pointing
at a folder where that checkout's ``lint`` is importable as ``trainlint`` (and ``rules`` as
``trainlint.rules``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BAD = "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x)\n"


def patterns(kind: str, n: int) -> list[str]:
    makers = {
        "names": lambda i: f"g{i}",
        "paths": lambda i: f"d/s{i}",
        "globs": lambda i: f"t{i}_*" if i % 2 else f"*_{i}.py",
        "anywhere": lambda i: f"*x{i}*",
        "alike": lambda i: f"*a*[{i}]",
    }
    if kind != "mixed":
        return [makers[kind](i) for i in range(n)]
    order = ["names", "paths", "globs"]
    out = [makers[order[i % 3]](i) for i in range(n - n // 100)]
    return out + [makers["anywhere"](i) for i in range(n // 100)]


def build(root: Path, kind: str, n: int, files: int, folders: int, key: str = "extend-exclude") -> int:
    """The repository; returns how many of its files are neither excluded nor ignored."""
    pats = patterns(kind, n)
    # the last folder is excluded (or its findings ignored) by the configuration's last pattern
    excluded_folder = "excluded_here"
    (root / ".git").mkdir()
    if key == "extend-exclude":
        setting = json.dumps([*pats, excluded_folder], separators=(",", ":"))
    else:
        table = {p: ["TL2"] for p in [*pats, f"src/{excluded_folder}/*"]}
        setting = "{" + ",".join(f"{json.dumps(p)}={json.dumps(ids)}" for p, ids in table.items()) + "}"
    (root / "pyproject.toml").write_text(f"[tool.trainlint]\n{key} = {setting}\n")
    kept = 0
    for i in range(files):
        folder = root / "src" / (excluded_folder if i % folders == folders - 1 else f"pkg{i % folders}")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"mod{i}.py").write_text(BAD)
        kept += folder.name != excluded_folder
    return kept


def run(root: Path) -> tuple[float, float, int]:
    """Wall seconds, peak MiB of the trainlint process, files linted."""
    started = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainlint",
            "--no-cache",
            "-j1",
            "--select",
            "TL201",
            "--format",
            "json",
            ".",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    elapsed = time.perf_counter() - started
    if proc.returncode not in (0, 1):
        raise SystemExit(f"trainlint failed ({proc.returncode}): {proc.stderr[-2000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the largest child so far
    linted = len({f["path"] for f in json.loads(proc.stdout)["findings"]})
    return elapsed, peak, linted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--patterns", type=int, default=100_000)
    parser.add_argument(
        "--kind", choices=["names", "paths", "globs", "anywhere", "alike", "mixed"], default="mixed"
    )
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--folders", type=int, default=100)
    parser.add_argument("--key", choices=["extend-exclude", "per-file-ignores"], default="extend-exclude")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trainlint-excludes-") as tmp:
        root = Path(tmp)
        kept = build(root, args.kind, args.patterns, args.files, args.folders, args.key)
        elapsed, peak, linted = run(root)
    status = "ok" if linted == kept else f"WRONG: linted {linted} files, expected {kept}"
    print(
        f"{args.patterns} {args.kind} {args.key} patterns, {args.files} files: {elapsed:.1f} s, "
        f"peak {peak:.0f} MiB, {status} (load average {os.getloadavg()[0]:.1f})"
    )


if __name__ == "__main__":
    main()
