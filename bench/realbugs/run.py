"""Run trainlint over the real-bug corpus and report recall and false positives per rule family.

Each case in cases.json names a public repository, a commit, a path and a line. The script
materialises the Python files of that commit from a local git mirror (made with the session's
`fetch`, or any `git clone --mirror`) into an ignored work folder, runs
`trainlint --no-cache --format json` once per snapshot on the whole snapshot, and matches findings:
a bug counts as found when a finding of its rule sits in its file within +/-3 lines (primary
location or a `related` location); a look-alike counts as a false positive when such a finding
exists. Cases whose mirror or commit is missing are listed as not materialised, never as misses.

    python bench/realbugs/run.py [--mirrors DIR] [--only-heldout | --no-heldout] [--linter-rev REV] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORK = HERE / "work"
TOLERANCE = 3
FAMILIES = {
    "TL1": "amp",
    "TL2": "checkpoint",
    "TL3": "accumulation",
    "TL4": "measurement",
    "TL5": "distributed",
}
# Project markers travel with the sources so that root detection sees a real project.
MARKERS = {"pyproject.toml", "setup.cfg"}


def family(rule: str) -> str:
    return FAMILIES.get(rule[:3], "other")


def wanted(name: str) -> bool:
    return name.endswith(".py") or name in MARKERS


def mirror_dir(mirrors: Path, repo: str) -> Path:
    return mirrors / repo.replace("/", "+") / "repo"


def materialise(mirrors: Path, repo: str, commit: str) -> tuple[Path | None, str]:
    """Extract the commit's Python files; return (folder, "") or (None, why not)."""
    git_dir = mirror_dir(mirrors, repo)
    if not git_dir.is_dir():
        return None, f"no mirror at {git_dir}"
    dest = WORK / f"{repo.replace('/', '+')}@{commit[:12]}"
    if (dest / ".materialised").exists():
        return dest, ""
    tree = subprocess.run(
        ["git", "-C", str(git_dir), "ls-tree", "-r", "-z", commit],
        capture_output=True,
        check=False,
    )
    if tree.returncode != 0:
        return None, (tree.stderr.decode(errors="replace").strip().splitlines() or ["ls-tree failed"])[-1]
    blobs = []
    for entry in tree.stdout.decode(errors="surrogateescape").split("\0"):
        meta, _, name = entry.partition("\t")
        if name and meta.split()[1] == "blob" and wanted(name):
            blobs.append((meta.split()[2], name))
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    # One cat-file process for all blobs; a snapshot may lack some (large files), which are skipped.
    cat = subprocess.run(
        ["git", "-C", str(git_dir), "cat-file", "--batch"],
        input="".join(f"{sha}\n" for sha, _ in blobs).encode(),
        capture_output=True,
        check=False,
    )
    data, pos = cat.stdout, 0
    for _sha, name in blobs:
        end = data.index(b"\n", pos)
        header = data[pos:end].split()
        pos = end + 1
        if header[-1] == b"missing":
            continue
        size = int(header[2])
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data[pos : pos + size])
        pos += size + 1
    # The folder stands for the repository root, as a checkout's .git would.
    (dest / ".git").mkdir(exist_ok=True)
    (dest / ".materialised").touch()
    return dest, ""


def export_linter(rev: str) -> Path:
    """Lay out trainlint as of git revision `rev` of this checkout as an importable package."""
    root = HERE.parents[1]
    sha = subprocess.run(
        ["git", "-C", str(root), "rev-parse", rev], capture_output=True, text=True, check=True
    )
    dest = WORK / f"linter@{sha.stdout.strip()[:12]}"
    if (dest / "trainlint" / "__init__.py").exists():
        return dest
    src = WORK / "linter-src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(dest, ignore_errors=True)
    src.mkdir(parents=True)
    tar = subprocess.run(
        ["git", "-C", str(root), "archive", sha.stdout.strip(), "lint", "rules"],
        capture_output=True,
        check=True,
    )
    subprocess.run(["tar", "-x", "-C", str(src)], input=tar.stdout, check=True)
    # pyproject's package-dir: trainlint = lint/, trainlint.rules = rules/.
    shutil.move(src / "lint", dest / "trainlint")
    shutil.move(src / "rules", dest / "trainlint" / "rules")
    shutil.rmtree(src)
    return dest


def lint(folder: Path, jobs: int | None, linter: Path | None) -> dict:
    # -P: the snapshot is the cwd and must never shadow a module trainlint imports.
    cmd = [sys.executable, "-P", "-m", "trainlint", "--no-cache", "--format", "json", "--exit-zero"]
    if jobs:
        cmd += ["--jobs", str(jobs)]
    env = dict(os.environ)
    if linter is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(linter), env.get("PYTHONPATH")]))
    done = subprocess.run([*cmd, "."], cwd=folder, capture_output=True, text=True, check=False, env=env)
    if not done.stdout.strip():
        raise RuntimeError(f"trainlint gave no output on {folder}: {done.stderr[-2000:]}")
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        # Tolerates a JSON renderer that escapes its own layout newlines (seen mid-edit in session 3).
        return json.loads(done.stdout.replace("\\u000a", "\n"), strict=False)


def locations(finding: dict, folder: Path) -> list[tuple[str, int]]:
    """Primary and related locations of a finding, as (path relative to the snapshot, line)."""

    def rel(path: str) -> str:
        p = Path(path)
        return (p if not p.is_absolute() else p.relative_to(folder)).as_posix().removeprefix("./")

    out = [(rel(finding["path"]), finding["line"])]
    for extra in finding.get("related") or []:
        if extra.get("line") is not None:
            out.append((rel(extra.get("path") or finding["path"]), extra["line"]))
    return out


