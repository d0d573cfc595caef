"""Probes: for one finding, the programs (as written, reference, fixed) that show whether it is real.

A rule names its probe with ``probe = "tl201"``; the function of that name here takes a
``ProbeContext`` and returns a probe dict for the child runtime (``driver`` plus one program per
variant), or raises ``NotExecutable`` with the reason.
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from trainlint.events import CHECKPOINT_FUNCTIONS, CLIP_FUNCTIONS, GRAD_SCALERS, first_arg, is_optimizer_class
from trainlint.model import FileModel, Site, attr_name, dotted, exclusive, keyword, positional, receiver, walk
from trainlint.verify.bind import Program, Synth, call_entry, constructor_call, required_conditions
from trainlint.verify.context import ProbeContext, TextEdit, insert_after, insert_before, replace_node
from trainlint.verify.source import Carry, NotExecutable, analyse_names, call_site_at, indent
from trainlint.verify.window import (
    Binder,
    Region,
    optimizer_construction,
    parameters_receivers,
    step_window,
    window_code,
)

CHECKPOINT_KEYWORDS = frozenset(
    {"use_reentrant", "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop"}
)
HIT = "ckpt"


# --------------------------------------------------------------------------------------------------
# running the function that holds a flagged call


def _entry_path(ctx: ProbeContext, node: cst.CSTNode) -> tuple[str | None, str]:
    """(class name or None, function name) of the outermost def around ``node``; the probe calls it."""
    funcs = [a for a in ctx.tree.ancestors(node) if isinstance(a, cst.FunctionDef)]
    if not funcs:
        raise NotExecutable("the flagged call is at module level; the probe runs calls inside functions")
    outer = funcs[-1]
    owner = ctx.tree.enclosing_class(outer)
    if owner is None:
        if ctx.tree.parent.get(id(outer)) is not ctx.model.module:
            raise NotExecutable(f"`{outer.name.value}` is not a module-level function or method")
        return None, outer.name.value
    if ctx.tree.parent.get(id(owner)) is not ctx.model.module:
        raise NotExecutable(f"class `{owner.name.value}` is nested; the probe runs module-level classes")
    return owner.name.value, outer.name.value


def _find_entry(
    model: FileModel, path: tuple[str | None, str]
) -> tuple[cst.ClassDef | None, cst.FunctionDef]:
    cls_name, func_name = path
    body = model.module.body
    if cls_name is not None:
        for stmt in body:
            if isinstance(stmt, cst.ClassDef) and stmt.name.value == cls_name:
                for inner in stmt.body.body:
                    if isinstance(inner, cst.FunctionDef) and inner.name.value == func_name:
                        return stmt, inner
        raise NotExecutable(f"method `{cls_name}.{func_name}` not found")
    for stmt in body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == func_name:
            return None, stmt
    raise NotExecutable(f"function `{func_name}` not found")


def entry_programs(
    ctx: ProbeContext, site: Site, variants: dict[str, list[TextEdit]]
) -> tuple[dict[str, list[str]], list[str], list[str]]:
    """Programs per variant that call the function holding ``site``. For a method there are two
    alternatives: the user's class built by its own ``__init__`` with small sizes, and a stand-in
    ``self`` built from how the methods use their attributes; the runtime uses the first whose
    reference runs."""
    path = _entry_path(ctx, site.node)
    _, entry = _find_entry(ctx.model, path)
    conditions = _site_conditions(site, entry)
    path, conditions, below = _climb(ctx.model, path, conditions)
    programs: dict[str, list[str]] = {}
    roots: list[str] = []
    for name, edits in variants.items():
        vmodel = ctx.variant(edits)
        classdef, _ = _find_entry(vmodel, path)
        alternatives = []
        builders = ("own", "synth") if classdef is not None else ("plain",)
        failures = []
        for how in builders:
            try:
                program_text, roots = _entry_program(ctx, vmodel, how, path, conditions, below)
                alternatives.append(program_text)
            except NotExecutable as exc:  # this way of building the entry does not apply
                failures.append(str(exc))
        if not alternatives:
            raise NotExecutable(failures[0])
        programs[name] = alternatives
    notes = [f"`{k}` set to {v}" for k, v in conditions.items()]
    notes.extend(f"`{cls}.{attr}` set to {value}" for cls, attr, value in below)
    if path != _entry_path(ctx, site.node):
        notes.insert(0, f"run through `{'.'.join(p for p in path if p)}`")
    return programs, roots, notes


def _entry_program(
    ctx: ProbeContext,
    vmodel: FileModel,
    how: str,
    path: tuple[str | None, str],
    conditions: dict[str, bool],
    below: list[tuple[str, str, bool]],
) -> tuple[str, list[str]]:
    """One program calling the entry: ``own`` builds the user's class with its ``__init__``,
    ``synth`` builds a stand-in ``self``, ``plain`` calls a module-level function."""
    classdef, func = _find_entry(vmodel, path)
    program = Program(Carry(vmodel))
    receiver = None
    if how == "own":
        assert classdef is not None
        program.carry.carry(classdef.name.value)
        program.setup.append(f"self = __tl__.place({constructor_call(vmodel, classdef.name.value)})")
        receiver = "self"
    elif how == "synth":
        assert classdef is not None
        synth = Synth(vmodel, conditions, plan_model=ctx.model)
        synth.synth_class(classdef.name.value)
        program.classes = synth.plans_in_order()
        program.setup.append(f"self = __tl__.place({classdef.name.value}())")
        receiver = "self"
    else:
        program.carry.carry(func.name.value)
    for cls_name, attr, value in below:
        program.setup.append(f"__tl__.set_on(self, {cls_name!r}, {attr!r}, {value!r})")
    for key, value in conditions.items():
        if key == "self.training" and receiver:
            program.setup.append(f"self.train({value!r})")
        elif key.startswith("self.") and receiver:
            program.setup.append(f"{key} = {value!r}")
        elif "." not in key and key in vmodel.module_scope.bindings:
            program.overrides.append(f"{key} = {value!r}")
    _, plan_func = _find_entry(ctx.model, path)
    module_args = call_entry(vmodel, func, receiver, conditions, program, plan_func=plan_func)
    return program.render(), (["self"] if receiver else []) + module_args


def _site_conditions(site: Site, func: cst.FunctionDef) -> dict[str, bool]:
    inside = {id(n) for n in walk(func)}
    return required_conditions([f for f in site.frames if id(f.node) in inside], func)


def _self_calls(model: FileModel, func: cst.FunctionDef, attr: str) -> list[Site]:
    """Calls in ``func`` of ``self.<attr>(...)``, or of a loop variable over ``self.<attr>``."""
    scope = model.scope_for(func)
    loop_vars = set()
    for node in walk(func):
        if isinstance(node, cst.For):
            it = node.iter
            if isinstance(it, cst.Call) and dotted(it.func) == "enumerate" and it.args:
                it = it.args[0].value
                target = node.target
                if isinstance(target, cst.Tuple) and len(target.elements) == 2:
                    target = target.elements[1].value
            else:
                target = node.target
            if dotted(it) == f"self.{attr}" and isinstance(target, cst.Name):
                loop_vars.add(target.value)
    out = []
    for site in model.calls_in(scope) if scope is not None else []:
        name = dotted(site.node.func)  # type: ignore[attr-defined]
        if name == f"self.{attr}" or name in loop_vars:
            out.append(site)
    return out


def _map_conditions(
    model: FileModel, callee: cst.FunctionDef, call: cst.Call, conditions: dict[str, bool]
) -> tuple[dict[str, bool], list[tuple[str, bool]]] | None:
    """Translate conditions on the callee's parameters into the caller's terms (through the call's
    arguments); attribute conditions (``self.x``) are returned apart. None when the call passes a
    literal that makes the flagged call unreachable."""
    from trainlint.verify.bind import function_params
    from trainlint.verify.source import is_literal

    params = [(n, p) for n, p, _ in function_params(callee)][1:]
    passed: dict[str, cst.BaseExpression] = {}
    pos = 0
    for arg in call.args:
        if arg.star:
            return None
        if arg.keyword is None:
            if pos < len(params):
                passed[params[pos][0]] = arg.value
            pos += 1
        else:
            passed[arg.keyword.value] = arg.value
    out: dict[str, bool] = {}
    attrs: list[tuple[str, bool]] = []
    for key, want in conditions.items():
        if key.startswith("self."):
            if key != "self.training":
                attrs.append((key[5:], want))
            continue
        param = next((p for n, p in params if n == key), None)
        if param is None:
            out[key] = want  # a module-level flag
            continue
        value = passed.get(key, param.default)
        if value is None:
            return None
        if is_literal(value):
            if model.code(value) not in ("True", "False") or (model.code(value) == "True") != want:
                return None
            continue
        path = dotted(value)
        if path is None:
            return None
        out[path] = want
    return out, attrs


def _climb(
    model: FileModel, path: tuple[str | None, str], conditions: dict[str, bool]
) -> tuple[tuple[str | None, str], dict[str, bool], list[tuple[str, str, bool]]]:
    """Run the flagged code through the code that calls it in this file: a helper method through
    its class's ``forward``, a module's ``forward`` through the model that holds it. That way the
    inputs are what they are in the file (an encoder's input comes from a trainable embedding),
    not data tensors. Returns the new entry, its conditions and attribute settings for classes
    below it."""
    from trainlint.verify.bind import Synth

    below: list[tuple[str, str, bool]] = []
    for _ in range(4):
        cls_name, func_name = path
        if cls_name is None:
            break
        classdef, func = _find_entry(model, path)
        scope = model.scope_for(classdef)
        assert scope is not None
        if func_name != "forward":
            forward = model.method(scope, "forward")
            calls = _self_calls(model, forward, func_name) if forward is not None else []
            if forward is None or len(calls) != 1:
                break
            mapped = _map_conditions(model, func, calls[0].node, conditions)  # type: ignore[arg-type]
            if mapped is None:
                break
            new, attrs = mapped
            new.update({f"self.{a}": v for a, v in attrs})
            new.update(_site_conditions(calls[0], forward))
            path, conditions = (cls_name, "forward"), new
            continue
        holder = None
        for stmt in model.module.body:
            if not isinstance(stmt, cst.ClassDef) or stmt.name.value == cls_name:
                continue
            holder_scope = model.scope_for(stmt)
            if holder_scope is None:
                continue
            for attr, values in holder_scope.self_attrs.items():
                if any(
                    isinstance(n, cst.Call)
                    and model.qualname(n.func, model.module_scope) == f"<local>.{cls_name}"
                    for v in values
                    for n in walk(v)
                ):
                    forward = model.method(holder_scope, "forward")
                    calls = _self_calls(model, forward, attr) if forward is not None else []
                    if forward is not None and len(calls) == 1:
                        holder = (stmt, forward, calls[0])
                        break
            if holder is not None:
                break
        if holder is None:
            break
        parent, forward, call_site = holder
        mapped = _map_conditions(model, func, call_site.node, conditions)  # type: ignore[arg-type]
        if mapped is None or Synth.module_class_of(model, parent.name.value) is None:
            break
        new, attrs = mapped
        below.extend((cls_name, a, v) for a, v in attrs)
        if "self.training" in conditions:
            new["self.training"] = conditions["self.training"]
        new.update(_site_conditions(call_site, forward))
        path, conditions = (parent.name.value, "forward"), new
    return path, conditions, below


# --------------------------------------------------------------------------------------------------
# TL201 / TL202: reentrant checkpoint


def _checkpoint_site(ctx: ProbeContext) -> Site:
    model = ctx.model

    def accept(site: Site) -> bool:
        callee = model.callee(site)
        return callee in CHECKPOINT_FUNCTIONS or callee == "functools.partial"

    site = call_site_at(model, ctx.finding, accept)
    if model.callee(site) == "functools.partial":
        raise NotExecutable("checkpoint bound through functools.partial: the probe runs direct calls only")
    return site


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


def _call_at_related(ctx: ProbeContext, message_part: str) -> Site:
    """The call site a finding's related location points at (e.g. "checkpointed here")."""
    for rel in ctx.finding.related:
        if message_part in rel.message:
            for site in ctx.model.calls:
                pos = ctx.model.position(site.node)
                if pos.start.line == rel.line and pos.start.column + 1 == rel.column:
                    return site
    raise NotExecutable(f"the finding does not say where it is {message_part}")


def _flagged_node(ctx: ProbeContext) -> cst.CSTNode:
    """The node the finding points at (exact span), preferring the outermost of equal spans."""
    span = (ctx.finding.line, ctx.finding.column, ctx.finding.end_line, ctx.finding.end_column)
    from trainlint.verify.source import node_span

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


def tl203(ctx: ProbeContext) -> dict[str, Any]:
    """One forward+backward with the checkpoint as written vs the plain call; counts how often the
    flagged statement runs and compares module state afterwards."""
    site = _call_at_related(ctx, "checkpointed here")
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
    entry_path = _entry_path(ctx, call)
    _, entry = _find_entry(model, entry_path)
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
# TL101: clip before unscale


def _loss_binding(model: FileModel, expr: cst.BaseExpression, value: str) -> tuple[str, str]:
    """(name bound per step, the line that binds it) for the loss inside ``scaler.scale(expr)``."""
    node = expr
    while True:
        if isinstance(node, cst.BinaryOperation):
            node = node.left
        elif isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and not node.args:
            node = node.func.value  # loss.float(), loss.mean()
        elif isinstance(node, cst.Subscript):
            node = node.value
        else:
            break
    if isinstance(node, cst.Name):
        return node.value, f"{node.value} = {value}"
    if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name):
        return node.value.value, f"{node.value.value} = __tl__.Output({node.attr.value}={value})"
    raise NotExecutable(f"the scaled loss `{model.code(expr)}` is not a name the probe can bind")


