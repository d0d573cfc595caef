"""Drivers of the probes that run a program once per variant: a checkpointed call (TL201, TL202,
TL203, TL204) and a step window (TL101, TL105, TL301). Each runs the variants and turns what they
computed into a verdict with evidence."""

from __future__ import annotations

import math
import re

import torch

from . import capture, state
from .capture import detached, named_parameters, projection_loss, state_of, tensors_in
from .compare import (
    AUTOCAST_STEPS,
    AUTOCAST_SUMS,
    FLOAT32,
    FLOAT32_SUMS,
    HALF_PARAMETERS,
    FixWording,
    Tolerance,
    compare,
    evidence_numbers,
    fixed_outcome,
    not_executable,
    note_text,
    num,
    pct,
    reference_evidence,
    result,
    short_list,
    verdict,
    worse,
)
from .sandbox import UnboundName, VariantFailed, call_user, exec_program, is_binding, seed
from .standins import LONG_STEPS, LOSS_SCALE, STEPS, TRIAL_SHAPES, B, D, T, float_shape

CHECKPOINT_FIX = FixWording(
    "with the fix it raises {failure}",
    "with the fix: gradients match the reference (max rel {max_rel})",
    "with the fix: still differs (max rel {max_rel})",
)
RNG_FIX = FixWording(
    "with the RNG state preserved it raises {failure}",
    "with the RNG state preserved: gradients match the reference (max rel {max_rel})",
    "with the RNG state preserved: still differs (max rel {max_rel})",
)
STEP_FIX = FixWording.max_rel("with the fix")
ACCUMULATION_FIX = FixWording.max_rel(
    "weighting each microbatch by its share of the window's tokens",
    raises="the token-weighted fix raises {failure}",
)


# --------------------------------------------------------------------------------------------------
# running the variants


def run_grads_variant(ns: dict, roots: list[str]) -> dict:
    """Call ``__tl_run__`` (one forward), backpropagate a fixed projection of every output and
    capture outputs, parameter gradients and input gradients."""
    out, warns = call_user(ns["__tl_run__"])
    outputs = tensors_in(out)
    params = named_parameters({r: ns[r] for r in roots if r in ns})
    loss = projection_loss(outputs)
    if loss is not None:
        _, more = call_user(loss.backward)
        warns.extend(more)
    grads = {f"grad of {n}": detached(p.grad) for n, p in params.items() if p.requires_grad}
    for name, t in ns.get("__tl_inputs__", {}).items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            grads[f"grad of input {name}"] = detached(t.grad)
    return {
        "outputs": {n: detached(t) for n, t in outputs},
        "grads": grads,
        "hits": dict(capture.hit_counts),
        "warnings": warns,
        "params": params,
    }


def run_variants(probe: dict, names: tuple[str, ...], run) -> tuple[dict, dict]:
    """Run each variant's program with ``run(ns)``. A variant may come with alternative programs
    (the user's own constructor, then stand-ins built from use): the first alternative whose
    reference runs is used for every variant. Returns (runs, failures)."""
    programs = probe["programs"]
    alternatives = (
        programs["reference"] if isinstance(programs["reference"], list) else [programs["reference"]]
    )
    chosen = 0
    first_failure: str | None = None
    capture.stood_in.clear()  # what an earlier probe left unreported
    capture.sized_by_pattern.clear()
    capture.entry.clear()
    float_shape(None)
    found = None
    for index in range(len(alternatives)):
        found, failure = _reference_by_trial(_alt(programs["reference"], index), run)
        if found is not None:
            chosen = index
            break
        if isinstance(failure.exc, SystemExit):
            return {}, {"reference": str(failure)}
        if first_failure is None or (
            str(failure).startswith("uses `") and not first_failure.startswith(("uses `", *NO_FIT))
        ):
            first_failure = str(failure)
    if found is None:
        float_shape(None)
        return {}, {"reference": first_failure or "no program"}
    reference, shape_note = found
    probe["chosen"] = chosen  # the drivers read what the chosen program synthesised
    runs = {"reference": reference}
    failures: dict[str, str] = {}
    for name in names:
        if name == "reference" or name not in programs:
            continue
        try:
            ns = exec_program(_alt(programs[name], chosen), name)
            seed(1)
            runs[name] = run(ns)
        except VariantFailed as exc:
            failures[name] = str(exc)
            if isinstance(exc.exc, UnboundName | SystemExit):
                break
    float_shape(None)
    if shape_note:
        capture.entry.append(shape_note)
    return runs, failures


