"""The losses a scope backpropagates, as the names a running total could hold them by (TL302)."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from trainlint.model import (
    FileModel,
    Scope,
    Site,
    attr_name,
    dotted,
    is_backward_call,
    positional,
    walk_scope,
)
from trainlint.model.crossfile import assigned_name, backward_returned
from trainlint.model.losses import backward_calls


def backward_losses(model: FileModel, scope: Scope) -> list[tuple[str, Site]]:
    """The dotted loss expressions the scope's backward calls differentiate: ``loss`` in
    ``loss.backward()``, ``accelerator.backward(loss)``, ``scaler.scale(loss / n).backward()``."""
    out = []
    if model.project is not None:
        for site in model.calls_in(scope):
            key = assigned_name(site)
            if key is not None and backward_returned(model, site) is not None:
                out.append((key, site))
    for site in backward_calls(model, scope):
        call = site.node
        assert isinstance(call, cst.Call)
        if not is_backward_call(call):
            # a helper of this file that runs the backward: its loss-named arguments
            for arg in call.args:
                key = dotted(arg.value)
                if key is not None and "loss" in key.rsplit(".", 1)[-1].lower():
                    out.append((key, site))
            continue
        args = positional(call)
        if args:
            expr: cst.CSTNode = args[0]
        elif isinstance(call.func, cst.Attribute):
            expr = call.func.value
        else:
            continue
        if isinstance(expr, cst.Call) and attr_name(expr) == "scale" and positional(expr):
            expr = positional(expr)[0]
        for node in _value_references(expr):
            key = dotted(node)
            if key is not None:
                out.append((key, site))
    return out + _unpacked(scope, out)


def _value_references(expr: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """Maximal Name/Attribute chains of ``expr`` that are values (not called functions)."""
    if isinstance(expr, cst.Name | cst.Attribute) and dotted(expr) is not None:
        yield expr
        return
    if isinstance(expr, cst.Call):
        if isinstance(expr.func, cst.Attribute):
            yield from _value_references(expr.func.value)
        for arg in expr.args:
            yield from _value_references(arg.value)
        return
    for child in expr.children:
        yield from _value_references(child)


def _unpacked(scope: Scope, losses: list[tuple[str, Site]]) -> list[tuple[str, Site]]:
    """The loop variables that walk a dict (or list) of losses: ``value`` in ``for name, value in
    losses.items()`` and ``for value in losses.values()``, each tied to the loss's backward."""
    backward_of = dict(reversed(losses))
    out = []
    for node in walk_scope(scope.node):
        if not isinstance(node, cst.For):
            continue
        source, target = node.iter, node.target
        if (
            isinstance(source, cst.Call)
            and isinstance(source.func, cst.Attribute)  # (not a function of its own named ``values``)
            and source.func.attr.value in ("items", "values")
            and not source.args
        ):
            items = attr_name(source) == "items"
            source = source.func.value
            if items:
                is_pair = isinstance(target, cst.Tuple) and len(target.elements) == 2
                target = target.elements[1].value if is_pair else None  # type: ignore[union-attr]
        key, name = dotted(source), dotted(target) if target is not None else None
        if key in backward_of and name is not None and "." not in name:
            out.append((name, backward_of[key]))
    return out
