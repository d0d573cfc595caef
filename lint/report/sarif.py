"""SARIF 2.1.0 output, in the shape GitHub code scanning reads."""

from __future__ import annotations

import json

from trainlint import __version__
from trainlint.report import RunReport
from trainlint.rule import Severity, registry

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
LEVELS = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "note"}


def _rule_descriptor(rule) -> dict:
    return {
        "id": rule.id,
        "name": rule.name,
        "shortDescription": {"text": rule.summary},
        "fullDescription": {"text": rule.doc.what if rule.doc else rule.summary},
        "help": {"text": rule.summary, "markdown": rule.explain()},
        "defaultConfiguration": {"level": LEVELS[rule.severity]},
        "properties": {"tags": [rule.name]},
    }


def render_sarif(report: RunReport) -> str:
    rules = list(registry())
    index = {rule.id: i for i, rule in enumerate(rules)}
    results = []
    for f in report.findings:
        region = {
            "startLine": f.line,
            "startColumn": f.column,
            "endLine": f.end_line,
            "endColumn": f.end_column,
        }
        result = {
            "ruleId": f.rule,
            "ruleIndex": index[f.rule],
            "level": LEVELS[f.severity],
            "message": {"text": f.message},
            "locations": [
                {
                    "physicalLocation": {
                        "artifactLocation": {"uri": f.path.replace("\\", "/"), "uriBaseId": "%SRCROOT%"},
                        "region": region,
                    }
                }
            ],
        }
        if f.related:
            result["relatedLocations"] = [
                {
                    "id": i,
                    "message": {"text": r.message},
                    "physicalLocation": {
                        "artifactLocation": {"uri": r.path.replace("\\", "/"), "uriBaseId": "%SRCROOT%"},
                        "region": {"startLine": r.line, "startColumn": r.column},
                    },
                }
                for i, r in enumerate(f.related)
            ]
        results.append(result)
    notifications = [{"level": "error", "message": {"text": e.message}} for e in report.errors]
    log = {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "trainlint",
                        "version": __version__,
                        "rules": [_rule_descriptor(r) for r in rules],
                    }
                },
                "invocations": [
                    {"executionSuccessful": not report.errors, "toolExecutionNotifications": notifications}
                ],
                "results": results,
            }
        ],
    }
    return json.dumps(log, indent=2, ensure_ascii=False)
