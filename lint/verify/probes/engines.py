"""Probe of TL504 (deepspeed-double-scaling): the user's loop, one accumulation window long, with the
engine bound to a real ``DeepSpeedEngine`` (ZeRO stage 0, the user's division kept) over a tiny model,
on the two-process gloo group; the reference removes the manual division and lets the engine divide.

DeepSpeed is not a dependency of trainlint: the child says ``not-executable`` when it cannot import
it. The engine is configured with the accumulation count the division uses (the file's value where
it has one), which is what makes the two divisions stack.

Where the division is the whole loss expression the loop builder replaces by its own loss
(``loss = outputs.loss / engine.gradient_accumulation_steps()``), the program as written divides that
loss by the file's divisor. Where it is in another function whose result the caller passes to the
engine's backward (Megatron's ``forward_step`` and ``backward_step``), the window is the backward's
function and the division is applied, with the file's divisor, to the loss it receives.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import libcst as cst

from trainlint.model import FileModel, Scope, Site, dotted, first_arg, keyword, receiver, switches_of, walk
from trainlint.model.vocab import DEEPSPEED_SWITCH
from trainlint.rules.distributed.tl504_deepspeed_double_scaling import DeepspeedDoubleScaling
from trainlint.verify.context import ProbeContext, TextEdit, insert_before, replace_node
from trainlint.verify.loops import LoopWindow, build_loop
from trainlint.verify.source import NotExecutable, call_site_at, node_span
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
    division, function = _division(ctx, backward)
    divisor = division.right if isinstance(division, cst.BinaryOperation) else division.value  # type: ignore[union-attr]
    scope = model.scope_for(function) if function is not None else backward.scope
    count, roles, notes = _divisor_roles(model, scope or backward.scope, engine, divisor)
    notes.append(
        f"`{engine}` is a DeepSpeed engine (ZeRO stage 0, SGD lr 0.1) over a tiny model with "
        f"gradient_accumulation_steps={count}, run for one accumulation window on 2 CPU processes (gloo)"
    )
    roles.update({engine: ENGINE, **_guard_roles(backward, notes)})
    window = build_loop(ctx, backward, backward, [], model_expr=ENGINE, iterations=count)
    if function is not None:
        written, reference = _split_variants(model, window, backward, division, notes)
    else:
        written, reference = _variants(model, window, division)
    scale = keyword(call, "scale_wrt_gas")
    if scale is not None:  # cut from the end of the argument before it
        index = list(call.args).index(scale)
        if index == 0:
            raise NotExecutable("`scale_wrt_gas=` comes before the loss in the backward call")
        reference[1].append(_cut(model, call.args[index - 1].value, scale))
    config = f'{{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": {count}, "zero_optimization": {{"stage": 0}}}}'
    setup = [
        f"{ENGINE} = __import__('deepspeed').initialize(model=__tl_model__, config={config}, "
        "optimizer=__tl_torch__.optim.SGD(__tl_model__.parameters(), lr=0.1))[0]"
    ]
    programs = {
        name: variant.render(edits, roles=roles, setup=setup)
        for name, (variant, edits) in (("as_written", written), ("reference", reference))
    }
    notes.extend(n for n in window.notes if n not in notes)
    return {"driver": "deepspeed_scaling", "programs": programs, "notes": notes, "accumulation": count}


Variant = tuple[LoopWindow, list[TextEdit]]


def _variants(model: FileModel, window: LoopWindow, division: cst.CSTNode) -> tuple[Variant, Variant]:
    """The window as written and (the reference) without the division: ``/ k`` cut after the left
    operand, or the whole ``loss /= k``. Where the division is the very expression the window
    replaced by its own loss, the program as written divides that loss by the file's divisor."""
    binary = isinstance(division, cst.BinaryOperation)
    cut = _cut(model, division.left, division.right) if binary else replace_node(model, division, "pass")
    inside = [e for e in window.common if _overlaps(model, division, e, cut if binary else None)]
    if not inside:
        return (window, []), (window, [cut])
    loss = inside[0]
    if (
        not binary
        or len(inside) > 1
        or (loss.line, loss.column, loss.end_line, loss.end_column) != node_span(model, division)
    ):
        raise NotExecutable(
            f"the division `{model.code(division)}` is part of the loss expression the probe replaces "
            "with its own loss"
        )
    # the probe's loss stands for the left operand: as written it is divided by the file's divisor
    divided = dataclasses.replace(loss, content=f"{loss.content} / ({model.code(division.right)})")
    others = [e for e in window.common if e is not loss]
    return (dataclasses.replace(window, common=[*others, divided]), []), (window, [])


def _split_variants(
    model: FileModel, window: LoopWindow, backward: Site, division: cst.CSTNode, notes: list[str]
) -> tuple[Variant, Variant]:
    """The backward's function (or its loop) is the window: the loss it receives divided first, as
    the other function (``forward_step``) divides what it returns; the reference leaves it undivided."""
    loss = first_arg(backward.node, "loss")  # type: ignore[arg-type]
    if not isinstance(division, cst.BinaryOperation) or not isinstance(loss, cst.Name):
        raise NotExecutable("the division in another function is not `value / count` of a loss name")
    statement = _window_statement(window, backward)
    column = model.position(statement).start.column
    text = f"{loss.value} = {loss.value} / ({model.code(division.right)})\n" + " " * column
    notes.append(
        f"`{model.code(division)}` (line {model.position(division).start.line}) divides the "
        f"`{loss.value}` that `{backward.scope.name}` receives: it is so divided before the engine's backward"
    )
    return (window, [insert_before(model, statement, text)]), (window, [])