SHAPE_ERRORS = re.compile(
    r"expected \dD|shape|size mismatch|mat1 and mat2|channels|dimension|must match the size", re.IGNORECASE
)


def _reference_by_trial(program: str, run) -> tuple[tuple[dict, str] | None, VariantFailed | None]:
    """Run the reference with synthetic inputs shaped (B, T, D); when that fails on a shape, with a few
    other shapes (an image model's (B, C, H, W), flat features), the one that fits named. Returns
    ((the run, the note naming a shape found by trial), None) or (None, the first failure)."""
    first: VariantFailed | None = None
    tried: list[tuple[int, ...]] = []
    for shape in (None, *TRIAL_SHAPES):
        float_shape(shape)
        try:
            ns = exec_program(program, "reference")
            seed(1)
            out = run(ns)
        except VariantFailed as exc:
            first = first or exc
            if not SHAPE_ERRORS.search(str(first)) or isinstance(exc.exc, UnboundName | SystemExit):
                return None, _sizes_first(first, tried, program)
            tried.append(shape or (B, T, D))
            continue
        note = ""
        if shape is not None:
            failed = ["(B, T, D)", *(str(s) for s in TRIAL_SHAPES[: TRIAL_SHAPES.index(shape)])]
            note = (
                f"synthetic inputs shaped {tuple(shape)}, found by trial after {', '.join(failed)} "
                f"did not fit ({str(first)[:80]})"
            )
        return (out, note), None
    return None, _sizes_first(first, tried, program)


NO_FIT = ("no size tried", "no shape tried")  # leads of a detail that names the synthetic sizes


def _sizes_first(
    failure: VariantFailed | None, tried: list[tuple[int, ...]], program: str
) -> VariantFailed | None:
    """A reference that failed on a tensor shape with every synthetic shape tried: its detail leads with
    the synthetic sizes that did not fit the code (the settings chosen by name or use, else the
    synthetic inputs' shapes), the error after them."""
    if failure is None or not tried:
        return failure
    shapes = ", ".join(str(s) for s in dict.fromkeys(tried))
    names = SYNTHETIC_FLOAT.findall(program)
    inputs = f"input{'s' if len(names) != 1 else ''} " + " and ".join(f"`{n}`" for n in names)
    sizes = {
        n: v
        for n, v in capture.sized_by_pattern.items()
        if isinstance(v, tuple) or (isinstance(v, int) and not isinstance(v, bool))
    }
    if sizes:
        named = " or ".join(f"`{n}`" for n in sizes)
        chosen = ", ".join(f"`{n}` = {v!r}" for n, v in sizes.items())
        lead = f"{NO_FIT[0]} for {named} fits the code: {chosen}, chosen by name or use, with the synthetic "
        lead += f"{inputs.strip()} shaped {shapes}"
    else:
        lead = f"{NO_FIT[1]} for the synthetic {inputs.strip()} fits the code: {shapes}"
    rewritten = VariantFailed(failure.exc)
    rewritten.args = (f"{lead}; the first raises {failure}",)
    return rewritten


def _alt(program, index: int) -> str:
    return program[index] if isinstance(program, list) else program


def _harness_failure(text: str) -> bool:
    """The variant failed on the harness's binding, not on the behaviour measured."""
    return text.startswith("uses `") or text.startswith("the snippet called")


DID_NOT_RUN = "did not run with the stand-in values"


def _did_not_run(probe: dict, run: dict, label: str) -> dict | None:
    if probe.get("hit_key") and not run["hits"].get(probe["hit_key"]):
        return not_executable(f"{label} {DID_NOT_RUN}")
    return None


def _none_gradients(cmp: dict) -> dict:
    if cmp["missing"]:
        return {"none_gradients": [n.removeprefix("grad of ") for n in cmp["missing"]]}
    return {}


# --------------------------------------------------------------------------------------------------
# checkpointed calls


SYNTHETIC_FLOAT = re.compile(r'^__tl_arg_(\w+) = __tl__\.data\("float"\)$', re.MULTILINE)