def _model_roles(model: FileModel, scope, exprs: list[cst.CSTNode], roles: dict[str, str]) -> None:
    for expr in exprs:
        for key in parameters_receivers(expr):
            roles.setdefault(key, "__tl_model__")
    # names bound to parameter lists of the model (params = list(model.parameters()))
    for expr in exprs:
        for node in walk(expr):
            if isinstance(node, cst.Name) and node.value not in roles:
                for value in model.values_of(node, scope):
                    if parameters_receivers(value):
                        roles[node.value] = "list(__tl_model__.parameters())"


def tl101(ctx: ProbeContext) -> dict[str, Any]:
    """The step window as written (scaled backward → clip → scaler.step) vs the same window with the
    scaler disabled (a plain fp32 step), and with the fix (``unscale_`` before the clip)."""
    model = ctx.model
    clip = call_site_at(model, ctx.finding, lambda s: model.callee(s) in CLIP_FUNCTIONS)
    backward = _call_at_related(ctx, "scaled backward")
    if backward.scope is not clip.scope:
        raise NotExecutable("the scaled backward is in another function than the clip")
    training = model.training
    steps = [
        e
        for e in training.events_in(clip.scope, "scaler_step")
        if e.order > clip.order and not exclusive(e.site.frames, clip.frames)
    ]
    if not steps:
        raise NotExecutable("no `scaler.step(...)` after the clip in this function")
    step = steps[0]
    regions = step_window(ctx.tree, backward.node, clip.node, step.site.node)
    scale_call = receiver(backward.node)  # type: ignore[arg-type]
    assert isinstance(scale_call, cst.Call)
    scaler_key = dotted(receiver(scale_call)) or "scaler"
    scale_args = positional(scale_call)
    if not scale_args:
        raise NotExecutable("`scale()` without a loss argument")
    loss_name, loss_line = _loss_binding(model, scale_args[0], "__tl__.loss(__tl_model__, __tl_step__)")
    roles: dict[str, str] = {}
    notes: list[str] = []
    optimizer_expr = first_arg(step.call, "optimizer")
    optimizer_key = dotted(optimizer_expr) if optimizer_expr is not None else None
    opt_exprs: list[cst.CSTNode] = []
    if optimizer_key:
        built = [
            c for c, callee in model.call_values(optimizer_expr, clip.scope) if is_optimizer_class(callee)
        ]
        if built:
            code, described = optimizer_construction(
                model, built[-1], clip.scope, "__tl_model__.parameters()"
            )
            roles[optimizer_key] = code
            notes.append(f"optimizer {described}")
            opt_exprs.append(built[-1])
        else:
            roles[optimizer_key] = "__tl_torch__.optim.SGD(__tl_model__.parameters(), lr=0.1)"
            notes.append(f"`{optimizer_key}` built as SGD(lr=0.1): its construction is not in this function")
    enabled = "True"
    for call, callee in model.call_values(receiver(scale_call), clip.scope):  # type: ignore[arg-type]
        if callee in GRAD_SCALERS:
            kw = keyword(call, "enabled")
            if kw is not None:
                enabled = model.code(kw.value)
    source = model.source
    wrap = [insert_before(model, clip.node, "__tl__.record('clip', "), insert_after(model, clip.node, ")")]
    windows = {
        "as_written": window_code(source, regions, wrap),
        "reference": window_code(source, regions, wrap),
    }
    if ctx.finding.fix is not None:
        windows["fixed"] = window_code(source, regions, ctx.fix_edits())
    _model_roles(model, clip.scope, [clip.node, *opt_exprs], roles)
    programs: dict[str, str] = {}
    for name, window in windows.items():
        scaler_value = f"__tl__.scaler(enabled={'False' if name == 'reference' else f'({enabled})'})"
        variant_roles = dict(roles)
        variant_roles[scaler_key] = scaler_value
        binder = Binder(model, clip.scope, roles=variant_roles)
        role_names = [
            n
            for r in variant_roles.values()
            for n in analyse_names(f"_ = {r}\n").free
            if not n.startswith("__tl")
        ]
        binder.bind([n for n in dict.fromkeys(role_names) if n not in variant_roles], [])
        names = analyse_names(window)
        free = [n for n in names.free if n != loss_name and not n.startswith("__tl")]
        binder.bind(free, names.attrs)
        if name == "as_written":
            notes.extend(binder.notes)
        assert binder.carry is not None
        programs[name] = (
            "import torch as __tl_torch__\n"
            + binder.carry.code()
            + "__tl__.seed(0)\n__tl_model__ = __tl__.tiny_model()\n"
            + "".join(line + "\n" for line in binder.lines)
            + "__tl_before__ = __tl__.snapshot(__tl_model__)\n"
            + "for __tl_step__ in range(__tl__.STEPS):\n"
            + "    __tl__.zero(__tl_model__)\n"
            + f"    {loss_line}\n"
            + indent(window)
            + "__tl_after__ = __tl__.snapshot(__tl_model__)\n"
        )
    return {
        "driver": "step",
        "programs": programs,
        "notes": notes,
        "what": "clip",
        "enabled": enabled,
    }


