"""JSON output, schema 1 (see the interface contract)."""

from __future__ import annotations

import json
from typing import Any

from trainlint import __version__
from trainlint.report import RunReport, rule_url
from trainlint.report.escape import json_safe
from trainlint.rule import Finding

SCHEMA = 1


def render_json(report: RunReport) -> str:
    payload = {
        "tool": "trainlint",
        "version": __version__,
        "schema": SCHEMA,
        "findings": [_finding(f) for f in report.findings],
        "errors": [e.to_json() for e in report.errors],
        "summary": {
            "files": report.files,
            "findings": len(report.findings),
            "by_rule": report.by_rule(),
            "elapsed_s": round(report.elapsed_s, 3),
            "excluded": report.excluded,
        },
    }
    return json_safe(json.dumps(payload, indent=2, ensure_ascii=False))


def _finding(finding: Finding) -> dict[str, Any]:
    data = finding.to_json()
    data["url"] = data["url"] or rule_url(finding.rule)
    return data