def drive_grads(probe: dict) -> dict:
    """TL201/TL202, run with the synthetic float inputs as a loader gives them (no grad) and again
    requiring grad (as activations of an earlier layer would): the verdict is the first run's, and
    the detail names the inputs it synthesised and what the other state gives."""
    first = _grads_once(probe)
    inputs = SYNTHETIC_FLOAT.findall(_alt(probe["programs"]["reference"], probe.get("chosen", 0)))
    skipped = DID_NOT_RUN in first["detail"]
    if not inputs or (first["status"] == "not-executable" and not skipped):
        return first
    state.INPUTS_REQUIRE_GRAD = True
    try:
        second = _grads_once(probe)
    finally:
        state.INPUTS_REQUIRE_GRAD = False
    names = ", ".join(f"`{n}`" for n in inputs)
    if skipped:
        # the code checkpoints only inputs that require grad (`if x.requires_grad: checkpoint(...)`)
        second["evidence"]["synthetic_inputs"] = inputs
        second["detail"] += (
            f"; with the synthetic input {names} requiring grad (as an earlier layer's output does): as a "
            "batch (no grad) the checkpoint call does not run"
        )
        return second
    first["evidence"]["synthetic_inputs"] = inputs
    first["evidence"]["with_inputs_requiring_grad"] = second["status"]
    if second["status"] == first["status"]:
        first["detail"] += f"; the same when the synthetic input {names} requires grad"
    else:
        first["detail"] += (
            f"; with the synthetic input {names} as a batch (no grad); {second['status']} when it requires "
            "grad (as an earlier layer's output does)"
        )
    return first


def _checkpoint_variants(probe: dict) -> tuple[dict, dict, str]:
    """The reference, as-written and fixed runs of a checkpointed call (outputs and gradients), their
    failures, and the call's name for the details."""
    roots = probe.get("roots", ["self"])
    runs, failures = run_variants(
        probe, ("reference", "as_written", "fixed"), lambda ns: run_grads_variant(ns, roots)
    )
    return runs, failures, probe.get("call_label", "the checkpointed call")


def _grads_once(probe: dict) -> dict:
    runs, failures, label = _checkpoint_variants(probe)
    if "reference" in failures or "reference" not in runs:
        return not_executable(failures.get("reference") or failures.get("as_written", "no result"))
    fixed = fixed_outcome(runs, failures, ("grads", "outputs"), FLOAT32, CHECKPOINT_FIX)
    if "as_written" in failures:
        text = failures["as_written"]
        if _harness_failure(text):
            return not_executable(text)
        ev = {"exception": text, **({"fixed_vs_reference": fixed.evidence} if fixed else {})}
        return verdict(True, f"as written, {label} raises {text}; without checkpoint it runs", ev, fixed, [])
    aw, ref = runs["as_written"], runs["reference"]
    skipped = _did_not_run(probe, aw, label)
    if skipped:
        return skipped
    cmp_g = compare(aw["grads"], ref["grads"], FLOAT32)
    cmp_o = compare(aw["outputs"], ref["outputs"], FLOAT32)
    ev = reference_evidence(
        worse(cmp_g, cmp_o), FLOAT32, fixed, gradients_compared=len(ref["grads"]), **_none_gradients(cmp_g)
    )
    notes = probe.get("notes", [])
    if cmp_g["match"] and cmp_o["match"]:
        detail = (
            f"as written, {label} gives the same outputs and gradients as without checkpoint "
            f"({len(ref['grads'])} gradients, max rel {cmp_g['max_rel']})"
        )
        return verdict(False, detail, ev, fixed, notes)
    if cmp_g["missing"]:
        names = [n.removeprefix("grad of ") for n in cmp_g["missing"]]
        detail = (
            f"as written, {len(names)} of {len(ref['grads'])} parameter gradients come back None "
            f"({short_list(names)})"
        )
        if any("requires_grad" in w for w in aw["warnings"]):
            detail += ": no input of the reentrant checkpoint requires grad"
    else:
        which = cmp_g if not cmp_g["match"] else cmp_o
        detail = (
            f"as written, {which['worst']} differs from the reference by {pct(which['max_rel'])} (max rel)"
        )
    return verdict(True, detail, ev, fixed, notes)