# --------------------------------------------------------------------------------------------------
# TL301: mean of per-microbatch token means

TOKEN_INPUTS = {"input_ids", "ids", "idx", "x", "X", "tokens", "inputs", "input", "token_ids", "src"}
TOKEN_LABELS = {"labels", "label", "targets", "target", "y", "Y", "tgt", "label_ids"}
TOKEN_MASKS = {"attention_mask", "mask", "attn_mask"}
BATCH_NAMES = {"batch", "micro_batch", "microbatch", "inputs_dict", "data", "sample", "mb"}
DATA_CALLS = ("next", "to", "cuda", "pin_memory", "get_batch", "load", "sample", "collate", "items", "fetch")


def _division_at(ctx: ProbeContext):
    from trainlint.rules.accumulation import divisions
    from trainlint.verify.source import finding_span, node_span

    span = finding_span(ctx.finding)
    for division in divisions(ctx.model):
        if node_span(ctx.model, division.node) == span:
            return division
    raise NotExecutable(f"the flagged division at line {ctx.finding.line} was not found")


def _loads_data(model: FileModel, stmt: cst.CSTNode) -> bool:
    for node in walk(stmt):
        if isinstance(node, cst.Call):
            name = attr_name(node) or ""
            if any(part in name for part in DATA_CALLS if len(part) > 4) or name in DATA_CALLS:
                return True
    return False