def matches(case: dict, findings: list[dict], folder: Path) -> list[dict]:
    # A missing call (set_epoch) has two honest places: the object and the loop that lacks the call.
    wanted_lines = [case["line"], *case.get("alt_lines", [])]
    hits = []
    for f in findings:
        if f["rule"] != case["rule"]:
            continue
        for path, line in locations(f, folder):
            if path == case["path"] and any(abs(line - want) <= TOLERANCE for want in wanted_lines):
                hits.append(f)
                break
    return hits


def evaluate(cases: list[dict], mirrors: Path, jobs: int | None, linter: Path | None) -> list[dict]:
    by_snapshot: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for case in cases:
        by_snapshot[(case["repo"], case["commit"])].append(case)
    results = []
    for (repo, commit), group in by_snapshot.items():
        folder, why = materialise(mirrors, repo, commit)
        report = lint(folder, jobs, linter) if folder else None
        for case in group:
            row = {**case, "materialised": folder is not None, "why_not": why, "hits": []}
            if report is not None:
                if not (folder / case["path"]).is_file():
                    row.update(materialised=False, why_not=f"{case['path']} not in snapshot")
                else:
                    row["hits"] = matches(case, report["findings"], folder)
            results.append(row)
        print(f"  {repo}@{commit[:10]}: {'ok' if folder else 'NOT MATERIALISED: ' + why}", file=sys.stderr)
    return results


def table(results: list[dict]) -> str:
    fams = sorted({family(r["rule"]) for r in results})
    lines = [
        "| family | bugs found / materialised | recall | look-alikes flagged / materialised |",
        "|---|---:|---:|---:|",
    ]
    tot = [0, 0, 0, 0]
    for fam in fams:
        rows = [r for r in results if family(r["rule"]) == fam and r["materialised"]]
        bugs = [r for r in rows if r["kind"] == "bug"]
        looks = [r for r in rows if r["kind"] == "lookalike"]
        found = sum(bool(r["hits"]) for r in bugs)
        fps = sum(bool(r["hits"]) for r in looks)
        tot = [tot[0] + found, tot[1] + len(bugs), tot[2] + fps, tot[3] + len(looks)]
        rec = f"{100 * found / len(bugs):.0f} %" if bugs else "-"
        lines.append(f"| {fam} | {found} / {len(bugs)} | {rec} | {fps} / {len(looks)} |")
    rec = f"{100 * tot[0] / tot[1]:.0f} %" if tot[1] else "-"
    lines.append(f"| **all** | {tot[0]} / {tot[1]} | {rec} | {tot[2]} / {tot[3]} |")
    return "\n".join(lines)


def render(results: list[dict]) -> str:
    out = ["All cases:", "", table(results), ""]
    for label, held in (("Tuning cases (heldout: false)", False), ("Held-out cases (heldout: true)", True)):
        out += [f"{label}:", "", table([r for r in results if r["heldout"] == held]), ""]
    missed = [r for r in results if r["materialised"] and r["kind"] == "bug" and not r["hits"]]
    flagged = [r for r in results if r["materialised"] and r["kind"] == "lookalike" and r["hits"]]
    absent = [r for r in results if not r["materialised"]]
    for title, rows in (("Missed bugs", missed), ("Flagged look-alikes", flagged)):
        out.append(f"{title} ({len(rows)}):")
        # Held-out rows stay terse so that a list of misses read while tuning never describes them.
        out += [
            f"- {r['id']} {r['rule']} (held out)"
            if r["heldout"]
            else f"- {r['id']} {r['rule']} {r['repo']} `{r['path']}:{r['line']}`: {r['reason']}"
            for r in rows
        ]
        out.append("")
    out.append(f"Not materialised ({len(absent)}), not counted:")
    out += [f"- {r['id']} {r['repo']}@{r['commit'][:10]} `{r['path']}`: {r['why_not']}" for r in absent]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--mirrors", type=Path, default=Path("/work/.mirror"), help="folder of <owner+name>/repo mirrors"
    )
    ap.add_argument("--cases", type=Path, default=HERE / "cases.json")
    pick = ap.add_mutually_exclusive_group()
    pick.add_argument("--only-heldout", action="store_true", help="measure the held-out cases only")
    pick.add_argument("--no-heldout", action="store_true", help="leave the held-out cases out (for tuning)")
    ap.add_argument("--jobs", type=int, default=None, help="passed to trainlint --jobs")
    ap.add_argument(
        "--linter-rev",
        default=None,
        help="run trainlint as committed at this git revision (e.g. HEAD) instead of the installed working tree",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write per-case results here")
    args = ap.parse_args(argv)
    cases = json.loads(args.cases.read_text())
    if args.only_heldout:
        cases = [c for c in cases if c["heldout"]]
    elif args.no_heldout:
        cases = [c for c in cases if not c["heldout"]]
    linter = export_linter(args.linter_rev) if args.linter_rev else None
    results = evaluate(cases, args.mirrors, args.jobs, linter)
    print(render(results))
    if args.json:
        slim = [
            {**r, "hits": [{k: h[k] for k in ("rule", "path", "line")} for h in r["hits"]]} for r in results
        ]
        args.json.write_text(json.dumps(slim, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
