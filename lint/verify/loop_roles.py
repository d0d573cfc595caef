"""Roles of a loop window: what the probe builds for each name the cut-out statements use (scalers,
optimizers as the file builds them, the model, schedulers, the accumulation count, the loop's index)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import libcst as cst

from trainlint.model import (
    Frame,
    Scope,
    dotted,
    first_arg,
    keyword,
    positional,
    receiver,
    walk,
)
from trainlint.model.training import GRAD_SCALERS, is_optimizer_class, is_step_count_name
from trainlint.verify.context import ProbeContext
from trainlint.verify.source import NotExecutable
from trainlint.verify.window import (
    accumulation_count,
    optimizer_construction,
    parameters_receivers,
)

if TYPE_CHECKING:
    from trainlint.verify.loops import LoopWindow, _Cut

MAX_COUNT = 8  # accumulation counts above this run with this many microbatches per window


def training_roles(cut: _Cut, window: LoopWindow, window_events: list, events: list, kept: list[int]) -> None:
    """Roles of the scalers, optimizers, model and schedulers the window uses."""
    model, scope, roles, model_expr = cut.model, cut.scope, window.roles, window.model_expr
    training = model.training
    for e in window_events:
        if e.kind in ("scaled_backward", "unscale", "update", "scaler_step") and e.key:
            roles.setdefault(e.key, f"__tl__.scaler(enabled={scaler_enabled(model, scope, e.key)})")
    optimizers: list[tuple[str, cst.BaseExpression]] = []
    for e in window_events:
        expr = None
        if e.kind in ("scaler_step", "unscale"):
            expr = first_arg(e.call, "optimizer")
        elif e.kind in ("step", "zero_grad") and training.is_optimizer_like(receiver(e.call), scope):
            expr = receiver(e.call)
        key = dotted(expr) if expr is not None else None
        if key and key not in roles and key not in (k for k, _ in optimizers):
            optimizers.append((key, expr))  # type: ignore[arg-type]
    constructions = _optimizer_roles(cut, window, optimizers)
    for expr in [*cut.statements(kept), *constructions]:
        for key in parameters_receivers(expr):
            roles.setdefault(key, model_expr)
    for key in _model_arguments(model, scope, cut.statements(kept)):
        roles.setdefault(key, model_expr)
    for e in window_events:
        if (
            e.kind == "zero_grad"
            and e.key
            and e.key not in roles
            and parameters_owner(model, scope, e, events)
        ):
            roles[e.key] = model_expr
        if e.kind == "step" and e.key and e.key not in roles and _is_scheduler(model, scope, e):
            roles[e.key] = f"__tl__.NoOp({e.key!r})"
            window.notes.append(f"`{e.key}.step()` does nothing (the learning rate stays fixed)")


def _optimizer_roles(
    cut: _Cut, window: LoopWindow, optimizers: list[tuple[str, cst.BaseExpression]]
) -> list[cst.CSTNode]:
    """Each optimizer built as the file builds it, over the probe's model; returns the constructions."""
    model, scope, model_expr = cut.model, cut.scope, window.model_expr
    constructions: list[cst.CSTNode] = []
    for key, expr in optimizers:
        built = [c for c, callee in model.call_values(expr, scope) if is_optimizer_class(callee)]
        if built:
            code, described = optimizer_construction(model, built[-1], scope, f"{model_expr}.parameters()")
            window.notes.append(f"`{key}` built as {described}")
            constructions.append(built[-1])
        else:
            code = f"__tl_torch__.optim.SGD({model_expr}.parameters(), lr=0.1)"
            window.notes.append(f"`{key}` built as SGD(lr=0.1): its construction is not in this function")
        window.roles[key] = f"__tl__.watch({code}, {key!r})"
    return constructions