def _assigned(stmt: cst.CSTNode) -> set[str]:
    out: set[str] = set()
    for node in walk(stmt):
        targets: list[cst.CSTNode] = []
        if isinstance(node, cst.Assign):
            targets = [t.target for t in node.targets]
        elif isinstance(node, cst.AnnAssign | cst.AugAssign):
            targets = [node.target]
        for target in targets:
            for n in walk(target):
                if isinstance(n, cst.Name):
                    out.add(n.value)
    return out


def _model_call_mode(window: cst.Module, call_name: str) -> str:
    """How the window uses what the model returns: a tuple, an output object, or logits."""
    for node in walk(window):
        if isinstance(node, cst.Assign) and isinstance(node.value, cst.Call):
            if dotted(node.value.func) == call_name:
                target = node.targets[0].target
                if isinstance(target, cst.Tuple | cst.List):
                    return "tuple"
                if isinstance(target, cst.Name):
                    code = window.code
                    r = target.value
                    if f"{r}.loss" in code or f'{r}["loss"]' in code or f"{r}['loss']" in code:
                        return "output"
                    if f"{r}.logits" in code or f"{r}[0]" in code:
                        return "output"
        if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Call):
            if dotted(node.value.func) == call_name and node.attr.value in ("loss", "logits"):
                return "output"
    return "logits"


