"""Probe of TL504 (deepspeed-double-scaling): the user's loop, one accumulation window long, with the
engine bound to a real ``DeepSpeedEngine`` (ZeRO stage 0, the user's division kept) over a tiny model,
on the two-process gloo group; the reference removes the manual division and lets the engine divide.

DeepSpeed is not a dependency of trainlint: the child says ``not-executable`` when it cannot import
it. The engine is configured with the accumulation count the division uses (the file's value where
it has one), which is what makes the two divisions stack.
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from trainlint.model import FileModel, Site, dotted, first_arg, keyword, receiver, walk
from trainlint.rules.distributed.tl504_deepspeed_double_scaling import DeepspeedDoubleScaling
from trainlint.verify.context import ProbeContext, TextEdit, replace_node
from trainlint.verify.loops import build_loop
from trainlint.verify.source import NotExecutable, call_site_at
from trainlint.verify.window import accumulation_count

ENGINE = "__tl_engine__"
DEFAULT_COUNT = 4  # when the divisor's value is only known at run time
MAX_COUNT = 8


def tl504(ctx: ProbeContext) -> dict[str, Any]:
    """One accumulation window through a real DeepSpeed engine as written vs without the manual
    division (and with the engine's own ``scale_wrt_gas`` default): the gradient each accumulates."""
    model = ctx.model
    backward = call_site_at(model, ctx.finding)
    call = backward.node
    assert isinstance(call, cst.Call)
    engine, loss = dotted(receiver(call)), first_arg(call, "loss")
    if engine is None or loss is None:
        raise NotExecutable("the engine or the loss of the backward call is not a name of its own")
    division = _division(ctx, backward)
    divisor = division.right if isinstance(division, cst.BinaryOperation) else division.value  # type: ignore[union-attr]
    notes: list[str] = []
    key = dotted(divisor)
    count, said = (
        accumulation_count(model, backward.scope, divisor)
        if key or isinstance(divisor, cst.Integer)
        else (0, [])
    )
    if count < 2:
        count = DEFAULT_COUNT
        said = [f"`{model.code(divisor)}` is only known at run time: {DEFAULT_COUNT} is used"]
    elif count > MAX_COUNT:  # any count of 2 or more shows the hazard: keep the window short
        said = [*said, f"`{model.code(divisor)}` = {count} in the file, run with {MAX_COUNT}"]
        count = MAX_COUNT
    notes.extend(said)
    notes.append(
        f"`{engine}` is a DeepSpeed engine (ZeRO stage 0, SGD lr 0.1) over a tiny model with "
        f"gradient_accumulation_steps={count}, run for one accumulation window on 2 CPU processes (gloo)"
    )
    window = build_loop(ctx, backward, backward, [], model_expr=ENGINE, iterations=count)
    # what the reference cuts (`/ k`, or the whole `loss /= k`) must be the file's own text in the window
    kept = _cut(model, division.left, division.right) if isinstance(division, cst.BinaryOperation) else None
    if any(_overlaps(model, division, e, kept) for e in window.common):
        raise NotExecutable(
            f"the division `{model.code(division)}` is part of the loss expression the probe replaces "
            "with its own loss"
        )
    roles = {engine: ENGINE}
    if key and not key.startswith(f"{engine}."):  # the engine's own count comes from the engine
        roles[key] = str(count)
    config = f'{{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": {count}, "zero_optimization": {{"stage": 0}}}}'
    setup = [
        f"{ENGINE} = __import__('deepspeed').initialize(model=__tl_model__, config={config}, "
        "optimizer=__tl_torch__.optim.SGD(__tl_model__.parameters(), lr=0.1))[0]"
    ]
    # the reference: the division and any `scale_wrt_gas=` cut out (the text after the left operand,
    # after the loss argument), so that the loss the window replaced keeps its own edit
    if isinstance(division, cst.BinaryOperation):
        reference = [_cut(model, division.left, division.right)]
    else:
        reference = [replace_node(model, division, "pass")]
    scale = keyword(call, "scale_wrt_gas")
    if scale is not None:  # cut from the end of the argument before it
        index = list(call.args).index(scale)
        if index == 0:
            raise NotExecutable("`scale_wrt_gas=` comes before the loss in the backward call")
        reference.append(_cut(model, call.args[index - 1].value, scale))
    programs = {
        "as_written": window.render([], roles=roles, setup=setup),
        "reference": window.render(reference, roles=roles, setup=setup),
    }
    notes.extend(n for n in window.notes if n not in notes)
    return {"driver": "deepspeed_scaling", "programs": programs, "notes": notes, "accumulation": count}


def _division(ctx: ProbeContext, backward: Site) -> cst.CSTNode:
    """The division the rule labelled (``loss / k`` or ``loss /= k``), found at its position."""
    for rel in ctx.finding.related:
        if rel.label != DeepspeedDoubleScaling.DIVISION:
            continue
        for node in walk(backward.scope.node):
            if isinstance(node, cst.BinaryOperation | cst.AugAssign):
                pos = ctx.model.position(node)
                if pos.start.line == rel.line and pos.start.column + 1 == rel.column:
                    return node
    for rel in ctx.finding.related:
        if rel.label == DeepspeedDoubleScaling.DIVISION:  # found by the rule in a caller's helper
            raise NotExecutable(
                f"the division (line {rel.line}) is in another function than the engine's backward: the"
                " probe runs the backward's own loop only"
            )
    raise NotExecutable("the finding has no division among its related locations")


def _cut(model: FileModel, after: cst.CSTNode, through: cst.CSTNode) -> TextEdit:
    """Delete the text from the end of ``after`` through the end of ``through``."""
    a, b = model.position(after), model.position(through)
    return TextEdit(a.end.line, a.end.column + 1, b.end.line, b.end.column + 1, "")


def _overlaps(model: FileModel, node: cst.CSTNode, edit: TextEdit, span: TextEdit | None) -> bool:
    """The window's ``edit`` touches ``span`` (default: the whole ``node``)."""
    if span is None:
        pos = model.position(node)
        span = TextEdit(pos.start.line, pos.start.column + 1, pos.end.line, pos.end.column + 1, "")
    start, end = (span.line, span.column), (span.end_line, span.end_column)
    return (edit.line, edit.column) < end and start < (edit.end_line, edit.end_column)