def _model_arguments(model, scope: Scope, stmts: list[cst.CSTNode]) -> list[str]:
    """Arguments passed to the file's own functions where the function takes their parameters
    (``clip_grads(model, opt)`` whose body calls ``model.parameters()``)."""
    from trainlint.verify.bind import function_params

    out: list[str] = []
    for stmt in stmts:
        for node in walk(stmt):
            if not isinstance(node, cst.Call) or not isinstance(node.func, cst.Name):
                continue
            definition = model.definition(node.func.value, scope)
            if not isinstance(definition, cst.FunctionDef):
                continue
            inside = set(parameters_receivers(definition.body))
            params = [name for name, _, _ in function_params(definition)]
            for position, arg in enumerate(node.args):
                if arg.star:
                    break
                param = (
                    arg.keyword.value
                    if arg.keyword is not None
                    else (params[position] if position < len(params) else None)
                )
                key = dotted(arg.value)
                if param in inside and key and key not in out:
                    out.append(key)
    return out


def _is_scheduler(model, scope: Scope, event) -> bool:
    """A learning-rate scheduler's ``step()``: by construction, or by a ``*sched*`` name."""
    recv = receiver(event.call)
    if any("lr_scheduler" in (callee or "") for _, callee in model.call_values(recv, scope)):
        return True
    # ``g_sch, d_sch = self.lr_schedulers()`` (Lightning)
    if any((dotted(call.func) or "").endswith("lr_schedulers") for call, _ in model.call_values(recv, scope)):
        return True
    return bool(SCHEDULER_NAME.search((event.key or "").rsplit(".", 1)[-1].lower()))


def parameters_owner(model, scope: Scope, event, events) -> bool:
    """``model.zero_grad()`` where ``model`` is what an optimizer of the scope was built over."""
    key = event.key
    if not key:
        return False
    for e in events:
        for expr in (receiver(e.call), first_arg(e.call, "optimizer")):
            if expr is None:
                continue
            for call, callee in model.call_values(expr, scope):
                if is_optimizer_class(callee) and key in parameters_receivers(call):
                    return True
    for site in model.calls_in(scope):
        if is_optimizer_class(model.callee(site)) and key in parameters_receivers(site.node):
            return True
    return False


def scaler_enabled(model, scope: Scope, key: str) -> str:
    """The ``enabled=`` argument of the scaler's construction, as written (``True`` when absent)."""
    for call, callee in model.call_values(cst.parse_expression(key), scope):
        if callee in GRAD_SCALERS:
            kw = keyword(call, "enabled")
            if kw is not None:
                return f"({model.code(kw.value)})"
    return "True"


def index_bindings(model, loop: Frame | None, free: list[str], window: LoopWindow) -> list[str]:
    """``i = __tl_step__`` for the index of ``for i, batch in enumerate(loader)`` / ``for i in
    range(n)``; the iterable becomes a ``Loader`` whose length is the iteration count."""
    if loop is None:
        return _step_function_index(model, free, window)
    if not isinstance(loop.node, cst.For):
        return []
    node = loop.node
    lines: list[str] = []
    it = node.iter
    index_name = None
    start = "0"
    if isinstance(it, cst.Call) and dotted(it.func) == "enumerate" and it.args:
        target = node.target
        if isinstance(target, cst.Tuple | cst.List) and target.elements:
            first = target.elements[0].value
            if isinstance(first, cst.Name):
                index_name = first.value
        start_arg = keyword(it, "start")
        pos = positional(it)
        start_expr = start_arg.value if start_arg is not None else (pos[1] if len(pos) > 1 else None)
        if start_expr is not None:
            if not isinstance(start_expr, cst.Integer):
                raise NotExecutable("the loop counts from a start the probe cannot read")
            start = start_expr.value
        source = it.args[0].value
    elif isinstance(it, cst.Call) and dotted(it.func) == "range" and isinstance(node.target, cst.Name):
        pos = positional(it)
        index_name = node.target.value
        if len(pos) >= 2:
            if not isinstance(pos[0], cst.Integer):
                raise NotExecutable("the loop's range starts at a value the probe cannot read")
            start = pos[0].value
        source = None
    else:
        source = it
    if index_name is not None:
        lines.append(f"{index_name} = __tl_step__" + (f" + {start}" if start != "0" else ""))
        window.reserved.add(index_name)
    key = dotted(source) if source is not None else None
    if key and key.split(".")[0] in free:
        window.roles.setdefault(key, f"__tl__.Loader({key!r}, {window.iterations})")
    return lines


