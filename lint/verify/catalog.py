"""Probes for the rest of the catalog: loss-scaling order (TL102-TL104), accumulation (TL302, TL303) and
data parallelism (TL501, TL502). TL204 lives with the other checkpoint probes in ``probes.py``.

Each probe cuts the user's loop statements out of the file (``loops.build_loop``) and runs them as
written, in the documented order (the reference) and with the rule's fix where it has one.
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from trainlint.evidence import in_loop, innermost_loop
from trainlint.model import Site, attr_name, dotted, exclusive, receiver
from trainlint.verify.context import ProbeContext, TextEdit, insert_after, insert_before, replace_node
from trainlint.verify.loops import LoopWindow, build_loop
from trainlint.verify.source import NotExecutable, call_site_at

UPDATE_WITHOUT_STEP = "No inf checks were recorded prior to update"
UNSCALED_TWICE = "unscale_() has already been called on this optimizer since the last update()"


def _related(ctx: ProbeContext, part: str) -> Site:
    from trainlint.verify.probes import _call_at_related

    return _call_at_related(ctx, part)


def _flagged(ctx: ProbeContext, method: str) -> Site:
    return call_site_at(ctx.model, ctx.finding, lambda s: attr_name(s.node) == method)  # type: ignore[arg-type]


def _backward_for(ctx: ProbeContext, site: Site, kinds=("scaled_backward",)) -> Site:
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


def _small_statement(ctx: ProbeContext, site: Site) -> cst.BaseSmallStatement:
    """The expression statement that is exactly this call (``scaler.step(opt)`` on its own)."""
    statement = site.statement
    if isinstance(statement, cst.SimpleStatementLine):
        for small in statement.body:
            if isinstance(small, cst.Expr) and small.value is site.node:
                return small
    line = ctx.model.position(site.node).start.line
    raise NotExecutable(f"the call on line {line} is not a statement of its own")


def _loop_probe(
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


# --------------------------------------------------------------------------------------------------
# TL102: optimizer.step() after a scaled backward


def tl102(ctx: ProbeContext) -> dict[str, Any]:
    """The loop as written (``optimizer.step()`` on scaled gradients) vs ``scaler.step(optimizer)``
    with an ``update()``; the last iterations' loss overflows under the loss scale, as fp16 gradients
    do when the scale is too large: ``scaler.step`` skips that step, a direct step applies it."""
    model = ctx.model
    step = _flagged(ctx, "step")
    backward = _related(ctx, "scaled backward")
    training = model.training
    scaler_key = next(
        (e.key for e in training.events_in(backward.scope, "scaled_backward") if e.site is backward), None
    )
    optimizer = dotted(receiver(step.node))  # type: ignore[arg-type]
    if not scaler_key or not optimizer:
        raise NotExecutable("the scaler or the optimizer is not a plain name")
    updates = [
        e
        for e in training.events_in(step.scope, "update")
        if e.key == scaler_key and e.order > step.order and not exclusive(e.site.frames, step.frames)
    ]
    call = step.node
    assert isinstance(call, cst.Call)
    args = [optimizer, *(model.code(a) for a in call.args)]
    documented = f"{scaler_key}.step({', '.join(args)})"
    if not updates:
        _small_statement(ctx, step)
        documented += f"; {scaler_key}.update()"
    window = build_loop(ctx, step, backward, [])
    variants = {
        "reference": [replace_node(model, call, documented)],
        "as_written": [],
    }
    if ctx.finding.fix is not None:
        variants["fixed"] = ctx.fix_edits()
    probe = _loop_probe(window, variants, expect=(UPDATE_WITHOUT_STEP,), overflow=True)
    return probe


# --------------------------------------------------------------------------------------------------
# TL103: scaler.update() on every micro-step


def tl103(ctx: ProbeContext) -> dict[str, Any]:
    """The loop as written vs ``update()`` moved right after ``scaler.step`` under the accumulation
    condition; an enabled scaler raises on the first micro-step that has nothing to update."""
    model = ctx.model
    update = _flagged(ctx, "update")
    step = _related(ctx, "scaler.step")
    backward = _backward_for(ctx, update)
    window = build_loop(ctx, update, backward, [step])
    small = _small_statement(ctx, step)
    variants = {
        "reference": [
            replace_node(model, update.node, "None"),
            insert_after(model, small, f"; {model.code(update.node)}"),
        ],
        "as_written": [],
    }
    return _loop_probe(window, variants, expect=(UPDATE_WITHOUT_STEP,))


# --------------------------------------------------------------------------------------------------
# TL104: unscale_ twice before update()


def tl104(ctx: ProbeContext) -> dict[str, Any]:
    """The loop as written vs one ``unscale_`` per ``update()``: the second call raises the documented
    RuntimeError when the scaler is enabled."""
    model = ctx.model
    unscale = _flagged(ctx, "unscale_")
    backward = _backward_for(ctx, unscale)
    try:
        first = _related(ctx, "first unscale_")
    except NotExecutable:
        first = None
    if first is not None:
        window = build_loop(ctx, unscale, backward, [first])
        variants = {"reference": [replace_node(model, unscale.node, "None")], "as_written": []}
        if ctx.finding.fix is not None:
            variants["fixed"] = ctx.fix_edits()
        return _loop_probe(window, variants, expect=(UNSCALED_TWICE,))
    # every micro-step: the documented order unscales once, right before the step
    update = _related(ctx, "update under the accumulation condition")
    training = model.training
    steps = [
        e.site
        for e in training.events_in(unscale.scope, "scaler_step")
        if e.key == dotted(receiver(unscale.node))
        and not exclusive(e.site.frames, update.frames)  # type: ignore[arg-type]
        and innermost_loop(e.site) is not None
        and in_loop(e.site, innermost_loop(unscale))  # type: ignore[arg-type]
    ]
    if not steps:
        raise NotExecutable("no `scaler.step(...)` in the loop of the flagged `unscale_`")
    small = _small_statement(ctx, steps[0])
    window = build_loop(ctx, unscale, backward, [update, steps[0]])
    variants = {
        "reference": [
            replace_node(model, unscale.node, "None"),
            insert_before(model, small, f"{model.code(unscale.node)}; "),
        ],
        "as_written": [],
    }
    return _loop_probe(window, variants, expect=(UNSCALED_TWICE,))


# --------------------------------------------------------------------------------------------------
# TL303: zero_grad() on every micro-step


def tl303(ctx: ProbeContext) -> dict[str, Any]:
    """The loop as written vs ``zero_grad()`` moved right after the step under the accumulation
    condition: compares the gradient each optimizer step applies (the accumulated window vs only the
    last microbatch)."""
    model = ctx.model
    zero = _flagged(ctx, "zero_grad")
    step = _related(ctx, "the optimizer steps here")
    backward = _backward_for(ctx, step, kinds=("scaled_backward", "backward"))
    window = build_loop(ctx, zero, backward, [step])
    small = _small_statement(ctx, step)
    variants = {
        "reference": [
            replace_node(model, zero.node, "None"),
            insert_after(model, small, f"; {model.code(zero.node)}"),
        ],
        "as_written": [],
    }
    return _loop_probe(window, variants)


# --------------------------------------------------------------------------------------------------
# TL302: a running total that keeps every iteration's graph

GRAPH_ITERATIONS = 6


def _statement_site(ctx: ProbeContext) -> Site:
    """The site of the flagged addition (``total += loss``, ``total = total + loss``, an append)."""
    from trainlint.verify.source import finding_span, node_span

    span = finding_span(ctx.finding)
    model = ctx.model
    for site in (*model.augassigns, *model.assigns, *model.calls):
        if node_span(model, site.node) == span:
            return site
    raise NotExecutable(f"the flagged statement at line {ctx.finding.line} was not found")


def _added_expression(site: Site) -> cst.BaseExpression:
    node = site.node
    if isinstance(node, cst.AugAssign):
        return node.value
    if isinstance(node, cst.Assign) and isinstance(node.value, cst.BinaryOperation):
        target = dotted(node.targets[0].target)
        left, right = node.value.left, node.value.right
        return right if dotted(left) == target else left
    if isinstance(node, cst.Call) and node.args:
        return node.args[0].value
    raise NotExecutable("the flagged statement adds no value the probe can find")


def tl302(ctx: ProbeContext) -> dict[str, Any]:
    """The loop as written vs the same loop with the added loss detached; counts the autograd nodes
    that are still reachable from the program's variables after each iteration."""
    model = ctx.model
    site = _statement_site(ctx)
    backward = _related(ctx, "backpropagated here")
    added = _added_expression(site)
    window = build_loop(ctx, site, backward, [], iterations=GRAPH_ITERATIONS)
    variants = {
        "reference": [replace_node(model, added, f"({model.code(added)}).detach()")],
        "as_written": [],
    }
    programs = {name: window.render(edits, census=True) for name, edits in variants.items()}
    statement = model.code(site.node).strip().splitlines()[0]
    return {
        "driver": "graph",
        "programs": programs,
        "notes": list(window.notes),
        "total_label": f"`{statement}`",
    }


