"""Probes of the gradient-accumulation rules: the mean of token means (TL301), a running total that keeps
the graph (TL302), zero_grad() on every micro-step (TL303)."""

from __future__ import annotations

from typing import Any

import libcst as cst

from trainlint.model import (
    Site,
    attr_name,
    dotted,
    exclusive,
    in_loop,
    innermost_loop,
    int_value,
    receiver,
    split_lines,
    walk,
)
from trainlint.rules.accumulation.tl302_loss_accumulated_with_graph import LossAccumulatedWithGraph
from trainlint.rules.accumulation.tl303_zero_grad_every_microstep import ZeroGradEveryMicrostep
from trainlint.verify.context import ProbeContext, replace_node
from trainlint.verify.loops import build_loop
from trainlint.verify.probes._common import (
    backward_for,
    flagged_call,
    loop_probe,
    moved_after_step,
)
from trainlint.verify.probes._tokens import (
    division_at,
    division_statements,
    loss_target,
    token_callers,
    token_window_binder,
)
from trainlint.verify.source import (
    NotExecutable,
    analyse_names,
    finding_span,
    indent,
    node_span,
)
from trainlint.verify.window import (
    accumulation_count,
    window_code,
)

# --------------------------------------------------------------------------------------------------
# TL301: mean of per-microbatch token means


def tl301(ctx: ProbeContext) -> dict[str, Any]:
    """K microbatches with uneven valid-token counts through the user's loss code and division vs
    one big batch (K = 1); the fix weighs each microbatch by its share of the window's tokens."""
    model = ctx.model
    division = division_at(ctx)
    scope = division.site.scope
    stmt, regions, blank, _ = division_statements(ctx, division)
    k_value, notes = accumulation_count(model, scope, division.divisor)
    divisor_text = model.code(division.divisor)
    if k_value < 2:
        raise NotExecutable(f"the accumulation count `{divisor_text}` is {k_value}: nothing is accumulated")
    k_value = min(k_value, 16)
    weight = f"({model.code(division.dividend)}) * __tl__.token_weight()"
    if isinstance(division.node, cst.AugAssign):
        fixed_edit = replace_node(
            model, division.node, f"{model.code(division.dividend)} *= __tl__.token_weight()"
        )
    else:
        fixed_edit = replace_node(model, division.node, weight)
    # the accumulation count is the probe's: K microbatches as written, 1 for the big batch
    count = replace_node(model, division.divisor, "__tl_accum__")
    windows = {
        "as_written": window_code(model.source, regions, [*blank, count]),
        "reference": window_code(model.source, regions, [*blank, count]),
        "fixed": window_code(model.source, regions, [*blank, fixed_edit]),
    }
    calls = token_callers(model, scope, windows["as_written"])
    callers = calls.callers
    ignore = loss_ignore_index(calls.parsed) or loss_ignore_index(scope.node)
    if ignore is not None:
        notes.append(f"padding labels are {ignore}, the `ignore_index` of the file's loss")
    target = loss_target(division, stmt)
    stand_ins = calls.stand_ins(model, scope, notes)
    members = calls.members(model, scope, windows["as_written"], stand_ins)
    notes.extend(members.notes)
    programs = {}
    for name, window in windows.items():
        binder, per_micro = token_window_binder(model, scope, window, stand_ins, members)
        k_here = 1 if name == "reference" else k_value
        if name == "as_written":
            notes.extend(binder.notes)
        assert binder.carry is not None
        batches = f"__tl__.token_batches({k_value}{'' if ignore is None else f', ignore={ignore}'})"
        if name == "reference":
            batches = f"[__tl__.concat_batches({batches})]"
        loop = (
            "for __tl_micro__, __tl_mb__ in enumerate(__tl_batches__):\n"
            "    __tl__.begin_micro(__tl_micro__)\n"
            + "".join(f"    {line}\n" for line in per_micro)
            + indent(window)
            + (f"    {target}.backward()\n" if target else "")
        )
        program = (
            "import torch as __tl_torch__\n"
            + binder.carry.code()
            + members.code()
            + "__tl__.seed(0)\n"
            + "".join(line + "\n" for line in binder.lines)
            + f"__tl_accum__ = {k_here}\n"
            + f"__tl_batches__ = {batches}\n"
        )
        if name == "fixed":
            # a first pass counts the valid tokens each microbatch's loss averages over
            program += "__tl__.counting_pass(True)\n" + loop + "__tl__.counting_pass(False)\n"
            program += "".join(f"__tl__.zero_all({c})\n" for c in callers)
        program += loop
        program += "__tl_modules__ = [" + ", ".join(callers) + "]\n"
        programs[name] = program
    return {
        "driver": "accumulation",
        "programs": programs,
        "notes": notes,
        "microbatches": k_value,
    }


