"""Orchestration: findings with probes → probe programs per file → child runs → ``verify`` dicts."""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any

import libcst as cst

from trainlint.model import FileModel
from trainlint.rule import Applicability, Finding, registry
from trainlint.verify.context import ProbeContext
from trainlint.verify.probes import PROBES, Probe
from trainlint.verify.runner import run_probes
from trainlint.verify.source import NotExecutable, Tree

# Probes of all files run in one child process (torch is imported once), BATCH at a time; a probe
# that kills its child is reported and the rest go on in a fresh one (see runner.py).
BATCH = 48


def probe_for(rule_id: str) -> Probe | None:
    """The probe of a rule that declares one. A declared probe missing from ``PROBES`` raises (the
    finding gets an ``error`` verdict) rather than silently going unverified."""
    rule = registry().get(rule_id)
    if rule is None or not rule.has_probe():
        return None
    probe = PROBES.get(rule.id)
    if probe is None:
        raise LookupError(f"{rule.id} declares a probe but trainlint.verify.probes.PROBES has none")
    return probe


def _verify_dict(
    status: str, device: str, torch: str, detail: str, evidence: dict[str, Any]
) -> dict[str, Any]:
    return {"status": status, "device": device, "torch": torch, "detail": detail, "evidence": evidence}


def build_probe(finding: Finding, model: FileModel, tree: Tree) -> dict[str, Any]:
    """The probe dict for one finding; raises NotExecutable."""
    func = probe_for(finding.rule)
    if func is None:
        raise LookupError(f"{finding.rule} has no probe")
    return func(ProbeContext(finding, model, tree))


def verify_all(
    findings: list[Finding], sources: dict[str, str], device: str, timeout: float
) -> list[Finding]:
    from trainlint.verify import torch_version

    version = torch_version()
    shown_device = "cpu" if device == "auto" else device  # not run: the child reports the real one
    verdicts: dict[int, dict[str, Any]] = {}
    by_file: dict[str, list[int]] = {}
    all_jobs: list[dict[str, Any]] = []
    for i, finding in enumerate(findings):
        rule = registry().get(finding.rule)
        if rule is not None and rule.has_probe():
            by_file.setdefault(finding.path, []).append(i)
    for path, indexes in by_file.items():
        text = sources.get(path)
        if text is None:
            for i in indexes:
                verdicts[i] = _verify_dict(
                    "not-executable", shown_device, version, "source not available", {}
                )
            continue
        try:
            model = FileModel(cst.parse_module(text), path, text)
            tree = Tree(model)
        except (cst.ParserSyntaxError, RecursionError) as exc:
            for i in indexes:
                verdicts[i] = _verify_dict(
                    "not-executable", shown_device, version, f"does not parse: {exc}", {}
                )
            continue
        jobs: list[dict[str, Any]] = []
        for i in indexes:
            try:
                probe = build_probe(findings[i], model, tree)
            except NotExecutable as exc:
                verdicts[i] = _verify_dict("not-executable", shown_device, version, str(exc), {})
                continue
            except Exception as exc:  # a bug in a probe builder: report it, keep going
                verdicts[i] = _verify_dict(
                    "error",
                    shown_device,
                    version,
                    f"harness error while building the probe: {type(exc).__name__}: {exc}",
                    {"traceback": traceback.format_exc()[-2000:]},
                )
                continue
            probe["id"] = str(i)
            probe["rule"] = findings[i].rule
            jobs.append(probe)
        all_jobs.extend(jobs)
    for start in range(0, len(all_jobs), BATCH):
        batch = all_jobs[start : start + BATCH]
        results = run_probes(batch, device, timeout)
        for job in batch:
            res = results[job["id"]]
            i = int(job["id"])
            verdict = _verify_dict(
                res.get("status", "error"),
                res.get("device", shown_device),
                res.get("torch", version),
                res.get("detail", ""),
                res.get("evidence", {}),
            )
            if res.get("fixed_matches"):
                verdict["fix_verified"] = True
            verdicts[i] = verdict
    out = []
    for i, finding in enumerate(findings):
        verdict = verdicts.get(i)
        if verdict is None:
            out.append(finding)
            continue
        fix = finding.fix
        verified = verdict.pop("fix_verified", False)
        if fix is not None and verified and verdict["status"] in ("confirmed", "not-reproduced"):
            fix = dataclasses.replace(fix, applicability=Applicability.VERIFIED)
        out.append(dataclasses.replace(finding, verify=verdict, fix=fix))
    return out
