"""SARIF 2.1.0 output, in the shape GitHub code scanning reads (validated against the vendored schema in
tests/data)."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from trainlint import __version__
from trainlint.report import DOCS_URL, RunReport, rule_url
from trainlint.report.escape import json_safe
from trainlint.rule import Finding, Fix, Related, Rule, Severity, registry

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
LEVELS = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "note"}
SRCROOT = "%SRCROOT%"


def _rule_descriptor(rule: type[Rule]) -> dict[str, Any]:
    return {
        "id": rule.id,
        "name": rule.name,
        "shortDescription": {"text": rule.summary},
        "fullDescription": {"text": rule.doc.what if rule.doc else rule.summary},
        "help": {"text": rule.summary, "markdown": rule.explain()},
        "helpUri": rule_url(rule.id),
        "defaultConfiguration": {"level": LEVELS[rule.severity]},
        "properties": {"tags": [rule.name]},
    }


def _uri(path: str) -> str:
    """A relative URI reference: separators as ``/``, and characters a URI cannot hold (spaces, ``%``,
    ``#``, ``?``, non-ASCII) percent-encoded."""
    return quote(path.replace("\\", "/"), safe="/")


def _artifact(path: str) -> dict[str, str]:
    return {"uri": _uri(path), "uriBaseId": SRCROOT}


def _related(index: int, r: Related) -> dict[str, Any]:
    region = {"startLine": r.line, "startColumn": r.column}
    if r.end_line is not None and r.end_column is not None:
        region |= {"endLine": r.end_line, "endColumn": r.end_column}
    return {
        "id": index,
        "message": {"text": r.message},
        "physicalLocation": {"artifactLocation": _artifact(r.path), "region": region},
    }


def _fix(path: str, fix: Fix) -> dict[str, Any]:
    """A SARIF fix: every edit a replacement of a region (end exclusive, as trainlint's)."""
    replacements = [
        {
            "deletedRegion": {
                "startLine": e.line,
                "startColumn": e.column,
                "endLine": e.end_line,
                "endColumn": e.end_column,
            },
            "insertedContent": {"text": e.content},
        }
        for e in fix.edits
    ]
    return {
        "description": {"text": f"{fix.description} ({fix.applicability.value} fix)"},
        "artifactChanges": [{"artifactLocation": _artifact(path), "replacements": replacements}],
        "properties": {"applicability": fix.applicability.value},
    }


def _result(f: Finding, rule_index: int) -> dict[str, Any]:
    result: dict[str, Any] = {
        "ruleId": f.rule,
        "ruleIndex": rule_index,
        "level": LEVELS[f.severity],
        "message": {"text": f.message},
        "locations": [
            {
                "physicalLocation": {
                    "artifactLocation": _artifact(f.path),
                    "region": {
                        "startLine": f.line,
                        "startColumn": f.column,
                        "endLine": f.end_line,
                        "endColumn": f.end_column,
                    },
                }
            }
        ],
    }
    if f.related:
        result["relatedLocations"] = [_related(i, r) for i, r in enumerate(f.related)]
    if f.fix is not None and f.cell is None:  # a notebook's edits count lines within a cell, not the file
        result["fixes"] = [_fix(f.path, f.fix)]
    properties: dict[str, Any] = {}
    if f.verify is not None:  # the --verify verdict, as trainlint's JSON carries it
        properties["verify"] = f.verify
    if f.cell is not None:  # a notebook: the region's lines count within this code cell
        properties["cell"] = f.cell
    if properties:
        result["properties"] = properties
    return result


def render_sarif(report: RunReport) -> str:
    rules = list(registry())
    index = {rule.id: i for i, rule in enumerate(rules)}
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
                        "informationUri": DOCS_URL,
                        "rules": [_rule_descriptor(r) for r in rules],
                    }
                },
                "invocations": [
                    {"executionSuccessful": not report.errors, "toolExecutionNotifications": notifications}
                ],
                # trainlint counts columns in code points; SARIF's default is UTF-16 code units
                "columnKind": "unicodeCodePoints",
                "results": [_result(f, index[f.rule]) for f in report.findings],
            }
        ],
    }
    return json_safe(json.dumps(log, indent=2, ensure_ascii=False))