def _model_calls(window: cst.Module) -> list[str]:
    """Dotted names called with token data (``model(input_ids)``, ``self.model(**batch)``)."""
    tokenish = TOKEN_INPUTS | TOKEN_LABELS | TOKEN_MASKS | BATCH_NAMES
    out = []
    for node in walk(window):
        if isinstance(node, cst.Call):
            name = dotted(node.func)
            if name is None or name.split(".")[-1] in ("backward", "view", "reshape", "size", "float"):
                continue
            used = {n.value for a in node.args for n in walk(a.value) if isinstance(n, cst.Name)}
            if used & tokenish and name not in out:
                out.append(name)
    return out


def _library_callable(model: FileModel, scope, name: str) -> bool:
    """``F.cross_entropy``, ``criterion = nn.CrossEntropyLoss()``, the file's own functions: called
    with token data, but not the model."""
    expr = cst.parse_expression(name)
    if model.qualname(expr, scope) is not None:
        return True
    if "." not in name:
        for _, callee in model.call_values(expr, scope):
            if callee and (callee.endswith("Loss") or callee.startswith("torch.nn.functional")):
                return True
    return False


def _int_value(expr: cst.BaseExpression) -> int | None:
    """The value of an integer literal or of literal integer arithmetic (``5 * 8``)."""
    if isinstance(expr, cst.Integer):
        return int(expr.value, 0)
    if isinstance(expr, cst.BinaryOperation):
        left, right = _int_value(expr.left), _int_value(expr.right)
        if left is None or right is None:
            return None
        if isinstance(expr.operator, cst.Add):
            return left + right
        if isinstance(expr.operator, cst.Subtract):
            return left - right
        if isinstance(expr.operator, cst.Multiply):
            return left * right
        if isinstance(expr.operator, cst.FloorDivide) and right:
            return left // right
    return None