def drive_rng(probe: dict) -> dict:
    """TL204: the checkpoint with ``preserve_rng_state=False`` vs the plain call (and with the RNG
    state preserved): gradients computed for a different random draw than the forward used."""
    runs, failures, label = _checkpoint_variants(probe)
    if "reference" in failures or "reference" not in runs:
        return not_executable(failures.get("reference") or failures.get("as_written", "no result"))
    if "as_written" in failures:
        return not_executable(f"as written, {label} raises {failures['as_written']}")
    aw, ref = runs["as_written"], runs["reference"]
    skipped = _did_not_run(probe, aw, label)
    if skipped:
        return skipped
    cmp_g = compare(aw["grads"], ref["grads"], FLOAT32)
    cmp_o = compare(aw["outputs"], ref["outputs"], FLOAT32)
    fixed = fixed_outcome(runs, failures, ("grads", "outputs"), FLOAT32, RNG_FIX)
    ev = reference_evidence(
        worse(cmp_g, cmp_o),
        FLOAT32,
        fixed,
        outputs_vs_reference=evidence_numbers(cmp_o),
        gradients_compared=len(ref["grads"]),
        **_none_gradients(cmp_g),
    )
    notes = probe.get("notes", [])
    if cmp_g["match"] and cmp_o["match"]:
        detail = (
            f"as written, {label} gives the same outputs and gradients as the plain forward+backward "
            f"({len(ref['grads'])} gradients, max rel {cmp_g['max_rel']}): the function drew no random "
            "numbers that matter here"
        )
        return verdict(False, detail, ev, fixed, notes)
    which = cmp_g if not cmp_g["match"] else cmp_o
    detail = (
        f"as written, recomputation draws new random numbers: {which['worst']} differs from the plain "
        f"forward+backward by {pct(which['max_rel'])} (max rel) while the forward outputs "
        + ("match" if cmp_o["match"] else "differ")
    )
    return verdict(True, detail, ev, fixed, notes)


def drive_side_effects(probe: dict) -> dict:
    """TL203: one forward+backward under checkpoint vs plain; count each side effect."""
    roots = probe.get("roots", ["self"])
    keys = probe["counters"]
    watch = probe.get("watch", [])

    def run(ns: dict) -> dict:
        out = run_grads_variant(ns, roots)
        out["state"] = state_of({r.removeprefix("__tl_arg_"): ns[r] for r in roots if r in ns})
        out["globals"] = {
            k.removeprefix("__tl_arg_"): float(len(v)) if isinstance(v, list | dict | set) else float(v)
            for k, v in ns.items()
            if (k in watch and isinstance(v, list | dict | set | int | float))
            or (k.startswith("__tl_arg_") and isinstance(v, list | dict | set))
        }
        return out

    runs, failures = run_variants(probe, ("reference", "as_written"), run)
    if "reference" in failures:
        return not_executable(failures["reference"])
    if "as_written" in failures:
        text = failures["as_written"]
        if _harness_failure(text):
            return not_executable(text)
        return result("confirmed", f"as written, the checkpointed call raises {text}", {"exception": text})
    aw, ref = runs["as_written"], runs["reference"]
    skipped = _did_not_run(probe, aw, probe.get("call_label", "the checkpoint call"))
    if skipped:
        return skipped
    counts = {
        label: {"checkpointed": aw["hits"].get(key, 0), "plain": ref["hits"].get(key, 0)}
        for key, label in keys.items()
    }
    changed = compare(aw["state"], ref["state"], FLOAT32)
    glob = {k: (aw["globals"].get(k), ref["globals"].get(k)) for k in ref["globals"]}
    glob_diff = [k for k, (a, b) in glob.items() if a != b]
    ev: dict = {"executions": counts, "state_vs_plain": evidence_numbers(changed)}
    if changed["differing"]:
        ev["state_differs"] = changed["differing"]
    if glob_diff:
        ev["globals"] = {k: {"checkpointed": glob[k][0], "plain": glob[k][1]} for k in glob_diff}
    if all(c["plain"] == 0 for c in counts.values()):
        return not_executable("the flagged statement did not run in the plain forward with the stand-ins")
    diff = [label for label, c in counts.items() if c["checkpointed"] != c["plain"]]
    grads = compare(aw["grads"], ref["grads"], FLOAT32)
    if diff and not (changed["differing"] or glob_diff or not grads["match"]):
        # the statement ran again but left nothing different: a repeat, not a hazard for this run
        ev["harmless_repeat"] = True
        ev["gradients_vs_plain"] = evidence_numbers(grads)
        runs_text = "; ".join(
            f"{label} ran {counts[label]['checkpointed']} times under checkpoint vs {counts[label]['plain']} without"
            for label in diff
        )
        return result(
            "not-reproduced",
            f"in one forward+backward, {runs_text}, but the repeat is harmless: the state, the module "
            f"globals and the {len(ref['grads'])} gradients are the same as without checkpoint "
            f"(max rel {grads['max_rel']})",
            ev,
        )
    if diff or changed["differing"] or glob_diff:
        parts = [
            f"{label} ran {counts[label]['checkpointed']} times under checkpoint vs "
            f"{counts[label]['plain']} without"
            for label in diff
        ]
        if changed["differing"]:
            parts.append(f"state differs afterwards: {short_list(changed['differing'])}")
        parts.extend(f"`{k}` ends at {glob[k][0]:g} instead of {glob[k][1]:g}" for k in glob_diff)
        said = note_text(probe.get("notes", []))
        return result("confirmed", "in one forward+backward, " + "; ".join(parts) + said, ev)
    label, c = next(iter(counts.items()))
    return result(
        "not-reproduced",
        f"in one forward+backward, {label} ran {c['checkpointed']} time(s) under checkpoint, "
        f"as often as without it, and the state afterwards is the same",
        ev,
    )


