"""Probes of the data-parallel rules (TL501, TL502), run on a real two-process gloo group."""

from __future__ import annotations

from typing import Any

from trainlint.model import is_backward_call
from trainlint.model.training import ddp_models
from trainlint.rules.distributed.tl501_ddp_accumulation_without_no_sync import DdpAccumulationWithoutNoSync
from trainlint.verify.context import ProbeContext, replace_node
from trainlint.verify.loops import build_loop
from trainlint.verify.probes._tokens import (
    division_at,
    division_statements,
    loss_target,
    token_callers,
    token_window_binder,
)
from trainlint.verify.source import call_site_at, indent
from trainlint.verify.window import (
    window_code,
)


def tl501(ctx: ProbeContext) -> dict[str, Any]:
    """The accumulation loop on a DistributedDataParallel stand-in over two processes: gradient
    all-reduces per optimizer step as written vs with synchronisation only on the microbatch before
    each step (what ``no_sync`` on the others gives), and the gradients applied."""
    model = ctx.model
    backward = call_site_at(model, ctx.finding, lambda s: is_backward_call(s.node))  # type: ignore[arg-type]
    step = ctx.related(DdpAccumulationWithoutNoSync.STEP)
    window = build_loop(ctx, step, backward, [], model_expr="__tl_ddp__")
    roles = {key: "__tl_ddp__" for key in ddp_models(model)}
    scaled = [key for key, value in window.roles.items() if value.startswith("__tl__.scaler(")]
    for key in scaled:  # loss scaling does not change how often gradients are all-reduced
        if window.roles[key] != "__tl__.scaler(enabled=True)":
            roles[key] = "__tl__.scaler(enabled=True)"
            window.notes.append(
                f"`{key}` runs enabled (loss scaling does not change the number of all-reduces)"
            )
    program = window.render([], roles=roles, setup=["__tl_ddp__ = __tl__.ddp(__tl_model__)"])
    notes = list(window.notes)
    notes.append("DistributedDataParallel built over the tiny model on CPU (gloo)")
    return {
        "driver": "ddp_sync",
        "programs": {"as_written": program, "reference": program},
        "notes": notes,
        "iterations": window.iterations,
        "accumulation": window.accumulation,
    }


def tl502(ctx: ProbeContext) -> dict[str, Any]:
    """Each rank's own batch (different numbers of valid tokens) through the user's loss code and
    division under DistributedDataParallel vs one process over every rank's batch (the global token
    mean); the fix all-reduces the count and multiplies by the world size."""
    model = ctx.model
    division = division_at(ctx)
    scope = division.site.scope
    stmt, regions, blank, initial = division_statements(ctx, division, climb=True)
    divisor = model.code(division.divisor)
    fixed_edit = replace_node(model, division.divisor, f"(__tl__.global_count({divisor}) / __tl__.WORLD)")
    recorded = replace_node(model, division.divisor, f"__tl__.record('tokens', {divisor})")
    windows = {
        "as_written": window_code(model.source, regions, [*blank, recorded]),
        "fixed": window_code(model.source, regions, [*blank, fixed_edit]),
        "reference": window_code(model.source, regions, blank),
    }
    calls = token_callers(model, scope, windows["as_written"])
    callers = calls.callers
    target = loss_target(division, stmt)
    programs = {}
    notes: list[str] = []
    lms = calls.stand_ins(model, scope, notes)
    members = calls.members(model, scope, windows["as_written"], lms)
    notes.extend(members.notes)
    notes.extend(f"`{n}` starts at {v}, as before the loop" for n, v in initial.items())
    for name, window in windows.items():
        stand_ins = {c: lm if name == "reference" else f"__tl__.ddp({lm})" for c, lm in lms.items()}
        stand_ins.update(initial)
        binder, per_rank = token_window_binder(model, scope, window, stand_ins, members)
        if name == "as_written":
            notes.extend(binder.notes)
        assert binder.carry is not None
        batch = "__tl__.all_ranks_batch()" if name == "reference" else "__tl__.rank_batch()"
        programs[name] = (
            "import torch as __tl_torch__\n"
            + binder.carry.code()
            + members.code()
            + "__tl__.seed(0)\n"
            + "".join(line + "\n" for line in binder.lines)
            + f"for __tl_mb__ in [{batch}]:\n"
            + "".join(f"    {line}\n" for line in per_rank)
            + indent(window)
            + (f"    {target}.backward()\n" if target else "")
            + "__tl_modules__ = ["
            + ", ".join(callers)
            + "]\n"
        )
    return {"driver": "ddp_tokens", "programs": programs, "notes": notes}
