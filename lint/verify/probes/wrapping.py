"""Probe of TL507 (wrapped-model-bypassed): the user's training loop on a real two-process gloo group,
with the module the rule names bound to a tiny model and the name it was wrapped under bound to a real
``DistributedDataParallel`` over that same model. Each rank takes its own batches; after the loop the
child compares the two ranks' parameters.

The loss is built as every loop probe builds it (``__tl__.micro_loss`` where the file computes it), over
the module that the file's loss really goes through: the bypassed module when the flagged call feeds the
loss with autograd recording, the wrapper otherwise (a call under ``torch.no_grad()`` or whose result
the loss never reads, which leaves training to the wrapper). The module inside the wrapper reached by
its ``.module`` (``ddp.module(x)``, or a name assigned from it) is the real wrapper's ``.module``, so
that the attribute DDP itself provides is what bypasses it. The fixed variant calls the wrapper.
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from trainlint.model import FileModel, Site, dotted, grad_disabled, in_loop, innermost_loop, walk
from trainlint.rules.distributed.tl507_wrapped_model_bypassed import WrappedModelBypassed
from trainlint.verify.context import ProbeContext, replace_node
from trainlint.verify.loops import LoopWindow, build_loop
from trainlint.verify.probes._common import edit_covers, wrap_names
from trainlint.verify.source import NotExecutable, call_site_at, node_span

# The module each variant's loss goes through; the loop window is built over this placeholder name.
LOSS_MODULE = "__tl_loss_module__"
INNER, WRAPPER = "__tl_model__", "__tl_ddp__"


def tl507(ctx: ProbeContext) -> dict[str, Any]:
    """The loop as written (the loss through the module it really goes through) vs the same loop with
    the flagged call made through the wrapper, on two ranks with different batches: do the ranks'
    parameters still agree after the loop?"""
    model = ctx.model
    flagged = call_site_at(model, ctx.finding)
    wrap = ctx.related(WrappedModelBypassed.WRAP)
    call, wrap_call = flagged.node, wrap.node
    assert isinstance(call, cst.Call) and isinstance(wrap_call, cst.Call)
    inner, outer = wrap_names(ctx, wrap_call)
    callee = dotted(call.func)
    if inner is None or outer is None or callee is None:
        raise NotExecutable("the wrapped module or the wrapper is not bound to a name of its own")
    # the rule reports the wrapped module by its own name, else the wrapper's `.module` (or a name
    # assigned from it): the module the real wrapper holds
    bypassed = INNER if callee == inner else None if callee == outer else f"{WRAPPER}.module"
    backward = _loop_backward(model, flagged)
    # built around the backward: a forward whose result only fed the replaced loss is then dropped
    window = build_loop(ctx, backward, backward, [], model_expr=LOSS_MODULE)
    feeds = bypassed is not None and _feeds_loss(model, flagged, window)
    notes = [
        f"`{inner}` is a tiny model and `{outer}` a DistributedDataParallel over it (gloo, 2 CPU processes, "
        "a different batch on each rank)"
    ]
    roles = {inner: INNER, outer: WRAPPER}
    if bypassed is not None and callee != inner:
        alias = callee != f"{outer}.module"
        named = f"`{outer}.module`, " if alias else ""
        notes.append(f"`{callee}` is {named}the module inside the DistributedDataParallel")
        if alias:  # a name assigned from it: the same object
            roles[callee] = bypassed
    if bypassed is not None and not feeds:
        notes.append(
            f"`{callee}(...)` does not feed the loss with autograd on: the loss goes through `{outer}`"
        )
    setup = [f"{WRAPPER} = __tl__.ddp({INNER})"]
    # the flagged call itself, where it is still in the window, goes through the wrapper too
    fix = [] if _replaced(model, flagged, window) else [replace_node(model, call.func, outer)]
    programs = {
        "as_written": window.render(
            [], roles=roles, setup=[*setup, f"{LOSS_MODULE} = {bypassed if feeds else WRAPPER}"]
        ),
        "fixed": window.render(fix, roles=roles, setup=[*setup, f"{LOSS_MODULE} = {WRAPPER}"]),
    }
    notes.extend(n for n in window.notes if n not in notes)
    return {"driver": "ddp_bypass", "programs": programs, "notes": notes, "iterations": window.iterations}


def _loop_backward(model: FileModel, flagged: Site) -> Site:
    """The backward of the flagged call's loop (the one the rule saw in the same function)."""
    loop = innermost_loop(flagged)
    for event in model.training.events_in(flagged.scope, "backward", "scaled_backward"):
        if loop is None or in_loop(event.site, loop):
            return event.site
    raise NotExecutable("no backward call in the loop of the flagged call")


def _feeds_loss(model: FileModel, flagged: Site, window: LoopWindow) -> bool:
    """The flagged call's result reaches the loss with autograd recording: the call is inside the loss
    expression the window replaced, or it assigns a name that expression reads."""
    if grad_disabled(model, flagged):
        return False
    losses = [e for e in window.common if "micro_loss(" in e.content]
    if any(edit_covers(e, node_span(model, flagged.node)) for e in losses):
        return True
    spans = [(e.line, e.column, e.end_line, e.end_column) for e in losses]
    replaced = [n for n in walk(flagged.scope.node) if node_span_or_none(model, n) in spans]
    read = {n.value for node in replaced for n in walk(node) if isinstance(n, cst.Name)}
    return bool(_assigned_names(flagged) & read)


def _replaced(model: FileModel, flagged: Site, window: LoopWindow) -> bool:
    """The flagged call is gone from the window: inside an edited span (the loss, a dropped
    assignment) or outside the window's lines."""
    here = node_span(model, flagged.node)
    if any(edit_covers(e, here) for e in window.common):
        return True
    return not any(r.start <= here[0] and here[2] <= r.end for r in window.regions)


def node_span_or_none(model: FileModel, node: cst.CSTNode) -> tuple[int, int, int, int] | None:
    try:
        return node_span(model, node)
    except KeyError:  # whitespace and other nodes without a position
        return None


def _assigned_names(flagged: Site) -> set[str]:
    """Names the flagged call's statement binds (``y_hat = model(x)``, ``logits, loss = model(x)``)."""
    statement = flagged.statement
    out: set[str] = set()
    if isinstance(statement, cst.SimpleStatementLine):
        for small in statement.body:
            targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else []
            if isinstance(small, cst.AnnAssign | cst.AugAssign):
                targets = [small.target]
            for target in targets:
                out.update(n.value for n in walk(target) if isinstance(n, cst.Name))
    return out