def loss_ignore_index(code: cst.CSTNode) -> int | None:
    """The ``ignore_index`` a loss in ``code`` (the window, else its function, where the loss may be
    built) is given as a literal, when it is not PyTorch's -100: the synthetic batches pad their
    labels with it (a loss that ignores -1 fed -100 would fail)."""
    for node in walk(code):
        if isinstance(node, cst.Arg) and node.keyword is not None and node.keyword.value == "ignore_index":
            value = int_value(node.value)
            if value is not None and value != -100:
                return value
    return None


# --------------------------------------------------------------------------------------------------
# TL302: a running total that keeps every iteration's graph


GRAPH_ITERATIONS = 6


def _statement_site(ctx: ProbeContext) -> Site:
    """The site of the flagged addition (``total += loss``, ``total = total + loss``, an append)."""
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


def _total_name(site: Site) -> str | None:
    node = site.node
    if isinstance(node, cst.AugAssign):
        target = node.target
        return dotted(target.value if isinstance(target, cst.Subscript) else target)  # ``totals[k] += v``
    if isinstance(node, cst.Assign):
        return dotted(node.targets[0].target)
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
        return dotted(node.func.value)  # losses.append(loss)
    return None


def _resets(model, site: Site, backward: Site) -> list[Site]:
    """Statements of the training loop (the innermost loop around the total that also holds the
    backward) that start the total afresh (``total = 0.0``): the window keeps them, so that a total
    reset on every iteration holds one iteration's graph, as it does when run."""
    name = _total_name(site)
    around = [f for f in site.frames if f.kind == "loop" and f.branch == "body" and in_loop(backward, f)]
    loop = around[-1] if around else innermost_loop(site)
    if name is None or loop is None:
        return []
    out = []
    for other in model.assigns:
        node = other.node
        if other is site or other.scope is not site.scope or not in_loop(other, loop):
            continue
        if (
            not isinstance(node, cst.Assign)
            or len(node.targets) != 1
            or dotted(node.targets[0].target) != name
        ):
            continue
        if name not in analyse_names(f"_ = {model.code(node.value)}\n").free:
            out.append(other)
    return out


def _detached(code: str) -> str:
    """``code`` with every tensor in it detached (a loss, or an output dict that holds one)."""
    leaf = "lambda __tl_t__: __tl_t__.detach() if isinstance(__tl_t__, __tl_torch__.Tensor) else __tl_t__"
    return f"__tl_torch__.utils._pytree.tree_map({leaf}, ({code}))"


def tl302(ctx: ProbeContext) -> dict[str, Any]:
    """The loop as written vs the same loop with the added loss detached; counts the autograd nodes
    that are still reachable from the program's variables after each iteration."""
    model = ctx.model
    site = _statement_site(ctx)
    backward = ctx.related(LossAccumulatedWithGraph.BACKWARD)
    added = _added_expression(site)
    window = build_loop(ctx, site, backward, _resets(model, site, backward), iterations=GRAPH_ITERATIONS)
    variants = {
        "reference": [replace_node(model, added, _detached(model.code(added)))],
        "as_written": [],
    }
    programs = {name: window.render(edits, census=True) for name, edits in variants.items()}
    statement = split_lines(model.code(site.node).strip())[0]
    return {
        "driver": "graph",
        "programs": programs,
        "notes": list(window.notes),
        "total_label": f"`{statement}`",
    }


# --------------------------------------------------------------------------------------------------
# TL303: zero_grad() on every micro-step


def tl303(ctx: ProbeContext) -> dict[str, Any]:
    """The loop as written vs ``zero_grad()`` moved right after the step under the accumulation
    condition: compares the gradient each optimizer step applies (the accumulated window vs only the
    last microbatch)."""
    zero = flagged_call(ctx, "zero_grad")
    step = ctx.related(ZeroGradEveryMicrostep.STEP)
    try:
        backward = backward_for(ctx, step, kinds=("scaled_backward", "backward"))
    except NotExecutable:
        backward = _manual_backward(ctx, step)
    window = build_loop(ctx, zero, backward, [step])
    variants = moved_after_step(ctx, zero, step)
    return loop_probe(window, variants)


def _manual_backward(ctx: ProbeContext, site: Site) -> Site:
    """Lightning's ``self.manual_backward(loss)`` in the step function of ``site`` (a
    ``training_step`` under manual optimization): the last one before it, else the first after."""
    loop = innermost_loop(site)
    candidates = [
        s
        for s in ctx.model.calls_in(site.scope)
        if attr_name(s.node) == "manual_backward"  # type: ignore[arg-type]
        and dotted(receiver(s.node)) == "self"  # type: ignore[arg-type]
        and not exclusive(s.frames, site.frames)
        and (loop is None or in_loop(s, loop))
    ]
    if not candidates:
        raise NotExecutable("no backward call in the loop of the flagged call")
    before = [s for s in candidates if s.order < site.order]
    return before[-1] if before else candidates[0]
