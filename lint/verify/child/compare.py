"""Comparing what the variants of a probe computed: named tolerances, one comparison of name -> tensor
maps, and the builders every driver uses for its evidence and verdict (as written vs reference, and
the fix vs reference)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

import torch

from . import capture


@dataclass(frozen=True)
class Tolerance:
    """An entry differs when ``|got - ref| > atol + rtol * max|ref|`` (over one tensor)."""

    rtol: float
    atol: float

    def exceeded(self, diff: float, scale: float) -> bool:
        return diff > self.atol + self.rtol * scale

    def as_evidence(self) -> dict:
        return {"rtol": self.rtol, "atol": self.atol}


# The same float32 computation, only the order of operations differs (checkpoint recomputation,
# state after one forward+backward).
FLOAT32 = Tolerance(rtol=1e-5, atol=1e-7)
# float32 token means: one big batch vs a sum of microbatch means, or an all-reduce over two ranks
# (many more additions, in another order).
FLOAT32_SUMS = Tolerance(rtol=1e-4, atol=1e-7)
# The same token sums with the forward under autocast: each product is rounded to the autocast dtype
# (bf16 keeps 8 bits of mantissa, a unit roundoff of 0.2%; fp16 keeps 11), so two orders of summation
# differ by a few roundoffs. A hazard (uneven token counts) moves the gradient by far more.
AUTOCAST_SUMS = {"bfloat16": Tolerance(rtol=2e-2, atol=1e-6), "float16": Tolerance(rtol=5e-3, atol=1e-6)}
# Several optimizer steps of the tiny model whose forward runs under 16-bit autocast: rounding in the
# autocast dtype compounds over the steps.
AUTOCAST_STEPS = Tolerance(rtol=1e-3, atol=1e-7)
# How far 16-bit parameters move vs float32 ones over many small steps: within 10%.
HALF_PARAMETERS = Tolerance(rtol=0.1, atol=1e-6)


def compare(got: dict, ref: dict, tol: Tolerance) -> dict:
    """Compare two name -> tensor-or-None maps. ``missing`` lists names whose value is None in
    ``got`` while ``ref`` has a tensor; max_rel is the largest |got-ref|_inf / |ref|_inf."""
    max_abs = 0.0
    max_rel = 0.0
    missing: list[str] = []
    extra: list[str] = []
    worst = None
    differing: list[str] = []
    for name, r in ref.items():
        g = got.get(name)
        if r is None and g is None:
            continue
        if r is not None and g is None:
            missing.append(name)
            g = torch.zeros_like(r)  # a missing gradient counts as zero in the numbers
        if r is None:
            extra.append(name)
            continue
        if g.shape != r.shape:
            differing.append(name)
            max_rel = math.inf
            continue
        diff = (g - r).abs()
        if not torch.isfinite(g).all():
            a = math.inf
        else:
            a = float(diff.max()) if diff.numel() else 0.0
        scale = float(r.abs().max()) if r.numel() else 0.0
        rel = a / scale if scale > 0 else (0.0 if a == 0 else math.inf)
        if tol.exceeded(a, scale) and name not in missing:
            differing.append(name)
        if rel > max_rel or (worst is None and a > 0):
            worst = name
        max_abs = max(max_abs, a)
        max_rel = max(max_rel, rel)
    return {
        "max_abs": num(max_abs),
        "max_rel": num(max_rel),
        "missing": missing,
        "extra": extra,
        "differing": differing,
        "worst": worst,
        "match": not missing and not extra and not differing,
    }


def num(x: float):
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return float(f"{x:.6g}")


def evidence_numbers(cmp: dict) -> dict:
    return {"max_abs": cmp["max_abs"], "max_rel": cmp["max_rel"]}


def pct(x) -> str:
    if isinstance(x, str):
        return x
    return f"{100 * x:.1f}%" if x >= 0.001 else f"{x:.2g}"


def short_list(names: list[str], n: int = 4) -> str:
    shown = ", ".join(f"`{x}`" for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def worse(a: dict, b: dict) -> dict:
    return a if (a["missing"] or not b["missing"]) and _rel(a) >= _rel(b) else b


def _rel(c: dict) -> float:
    return math.inf if isinstance(c["max_rel"], str) or c["missing"] else c["max_rel"]


def non_finite(params: dict) -> int:
    return sum(int((~torch.isfinite(t)).sum()) for t in params.values())


def compare_finite(got: dict, ref: dict, tol: Tolerance) -> dict:
    """``compare`` where entries that are NaN/inf on both sides at the same places count as equal."""
    g2, r2 = {}, {}
    for name, r in ref.items():
        g = got.get(name)
        if isinstance(g, torch.Tensor) and isinstance(r, torch.Tensor) and g.shape == r.shape:
            both = ~torch.isfinite(g) & ~torch.isfinite(r)
            g = torch.where(both, torch.zeros_like(g), g)
            r = torch.where(both, torch.zeros_like(r), r)
        g2[name], r2[name] = g, r
    return compare(g2, r2, tol)


def updates(run: dict, until: str = "after") -> dict:
    before, after = run["before"], run[until]
    if after is None:
        return {}
    return {f"update of {n}": after[n] - before[n] for n in before if n in after}


def norm_ratio(got: dict, ref: dict) -> float:
    num = math.sqrt(sum(float((t.double() ** 2).sum()) for t in got.values() if t is not None))
    den = math.sqrt(sum(float((t.double() ** 2).sum()) for t in ref.values() if t is not None))
    return num / den if den > 0 else math.inf


def loop_comparison(aw: dict, ref: dict, tol: Tolerance) -> tuple[dict, list[str], bool]:
    """Evidence and sentences for two loop runs; True when they differ."""
    ev: dict = {}
    parts: list[str] = []
    differs = False
    n_aw, n_ref = len(aw["steps"]), len(ref["steps"])
    ev["optimizer_steps"] = {"as_written": n_aw, "reference": n_ref}
    if n_aw != n_ref:
        differs = True
        parts.append(f"the optimizer stepped {n_aw} times instead of {n_ref}")
    worst = None
    per_step = []
    for index, (sa, sr) in enumerate(zip(aw["steps"], ref["steps"], strict=False)):
        cmp = compare_finite(sa["grads"], sr["grads"], tol)
        per_step.append(cmp["max_rel"])
        if not cmp["match"] and worst is None:
            worst = (index, cmp)
    if per_step:
        ev["applied_gradient_max_rel"] = per_step
    if worst is not None:
        differs = True
        index, cmp = worst
        ratio = norm_ratio(aw["steps"][index]["grads"], ref["steps"][index]["grads"])
        ev["applied_gradient_norm_ratio"] = num(ratio)
        if ratio == 0:
            size = "; no gradient was left for the step"
        elif math.isfinite(ratio):
            size = f"; its norm is {ratio:.4g} times the documented one"
        else:
            size = ""
        parts.append(
            f"the gradient applied at step {index + 1} differs by {pct(cmp['max_rel'])} (max rel){size}"
        )
    if ref.get("before_overflow") is not None and aw.get("before_overflow") is not None:
        early = compare_finite(updates(aw, "before_overflow"), updates(ref, "before_overflow"), tol)
        ev["update_before_overflow_vs_reference"] = evidence_numbers(early)
        if not early["match"]:
            differs = True
            parts.append(f"the update before the overflow step differs by {pct(early['max_rel'])} (max rel)")
    update = compare_finite(updates(aw), updates(ref), tol)
    ev["as_written_vs_reference"] = evidence_numbers(update)
    bad_aw, bad_ref = non_finite(aw["after"]), non_finite(ref["after"])
    total = sum(t.numel() for t in ref["after"].values())
    if bad_aw or bad_ref:
        ev["non_finite_parameters"] = {"as_written": bad_aw, "reference": bad_ref, "of": total}
    if bad_aw != bad_ref:
        differs = True
        parts.append(f"{bad_aw} of {total} parameter entries end up NaN/inf (reference: {bad_ref})")
    elif not update["match"]:
        differs = True
        parts.append(f"the final update differs by {pct(update['max_rel'])} (max rel)")
    return ev, parts, differs


# --------------------------------------------------------------------------------------------------
# evidence and verdicts


def result(status: str, detail: str, evidence: dict, fixed_matches: bool = False) -> dict:
    detail, evidence = synthetic_note(detail, evidence)
    return {"status": status, "detail": detail, "evidence": evidence, "fixed_matches": fixed_matches}


def _quoted(entry: str) -> str:
    """``name (how)`` as `` `name` (how)``."""
    name, _, how = entry.partition(" (")
    return f"`{name}`" + (f" ({how}" if how else "")


def synthetic_note(detail: str, evidence: dict) -> tuple[str, dict]:
    """The detail and evidence with what the programs made up by use (stand-ins for names of modules
    the child cannot import, sizes chosen from the shape of a name) named; the records are reset."""
    if capture.stood_in:
        said = "; ".join(
            f"{', '.join(_quoted(n) for n in names)} ({origin})" for origin, names in capture.stood_in.items()
        )
        detail += f" [stand-ins for what cannot be imported: {said}]"
        evidence = {**evidence, "stand_ins": {o: list(n) for o, n in capture.stood_in.items()}}
    if capture.sized_by_pattern:
        said = ", ".join(f"`{n}` = {v!r}" for n, v in capture.sized_by_pattern.items())
        detail += f" [settings not in the file, chosen by name or use: {said}]"
        evidence = {**evidence, "sized_by_name": dict(capture.sized_by_pattern)}
    if capture.entry:
        detail += note_text(capture.entry)
    capture.stood_in.clear()
    capture.sized_by_pattern.clear()
    capture.entry.clear()
    return detail, evidence


def not_executable(detail: str) -> dict:
    return result("not-executable", detail, {})


def note_text(notes: list[str]) -> str:
    """The probe's notes (what the harness assumed) as the bracketed tail of a detail."""
    return f" [{'; '.join(notes)}]" if notes else ""


