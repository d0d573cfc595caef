"""`--verify` on real training code: the verdict of every probe-backed true finding, per rule.

The true findings come from two places:

- the real-bug corpus (bench/realbugs/cases.json): a bug case whose rule has a probe and which
  trainlint finds (the same +/-3 line match as bench/realbugs/run.py); held-out cases only with
  ``--with-heldout`` (they are for the final measurement, never for tuning);
- README's twelve codebases: the findings of probe-backed rules judged true by hand in README's
  accuracy section (TL101, TL201, TL301, TL505), selected here by rule and path; the count found is
  checked against README's count.

Snapshots are materialised by bench/realbugs/run.py into bench/realbugs/work; each snapshot is run
once, ``trainlint --verify --format json`` on the files that hold the true findings, with ``-P`` and
a time limit. Results are cached per snapshot under bench/realbugs/work/verify-cache, keyed by the
hash of the trainlint sources that ran (``--reuse`` takes the newest cached result instead).

    nice -n 10 python bench/verify_real.py [--with-heldout] [--linter-rev REV] [--reuse] [--json OUT]

``--linter-rev HEAD`` runs trainlint as committed (the table before a change), exported as
bench/realbugs/run.py does.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REALBUGS = ROOT / "bench" / "realbugs"
CACHE = REALBUGS / "work" / "verify-cache"
PROBED = frozenset(
    "TL101 TL102 TL103 TL104 TL105 TL201 TL202 TL203 TL204 TL301 TL302 TL303 TL501 TL502 TL505".split()
)
STATUSES = ("confirmed", "not-reproduced", "not-executable")
SNAPSHOT_LIMIT_S = 900

# README's accuracy section: (repo, commit, rule, path pattern, how many README judged true there).
# DeepSpeedExamples' TL505 in bing_bert/deepspeed_train.py is README's one false positive.
CODEBASES = [
    ("pytorch/examples", "77f55b912142e11fcfdf5b530231fb9c52f181e8", "TL101", r"^distributed/minGPT-ddp/mingpt/trainer\.py$", 1),
    ("pytorch/examples", "77f55b912142e11fcfdf5b530231fb9c52f181e8", "TL505", r"^distributed/FSDP/T5_training\.py$", 1),
    ("Lightning-AI/litgpt", "26857050fe3ff627cd714fe92f5838f51a3d5efa", "TL301", r"finetune/(lora|full|adapter|adapter_v2|lora_legacy)\.py$", 6),
    ("microsoft/DeepSpeedExamples", "83757d9c937daabd1089a08051061706cb73900d", "TL201", r"(bing_bert|BingBertGlue|BingBertSquad|compression/bert|DeepSpeed-VisualChat)/", 11),
    ("microsoft/DeepSpeedExamples", "83757d9c937daabd1089a08051061706cb73900d", "TL505", r"^(?!.*bing_bert/deepspeed_train\.py$)", 15),
]  # fmt: skip


def _realbugs_run():
    spec = importlib.util.spec_from_file_location("realbugs_run", REALBUGS / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RB = _realbugs_run()


def code_hash(linter: Path | None = None) -> str:
    """The hash of the trainlint sources that run: the working tree's, or an exported revision's."""
    digest = hashlib.sha256()
    folders = [linter / "trainlint"] if linter else [ROOT / "lint", ROOT / "rules"]
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            digest.update(path.relative_to(folder.parent).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def trainlint(folder: Path, args: list[str], timeout: float) -> dict:
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "trainlint",
        "--no-cache",
        "--format",
        "json",
        "--exit-zero",
        "--jobs",
        "1",
    ]
    try:
        done = subprocess.run(
            [*cmd, *args], cwd=folder, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"findings": [], "errors": [f"time limit of {timeout:.0f} s reached"]}
    if not done.stdout.strip():
        return {"findings": [], "errors": [f"no output: {done.stderr[-1000:]}"]}
    return json.loads(done.stdout)


def verify_snapshot(folder: Path, rules: set[str], files: set[str], key: str, reuse: bool) -> dict:
    """``trainlint --verify`` on `files` of the snapshot, cached by the sources' hash."""
    tag = hashlib.sha256(json.dumps([sorted(rules), sorted(files)]).encode()).hexdigest()[:10]
    cache = CACHE / f"{folder.name}-{tag}-{key}.json"
    found = (
        sorted(CACHE.glob(f"{folder.name}-{tag}-*.json"), key=lambda p: p.stat().st_mtime) if reuse else []
    )
    if cache.exists() or found:
        return json.loads((cache if cache.exists() else found[-1]).read_text())["report"]
    args = ["--verify", "--select", ",".join(sorted(rules)), *sorted(files)]
    report = trainlint(folder, args, SNAPSHOT_LIMIT_S)
    # a child that failed to start (another helper's edit in progress) is not a verdict to keep
    if not any((f.get("verify") or {}).get("status") == "error" for f in report["findings"]):
        CACHE.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"code": key, "report": report}))
    return report


