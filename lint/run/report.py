"""Output of ``trainlint run``: the joined findings as text, JSON (schema 1 plus a ``run`` object per
finding and a ``run`` summary) or SARIF (the run status in each result's properties)."""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from trainlint.report import RunReport
from trainlint.run.join import NOT_REACHED, RUNTIME_ONLY, SEEN, Joined
from trainlint.run.runner import Outcome

LABELS = {
    SEEN: "seen in this run",
    NOT_REACHED: "not reached in this run",
    RUNTIME_ONLY: "runtime-only: the static pass does not see this",
}


def summary(joined: list[Joined], outcome: Outcome, steps: int, unloaded: int = 0) -> dict[str, Any]:
    counts = {s: sum(j.status == s for j in joined) for s in (SEEN, NOT_REACHED, RUNTIME_ONLY)}
    return {
        "ended": outcome.ended,
        "error": outcome.error,
        "optimizer_steps": steps,
        **counts,
        "static_in_files_not_loaded": unloaded,
    }


def render(
    joined: list[Joined],
    outcome: Outcome,
    steps: int,
    fmt: str,
    out: TextIO | None = None,
    unloaded: int = 0,
) -> None:
    """Write the report; ``unloaded`` counts static findings in files the run never loaded."""
    out = out or sys.stdout
    if fmt == "json":
        out.write(_json(joined, outcome, steps, unloaded) + "\n")
    elif fmt == "sarif":
        out.write(_sarif(joined) + "\n")
    else:
        _text(joined, outcome, steps, out, unloaded)


def _text(joined: list[Joined], outcome: Outcome, steps: int, out: TextIO, unloaded: int) -> None:
    for j in joined:
        f = j.finding
        out.write(f"{f.path}:{f.line}:{f.column}: {f.rule} [{f.severity.value}] {f.message}\n")
        obs = j.observation
        detail = f" at line {obs.line}" if obs is not None and obs.line != f.line else ""
        times = f", {obs.count} time(s)" if obs is not None else ""
        out.write(f"  run: {LABELS[j.status]}{detail}{times}\n")
        if j.status == SEEN and obs is not None:
            out.write(f"  measured: {obs.message}\n")
        out.write("\n")
    ended = {
        "finished": "the script finished",
        "stopped": f"stopped after {steps} optimizer step(s) (--steps)",
        "interrupted": f"interrupted (Ctrl-C) after {steps} optimizer step(s); this is what was seen so far",
        "raised": f"the script raised {outcome.error}",
        "exited": outcome.error or "the script exited",
    }[outcome.ended]
    s = summary(joined, outcome, steps, unloaded)
    others = f" ({unloaded} more in files the run did not load)" if unloaded else ""
    out.write(
        f"Run {ended}. {s[SEEN] + s[RUNTIME_ONLY]} hazard(s) seen at run time "
        f"({s[RUNTIME_ONLY]} runtime-only), {s[NOT_REACHED]} static finding(s) not reached{others}, "
        f"{steps} optimizer step(s).\n"
    )


def _json(joined: list[Joined], outcome: Outcome, steps: int, unloaded: int) -> str:
    from trainlint.report.json_format import render_json

    payload = json.loads(render_json(_report(joined)))
    for item, j in zip(payload["findings"], joined, strict=True):
        item["run"] = j.run_json()
    payload["run"] = summary(joined, outcome, steps, unloaded)
    return json.dumps(payload, indent=2, ensure_ascii=False)


def _sarif(joined: list[Joined]) -> str:
    from trainlint.report.sarif import render_sarif

    log = json.loads(render_sarif(_report(joined)))
    for result, j in zip(log["runs"][0]["results"], joined, strict=True):
        result["properties"] = {"run": j.run_json()}
    return json.dumps(log, indent=2, ensure_ascii=False)


def _report(joined: list[Joined]) -> RunReport:
    files = len({j.finding.path for j in joined})
    return RunReport(findings=[j.finding for j in joined], errors=[], files=files, elapsed_s=0.0)
