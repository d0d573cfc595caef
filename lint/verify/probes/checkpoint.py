"""Probes of the activation-checkpoint rules (TL201-TL204): the function holding the checkpoint call
run as written vs with the plain call."""

from __future__ import annotations

import re
from typing import Any

import libcst as cst

from trainlint.model import FileModel, Site, keyword, positional, walk
from trainlint.model.training import CHECKPOINT_FUNCTIONS
from trainlint.rules.checkpoint.tl201_checkpoint_use_reentrant import CheckpointUseReentrant
from trainlint.rules.checkpoint.tl203_checkpoint_side_effect import CheckpointSideEffect
from trainlint.verify.context import ProbeContext, TextEdit, insert_after, insert_before, replace_node
from trainlint.verify.probes._entry import entry_path, entry_programs, find_entry
from trainlint.verify.source import (
    NotExecutable,
    call_site_at,
    node_span,
)

CHECKPOINT_KEYWORDS = frozenset(
    {"use_reentrant", "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop"}
)

HIT = "ckpt"
SYNTHETIC_FLOAT = re.compile(r'^(__tl_arg_\w+) = __tl__\.data\("float"\)$', re.MULTILINE)


# --------------------------------------------------------------------------------------------------
# TL201 / TL202: reentrant checkpoint


def _checkpoint_site(ctx: ProbeContext) -> Site:
    model = ctx.model
    # `checkpoint = get_checkpoint_fn()`: the rule labels the factory's return; the flagged call is
    # then a name bound to what it returns (no callee of its own)
    from_factory = any(r.label == CheckpointUseReentrant.FACTORY for r in ctx.finding.related)

    def accept(site: Site) -> bool:
        callee = model.callee(site)
        return (
            callee in CHECKPOINT_FUNCTIONS
            or callee == "functools.partial"
            or (from_factory and callee is None and isinstance(site.node.func, cst.Name))
        )

    return call_site_at(model, ctx.finding, accept)


def direct_call(model: FileModel, site: Site) -> str:
    """The checkpointed function called directly, without checkpoint (checkpoint's own keywords
    dropped): the reference."""
    call = site.node
    assert isinstance(call, cst.Call)
    callee = model.callee(site) or ""
    args = [a for a in call.args]
    if callee.endswith("checkpoint_sequential"):
        pos = positional(call)
        functions = (
            pos[0] if pos else (keyword(call, "functions").value if keyword(call, "functions") else None)
        )
        value = pos[2] if len(pos) > 2 else (keyword(call, "input").value if keyword(call, "input") else None)
        if functions is None or value is None:
            raise NotExecutable("checkpoint_sequential call without functions/input")
        return f"__tl__.sequential({model.code(functions)}, {model.code(value)})"
    fn = None
    rest: list[str] = []
    for arg in args:
        if arg.keyword is None and not arg.star and fn is None:
            fn = model.code(arg.value)
            continue
        if arg.keyword is not None and arg.keyword.value == "function" and fn is None:
            fn = model.code(arg.value)
            continue
        if arg.keyword is not None and arg.keyword.value in CHECKPOINT_KEYWORDS:
            continue
        prefix = f"{arg.keyword.value}=" if arg.keyword is not None else arg.star
        rest.append(prefix + model.code(arg.value))
    if fn is None:
        raise NotExecutable("checkpoint call without a function argument")
    return f"({fn})({', '.join(rest)})"


def _checkpoint_probe(ctx: ProbeContext, fixed: list[TextEdit] | None) -> dict[str, Any]:
    site = _checkpoint_site(ctx)
    model = ctx.model
    if model.callee(site) == "functools.partial":
        return _partial_probe(ctx, site, fixed)
    call = site.node
    wrap = [insert_before(model, call, f"__tl__.hit({HIT!r}, "), insert_after(model, call, ")")]
    variants = {
        "reference": [replace_node(model, call, f"__tl__.hit({HIT!r}, {direct_call(model, site)})")],
        "as_written": wrap,
    }
    if fixed:
        variants["fixed"] = [*fixed, *wrap]
    programs, roots, notes = entry_programs(ctx, site, variants)
    return {
        "driver": "grads",
        "programs": programs,
        "roots": roots,
        "hit_key": HIT,
        "call_label": f"the checkpoint call on line {model.position(call).start.line}",
        "notes": notes,
    }