def corpus_targets(mirrors: Path, heldout: bool) -> list[dict]:
    """The corpus' probe-backed bug cases, grouped later by snapshot."""
    cases = json.loads((REALBUGS / "cases.json").read_text())
    out = []
    for case in cases:
        if case["kind"] != "bug" or case["rule"] not in PROBED or (case["heldout"] and not heldout):
            continue
        folder, why = RB.materialise(mirrors, case["repo"], case["commit"])
        out.append({**case, "source": "corpus", "folder": folder, "why_not": why})
    return out


def codebase_targets(mirrors: Path, warnings: list[str]) -> list[dict]:
    """README's judged-true findings of probe-backed rules, located by a static run."""
    out = []
    by_snapshot = defaultdict(list)
    for repo, commit, rule, pattern, count in CODEBASES:
        by_snapshot[(repo, commit)].append((rule, pattern, count))
    for (repo, commit), wanted in by_snapshot.items():
        folder, why = RB.materialise(mirrors, repo, commit)
        if folder is None:
            warnings.append(f"{repo}@{commit[:10]} not materialised: {why}")
            continue
        rules = sorted({rule for rule, _, _ in wanted})
        report = trainlint(folder, ["--select", ",".join(rules), "."], SNAPSHOT_LIMIT_S)
        for rule, pattern, count in wanted:
            found = [
                f
                for f in report["findings"]
                if f["rule"] == rule and re.search(pattern, f["path"].removeprefix("./"))
            ]
            if len(found) != count:
                warnings.append(f"{repo} {rule}: {len(found)} findings where README judged {count}")
            for f in found:
                out.append(
                    {
                        "id": f"{repo.split('/')[1]}:{f['path'].removeprefix('./')}:{f['line']}",
                        "rule": rule,
                        "repo": repo,
                        "commit": commit,
                        "path": f["path"].removeprefix("./"),
                        "line": f["line"],
                        "heldout": False,
                        "source": "codebases",
                        "folder": folder,
                        "why_not": "",
                    }
                )
    return out


def verdicts(targets: list[dict], reuse: bool, linter: Path | None) -> list[dict]:
    key = code_hash(linter)
    groups = defaultdict(list)
    for t in targets:
        if t["folder"] is not None:
            groups[t["folder"]].append(t)
    rows = []
    for folder, group in groups.items():
        files = {t["path"] for t in group if (folder / t["path"]).is_file()}
        report = verify_snapshot(folder, {t["rule"] for t in group}, files, key, reuse)
        for t in group:
            hits = RB.matches(t, report["findings"], folder)
            verify = next((h.get("verify") for h in hits if h.get("verify")), None)
            status = verify["status"] if verify else ("not-found" if not hits else "no-verdict")
            rows.append({**t, "folder": str(folder), "status": status, "verify": verify})
        print(f"  {folder.name}: {len(group)} findings", file=sys.stderr)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| rule | findings | confirmed | not-reproduced | not-executable | other |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    total = Counter()
    for rule in sorted({r["rule"] for r in rows}):
        c = Counter(r["status"] if r["status"] in STATUSES else "other" for r in rows if r["rule"] == rule)
        n = sum(c.values())
        total.update(c)
        lines.append(
            f"| {rule} | {n} | {c['confirmed']} | {c['not-reproduced']} | {c['not-executable']} | {c['other']} |"
        )
    n = sum(total.values())
    decided = total["confirmed"] + total["not-reproduced"]
    lines.append(
        f"| **all** | {n} | {total['confirmed']} | {total['not-reproduced']} | {total['not-executable']} | "
        f"{total['other']} |"
    )
    lines.append("")
    lines.append(
        f"Decided (confirmed or not-reproduced): {decided} / {n}"
        + (f" = {100 * decided / n:.0f} %" if n else "")
    )
    return "\n".join(lines)