def _accumulation_count(model: FileModel, scope, divisor: cst.BaseExpression) -> tuple[int, list[str]]:
    """K as the file defines it (a literal, a local constant or parameter default, an argparse
    default), else 4, with a note saying where it came from."""
    from trainlint.verify.window import argparse_defaults

    text = model.code(divisor)
    if isinstance(divisor, cst.Integer):
        return int(divisor.value), []
    candidates = []
    if isinstance(divisor, cst.Name):
        value = Binder(model, scope).local_value(divisor.value)
        if value is not None and value.isdigit():
            return int(value), []
        values = model.values_of(divisor, scope)
        if len(values) == 1 and _int_value(values[0]) is not None:
            return int(_int_value(values[0])), []  # type: ignore[arg-type]
        if len(values) == 1 and dotted(values[0]):
            candidates.append(dotted(values[0]) or "")
    elif dotted(divisor):
        candidates.append(text)
    defaults = argparse_defaults(model)
    for candidate in candidates:
        last = candidate.split(".")[-1]
        if last in defaults and defaults[last].isdigit():
            return int(defaults[last]), [f"`{candidate}` = {defaults[last]} (argparse default)"]
    return 4, [f"`{text}` taken as 4 (its value is not in the file)"]


def division_statements(ctx: ProbeContext, division) -> tuple[cst.CSTNode, list[Region], list[TextEdit]]:
    """The statement holding a loss division and the earlier statements of its block that compute
    what it divides (data loading left out): (statement, region, edits blanking skipped lines)."""
    model = ctx.model
    stmt = ctx.tree.statement_of(division.node)
    _, body = ctx.tree.block_of(stmt)
    index = [id(s) for s in body].index(id(stmt))
    start = index
    needed = set(analyse_names(code_of_nodes([stmt])).free)
    for i in range(index - 1, -1, -1):
        candidate = body[i]
        if not (_assigned(candidate) & needed) or _loads_data(model, candidate):
            continue
        if isinstance(candidate, cst.BaseCompoundStatement) and not isinstance(candidate, cst.With):
            continue
        start = i
        needed |= set(analyse_names(code_of_nodes(body[i : index + 1])).free)
    kept = [s for s in body[start : index + 1] if s is stmt or s is body[start] or not _loads_data(model, s)]
    regions = [Region(model.position(kept[0]).start.line, model.position(kept[-1]).end.line)]
    lines = model.source.splitlines(keepends=True)
    keep_lines = {
        ln for s in kept for ln in range(model.position(s).start.line, model.position(s).end.line + 1)
    }
    # statements skipped inside the region (data loading) are blanked out
    blank = [
        TextEdit(ln, 1, ln, len(lines[ln - 1].rstrip("\r\n")) + 1, "")
        for ln in range(regions[0].start, regions[0].end + 1)
        if ln not in keep_lines and lines[ln - 1].strip()
    ]
    return stmt, regions, blank