# --------------------------------------------------------------------------------------------------
# TL501 / TL502: data parallelism on a real two-process gloo group


def tl501(ctx: ProbeContext) -> dict[str, Any]:
    """The accumulation loop on a DistributedDataParallel stand-in over two processes: gradient
    all-reduces per optimizer step as written vs with synchronisation only on the microbatch before
    each step (what ``no_sync`` on the others gives), and the gradients applied."""
    from trainlint.rules.distributed import _ddp_models

    model = ctx.model
    backward = call_site_at(model, ctx.finding, lambda s: (attr_name(s.node) or "").endswith("backward"))  # type: ignore[arg-type]
    step = _related(ctx, "the optimizer steps")
    window = build_loop(ctx, step, backward, [], model_expr="__tl_ddp__")
    roles = {key: "__tl_ddp__" for key in _ddp_models(model)}
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
    from trainlint.verify.probes import (
        Binder,
        _division_at,
        _library_callable,
        _model_call_mode,
        _model_calls,
        division_statements,
        indent,
        loss_target,
        token_lines,
    )
    from trainlint.verify.source import analyse_names
    from trainlint.verify.window import window_code

    model = ctx.model
    division = _division_at(ctx)
    scope = division.site.scope
    stmt, regions, blank = division_statements(ctx, division)
    divisor = model.code(division.divisor)
    fixed_edit = replace_node(model, division.divisor, f"(__tl__.global_count({divisor}) / __tl__.WORLD)")
    recorded = replace_node(model, division.divisor, f"__tl__.record('tokens', {divisor})")
    windows = {
        "as_written": window_code(model.source, regions, [*blank, recorded]),
        "fixed": window_code(model.source, regions, [*blank, fixed_edit]),
        "reference": window_code(model.source, regions, blank),
    }
    parsed = cst.parse_module(windows["as_written"])
    callers = [c for c in _model_calls(parsed) if not _library_callable(model, scope, c)]
    if not callers:
        raise NotExecutable("no model call on token data found before the division")
    target = loss_target(division, stmt)
    programs = {}
    notes: list[str] = []
    for name, window in windows.items():
        roles: dict[str, str] = {}
        for caller in callers:
            lm = f"__tl__.TinyLM({_model_call_mode(parsed, caller)!r})"
            roles[caller] = lm if name == "reference" else f"__tl__.ddp({lm})"
        names = analyse_names(window)
        per_rank = token_lines(names.free)
        bound = {line.split(" = ")[0] for line in per_rank}
        for n in names.free:
            if n in ("accelerator", "fabric", "engine", "model_engine") and n not in roles:
                roles[n] = "__tl__.Backward()"
            if n == "scaler" and n not in roles:
                roles[n] = "__tl__.scaler(enabled=False)"
        binder = Binder(model, scope, roles=roles)
        binder.bind([n for n in names.free if n not in bound and not n.startswith("__tl")], names.attrs)
        if name == "as_written":
            notes.extend(binder.notes)
        assert binder.carry is not None
        batch = "__tl__.all_ranks_batch()" if name == "reference" else "__tl__.rank_batch()"
        programs[name] = (
            "import torch as __tl_torch__\n"
            + binder.carry.code()
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
