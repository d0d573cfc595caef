"""Probes of the mixed-precision rules: clip before unscale (TL101), loss-scaling order (TL102-TL104),
16-bit parameters (TL105)."""

from __future__ import annotations

import ast
import re
from typing import Any

import libcst as cst

from trainlint.model import (
    FileModel,
    Site,
    attr_name,
    dotted,
    exclusive,
    first_arg,
    in_loop,
    innermost_loop,
    keyword,
    positional,
    receiver,
    walk,
)
from trainlint.model.training import is_optimizer_class
from trainlint.model.vocab import CLIP_FUNCTIONS, GRAD_SCALERS, MODULE_CHAIN
from trainlint.rules.amp.tl101_clip_before_unscale import ClipBeforeUnscale
from trainlint.rules.amp.tl102_step_bypasses_scaler import StepBypassesScaler
from trainlint.rules.amp.tl103_scaler_update_per_microstep import ScalerUpdatePerMicrostep
from trainlint.rules.amp.tl104_unscale_twice import UnscaleTwice
from trainlint.rules.amp.tl105_half_instead_of_autocast import HalfInsteadOfAutocast
from trainlint.verify.context import ProbeContext, insert_after, insert_before, replace_node
from trainlint.verify.loops import build_loop
from trainlint.verify.probes._common import (
    backward_for,
    flagged_call,
    loop_probe,
    moved_after_step,
    small_statement,
)
from trainlint.verify.source import NotExecutable, analyse_names, call_site_at, indent, is_literal
from trainlint.verify.values import file_value, runtime_read
from trainlint.verify.window import (
    Binder,
    optimizer_construction,
    parameters_receivers,
    step_window,
    window_code,
)

UPDATE_WITHOUT_STEP = "No inf checks were recorded prior to update"

UNSCALED_TWICE = "unscale_() has already been called on this optimizer since the last update()"


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
    # names bound to parameter lists of the model (params = list(model.parameters()), or
    # `self.unet_params = unet.parameters()` in `__init__`)
    for expr in exprs:
        for key in _parameter_lists(model, scope, expr):
            roles.setdefault(key, "list(__tl_model__.parameters())")


def _parameter_lists(model: FileModel, scope, expr: cst.CSTNode) -> list[str]:
    """Names and ``self.x`` in ``expr`` that the file binds to a module's parameters."""
    out = []
    for node in walk(expr):
        key = dotted(node) if isinstance(node, cst.Name | cst.Attribute) else None
        if (
            key is None
            or key in out
            or (key.count(".") and not key.startswith("self."))
            or key.count(".") > 1
        ):
            continue
        if any(parameters_receivers(value) for value in model.values_of(node, scope)):
            out.append(key)
    return out


CLIP_NAMES = ("clip_grad_norm_", "clip_grad_value_", "clip_grad_norm")


def _other_modules(model: FileModel, scope, window: str, roles: dict[str, str], notes: list[str]) -> None:
    """Modules of the window other than the one the probe trains (``text_encoder.parameters()`` next to
    ``unet.parameters()``, or their parameter lists): stand-ins whose parameters get no gradient here,
    named."""
    try:
        tree = cst.parse_module(window)
    except cst.ParserSyntaxError:
        return
    others = [(k, "__tl__.tiny_model()") for k in parameters_receivers(tree)]
    lists = _parameter_lists(model, scope, tree)
    # what a clip call is given as its parameters is a parameter list by its use
    for node in walk(tree):
        if isinstance(node, cst.Call) and (dotted(node.func) or "").endswith(CLIP_NAMES):
            given = first_arg(node, "parameters")
            key = dotted(given) if given is not None else None
            if key and key.count(".") <= 1 and key not in lists:
                lists.append(key)
    others += [(k, "list(__tl__.tiny_model().parameters())") for k in lists]
    for key, value in others:
        if key not in roles:
            roles[key] = value
            notes.append(
                f"`{key}` is a stand-in apart from the probe's model (its parameters get no gradient)"
            )


