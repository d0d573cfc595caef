"""Orchestration: findings with probes → probe programs per file → child runs → ``verify`` dicts."""

from __future__ import annotations

import contextlib
import dataclasses
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import libcst as cst

from trainlint.model import FileModel
from trainlint.rule import Applicability, Finding, registry
from trainlint.verify.context import ProbeContext
from trainlint.verify.probes import PROBES, Probe
from trainlint.verify.runner import Child, run_probes, start_child
from trainlint.verify.source import NotExecutable, Tree


@contextlib.contextmanager
def _visitor_methods_cached() -> Iterator[None]:
    """While probes are built, libcst finds each metadata provider's ``visit_*``/``leave_*`` methods
    once per class instead of with ``inspect.getmembers`` on every resolve: a third of a snippet's
    scope analysis on libcst (``source.analyse_names_cst``, now only where the ``ast`` version cannot
    answer). Same methods: providers define them on their class, never on an instance."""
    from libcst import BatchableCSTVisitor

    real = BatchableCSTVisitor.get_visitors
    names: dict[type, tuple[str, ...]] = {}

    def get_visitors(self: BatchableCSTVisitor) -> dict[str, Callable[..., Any]]:
        found = names.get(type(self))
        if found is None:
            found = names[type(self)] = tuple(real(self))
        return {name: getattr(self, name) for name in found}

    BatchableCSTVisitor.get_visitors = get_visitors  # type: ignore[method-assign]
    try:
        yield
    finally:
        BatchableCSTVisitor.get_visitors = real  # type: ignore[method-assign]


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


def _build_jobs(
    findings: list[Finding],
    by_file: dict[str, list[int]],
    sources: dict[str, str],
    verdict: Callable[[int, str, str, dict[str, Any]], None],
    built: Callable[[dict[str, Any]], None],
) -> list[dict[str, Any]]:
    """The probe dicts of the findings listed in ``by_file`` (ids: their indexes), each passed to
    ``built`` as soon as it is; a finding whose probe cannot be built gets its verdict through
    ``verdict(index, status, detail, evidence)``."""
    all_jobs: list[dict[str, Any]] = []
    for path, indexes in by_file.items():
        text = sources.get(path)
        if text is None:
            for i in indexes:
                verdict(i, "not-executable", "source not available", {})
            continue
        try:
            model = FileModel(cst.parse_module(text), path, text)
            tree = Tree(model)
        except (cst.ParserSyntaxError, RecursionError) as exc:
            for i in indexes:
                verdict(i, "not-executable", f"does not parse: {exc}", {})
            continue
        for i in indexes:
            try:
                probe = build_probe(findings[i], model, tree)
            except NotExecutable as exc:
                verdict(i, "not-executable", str(exc), {})
                continue
            except Exception as exc:  # a bug in a probe builder: report it, keep going
                detail = f"harness error while building the probe: {type(exc).__name__}: {exc}"
                verdict(i, "error", detail, {"traceback": traceback.format_exc()[-2000:]})
                continue
            probe["id"] = str(i)
            probe["rule"] = findings[i].rule
            all_jobs.append(probe)
            built(probe)
    return all_jobs


def _child_for(count: int, device: str, timeout: float, early: Child | None) -> Child | None:
    """The child for ``count`` probes: ``early`` (started before linting) when it fits, else a new
    one (none for no probe). An early child that is not used is ended."""
    if early is not None and count and early.takes(device, timeout, count):
        return early
    if early is not None:
        early.close()
    return start_child(device, timeout, count) if count else None


def verify_all(
    findings: list[Finding],
    sources: dict[str, str],
    device: str,
    timeout: float,
    early: Child | None = None,
) -> list[Finding]:
    """``early``: a child the caller started before linting (``start_early``); used or ended here."""
    from trainlint.verify import torch_version

    by_file: dict[str, list[int]] = {}
    for i, finding in enumerate(findings):
        rule = registry().get(finding.rule)
        if rule is not None and rule.has_probe():
            by_file.setdefault(finding.path, []).append(i)
    # The probes of every file run in one child process, which imports torch once; a probe that kills
    # it is reported and the rest go on in a fresh one (see runner.py). The child is started first:
    # it imports torch while the probes are built here (and, told their drivers, starts what they
    # need), and waits for their job.
    count = sum(len(indexes) for indexes in by_file.values())
    child = _child_for(count, device, timeout, early)
    version = torch_version()
    shown_device = "cpu" if device == "auto" else device  # not run: the child reports the real one
    verdicts: dict[int, dict[str, Any]] = {}

    def unbuilt(i: int, status: str, detail: str, evidence: dict[str, Any]) -> None:
        verdicts[i] = _verify_dict(status, shown_device, version, detail, evidence)

    def built(probe: dict[str, Any]) -> None:
        if child is not None:
            child.announce(str(probe.get("driver")))

    try:
        with _visitor_methods_cached():
            all_jobs = _build_jobs(findings, by_file, sources, unbuilt, built)
        results = run_probes(all_jobs, device, timeout, child) if all_jobs else {}
    finally:
        if child is not None:
            child.close()  # unused (no probe could be built) or already ended
    for job in all_jobs:
        res = results[job["id"]]
        verdict = _verify_dict(
            res.get("status", "error"),
            res.get("device", shown_device),
            res.get("torch", version),
            res.get("detail", ""),
            res.get("evidence", {}),
        )
        if res.get("fixed_matches"):
            verdict["fix_verified"] = True
        verdicts[int(job["id"])] = verdict
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
