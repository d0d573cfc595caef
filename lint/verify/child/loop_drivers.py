"""Drivers of the loop probes: the user's loop body run for a few iterations on the tiny model
(TL102, TL103, TL104, TL302, TL303), as written vs the documented order (and the fix)."""

from __future__ import annotations

from . import capture
from .compare import (
    AUTOCAST_STEPS,
    FixedOutcome,
    FixWording,
    Tolerance,
    fixed_compared,
    fixed_raised,
    loop_comparison,
    not_executable,
    note_text,
    num,
    result,
    verdict,
)
from .sandbox import VariantFailed, exec_program, is_binding
from .standins import LOSS_SCALE, OVERFLOW_FACTOR

LOOP_FIX = FixWording(
    "with the fix it raises {stripped}", "with the fix: matches the documented order", "with the fix: {parts}"
)


def _loop_variants(probe: dict) -> tuple[dict, dict]:
    runs: dict[str, dict] = {}
    failures: dict[str, dict] = {}
    for name in ("reference", "as_written", "fixed"):
        program = probe["programs"].get(name)
        if program is None:
            continue
        capture.current_loop.clear()
        try:
            ns = exec_program(program, name)
            runs[name] = capture.loop_result(ns)
        except VariantFailed as exc:
            failures[name] = {
                "text": str(exc),
                "iteration": capture.current_loop.get("iteration", 0),
                "binding": is_binding(exc),
            }
            if is_binding(exc):
                break
    return runs, failures


def _expected_failure(probe: dict, text: str) -> bool:
    return any(part in text for part in probe.get("expect", []))


def _loop_fixed(runs: dict, failures: dict, tol: Tolerance) -> FixedOutcome | None:
    if "fixed" in failures:
        return fixed_raised(failures["fixed"]["text"], LOOP_FIX)
    if "fixed" not in runs:
        return None
    fev, fparts, fdiff = loop_comparison(runs["fixed"], runs["reference"], tol)
    return fixed_compared(fev["as_written_vs_reference"], not fdiff, LOOP_FIX, parts="; ".join(fparts))


def drive_loop(probe: dict) -> dict:
    """TL102/TL103/TL104/TL303: the user's loop statements as written vs the documented order (and the
    fix), run for a few iterations on the tiny model; compares the gradients each optimizer step
    applied and the final parameters, or reports the documented exception."""
    runs, failures = _loop_variants(probe)
    notes = probe.get("notes", [])
    iterations = probe.get("iterations", 0)
    header = f"over {iterations} iterations"
    if probe.get("accumulation"):
        header += f" (accumulation count {probe['accumulation']})"
    for name in ("reference", "as_written", "fixed"):
        if name in failures and (name == "reference" or failures[name]["binding"]):
            return not_executable(failures[name]["text"])
    tol = AUTOCAST_STEPS
    ev: dict = {"tolerance": tol.as_evidence(), "iterations": iterations, "loss_scale": LOSS_SCALE}
    if probe.get("overflow_iteration") is not None:
        ev["overflow_iteration"] = probe["overflow_iteration"] + 1
    fixed = _loop_fixed(runs, failures, tol)
    if fixed is not None:
        ev["fixed_vs_reference"] = fixed.evidence
    if "as_written" in failures:
        failure = failures["as_written"]
        if not _expected_failure(probe, failure["text"]):
            return not_executable(f"as written, the loop raises {failure['text']}" + note_text(notes))
        ev["exception"] = failure["text"]
        ev["failing_iteration"] = failure["iteration"] + 1
        detail = (
            f"as written, iteration {failure['iteration'] + 1} raises {failure['text'].rstrip('.')}; in the "
            f"documented order the same {iterations} iterations run"
        )
        return verdict(True, detail, ev, fixed, notes)
    aw, ref = runs["as_written"], runs["reference"]
    if not ref["steps"]:
        return not_executable("the optimizer never stepped in the documented order with the stand-ins")
    cev, parts, differs = loop_comparison(aw, ref, tol)
    ev.update(cev)
    if probe.get("overflow_iteration") is not None:
        notes = [
            *notes,
            f"the loss of iteration {probe['overflow_iteration'] + 1} is multiplied by {OVERFLOW_FACTOR:g} so that "
            "its scaled gradients overflow, as fp16 gradients do when the scale is too large",
        ]
    if not differs:
        detail = (
            f"{header}, the loop as written applies the same {len(ref['steps'])} optimizer step(s) as the "
            f"documented order (max rel {cev['as_written_vs_reference']['max_rel']})"
        )
    else:
        detail = f"{header}, as written " + "; ".join(parts)
    return verdict(differs, detail, ev, fixed, notes)


def drive_graph(probe: dict) -> dict:
    """TL302: live autograd nodes after each iteration, as written vs with the added loss detached."""
    runs, failures = _loop_variants(probe)
    for name in ("reference", "as_written"):
        if name in failures:
            return not_executable(failures[name]["text"])
    aw, ref = runs["as_written"], runs["reference"]
    counts_aw, counts_ref = aw["census"], ref["census"]
    if len(counts_aw) < 3 or len(counts_ref) < 3:
        return not_executable("the loop did not run long enough to measure its graph")
    # growth per iteration after the first one (the first iteration builds the steady state)
    span = len(counts_aw) - 2
    growth_aw = (counts_aw[-1] - counts_aw[1]) / span
    growth_ref = (counts_ref[-1] - counts_ref[1]) / span
    ev = {
        "live_autograd_nodes": {"as_written": counts_aw, "reference": counts_ref},
        "growth_per_iteration": {"as_written": num(growth_aw), "reference": num(growth_ref)},
        "iterations": len(counts_aw) - 1,
    }
    notes = note_text(probe.get("notes", []))
    label = probe.get("total_label", "the running total")
    if growth_aw > growth_ref:
        return result(
            "confirmed",
            f"after {len(counts_aw) - 1} iterations {counts_aw[-1]} autograd nodes are alive as written vs "
            f"{counts_ref[-1]} with the loss detached: {label} keeps about {growth_aw - growth_ref:.0f} more "
            "per iteration" + notes,
            ev,
        )
    return result(
        "not-reproduced",
        f"the number of live autograd nodes does not grow with iterations ({counts_aw[1]} → {counts_aw[-1]}; "
        f"with the loss detached {counts_ref[1]} → {counts_ref[-1]})" + notes,
        ev,
    )