def token_lines(free: list[str]) -> list[str]:
    """Bind the token-data names a loss window reads to the current microbatch ``__tl_mb__``."""
    out = []
    for name in free:
        if name in TOKEN_INPUTS:
            out.append(f"{name} = __tl_mb__['input_ids']")
        elif name in TOKEN_LABELS:
            out.append(f"{name} = __tl_mb__['labels']")
        elif name in TOKEN_MASKS:
            out.append(f"{name} = __tl_mb__['attention_mask']")
        elif name in BATCH_NAMES:
            out.append(f"{name} = dict(__tl_mb__)")
    return out


def loss_target(division, stmt: cst.CSTNode) -> str | None:
    """The name to backpropagate after the division's statement (None when it backpropagates)."""
    stmt_code = code_of_nodes([stmt])
    if "backward(" in stmt_code:
        return None
    target = None
    if isinstance(division.node, cst.AugAssign) and isinstance(division.node.target, cst.Name):
        target = division.node.target.value
    elif isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Assign):
        t = stmt.body[0].targets[0].target
        target = t.value if isinstance(t, cst.Name) else None
    if target is None:
        raise NotExecutable("the divided loss is neither assigned to a name nor backpropagated")
    return target


def tl301(ctx: ProbeContext) -> dict[str, Any]:
    """K microbatches with uneven valid-token counts through the user's loss code and division vs
    one big batch (K = 1); the fix weighs each microbatch by its share of the window's tokens."""
    model = ctx.model
    division = _division_at(ctx)
    scope = division.site.scope
    stmt, regions, blank = division_statements(ctx, division)
    k_value, notes = _accumulation_count(model, scope, division.divisor)
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
    parsed = cst.parse_module(windows["as_written"])
    callers = [c for c in _model_calls(parsed) if not _library_callable(model, scope, c)]
    if not callers:
        raise NotExecutable("no model call on token data found before the division")
    target = loss_target(division, stmt)
    programs = {}
    for name, window in windows.items():
        roles: dict[str, str] = {}
        for caller in callers:
            roles[caller] = f"__tl__.TinyLM({_model_call_mode(parsed, caller)!r})"
        names = analyse_names(window)
        per_micro = token_lines(names.free)
        micro_names = {line.split(" = ")[0] for line in per_micro}
        k_here = 1 if name == "reference" else k_value
        for n in names.free:
            if n in ("scaler",) and n not in roles:
                roles[n] = "__tl__.scaler(enabled=False)"
            if n in ("accelerator", "fabric", "engine", "model_engine") and n not in roles:
                roles[n] = "__tl__.Backward()"
        binder = Binder(model, scope, roles=roles)
        binder.bind(
            [n for n in names.free if n not in micro_names and not n.startswith("__tl")],
            names.attrs,
        )
        if name == "as_written":
            notes.extend(binder.notes)
        assert binder.carry is not None
        batches = f"__tl__.token_batches({k_value})"
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


def code_of_nodes(nodes: list[cst.CSTNode]) -> str:
    from trainlint.verify.source import code_of

    return code_of(nodes)


# --------------------------------------------------------------------------------------------------
# TL105: training 16-bit parameters