# --------------------------------------------------------------------------------------------------
# step windows


def _step_run(ns: dict) -> dict:
    call_user(lambda: None)
    before, after = ns["__tl_before__"], ns["__tl_after__"]
    enabled = capture.records.get("scaler_enabled", [])
    return {
        "update": {f"update of {n}": after[n] - before[n] for n in before},
        "records": {k: list(v) for k, v in capture.records.items()},
        "scaler_off": bool(enabled) and not any(enabled),
    }


def _step_variants(probe: dict) -> tuple[dict, dict[str, str], dict | None]:
    """Runs and failures of the step window's variants, or the verdict when they cannot be compared."""
    runs: dict[str, dict] = {}
    failures: dict[str, str] = {}
    for name in ("reference", "as_written", "fixed"):
        if name not in probe["programs"]:
            continue
        try:
            runs[name] = _step_run(exec_program(probe["programs"][name], name))
        except VariantFailed as exc:
            failures[name] = str(exc)
            if name == "reference" or is_binding(exc):
                return runs, failures, not_executable(str(exc))
    if "as_written" in failures:  # not the hazard this probe measures
        return runs, failures, not_executable(f"as written, the step raises {failures['as_written']}")
    return runs, failures, None


def drive_step(probe: dict) -> dict:
    """TL101: the step window as written vs the same window without loss scaling; compares the
    parameter updates after a few steps, and the gradient norm the clip saw. A threshold whose value
    is not in the file is swept over typical values, with the verdict per value."""
    sweep = probe.get("sweep")
    if not sweep:
        return _step_once(probe)
    outcomes = []
    for value in sweep["values"]:
        programs = {k: f"__tl_sweep__ = {value!r}\n" + p for k, p in probe["programs"].items()}
        outcomes.append((value, _step_once({**probe, "programs": programs, "notes": []})))
    return sweep_verdict(sweep["name"], outcomes, probe.get("notes", []))


def sweep_verdict(name: str, outcomes: list[tuple[float, dict]], notes: list[str]) -> dict:
    """One verdict from the verdicts per swept value: confirmed when some typical value confirms it;
    the detail says for which values, then the numbers at the most typical confirmed value."""
    ran = [(v, r) for v, r in outcomes if r["status"] != "not-executable"]
    if not ran:
        return outcomes[0][1]
    confirmed = [v for v, r in ran if r["status"] == "confirmed"]
    others = [v for v, r in ran if r["status"] != "confirmed"]
    values = ", ".join(f"{v:g}" for v, _ in outcomes)
    if confirmed and others and max(confirmed) < min(others):
        split = f"confirmed for `{name}` <= {max(confirmed):g}, not reproduced above"
    elif confirmed and others and min(confirmed) > max(others):
        split = f"confirmed for `{name}` >= {min(confirmed):g}, not reproduced below"
    elif confirmed:
        split = "confirmed for " + ("every value" if not others else ", ".join(f"{v:g}" for v in confirmed))
    else:
        split = "not reproduced for any of them"
    shown_value, shown = min(ran, key=lambda vr: (vr[1]["status"] != "confirmed", abs(math.log10(vr[0]))))
    evidence = {
        **shown["evidence"],
        "sweep": {"name": name, "shown": shown_value, "status": {f"{v:g}": r["status"] for v, r in outcomes}},
    }
    detail = (
        f"`{name}` is not in the file: swept over {values}: {split}; at `{name}` = {shown_value:g}, "
        + shown["detail"]
        + note_text(notes)
    )
    return result("confirmed" if confirmed else "not-reproduced", detail, evidence, shown["fixed_matches"])


