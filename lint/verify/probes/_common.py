"""What the probes share: the flagged call, its backward, the probe dict of a loop window, the names
a wrap call binds, and where a window's edits fall."""

from __future__ import annotations

from typing import Any

import libcst as cst

from trainlint.model import Site, attr_name, dotted, exclusive, first_arg, in_loop, innermost_loop
from trainlint.verify.context import ProbeContext, TextEdit, insert_after, replace_node
from trainlint.verify.loops import LoopWindow
from trainlint.verify.source import NotExecutable, call_site_at


def flagged_call(ctx: ProbeContext, method: str) -> Site:
    return call_site_at(ctx.model, ctx.finding, lambda s: attr_name(s.node) == method)  # type: ignore[arg-type]


def backward_for(ctx: ProbeContext, site: Site, kinds=("scaled_backward",)) -> Site:
    """The backward of the loop (or function) that holds ``site``: the last one before it on the same
    path, else the first one after it in the same loop."""
    training = ctx.model.training
    loop = innermost_loop(site)
    candidates = [
        e.site
        for e in training.events_in(site.scope, *kinds)
        if not exclusive(e.site.frames, site.frames) and (loop is None or in_loop(e.site, loop))
    ]
    if not candidates:
        raise NotExecutable("no backward call in the loop of the flagged call")
    before = [s for s in candidates if s.order < site.order]
    return before[-1] if before else candidates[0]


def small_statement(ctx: ProbeContext, site: Site) -> cst.BaseSmallStatement:
    """The expression statement that is exactly this call (``scaler.step(opt)`` on its own)."""
    statement = site.statement
    if isinstance(statement, cst.SimpleStatementLine):
        for small in statement.body:
            if isinstance(small, cst.Expr) and small.value is site.node:
                return small
    line = ctx.model.position(site.node).start.line
    raise NotExecutable(f"the call on line {line} is not a statement of its own")


def moved_after_step(ctx: ProbeContext, call: Site, step: Site) -> dict[str, list[TextEdit]]:
    """The variants of a call that runs on every micro-step: as written, and (the reference) the call
    moved right after the optimizer's step, so that it runs under the step's own condition."""
    model = ctx.model
    moved = insert_after(model, small_statement(ctx, step), f"; {model.code(call.node)}")
    return {"reference": [replace_node(model, call.node, "None"), moved], "as_written": []}


def loop_probe(
    window: LoopWindow,
    variants: dict[str, list[TextEdit]],
    *,
    expect: tuple[str, ...] = (),
    overflow: bool = False,
) -> dict[str, Any]:
    iterations = window.iterations
    overflow_at = None
    if overflow:
        overflow_at = iterations
        iterations += window.accumulation or 1
    programs = {
        name: window.render(edits, overflow=overflow_at, iterations=iterations)
        for name, edits in variants.items()
    }
    return {
        "driver": "loop",
        "programs": programs,
        "notes": list(window.notes),
        "iterations": iterations,
        "accumulation": window.accumulation,
        "expect": list(expect),
        "overflow_iteration": overflow_at,
    }


def assigned_name(statement: cst.CSTNode, value: cst.CSTNode) -> str | None:
    """The dotted name ``statement`` binds ``value`` to (``opt = Adam(...)``, ``self.model = FSDP(...)``)."""
    if isinstance(statement, cst.SimpleStatementLine):
        for small in statement.body:
            if isinstance(small, cst.Assign) and small.value is value and len(small.targets) == 1:
                return dotted(small.targets[0].target)
    return None


def wrap_names(ctx: ProbeContext, call: cst.Call) -> tuple[str | None, str | None]:
    """The module a wrap call (``DDP(model)``, ``FSDP(module=model)``) wraps and the name it binds the
    wrapper to, each None when it is not a name of its own."""
    return dotted(first_arg(call, "module")), assigned_name(ctx.tree.statement_of(call), call)


def edit_covers(edit: TextEdit, span: tuple[int, int, int, int]) -> bool:
    """``edit`` replaces text that holds all of ``span`` (line, column, end line, end column)."""
    return (edit.line, edit.column) <= span[:2] and span[2:] <= (edit.end_line, edit.end_column)