def _returned_partial(ctx: ProbeContext, site: Site) -> str:
    """The name of the module-level function that returns ``functools.partial(checkpoint, ...)``
    (a factory the model calls to get its checkpoint function)."""
    model = ctx.model
    call = site.node
    assert isinstance(call, cst.Call)
    pos = positional(call)
    if not pos or not model.resolves_to(pos[0], site.scope, *CHECKPOINT_FUNCTIONS):
        raise NotExecutable("`functools.partial` on the flagged line does not bind torch's checkpoint")
    cls_name, func_name = entry_path(ctx, call)
    _, func = find_entry(model, (cls_name, func_name))
    scope = model.scope_for(func)
    for node in walk(func):
        if isinstance(node, cst.Return) and node.value is not None and scope is not None:
            values = [node.value, *model.values_of(node.value, scope)]
            if cls_name is None and any(v is call for v in values):
                return func_name
    raise NotExecutable(
        f"the checkpoint `functools.partial` on line {model.position(call).start.line} is not returned by "
        f"a module-level function: the probe applies what such a factory returns"
    )


def _partial_probe(ctx: ProbeContext, site: Site, fixed: list[TextEdit] | None) -> dict[str, Any]:
    """A factory returning ``functools.partial(checkpoint, ...)``: the program calls it and applies
    what it returns to a stand-in block (a Linear, then Dropout for TL204) on a synthetic input; the
    reference binds a plain call in place of checkpoint."""
    model = ctx.model
    call = site.node
    assert isinstance(call, cst.Call)
    factory = _returned_partial(ctx, site)
    wrap = [insert_before(model, call, f"__tl__.hit({HIT!r}, "), insert_after(model, call, ")")]
    variants = {
        "reference": [*wrap, replace_node(model, positional(call)[0], "__tl__.plain_checkpoint")],
        "as_written": wrap,
    }
    if fixed:
        variants["fixed"] = [*fixed, *wrap]
    programs, roots, notes = entry_programs(ctx, site, variants)
    random = ctx.finding.rule == "TL204"
    apply = (
        "__tl_factory__ = __tl_run__\n"
        f"stand_in_block = __tl__.place(__tl__.block({'dropout' if random else ''!r}))\n"
        "def __tl_run__():\n"
        "    return __tl_factory__()(stand_in_block, __tl__.data('float'))\n"
    )
    block = "a Linear, then Dropout(p=0.1)" if random else "a Linear"
    return {
        "driver": "rng" if random else "grads",
        "programs": {k: [p + apply for p in v] for k, v in programs.items()},
        "roots": [*roots, "stand_in_block"],
        "hit_key": HIT,
        "call_label": f"the checkpoint function `{factory}` returns",
        "notes": [
            *notes,
            f"what `{factory}` returns applied to a stand-in block ({block}) on a synthetic input",
        ],
    }


def tl201(ctx: ProbeContext) -> dict[str, Any]:
    """The checkpoint call as written (implicit reentrant default) vs the plain call, and the fix."""
    return _checkpoint_probe(ctx, ctx.fix_edits())


def tl202(ctx: ProbeContext) -> dict[str, Any]:
    """``use_reentrant=True`` as written vs the plain call, and ``use_reentrant=False``."""
    site = _checkpoint_site(ctx)
    arg = keyword(site.node, "use_reentrant")  # type: ignore[arg-type]
    fixed = [replace_node(ctx.model, arg.value, "False")] if arg is not None else None
    return _checkpoint_probe(ctx, fixed)


