"""JSON output, schema 1 (see the interface contract)."""

from __future__ import annotations

import json

from trainlint import __version__
from trainlint.report import RunReport

SCHEMA = 1


def render_json(report: RunReport) -> str:
    payload = {
        "tool": "trainlint",
        "version": __version__,
        "schema": SCHEMA,
        "findings": [f.to_json() for f in report.findings],
        "errors": [e.to_json() for e in report.errors],
        "summary": {
            "files": report.files,
            "findings": len(report.findings),
            "by_rule": report.by_rule(),
            "elapsed_s": round(report.elapsed_s, 3),
        },
    }
    return json.dumps(payload, indent=2, ensure_ascii=False)