@dataclass(frozen=True)
class FixWording:
    """How a driver words the fixed variant's outcome. Format fields: ``{failure}`` (the exception),
    ``{stripped}`` (the same without a final period), ``{max_rel}``, and any the driver passes."""

    raises: str
    matches: str
    differs: str

    @classmethod
    def max_rel(cls, label: str, raises: str | None = None) -> FixWording:
        """``<label>: max rel R (matches)`` / ``(still differs)``; ``<label> it raises X``."""
        return cls(
            raises or f"{label} it raises {{failure}}",
            f"{label}: max rel {{max_rel}} (matches)",
            f"{label}: max rel {{max_rel}} (still differs)",
        )


@dataclass(frozen=True)
class FixedOutcome:
    evidence: dict  # the evidence's ``fixed_vs_reference``
    text: str  # a clause for the detail
    matches: bool


def fixed_raised(failure: str, wording: FixWording) -> FixedOutcome:
    text = wording.raises.format(failure=failure, stripped=failure.rstrip("."))
    return FixedOutcome({"exception": failure}, text, False)


def fixed_compared(numbers: dict, matches: bool, wording: FixWording, **say: str) -> FixedOutcome:
    """``numbers`` are the ``evidence_numbers`` of the fix vs the reference."""
    text = (wording.matches if matches else wording.differs).format(max_rel=numbers["max_rel"], **say)
    return FixedOutcome(numbers, text, matches)


