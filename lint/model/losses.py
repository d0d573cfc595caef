"""Losses divided on their way to ``backward()``: the divisions of a file, and whether a divided value
reaches a backward call (the accumulation and data-parallel rules and their probes ask this)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import libcst as cst

from trainlint.model.filemodel import FileModel, Scope, Site
from trainlint.model.syntax import attr_name, positional, walk, walk_scope
from trainlint.model.training import is_backward_call


@dataclass(frozen=True)
class Division:
    """``dividend / divisor`` at ``node`` (a BinaryOperation, an AugAssign or a ``.div`` call)."""

    node: cst.CSTNode
    dividend: cst.BaseExpression
    divisor: cst.BaseExpression
    site: Site
    target: str | None = None  # for ``x /= n``: the name divided in place


def _reciprocal(expr: cst.BaseExpression) -> cst.BaseExpression | None:
    """``n`` in ``1 / n`` or ``1.0 / n``."""
    if (
        isinstance(expr, cst.BinaryOperation)
        and isinstance(expr.operator, cst.Divide)
        and isinstance(expr.left, cst.Integer | cst.Float)
        and float(expr.left.evaluated_value) == 1.0
    ):
        return expr.right
    return None


def snippet(model: FileModel, node: cst.CSTNode, fallback: str, limit: int = 60) -> str:
    """The node's code in backticks, without outer parentheses; ``fallback`` when long."""
    if isinstance(node, cst.BinaryOperation):
        node = node.with_changes(lpar=(), rpar=())
    text = model.code(node).strip()
    if len(text) > limit or "\n" in text:
        return fallback
    return f"`{text}`"


def divisions(model: FileModel) -> Iterator[Division]:
    """Every ``a / b``, ``a * (1 / b)``, ``a /= b``, ``a *= 1 / b`` and ``a.div(b)`` of the file."""
    for site in model.binops:
        node = site.node
        assert isinstance(node, cst.BinaryOperation)
        if isinstance(node.operator, cst.Divide):
            yield Division(node, node.left, node.right, site)
        elif isinstance(node.operator, cst.Multiply):
            for mine, other in ((node.right, node.left), (node.left, node.right)):
                count = _reciprocal(mine)
                if count is not None:
                    yield Division(node, other, count, site)
    for site in model.augassigns:
        node = site.node
        assert isinstance(node, cst.AugAssign)
        target = node.target.value if isinstance(node.target, cst.Name) else None
        if isinstance(node.operator, cst.DivideAssign):
            yield Division(node, node.target, node.value, site, target)
        elif isinstance(node.operator, cst.MultiplyAssign):
            count = _reciprocal(node.value)
            if count is not None:
                yield Division(node, node.target, count, site, target)
    for site in model.calls:
        call = site.node
        assert isinstance(call, cst.Call)
        if attr_name(call) == "div" and isinstance(call.func, cst.Attribute) and len(positional(call)) == 1:
            yield Division(call, call.func.value, positional(call)[0], site)


# What frameworks call it: ``loss.backward()``, ``torch.autograd.backward``, ``accelerator``/``fabric``/
# DeepSpeed ``engine``/ColossalAI ``booster.backward(loss)``, Lightning's ``self.manual_backward``.
# Any other name ending in ``backward`` (``_must_be_in_backward(node)``, ``is_backward(x)``) is a
# backward only when it is this file's own function that runs one (see ``backward_calls``).
def backward_calls(model: FileModel, scope: Scope) -> list[Site]:
    """Backward calls of the scope: ``x.backward()``, ``fabric.backward(x)``,
    ``self.manual_backward(x)``, and calls of this file's functions that run a backward."""
    out = []
    for site in model.calls_in(scope):
        call = site.node
        assert isinstance(call, cst.Call)
        if is_backward_call(call):
            out.append(site)
        else:
            definition = model.local_callee(site, methods=False)
            inner = model.scope_for(definition) if definition is not None else None
            if inner is not None and any(is_backward_call(s.node) for s in model.calls_in(inner)):  # type: ignore[arg-type]
                out.append(site)
    return out