def reason_of(detail: str) -> str:
    """The not-executable reason without the line numbers and names that make each one unique."""
    text = re.sub(r"`[^`]*`", "`…`", detail.split("\n")[0])
    text = re.sub(r"\bline \d+", "line N", text)
    text = re.sub(r"'[^']*'", "'…'", text)
    return text[:160]


def render(all_rows: list[dict], warnings: list[str]) -> str:
    # A bug case trainlint does not find is no finding: it is listed, not counted.
    rows = [r for r in all_rows if r["status"] != "not-found"]
    missed = [r for r in all_rows if r["status"] == "not-found"]
    out = ["All probe-backed true findings:", "", table(rows), ""]
    for label, source in (("Real-bug corpus", "corpus"), ("README's twelve codebases", "codebases")):
        part = [r for r in rows if r["source"] == source]
        if part:
            out += [f"{label}:", "", table(part), ""]
    held = [r for r in rows if r["heldout"]]
    if held:
        out += ["Tuning rows only:", "", table([r for r in rows if not r["heldout"]]), ""]
    stuck = [r for r in rows if r["status"] == "not-executable" and not r["heldout"]]
    out.append(f"Not-executable reasons, grouped ({len(stuck)} tuning rows):")
    for reason, n in Counter(reason_of(r["verify"]["detail"]) for r in stuck).most_common():
        out.append(f"- {n} x {reason}")
    out.append("")
    out.append("Every not-executable / other row (held-out rows terse):")
    for r in rows:
        if r["status"] == "confirmed" or r["status"] == "not-reproduced":
            continue
        if r["heldout"]:
            out.append(f"- {r['id']} {r['rule']} (held out): {r['status']}")
            continue
        detail = (r["verify"] or {}).get("detail", "")
        out.append(
            f"- {r['id']} {r['rule']} {r['repo']} `{r['path']}:{r['line']}` {r['status']}: {detail[:400]}"
        )
    out.append("")
    out.append("Decided rows:")
    for r in rows:
        if r["status"] in ("confirmed", "not-reproduced") and not r["heldout"]:
            out.append(
                f"- {r['id']} {r['rule']} `{r['path']}:{r['line']}` {r['status']}: {r['verify']['detail'][:300]}"
            )
    out.append("")
    out.append(f"Bug cases trainlint does not find (not counted): {len(missed)}")
    out += [
        f"- {r['id']} {r['rule']}" + (" (held out)" if r["heldout"] else f" `{r['path']}:{r['line']}`")
        for r in missed
    ]
    if warnings:
        out += ["", "Warnings:", *[f"- {w}" for w in warnings]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mirrors", type=Path, default=Path("/work/.mirror"))
    ap.add_argument(
        "--with-heldout", action="store_true", help="include held-out cases (final measurement only)"
    )
    ap.add_argument("--reuse", action="store_true", help="take cached results even if trainlint changed")
    ap.add_argument("--only", choices=("corpus", "codebases"), default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write per-finding rows here")
    ap.add_argument(
        "--linter-rev",
        default=None,
        help="verify with trainlint as committed at this revision (the table before)",
    )
    args = ap.parse_args(argv)
    linter = RB.export_linter(args.linter_rev) if args.linter_rev else None
    if linter is not None:  # the snapshots' trainlint runs see the exported package first
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(linter), os.environ.get("PYTHONPATH")]))
    os.environ.setdefault("PYTHONHASHSEED", "0")
    warnings: list[str] = []
    targets = []
    if args.only != "codebases":
        targets += corpus_targets(args.mirrors, args.with_heldout)
    if args.only != "corpus":
        targets += codebase_targets(args.mirrors, warnings)
    for t in targets:
        if t["folder"] is None:
            warnings.append(f"{t['id']} not materialised: {t['why_not']}")
    rows = verdicts(targets, args.reuse, linter)
    print(render(rows, warnings))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