def _step_once(probe: dict) -> dict:
    runs, failures, stop = _step_variants(probe)
    if stop is not None:
        return stop
    aw, ref = runs["as_written"], runs["reference"]
    scale = probe.get("loss_scale", LOSS_SCALE)
    cmp = compare(aw["update"], ref["update"], AUTOCAST_STEPS)
    seen_aw = [x for x in aw["records"].get("clip", []) if x is not None]
    seen_ref = [x for x in ref["records"].get("clip", []) if x is not None]
    clip: dict = {}
    norm_text = ""
    if seen_aw and seen_ref:
        clip["clip_saw_norm"] = {
            "as_written": [num(x) for x in seen_aw],
            "reference": [num(x) for x in seen_ref],
        }
        scaled = "scaler off" if aw.get("scaler_off") else f"loss scale {scale:g}"
        norm_text = (
            f"; the clip saw a gradient norm of {seen_aw[0]:.4g} instead of {seen_ref[0]:.4g} ({scaled})"
        )
    fixed = fixed_outcome(runs, failures, ("update",), AUTOCAST_STEPS, STEP_FIX)
    ev = reference_evidence(cmp, AUTOCAST_STEPS, fixed, steps=STEPS, loss_scale=scale, **clip)
    if aw.get("scaler_off"):
        ev["scaler_enabled"] = False
    if cmp["match"]:
        detail = f"over {STEPS} steps the update matches the unscaled reference (max rel {cmp['max_rel']})"
    else:
        detail = (
            f"over {STEPS} steps the update differs from the unscaled reference by {pct(cmp['max_rel'])} "
            "(max rel)"
        )
    return verdict(not cmp["match"], detail + norm_text, ev, fixed, probe.get("notes", []))


def drive_accumulation(probe: dict) -> dict:
    """TL301: gradients accumulated over uneven microbatches as written vs one big batch."""
    runs: dict[str, dict] = {}
    failures: dict[str, str] = {}
    for name in ("reference", "as_written", "fixed"):
        program = probe["programs"].get(name)
        if program is None:
            continue
        try:
            capture.counting_pass(True)  # as written and reference: record the counts, for the evidence
            ns = exec_program(program, name)
        except VariantFailed as exc:
            failures[name] = str(exc)
        else:
            runs[name] = {"grads": capture.module_grads(ns), "tokens": dict(capture.tokens_seen)}
        finally:
            capture.counting_pass(False)
        if name in failures and (name == "reference" or failures[name].startswith(("uses `", "the snippet"))):
            return not_executable(failures[name])
    if "as_written" in failures:
        return not_executable(failures["as_written"])
    aw, ref = runs["as_written"], runs["reference"]
    tol, dtype = _sums_tolerance(probe["programs"]["as_written"])
    cmp = compare(aw["grads"], ref["grads"], tol)
    valid = capture.batch_valid  # the microbatches of the last program run
    tokens = [aw["tokens"].get(i, valid.get(i, 0)) for i in sorted(valid)]
    fixed = fixed_outcome(runs, failures, ("grads",), tol, ACCUMULATION_FIX)
    ev = reference_evidence(cmp, tol, fixed, microbatches=len(tokens), valid_tokens_per_microbatch=tokens)
    if dtype != "float32":
        ev["autocast_dtype"] = dtype
    counts = ", ".join(str(t) for t in tokens)
    within = f", within the {dtype} tolerance rtol {tol.rtol:g}"
    if cmp["match"]:
        detail = (
            f"microbatches with {counts} valid tokens: the accumulated gradient matches one big batch "
            f"(max rel {cmp['max_rel']}{within})"
        )
    else:
        detail = (
            f"microbatches with {counts} valid tokens: the accumulated gradient differs from one big "
            f"batch's token mean by {pct(cmp['max_rel'])} (max rel; tolerance rtol {tol.rtol:g}, {dtype})"
        )
    return verdict(not cmp["match"], detail, ev, fixed, probe.get("notes", []))