def _step_optimizer_role(
    model: FileModel, scope, step_call: cst.Call, roles: dict[str, str], notes: list[str]
) -> list[cst.CSTNode]:
    """The role of the optimizer ``scaler.step`` steps, built as the file builds it over the probe's
    model (SGD when its construction is not in this function); returns the construction it used."""
    optimizer_expr = first_arg(step_call, "optimizer")
    optimizer_key = dotted(optimizer_expr) if optimizer_expr is not None else None
    if not optimizer_key:
        return []
    built = [c for c, callee in model.call_values(optimizer_expr, scope) if is_optimizer_class(callee)]
    if not built:
        roles[optimizer_key] = "__tl_torch__.optim.SGD(__tl_model__.parameters(), lr=0.1)"
        notes.append(f"`{optimizer_key}` built as SGD(lr=0.1): its construction is not in this function")
        return []
    code, described = optimizer_construction(model, built[-1], scope, "__tl_model__.parameters()")
    roles[optimizer_key] = code
    notes.append(f"optimizer {described}")
    return [built[-1]]


def _optimizer_loop(
    model: FileModel, scope, step_call: cst.Call, roles: dict[str, str], notes: list[str]
) -> None:
    """``for optimizer in self.optimizers: scaler.step(optimizer)``: the list the loop walks holds the
    probe's one optimizer (else the loop would step nothing)."""
    optimizer_expr = first_arg(step_call, "optimizer")
    key = dotted(optimizer_expr) if isinstance(optimizer_expr, cst.Name) else None
    binding = model.lookup(key, scope) if key else None
    if binding is None or binding.kind != "other" or not isinstance(binding.node, cst.For):
        return
    walked = dotted(binding.node.iter)
    if walked and walked not in roles:
        roles[walked] = f"[{roles[key]}]" if key in roles else "[]"
        roles.pop(key, None)
        notes.append(f"`{walked}` holds the one optimizer the probe steps")