SCHEDULER_NAME = re.compile(r"sched|(^|_)sch($|_)")  # ``lr_scheduler``, ``g_sch``
# parameters of a function run once per batch that count the batches (Lightning's ``batch_idx``)
STEP_INDEX_PARAMS = frozenset(
    {"batch_idx", "batch_nb", "batch_index", "step", "global_step", "iteration", "it"}
)


def _step_function_index(model, free: list[str], window: LoopWindow) -> list[str]:
    """In a step function (``training_step(self, batch, batch_idx)``, run once per batch), the
    parameter that counts the batches counts the probe's iterations."""
    node = window.scope.node
    if not isinstance(node, cst.FunctionDef):
        return []
    lines = []
    for param in node.params.params:
        name = param.name.value
        if name in STEP_INDEX_PARAMS and name in free and param.default is None:
            lines.append(f"{name} = __tl_step__")
            window.reserved.add(name)
            window.notes.append(
                f"`{name}` counts the probe's iterations (`{node.name.value}` runs once per batch)"
            )
    return lines


def accumulation_roles(
    ctx: ProbeContext, scope: Scope, stmts: list[cst.CSTNode], roles: dict, notes: list
) -> int | None:
    """Bind the accumulation count the window's conditions and micro-step loops use; returns it."""
    model = ctx.model
    training = model.training
    counts: list[cst.BaseExpression] = []
    for stmt in stmts:
        for node in walk(stmt):
            if isinstance(node, cst.If) and training.accumulation_condition(node.test, scope):
                for inner in walk(node.test):
                    if isinstance(inner, cst.BinaryOperation) and isinstance(inner.operator, cst.Modulo):
                        counts.append(inner.right)
            elif isinstance(node, cst.If):
                test = node.test
                if isinstance(test, cst.Comparison) and _counter_reset(node):
                    for comparator in (test.left, *(c.comparator for c in test.comparisons)):
                        if dotted(comparator) and is_step_count_name(dotted(comparator).rsplit(".", 1)[-1]):  # type: ignore[union-attr]
                            counts.append(comparator)
            elif (
                isinstance(node, cst.For)
                and isinstance(node.iter, cst.Call)
                and dotted(node.iter.func) == "range"
            ):
                pos = positional(node.iter)
                if len(pos) == 1 and dotted(pos[0]) and is_step_count_name(dotted(pos[0]).rsplit(".", 1)[-1]):  # type: ignore[union-attr]
                    counts.append(pos[0])
        # flags computed from a modulo (``is_update = (i + 1) % accum == 0``)
        for node in walk(stmt):
            if isinstance(node, cst.Assign) and training.accumulation_condition(node.value, scope):
                for inner in walk(node.value):
                    if isinstance(inner, cst.BinaryOperation) and isinstance(inner.operator, cst.Modulo):
                        counts.append(inner.right)
    value = None
    for expr in counts:
        key = dotted(expr)
        if isinstance(expr, cst.Integer):
            value = value or int(expr.value)
            continue
        if key is None or key in roles:
            continue
        k, more = accumulation_count(model, scope, expr)
        if k > MAX_COUNT:  # the hazard shows with any count of 2 or more: keep the probe small
            more = [*more, f"`{key}` = {k} in the file, run with {MAX_COUNT}"]
            k = MAX_COUNT
        roles[key] = str(k)
        notes.extend(m for m in more if m not in notes)
        value = value or k
    return value


def _counter_reset(node: cst.If) -> bool:
    from trainlint.model import Training

    return Training._counter_reset(node)