MODULE_CHAIN = frozenset(
    {"cuda", "cpu", "to", "half", "bfloat16", "float", "double", "train", "eval", "requires_grad_", "type"}
)


def _chain_root(call: cst.BaseExpression) -> cst.BaseExpression:
    """``Net()`` in ``Net().cuda().half()``, ``model`` in ``model.to(device, dtype=...)``."""
    node = call
    while (
        isinstance(node, cst.Call)
        and isinstance(node.func, cst.Attribute)
        and node.func.attr.value in MODULE_CHAIN
    ):
        node = node.func.value
    return node


def tl105(ctx: ProbeContext) -> dict[str, Any]:
    """The converted model trained for a few dozen small steps by the user's optimizer vs the same
    model kept in fp32 with an autocast forward; compares how far the parameters moved."""
    model = ctx.model
    training = model.training
    conversion = call_site_at(
        model,
        ctx.finding,
        lambda s: training.low_precision_conversion(s.node, s.scope),  # type: ignore[arg-type]
    )
    optimizer_site = _call_at_related(ctx, "optimizer")
    call = conversion.node
    assert isinstance(call, cst.Call)
    root = _chain_root(call)
    call_code = model.code(call)
    root_code = model.code(root)
    if not call_code.startswith(root_code):
        raise NotExecutable("the converted module expression is not a simple chain")
    converted = "__tl_model__" + call_code[len(root_code) :]
    opt_call = optimizer_site.node
    assert isinstance(opt_call, cst.Call)
    opt_code, described = optimizer_construction(
        model, opt_call, optimizer_site.scope, "__tl_model__.parameters()", strict=True
    )
    notes = [f"optimizer {described}"]
    uses_scaler = any(
        e.site.scope in (optimizer_site.scope, conversion.scope) for e in training.of_kind("scaled_backward")
    )
    programs = {}
    for name in ("as_written", "reference"):
        roles = {
            n: "__tl__.DEVICE" for n in analyse_names(f"_ = {converted}\n").free if "device" in n.lower()
        }
        binder = Binder(model, conversion.scope, roles=roles)
        free = [
            n for n in analyse_names(f"_ = {converted}\n_ = {opt_code}\n").free if not n.startswith("__tl")
        ]
        binder.bind(free, [])
        assert binder.carry is not None
        lines = [
            "import torch as __tl_torch__",
            binder.carry.code().rstrip("\n"),
            "__tl__.seed(0)",
            "__tl_model__ = __tl__.tiny_model()",
            *binder.lines,
        ]
        if name == "as_written":
            lines.append(f"__tl_model__ = {converted}")
        lines.append(f"__tl_optimizer__ = {opt_code}")
        if uses_scaler:
            lines.append("__tl_scaler__ = __tl__.scaler(True)")
        lines.append("__tl_before__ = __tl__.snapshot(__tl_model__)")
        lines.append("for __tl_step__ in range(__tl__.LONG_STEPS):")
        lines.append("    __tl__.zero(__tl_model__)")
        lines.append("    __tl_loss__ = __tl__.loss(__tl_model__, __tl_step__ % 4, growing=False)")
        if uses_scaler:
            lines.append("    __tl_scaler__.scale(__tl_loss__).backward()")
            lines.append("    __tl_scaler__.step(__tl_optimizer__)")
            lines.append("    __tl_scaler__.update()")
        else:
            lines.append("    __tl_loss__.backward()")
            lines.append("    __tl_optimizer__.step()")
        lines.append("__tl_after__ = __tl__.snapshot(__tl_model__)")
        lines.append("__tl_dtype__ = str(next(__tl_model__.parameters()).dtype)")
        programs[name] = "\n".join(line for line in lines if line) + "\n"
    if uses_scaler:
        notes.append("with the file's GradScaler")
    return {"driver": "half", "programs": programs, "notes": notes}


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


# the rest of the catalog (loops, accumulation, data parallelism)
from trainlint.verify.catalog import tl102, tl103, tl104, tl302, tl303, tl501, tl502  # noqa: E402

__all__ = [
    "tl101",
    "tl102",
    "tl103",
    "tl104",
    "tl105",
    "tl201",
    "tl202",
    "tl203",
    "tl204",
    "tl301",
    "tl302",
    "tl303",
    "tl501",
    "tl502",
]