def _sums_tolerance(program: str) -> tuple[Tolerance, str]:
    """The tolerance of token sums for a program, and the dtype its forward runs in: float32, or the
    autocast dtype (bf16 on CPU, where the harness runs every autocast in bf16)."""
    if "autocast" not in program:
        return FLOAT32_SUMS, "float32"
    dtype = "bfloat16" if state.DEVICE == "cpu" or "bfloat16" in program else "float16"
    return AUTOCAST_SUMS[dtype], dtype


def drive_half(probe: dict) -> dict:
    """TL105: 16-bit parameters trained as written vs fp32 parameters with an autocast forward."""
    runs: dict[str, dict] = {}
    for name in ("reference", "as_written"):
        try:
            ns = exec_program(probe["programs"][name], name)
        except VariantFailed as exc:
            text = str(exc)
            if name == "reference" or "unscale FP16 gradients" not in text:
                return not_executable(text)
            return result(
                "confirmed",
                f"training the converted parameters raises {text} (the GradScaler refuses 16-bit gradients)",
                {"exception": text},
            )
        before, after = ns["__tl_before__"], ns["__tl_after__"]
        runs[name] = {
            "moved": {f"movement of {n}": after[n] - before[n] for n in before},
            "dtype": ns.get("__tl_dtype__", "?"),
        }
    aw, ref = runs["as_written"], runs["reference"]
    tol = HALF_PARAMETERS
    cmp = compare(aw["moved"], ref["moved"], tol)
    bad = sum(int((~torch.isfinite(t)).sum()) for t in aw["moved"].values())
    diff_norm = math.sqrt(sum(float(((aw["moved"][n] - ref["moved"][n]) ** 2).sum()) for n in ref["moved"]))
    frozen = sum(int((t == 0).sum()) for t in aw["moved"].values())
    total = sum(t.numel() for t in aw["moved"].values())
    ref_frozen = sum(int((t == 0).sum()) for t in ref["moved"].values())
    aw_norm = math.sqrt(sum(float((t**2).sum()) for t in aw["moved"].values()))
    ref_norm = math.sqrt(sum(float((t**2).sum()) for t in ref["moved"].values()))
    ev = reference_evidence(
        cmp,
        tol,
        None,
        steps=LONG_STEPS,
        parameter_dtype=aw["dtype"].replace("torch.", ""),
        entries_never_updated={"as_written": frozen, "reference": ref_frozen, "of": total},
        movement_norm={"as_written": num(aw_norm), "reference": num(ref_norm)},
    )
    notes = note_text(probe.get("notes", []))
    dtype = ev["parameter_dtype"]
    ref_bad = sum(int((~torch.isfinite(t)).sum()) for t in ref["moved"].values())
    if ref_bad:
        # the fp32 run diverges as well: the training itself blows up, not the 16-bit storage
        ev["non_finite_entries"] = {"as_written": bad, "reference": ref_bad}
        return result(
            "not-executable",
            f"inconclusive: after {LONG_STEPS} steps the fp32 reference diverges too ({ref_bad} of {total} "
            f"entries NaN or inf; as written: {bad}), so the run cannot tell the 16-bit parameters apart"
            + notes,
            ev,
        )
    if bad:
        ev["non_finite_entries"] = bad
        return result(
            "confirmed",
            f"after {LONG_STEPS} steps {bad} of {total} {dtype} parameter entries are NaN or inf "
            "(the fp32 reference stays finite)" + notes,
            ev,
        )
    rel = diff_norm / ref_norm if ref_norm > 0 else math.inf
    ev["movement_rel_error"] = num(rel)
    summary = (
        f"after {LONG_STEPS} steps the {dtype} parameters moved {aw_norm / ref_norm:.1%} as far as the fp32 "
        f"reference, {frozen} of {total} entries never changed (reference: {ref_frozen})"
        if ref_norm > 0
        else f"after {LONG_STEPS} steps the reference did not move"
    )
    if rel <= tol.rtol:
        return result(
            "not-reproduced",
            summary + f"; the movement matches within {pct(tol.rtol)} (relative error {pct(rel)})" + notes,
            ev,
        )
    return result("confirmed", summary + f"; the movement is off by {pct(rel)} (relative error)" + notes, ev)
