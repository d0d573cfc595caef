"""Static and runtime joined: the static pass over the script's folder, and each static finding marked
seen (with the run's numbers) or not reached, each runtime finding without a static twin runtime-only."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainlint.rule import Finding, registry
from trainlint.run.monitor import Observation

SEEN, NOT_REACHED, RUNTIME_ONLY = "seen", "not-reached", "runtime-only"


@dataclass
class Joined:
    finding: Finding
    status: str  # SEEN, NOT_REACHED or RUNTIME_ONLY
    observation: Observation | None = None

    def run_json(self) -> dict[str, Any]:
        obs = self.observation
        out: dict[str, Any] = {"status": self.status}
        if obs is not None:
            out.update(message=obs.message, measured=obs.measured, count=obs.count, line=obs.line)
        return out


def static_findings(folder: Path) -> tuple[list[Finding], list[dict[str, str]]]:
    """The static pass over a folder, configured as the CLI would be: the one coupling to the linter."""
    from trainlint.config import find_config, ignored_for_file, load_config, matches, select_rules
    from trainlint.engine import lint_text
    from trainlint.files import DEFAULT_EXCLUDES, discover, read_source
    from trainlint.results import LintOptions

    config = load_config(find_config(folder))
    rule_ids = select_rules(config.select, config.extend_select, config.ignore)
    severity = tuple(sorted((k, v.value) for k, v in config.severity.items()))
    excludes = [*(DEFAULT_EXCLUDES if config.exclude is None else config.exclude), *config.extend_exclude]
    problems: list[str] = []
    findings: list[Finding] = []
    errors: list[dict[str, str]] = []
    for path in discover([folder], excludes, config.root, problems):
        shown = display(str(path))
        source = read_source(path)
        if source.text is None:
            continue
        ignored = ignored_for_file(config, os.path.relpath(path, config.root).replace(os.sep, "/"))
        ids = tuple(i for i in rule_ids if not matches(i, ignored))
        result = lint_text(source.text, shown, LintOptions(ids, severity))
        findings.extend(result.findings)
        errors.extend(_as_json(e, str(path)) for e in result.errors)
    errors.extend(_as_json(p, str(folder)) for p in problems)
    return findings, errors


def _as_json(problem: Any, path: str) -> dict[str, str]:
    """A linter problem as the JSON report's ``errors`` entry (a ``Problem``, or a plain message)."""
    if hasattr(problem, "to_json"):
        return problem.to_json()
    return dict(problem) if isinstance(problem, dict) else {"path": path, "message": str(problem)}


def display(path: str) -> str:
    """A path as the report shows it: relative to the working folder when inside it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel.replace(os.sep, "/")


def _runtime_finding(obs: Observation) -> Finding:
    rule = registry().get(obs.rule)
    assert rule is not None, obs.rule
    path = display(obs.path)
    return Finding(rule.id, rule.name, rule.severity, path, obs.line, 1, obs.line, 1, obs.message)


def _anchors(finding: Finding) -> set[int]:
    """The lines a runtime sighting may point at: the finding's own and its related places in its file
    (TL203's checkpoint call, TL105's optimizer)."""
    return {finding.line} | {r.line for r in finding.related if r.path == finding.path}


def join(static: list[Finding], observations: list[Observation]) -> list[Joined]:
    """An observation confirms every static finding of its rule in its file anchored at its line, else
    the nearest one; an observation with no static finding of its rule in its file is runtime-only."""
    claimed: dict[int, Observation] = {}
    out: list[Joined] = []
    for obs in observations:
        path = display(obs.path)
        twins = [i for i, f in enumerate(static) if f.rule == obs.rule and f.path == path]
        if not twins:
            out.append(Joined(_runtime_finding(obs), RUNTIME_ONLY, obs))
            continue
        exact = [i for i in twins if obs.line in _anchors(static[i])]
        nearest = min(twins, key=lambda i: (abs(static[i].line - obs.line), static[i].line))
        for i in exact or [nearest]:
            claimed.setdefault(i, obs)
    for i, finding in enumerate(static):
        obs = claimed.get(i)
        out.append(Joined(finding, SEEN if obs else NOT_REACHED, obs))
    out.sort(key=lambda j: (j.status == NOT_REACHED, j.finding.sort_key))
    return out