# --------------------------------------------------------------------------------------------------
# TL203: side effects repeated by recomputation


def _flagged_node(ctx: ProbeContext) -> cst.CSTNode:
    """The node the finding points at (exact span), preferring the outermost of equal spans."""
    span = (ctx.finding.line, ctx.finding.column, ctx.finding.end_line, ctx.finding.end_column)
    for node in walk(ctx.model.module):
        if (
            isinstance(node, cst.BaseExpression | cst.BaseSmallStatement)
            and node_span(ctx.model, node) == span
        ):
            return node
    raise NotExecutable(f"the flagged code at line {ctx.finding.line} was not found")


def _module_globals_in(model: FileModel, node: cst.CSTNode) -> list[str]:
    names = []
    for n in walk(node):
        if isinstance(n, cst.Name):
            bindings = model.module_scope.bindings.get(n.value, [])
            if any(b.kind == "assign" for b in bindings) and n.value not in names:
                names.append(n.value)
    return names


def _layer_effect_probe(ctx: ProbeContext) -> dict[str, Any]:
    """The checkpoint call itself is flagged: the layer it runs is a parameter whose forward (a class
    of another file) updates BatchNorm statistics. The layer becomes a stand-in with a counted
    BatchNorm; its inputs require grad (as an earlier layer's output does)."""
    model = ctx.model
    effect = next((r for r in ctx.finding.related if r.label == CheckpointSideEffect.EFFECT), None)
    where = f"{effect.path}, line {effect.line}" if effect else "another file"
    if effect is None or "BatchNorm" not in effect.message:
        what = effect.message if effect else "the side effect"
        raise NotExecutable(
            f"{what} ({where}) is in a layer of another file; the probe stands in only for BatchNorm statistics"
        )
    site = call_site_at(model, ctx.finding, lambda s: model.callee(s) in CHECKPOINT_FUNCTIONS)
    call = site.node
    assert isinstance(call, cst.Call)
    pos = positional(call)
    layer = model.code(pos[0]) if pos else ""
    if not layer.isidentifier():
        raise NotExecutable(f"the checkpointed layer `{layer}` is not a parameter the probe can stand in for")
    variants = {
        "reference": [replace_node(model, call, f"__tl__.hit({HIT!r}, {direct_call(model, site)})")],
        "as_written": [insert_before(model, call, f"__tl__.hit({HIT!r}, "), insert_after(model, call, ")")],
    }
    programs, roots, notes = entry_programs(ctx, site, variants)
    var = f"__tl_arg_{layer}"
    if not all(f"\n{var} = " in p for v in programs.values() for p in v):
        raise NotExecutable(
            f"the checkpointed layer `{layer}` is not a parameter of the function that holds it"
        )

    def stand_in(program: str) -> str:
        program = re.sub(
            rf"^{var} = .*$", f"{var} = __tl__.place(__tl__.block('batchnorm'))", program, flags=re.M
        )
        return SYNTHETIC_FLOAT.sub(r'\1 = __tl__.data("float").requires_grad_()', program)

    line = model.position(call).start.line
    return {
        "driver": "side_effects",
        "programs": {k: [stand_in(p) for p in v] for k, v in programs.items()},
        "roots": [*roots, *([] if var in roots else [var])],
        "counters": {"effect": f"the BatchNorm of a stand-in for `{layer}` (as at {where})"},
        "reference_label": "without checkpoint",
        "watch": [],
        "hit_key": HIT,
        "call_label": f"the checkpoint call on line {line}",
        "notes": [
            *notes,
            f"`{layer}` stood in by a Linear, then BatchNorm; the synthetic inputs require grad",
        ],
    }