def _step_program(binder: Binder, window: str, loss_name: str, loss_line: str) -> str:
    """The program of one TL101 variant: a few steps of the window on the tiny model, the loss bound
    per step; ``binder`` holds the variant's roles and binds every other free name."""
    read = [analyse_names(f"_ = {r}\n") for r in binder.roles.values()]
    role_names = [n for names in read for n in names.free if not n.startswith("__tl")]
    # with the fields the roles read (`enabled=args.fp16`): the argparse namespace gets its defaults
    role_attrs = [a for names in read for a in names.attrs]
    binder.bind([n for n in dict.fromkeys(role_names) if n not in binder.roles], role_attrs)
    names = analyse_names(window)
    free = [n for n in names.free if n != loss_name and not n.startswith("__tl")]
    binder.bind(free, names.attrs)
    assert binder.carry is not None
    return (
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


# PyTorch's GradScaler default: the scale a scaler built without ``init_scale`` starts from
DEFAULT_INIT_SCALE = 65536.0


def _number(node: ast.AST) -> float:
    """A constant written as arithmetic (``2**17.5``, ``2 ** 16``); ValueError for anything else."""
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_number(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div | ast.Pow):
        left, right = _number(node.left), _number(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        ops = {ast.Add: float.__add__, ast.Sub: float.__sub__, ast.Mult: float.__mul__}
        ops.update({ast.Div: float.__truediv__, ast.Pow: float.__pow__})
        return ops[type(node.op)](left, right)
    raise ValueError("not a number")


def _scaler_settings(model: FileModel, scope, scaler_expr) -> tuple[str, str, list[str]]:
    """(``enabled`` as the program writes it, the initial loss scale, notes) of the file's scaler.
    A value the file sets (a literal, a default, a constant) is used and named; a scaler the file
    switches off is said to be off, since then the clip sees true gradients."""
    enabled, scale, notes = "True", repr(DEFAULT_INIT_SCALE), []
    built = [c for c, callee in model.call_values(scaler_expr, scope) if callee in GRAD_SCALERS]
    if not built:
        return (
            enabled,
            scale,
            [f"loss scale {DEFAULT_INIT_SCALE:g} (PyTorch's default; the scaler is not built here)"],
        )
    call = built[-1]
    kw = keyword(call, "enabled")
    if kw is not None:
        enabled = model.code(kw.value)
        found = file_value(model, scope, kw.value)
        if found is not None and found.code == "False":
            where = "" if found.where == "written" else f" is False ({found.where})"
            notes.append(f"the scaler is off: `enabled={enabled}`{where}")
            return enabled, scale, notes  # no loss scale to name
        elif found is not None and found.where != "written":
            notes.append(found.note(enabled))
        elif found is None and not is_literal(kw.value) and not model.values_of(kw.value, scope):
            # a switch set outside the file (`enabled=args.amp`): the finding is about the scaler in use
            notes.append(f"`enabled={enabled}` is not in the file: taken as True (the scaler in use)")
            enabled = "True"
    kw = keyword(call, "init_scale")
    if kw is None:
        notes.append(f"loss scale {DEFAULT_INIT_SCALE:g} (PyTorch's default init_scale)")
        return enabled, scale, notes
    found = file_value(model, scope, kw.value)
    if found is None:
        notes.append(
            f"`init_scale={model.code(kw.value)}` is not in the file: taken as {DEFAULT_INIT_SCALE:g}, PyTorch's default"
        )
        return enabled, scale, notes
    try:
        value = _number(ast.parse(found.code, mode="eval").body)
    except (ValueError, TypeError, SyntaxError):
        notes.append(f"`init_scale={found.code}` is not a plain number: taken as {DEFAULT_INIT_SCALE:g}")
        return enabled, scale, notes
    where = "as written" if found.where == "written" else found.where
    notes.append(f"loss scale {value:g} (`init_scale`, {where})")
    return enabled, repr(value), notes


# typical clip thresholds, for a threshold whose value the file does not hold (read from a config
# file or the command line): the verdict is given per value
CLIP_SWEEP = (0.1, 1.0, 10.0, 1000.0, 100000.0)


def _threshold_sweep(model: FileModel, clip, notes: list[str]) -> tuple[dict[str, Any] | None, list]:
    """The sweep of the clip threshold and the edit that makes the window read ``__tl_sweep__``,
    when the threshold is a name or attribute chain whose value is not in the file."""
    call = clip.node
    assert isinstance(call, cst.Call)
    kw = keyword(call, "clip_value" if "value" in (attr_name(call) or "") else "max_norm")
    pos = positional(call)
    expr = kw.value if kw is not None else (pos[1] if len(pos) > 1 else None)
    path = dotted(expr) if expr is not None else None
    if expr is None or path is None or path in ("True", "False", "None"):
        return None, []
    found = file_value(model, clip.scope, expr)
    if found is not None and found.code != "None":
        return None, []  # bound from the file: no sweep
    if found is not None:  # ``grad_norm_clip: float = None``: a placeholder filled from a config file
        notes.append(f"{found.note(path)}: a placeholder")
    values = model.values_of(expr, clip.scope)
    reads = [runtime_read(model, v) for v in values]
    if values and not all(reads):
        return None, []  # computed in the file: no sweep
    if reads:
        notes.append(f"`{path}` = `{'` or `'.join(dict.fromkeys(r for r in reads if r))}`, read at run time")
    if "." not in path and model.lookup(path, clip.scope) is None:
        return None, []  # not defined anywhere: the probe names it as unbound
    # every read of the same setting in the function is the swept value (a second clip with the
    # same `max_norm=self.clip_grad_norm`); edits outside the step window are dropped
    not_reads = set()
    for n in walk(clip.scope.node):
        if isinstance(n, cst.Arg) and n.keyword is not None:
            not_reads.add(id(n.keyword))
        elif isinstance(n, cst.Attribute):
            not_reads.add(id(n.attr))
        elif isinstance(n, cst.AssignTarget | cst.Param):
            not_reads.add(id(n.target if isinstance(n, cst.AssignTarget) else n.name))
    same = [
        n
        for n in walk(clip.scope.node)
        if type(n) is type(expr) and dotted(n) == path and id(n) not in not_reads
    ]
    return {"name": path, "values": list(CLIP_SWEEP)}, [replace_node(model, n, "__tl_sweep__") for n in same]


def _step_taken(model: FileModel, clip, step, notes: list[str]) -> list:
    """The conditions that gate ``scaler.step`` after the clip (``if (global_step + 1) % accum == 0``)
    are taken as true, and said so: the probe runs one step per iteration."""
    clip_ifs = {id(f.node) for f in clip.frames}
    edits = []
    for frame in step.frames:
        if frame.kind == "if" and frame.branch == "body" and isinstance(frame.node, cst.If):
            if (
                id(frame.node) not in clip_ifs
                and model.position(frame.node).start.line > model.position(clip.node).start.line
            ):
                test = frame.node.test
                edits.append(replace_node(model, test, "True"))
                notes.append(
                    f"the step's condition `{model.code(test)}` taken as true (a step per iteration)"
                )
    # the class's own methods called after the step (`self._zero_grad(...)`): the probe zeroes the
    # gradients itself before each step and measures the update made by the step
    after = model.position(step.node).end.line
    cls = clip.scope.enclosing_class
    for site in model.calls_in(clip.scope):
        func = site.node.func
        if (
            cls is not None
            and isinstance(func, cst.Attribute)
            and dotted(func.value) == "self"
            and model.method(cls, func.attr.value) is not None
            and model.position(site.node).start.line > after
            and isinstance(site.parent, cst.Expr)
        ):
            edits.append(replace_node(model, site.node, "None"))
            notes.append(
                f"`{model.code(site.node)}` after the step is not run (the probe measures the step's update)"
            )
    return edits


def tl101(ctx: ProbeContext) -> dict[str, Any]:
    """The step window as written (scaled backward → clip → scaler.step) vs the same window with the
    scaler disabled (a plain fp32 step), and with the fix (``unscale_`` before the clip)."""
    model = ctx.model
    clip = call_site_at(model, ctx.finding, lambda s: model.callee(s) in CLIP_FUNCTIONS)
    backward = ctx.related(ClipBeforeUnscale.SCALED_BACKWARD)
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
    opt_exprs = _step_optimizer_role(model, clip.scope, step.call, roles, notes)
    _optimizer_loop(model, clip.scope, step.call, roles, notes)
    enabled, init_scale, scaler_notes = _scaler_settings(model, clip.scope, receiver(scale_call))
    notes.extend(scaler_notes)
    source = model.source
    sweep, swept = _threshold_sweep(model, clip, notes)
    swept = [*swept, *_step_taken(model, clip, step.site, notes)]
    wrap = [insert_before(model, clip.node, "__tl__.record('clip', "), insert_after(model, clip.node, ")")]
    windows = {
        "as_written": window_code(source, regions, [*wrap, *swept]),
        "reference": window_code(source, regions, [*wrap, *swept]),
    }
    if ctx.finding.fix is not None:
        windows["fixed"] = window_code(source, regions, [*ctx.fix_edits(), *swept])
    _model_roles(model, clip.scope, [clip.node, *opt_exprs], roles)
    given = first_arg(clip.node, "parameters")  # the clip's own parameters are the probe's model's
    if given is not None and dotted(given) and dotted(given) not in roles:
        roles[dotted(given)] = "list(__tl_model__.parameters())"
    _other_modules(model, clip.scope, windows["as_written"], roles, notes)
    programs: dict[str, str] = {}
    for name, window in windows.items():
        on = "False" if name == "reference" else f"({enabled})"
        scaler_value = f"__tl__.scaler(enabled={on}, init_scale={init_scale})"
        binder = Binder(model, clip.scope, roles={**roles, scaler_key: scaler_value})
        programs[name] = _step_program(binder, window, loss_name, loss_line)
        if name == "as_written":
            notes.extend(binder.notes)
    return {
        "driver": "step",
        "programs": programs,
        "notes": notes,
        "what": "clip",
        "enabled": enabled,
        "loss_scale": float(init_scale),
        **({"sweep": sweep} if sweep else {}),
    }


# --------------------------------------------------------------------------------------------------
# TL102: optimizer.step() after a scaled backward


def tl102(ctx: ProbeContext) -> dict[str, Any]:
    """The loop as written (``optimizer.step()`` on scaled gradients) vs ``scaler.step(optimizer)``
    with an ``update()``; the last iterations' loss overflows under the loss scale, as fp16 gradients
    do when the scale is too large: ``scaler.step`` skips that step, a direct step applies it."""
    model = ctx.model
    step = flagged_call(ctx, "step")
    backward = ctx.related(StepBypassesScaler.SCALED_BACKWARD)
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
        small_statement(ctx, step)
        documented += f"; {scaler_key}.update()"
    window = build_loop(ctx, step, backward, [])
    variants = {
        "reference": [replace_node(model, call, documented)],
        "as_written": [],
    }
    if ctx.finding.fix is not None:
        variants["fixed"] = ctx.fix_edits()
    probe = loop_probe(window, variants, expect=(UPDATE_WITHOUT_STEP,), overflow=True)
    return probe


# --------------------------------------------------------------------------------------------------
# TL103: scaler.update() on every micro-step


def tl103(ctx: ProbeContext) -> dict[str, Any]:
    """The loop as written vs ``update()`` moved right after ``scaler.step`` under the accumulation
    condition; an enabled scaler raises on the first micro-step that has nothing to update."""
    update = flagged_call(ctx, "update")
    step = ctx.related(ScalerUpdatePerMicrostep.SCALER_STEP)
    backward = backward_for(ctx, update)
    window = build_loop(ctx, update, backward, [step])
    variants = moved_after_step(ctx, update, step)
    return loop_probe(window, variants, expect=(UPDATE_WITHOUT_STEP,))


# --------------------------------------------------------------------------------------------------
# TL104: unscale_ twice before update()


def tl104(ctx: ProbeContext) -> dict[str, Any]:
    """The loop as written vs one ``unscale_`` per ``update()``: the second call raises the documented
    RuntimeError when the scaler is enabled."""
    model = ctx.model
    unscale = flagged_call(ctx, "unscale_")
    backward = backward_for(ctx, unscale)
    try:
        first = ctx.related(UnscaleTwice.FIRST)
    except NotExecutable:
        first = None
    if first is not None:
        window = build_loop(ctx, unscale, backward, [first])
        variants = {"reference": [replace_node(model, unscale.node, "None")], "as_written": []}
        if ctx.finding.fix is not None:
            variants["fixed"] = ctx.fix_edits()
        return loop_probe(window, variants, expect=(UNSCALED_TWICE,))
    # every micro-step: the documented order unscales once, right before the step
    update = ctx.related(UnscaleTwice.UPDATE)
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
    small = small_statement(ctx, steps[0])
    window = build_loop(ctx, unscale, backward, [update, steps[0]])
    variants = {
        "reference": [
            replace_node(model, unscale.node, "None"),
            insert_before(model, small, f"{model.code(unscale.node)}; "),
        ],
        "as_written": [],
    }
    return loop_probe(window, variants, expect=(UNSCALED_TWICE,))


# --------------------------------------------------------------------------------------------------
# TL105: training 16-bit parameters


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


def _half_sites(ctx: ProbeContext) -> tuple[Site, Site, str, list[str]]:
    """(conversion, optimizer, the conversion applied to the probe's model, notes). The finding sits
    at the conversion (``model.half()``) with the optimizer related, or, when a call of this file
    returns a model converted in another file (``load_model(..., use_fp16=True)``), at the optimizer
    with that call related: the probe's model is then converted with ``.half()``, as the other
    file does, and the detail says so."""
    model = ctx.model
    training = model.training
    try:
        conversion = call_site_at(
            model,
            ctx.finding,
            lambda s: training.low_precision_conversion(s.node, s.scope),  # type: ignore[arg-type]
        )
    except NotExecutable:
        conversion = ctx.related(HalfInsteadOfAutocast.CONVERSION)
        optimizer_site = call_site_at(model, ctx.finding)  # the finding sits at the optimizer
        elsewhere = [r for r in ctx.finding.related if r.label == HalfInsteadOfAutocast.CONVERSION]
        where = ", ".join(
            f"{r.path}, line {r.line}" for r in elsewhere if r.path and r.path != ctx.finding.path
        )
        callee = dotted(conversion.node.func) if isinstance(conversion.node, cst.Call) else None
        note = (
            f"`{callee or 'the call'}(...)` on line {model.position(conversion.node).start.line} returns the "
            f"model converted to 16-bit{f' ({where})' if where else ''}: the probe's model is converted with "
            "`.half()`"
        )
        return conversion, optimizer_site, "__tl_model__.half()", [note]
    call = conversion.node
    assert isinstance(call, cst.Call)
    root = _chain_root(call)
    call_code = model.code(call)
    root_code = model.code(root)
    if not call_code.startswith(root_code):
        raise NotExecutable("the converted module expression is not a simple chain")
    return (
        conversion,
        ctx.related(HalfInsteadOfAutocast.OPTIMIZER),
        "__tl_model__" + call_code[len(root_code) :],
        [],
    )


TOTAL_STEPS = re.compile(r"^(t_total|(num_)?(train_|training_)?(optimization_)?steps|(total|max)_steps)$")


def _schedule_length(binder: Binder, notes: list[str]) -> None:
    """A schedule's length the file computes from its data (``t_total=num_train_optimization_steps``)
    is the probe's own run: as many steps as it takes, and said so."""
    for name in [n for n in binder.unbound if TOTAL_STEPS.match(n)]:
        line = f"{name} = __tl__.Unbound({name!r})"
        if line in binder.lines:
            binder.lines[binder.lines.index(line)] = f"{name} = __tl__.LONG_STEPS"
            note = f"`{name}` is not in the file: taken as the number of steps the probe runs"
            notes.extend([note] if note not in notes else [])


def tl105(ctx: ProbeContext) -> dict[str, Any]:
    """The converted model trained for a few dozen small steps by the user's optimizer vs the same
    model kept in fp32 with an autocast forward; compares how far the parameters moved."""
    model = ctx.model
    training = model.training
    conversion, optimizer_site, converted, notes = _half_sites(ctx)
    opt_call = optimizer_site.node
    assert isinstance(opt_call, cst.Call)
    opt_code, described = optimizer_construction(
        model, opt_call, optimizer_site.scope, "__tl_model__.parameters()", strict=True
    )
    notes.insert(0, f"optimizer {described}")
    uses_scaler = any(
        e.site.scope in (optimizer_site.scope, conversion.scope) for e in training.of_kind("scaled_backward")
    )
    programs = {}
    for name in ("as_written", "reference"):
        roles = {
            n: "__tl__.DEVICE" for n in analyse_names(f"_ = {converted}\n").free if "device" in n.lower()
        }
        # the conversion's names bound where it is, the optimizer's where it is built (another
        # function: `prep_optimizer(args, ...)`), with the fields it reads (`args.lr`)
        binder = Binder(model, conversion.scope, roles=roles)
        read = analyse_names(f"_ = {converted}\n")
        binder.bind([n for n in read.free if not n.startswith("__tl")], read.attrs)
        opt_binder = Binder(model, optimizer_site.scope, roles=roles, carry=binder.carry)
        read = analyse_names(f"_ = {opt_code}\n")
        opt_free = [n for n in read.free if not n.startswith("__tl") and n not in binder.lines_for]
        opt_binder.bind([n for n in opt_free if n not in binder.carry.names], read.attrs)
        notes.extend(n for n in binder.notes + opt_binder.notes if n not in notes)
        _schedule_length(opt_binder, notes)
        assert binder.carry is not None
        lines = [
            "import torch as __tl_torch__",
            binder.carry.code().rstrip("\n"),
            "__tl__.seed(0)",
            "__tl_model__ = __tl__.tiny_model()",
            *binder.lines,
            *opt_binder.lines,
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