def worst_of(cmps: list[dict]) -> tuple[dict, bool]:
    """The worse of several comparisons of the same two runs, and whether all of them match."""
    return reduce(worse, cmps), all(c["match"] for c in cmps)


def fixed_outcome(
    runs: dict, failures: dict[str, str], keys: tuple[str, ...], tol: Tolerance, wording: FixWording
) -> FixedOutcome | None:
    """The fixed variant vs the reference on the run fields ``keys``; None without a fixed variant."""
    if "fixed" in failures:
        return fixed_raised(failures["fixed"], wording)
    if "fixed" not in runs:
        return None
    worst, ok = worst_of([compare(runs["fixed"][k], runs["reference"][k], tol) for k in keys])
    return fixed_compared(evidence_numbers(worst), ok, wording)


def reference_evidence(cmp: dict, tol: Tolerance, fixed: FixedOutcome | None, **more) -> dict:
    """The evidence of one probe: as written vs reference, the tolerance, ``more``, then the fix."""
    ev = {"as_written_vs_reference": evidence_numbers(cmp), "tolerance": tol.as_evidence(), **more}
    if fixed is not None:
        ev["fixed_vs_reference"] = fixed.evidence
    return ev


def verdict(
    confirmed: bool, detail: str, evidence: dict, fixed: FixedOutcome | None, notes: list[str]
) -> dict:
    """``confirmed`` or ``not-reproduced``, the fix's clause and the notes appended to ``detail``."""
    text = detail + (f"; {fixed.text}" if fixed else "") + note_text(notes)
    status = "confirmed" if confirmed else "not-reproduced"
    return result(status, text, evidence, fixed_matches=bool(fixed and fixed.matches))