def tl203(ctx: ProbeContext) -> dict[str, Any]:
    """One forward+backward with the checkpoint as written vs the plain call; counts how often the
    flagged statement runs and compares module state afterwards."""
    if not any(r.label == CheckpointSideEffect.CHECKPOINT for r in ctx.finding.related):
        return _layer_effect_probe(ctx)
    site = ctx.related(CheckpointSideEffect.CHECKPOINT)
    model = ctx.model
    call = site.node
    effect = _flagged_node(ctx)
    if isinstance(effect, cst.BaseExpression):
        # counted before it runs: recomputation may stop early inside it (non-reentrant early stop)
        counter = [
            insert_before(model, effect, "(__tl__.count('effect'), "),
            insert_after(model, effect, ")[1]"),
        ]
    else:
        counter = [insert_before(model, effect, "__tl__.count('effect'); ")]
    wrap = [insert_before(model, call, f"__tl__.hit({HIT!r}, "), insert_after(model, call, ")")]
    # the reference runs without any checkpoint in the function that holds the flagged call
    holder = entry_path(ctx, call)
    _, entry = find_entry(model, holder)
    inside = {id(n) for n in walk(entry)}
    others = [
        replace_node(model, other.node, direct_call(model, other))
        for other in model.calls_to(*CHECKPOINT_FUNCTIONS)
        if other is not site
        and id(other.node) in inside
        and not _contains_node(other.node, call)
        and not _contains_node(call, other.node)
    ]
    variants = {
        "reference": [
            *counter,
            *others,
            replace_node(model, call, f"__tl__.hit({HIT!r}, {direct_call(model, site)})"),
        ],
        "as_written": [*counter, *wrap],
    }
    overlap = model.position(effect)
    call_pos = model.position(call)
    if (call_pos.start.line, call_pos.start.column) <= (overlap.start.line, overlap.start.column) and (
        overlap.end.line,
        overlap.end.column,
    ) <= (call_pos.end.line, call_pos.end.column):
        # the side effect sits inside the checkpoint call (a lambda): edit the call's text instead
        variants = _lambda_variants(ctx, site, effect)
    programs, roots, notes = entry_programs(ctx, site, variants)
    line = model.position(effect).start.line
    return {
        "driver": "side_effects",
        "programs": programs,
        "roots": roots,
        "counters": {"effect": f"the statement on line {line}"},
        "reference_label": "without checkpoint",
        "watch": _module_globals_in(model, effect),
        "hit_key": HIT,
        "call_label": f"the checkpoint call on line {call_pos.start.line}",
        "notes": notes,
    }


def _contains_node(outer: cst.CSTNode, inner: cst.CSTNode) -> bool:
    return any(n is inner for n in walk(outer))


def _lambda_variants(ctx: ProbeContext, site: Site, effect: cst.CSTNode) -> dict[str, list[TextEdit]]:
    model = ctx.model
    call = site.node
    assert isinstance(call, cst.Call)
    call_code = model.code(call)
    effect_code = model.code(effect)
    counted_effect = f"(__tl__.count('effect'), {effect_code})[1]"
    counted = call_code.replace(effect_code, counted_effect, 1)
    direct = direct_call(model, site).replace(effect_code, counted_effect, 1)
    return {
        "reference": [replace_node(model, call, f"__tl__.hit({HIT!r}, {direct})")],
        "as_written": [replace_node(model, call, f"__tl__.hit({HIT!r}, {counted})")],
    }


# --------------------------------------------------------------------------------------------------
# TL204: checkpoint without the RNG state


def tl204(ctx: ProbeContext) -> dict[str, Any]:
    """The checkpoint call with ``preserve_rng_state=False`` as written vs the plain call, and with the
    RNG state preserved (the argument set to its default, ``True``)."""
    site = _checkpoint_site(ctx)
    arg = keyword(site.node, "preserve_rng_state")  # type: ignore[arg-type]
    if arg is None:
        raise NotExecutable("the checkpoint call has no `preserve_rng_state` argument")
    probe = _checkpoint_probe(ctx, [replace_node(ctx.model, arg.value, "True")])
    probe["driver"] = "rng"
    return probe