def names_reach_backward(model: FileModel, scope: Scope, names: set[str], after: int) -> bool:
    """Whether one of ``names`` (or a name computed from one, up to three assignments on) is used
    in a backward call of the scope after program position ``after``."""
    backwards = [b for b in backward_calls(model, scope) if b.order > after]
    seen = set(names)
    for _ in range(3):
        if not names:
            return False
        for call in backwards:
            for n in walk(call.node):
                if isinstance(n, cst.Name) and n.value in names:
                    return True
        names = _derived_names(model, scope, names, after) - seen
        seen |= names
    return False


def division_reaches_backward(model: FileModel, division: Division) -> bool:
    node = division.node
    for call in backward_calls(model, division.site.scope):
        if call.statement is division.site.statement and any(n is node for n in walk(call.node)):
            return True
    names = _assigned_names(division)
    if names_reach_backward(model, division.site.scope, names, division.site.order):
        return True
    return _returned_to_backward(model, division, names)


def _returned_to_backward(model: FileModel, division: Division, names: set[str]) -> bool:
    """The function returns the divided value and a caller in the file backpropagates what the call
    returns (``loss = self.compute_loss(batch)`` then ``loss.backward()``)."""
    scope = division.site.scope
    function = scope.node
    if not returns_division(division, names):
        return False
    return any(
        site.scope is not scope
        and model.local_callee(site) is function
        and call_reaches_backward(model, site)
        for site in model.calls
    )


def call_reaches_backward(model: FileModel, site: Site) -> bool:
    """What the call at ``site`` returns is backpropagated in its scope: ``f(x).backward()``,
    ``loss = f(x)`` then ``loss.backward()`` (or a name computed from it)."""
    for backward in backward_calls(model, site.scope):
        if backward.statement is site.statement and any(n is site.node for n in walk(backward.node)):
            return True
    return names_reach_backward(model, site.scope, _call_targets(site), site.order)


def returns_division(division: Division, names: set[str] | None = None) -> bool:
    """The division's function returns its value: ``return s / n``, or ``return loss`` after
    ``loss = s / n`` (also as a tuple's first element)."""
    function = division.site.scope.node
    if not isinstance(function, cst.FunctionDef):
        return False
    names = _assigned_names(division) if names is None else names
    for ret in walk_scope(function):
        if isinstance(ret, cst.Return) and ret.value is not None:
            value = ret.value
            if isinstance(value, cst.Tuple) and value.elements:
                value = value.elements[0].value
            if value is division.node or (isinstance(value, cst.Name) and value.value in names):
                return True
    return False


def _call_targets(site: Site) -> set[str]:
    """The names a call's result is assigned to (``loss`` in ``loss = f(x)``, ``loss, out = f(x)``)."""
    statement = site.statement
    out: set[str] = set()
    if isinstance(statement, cst.SimpleStatementLine):
        for small in statement.body:
            if isinstance(small, cst.Assign) and small.value is site.node:
                for target in small.targets:
                    elements = (
                        target.target.elements if isinstance(target.target, cst.Tuple) else [target.target]
                    )
                    for element in elements:
                        inner = element.value if isinstance(element, cst.Element) else element
                        if isinstance(inner, cst.Name):
                            out.add(inner.value)
    return out


def _assigned_names(division: Division) -> set[str]:
    if division.target is not None:
        return {division.target}
    statement = division.site.statement
    if not isinstance(statement, cst.SimpleStatementLine):
        return set()
    names: set[str] = set()
    for small in statement.body:
        if isinstance(small, cst.Assign | cst.AugAssign) and any(
            n is division.node for n in walk(small.value)
        ):
            targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else [small.target]
            names.update(t.value for t in targets if isinstance(t, cst.Name))
    return names


def _derived_names(model: FileModel, scope: Scope, names: set[str], after: int) -> set[str]:
    """Names assigned after ``after`` in the scope from an expression that uses one of ``names``."""
    out: set[str] = set()
    for site in model.assigns:
        if site.scope is not scope or site.order <= after or not isinstance(site.node, cst.Assign):
            continue
        if any(isinstance(n, cst.Name) and n.value in names for n in walk(site.node.value)):
            for target in site.node.targets:
                if isinstance(target.target, cst.Name):
                    out.add(target.target.value)
    return out