def _window_statement(window: LoopWindow, site: Site) -> cst.CSTNode:
    """The statement of the window's body (the loop's, else the function's) that holds ``site``."""
    holder = window.loop.node if window.loop is not None else site.scope.node
    block = getattr(holder, "body", None)
    for statement in block.body if isinstance(block, cst.IndentedBlock) else ():
        if any(n is site.node for n in walk(statement)):
            return statement
    raise NotExecutable("the backward call is not a statement of the probe's window")


def _divisor_roles(
    model: FileModel, scope: Scope, engine: str, divisor: cst.BaseExpression
) -> tuple[int, dict[str, str], list[str]]:
    """The accumulation count the engine is configured with, and the roles that give the divisor
    that value where the program cannot compute it (a setting, ``get_num_microbatches()``, a config
    read as ``cfg["gradient_accumulation_steps"]``): the file's value where it has one, else 4."""
    text = model.code(divisor)
    head = divisor.func if isinstance(divisor, cst.Call) else divisor
    key = dotted(head)
    count, said = (
        accumulation_count(model, scope, divisor) if key or isinstance(divisor, cst.Integer) else (0, [])
    )
    if (key or "").startswith(f"{engine}."):  # the engine's own count: what it is configured with
        count, said = DEFAULT_COUNT, [f"`{text}` is the engine's own count, configured as {DEFAULT_COUNT}"]
    elif count < 2:
        count = DEFAULT_COUNT
        said = [f"`{text}` is only known at run time: {DEFAULT_COUNT} is used"]
    elif count > MAX_COUNT:  # any count of 2 or more shows the hazard: keep the window short
        said = [*said, f"`{text}` = {count} in the file, run with {MAX_COUNT}"]
        count = MAX_COUNT
    roles: dict[str, str] = {}
    if key and not key.startswith(f"{engine}."):
        roles[key] = f"(lambda *_, **__: {count})" if head is not divisor else str(count)
    config = _config_read(model, scope, divisor)
    if config is not None:
        base, field = config
        roles[base] = f"{{{field!r}: {count}}}"
        said.append(f"`{base}` is not built in the file: a dict with {field!r}: {count} stands for it")
    return count, roles, list(said)


def _config_read(model: FileModel, scope: Scope, divisor: cst.BaseExpression) -> tuple[str, str] | None:
    """(``cfg``, ``"gradient_accumulation_steps"``) for a divisor ``cfg["gradient_accumulation_steps"]``
    whose config the file never builds (it comes from a JSON file or the command line)."""
    if not (isinstance(divisor, cst.Subscript) and len(divisor.slice) == 1):
        return None
    index = divisor.slice[0].slice
    base = dotted(divisor.value)
    if not isinstance(index, cst.Index) or not isinstance(index.value, cst.SimpleString) or base is None:
        return None
    if model.values_of(divisor.value, scope) or ("." not in base and model.lookup(base, scope) is not None):
        return None
    field = index.value.evaluated_value
    return (base, field) if isinstance(field, str) else None


def _guard_roles(backward: Site, notes: list[str]) -> dict[str, str]:
    """The DeepSpeed switches whose branch holds the engine's backward (``if args.deepspeed:``, the
    ``else`` of ``if not self.use_deepspeed:``) set, so that the program takes that branch."""
    roles: dict[str, str] = {}
    for switch in switches_of(backward, DEEPSPEED_SWITCH):
        roles[switch.name] = "True"
        notes.append(f"`{switch.name}` is set: the branch with the engine's backward runs")
    return roles


def _division(ctx: ProbeContext, backward: Site) -> tuple[cst.CSTNode, cst.FunctionDef | None]:
    """The division the rule labelled (``loss / k`` or ``loss /= k``), found at its position, and the
    function that holds it when that is not the backward's own (None otherwise)."""
    model = ctx.model
    for rel in ctx.finding.related:
        if rel.label != DeepspeedDoubleScaling.DIVISION:
            continue
        for node in walk(model.module_scope.node):
            if isinstance(node, cst.BinaryOperation | cst.AugAssign):
                pos = model.position(node)
                if pos.start.line == rel.line and pos.start.column + 1 == rel.column:
                    own = any(n is node for n in walk(backward.scope.node))
                    return node, None if own else _function_of(model, node)
        raise NotExecutable(f"the division on line {rel.line} was not found in the file")
    raise NotExecutable("the finding has no division among its related locations")


def _function_of(model: FileModel, node: cst.CSTNode) -> cst.FunctionDef:
    """The innermost function that holds ``node``."""
    holders = [
        f
        for f in walk(model.module_scope.node)
        if isinstance(f, cst.FunctionDef) and any(n is node for n in walk(f))
    ]
    if not holders:
        raise NotExecutable("the division is outside any function, away from the engine's backward")
    return holders[-1]


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
