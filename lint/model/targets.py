"""Checkpoint targets: the code that a ``checkpoint(fn, ...)`` call runs twice (forward and recompute).

Resolves the callable to its definition through names, nested defs, ``self.method``, ``self.submodule``
(its class's ``forward``), ``functools.partial``, lambdas and ``create_custom_forward``-style factories
that return a nested def; and lists the same-file functions the target calls directly (one level).
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from trainlint.model.filemodel import FileModel, Scope, Site
from trainlint.model.syntax import dotted, positional, walk_scope

PARTIAL = "functools.partial"


@dataclass(frozen=True, eq=False)
class Target:
    """One function body that runs under checkpoint; ``via`` says how it was reached."""

    node: cst.FunctionDef | cst.Lambda
    scope: Scope
    via: str


def _function_target(model: FileModel, node: cst.CSTNode | None, via: str) -> Target | None:
    if isinstance(node, cst.FunctionDef | cst.Lambda):
        scope = model.scope_for(node)
        if scope is not None:
            return Target(node, scope, via)
    return None


def _class_forward(model: FileModel, cls_node: cst.ClassDef, via: str) -> Target | None:
    cls_scope = model.scope_for(cls_node)
    if cls_scope is None:
        return None
    return _function_target(
        model, model.method(cls_scope, "forward"), f"{via} ({cls_node.name.value}.forward)"
    )


def _returned_def(model: FileModel, factory: cst.FunctionDef) -> cst.FunctionDef | None:
    """For ``def make(m): def run(*a): ...; return run``, the nested ``run``."""
    scope = model.scope_for(factory)
    if scope is None:
        return None
    for node in walk_scope(factory):
        if isinstance(node, cst.Return) and isinstance(node.value, cst.Name):
            found = scope.bindings.get(node.value.value)
            if found and isinstance(found[-1].node, cst.FunctionDef):
                return found[-1].node
    return None


def resolve_callable(
    model: FileModel, expr: cst.BaseExpression, scope: Scope, depth: int = 0
) -> Target | None:
    """The definition an expression used as a callable refers to, when it is in this file."""
    if depth > 4:
        return None
    text = model.code(expr) if not isinstance(expr, cst.Lambda) else "<lambda>"
    if isinstance(expr, cst.Lambda):
        return _function_target(model, expr, "lambda")
    if isinstance(expr, cst.Call):
        callee = model.qualname(expr.func, scope)
        args = positional(expr)
        if callee == PARTIAL and args:
            return resolve_callable(model, args[0], scope, depth + 1)
        if callee is not None and callee.startswith("<local>."):
            factory = model.definition(dotted(expr.func) or "", scope)
            if isinstance(factory, cst.FunctionDef):
                return _function_target(model, _returned_def(model, factory), text)
        return None
    path = dotted(expr)
    if path is None:
        return None
    if path.startswith("self.") and path.count(".") == 1:
        cls = scope.enclosing_class
        if cls is None:
            return None
        attr = path[5:]
        method = model.method(cls, attr)
        if method is not None:
            return _function_target(model, method, text)
        for value in cls.self_attrs.get(attr, ()):
            if isinstance(value, cst.Call):
                definition = model.definition(dotted(value.func) or "", cls.parent or model.module_scope)
                if isinstance(definition, cst.ClassDef):
                    return _class_forward(model, definition, text)
        return None
    if "." in path:
        return None
    definition = model.definition(path, scope)
    if isinstance(definition, cst.FunctionDef):
        return _function_target(model, definition, text)
    if isinstance(definition, cst.ClassDef):
        return None
    for value in model.values_of(expr, scope):
        if isinstance(value, cst.Call | cst.Lambda):
            return resolve_callable(model, value, scope, depth + 1)
    return None


def resolve_checkpoint_target(model: FileModel, site: Site) -> Target | None:
    """The function a checkpoint call (or a ``partial(checkpoint, fn)``) runs, if it is in this file."""
    call = site.node
    assert isinstance(call, cst.Call)
    args = positional(call)
    if model.qualname(call.func, site.scope) == PARTIAL:
        args = args[1:]
    if not args:
        return None
    return resolve_callable(model, args[0], site.scope)


def called_functions(model: FileModel, target: Target) -> list[tuple[Site, Target]]:
    """Same-file functions and ``self`` methods the target calls directly (one level deep)."""
    out = []
    for site in model.calls_in(target.scope):
        path = dotted(site.node.func)  # type: ignore[attr-defined]
        definition = model.local_callee(site)
        if path is None or definition is None or definition is target.node:
            continue
        callee = _function_target(model, definition, path)
        if callee is not None:
            out.append((site, callee))
    return out


def factory_arguments(model: FileModel, site: Site) -> list[cst.BaseExpression]:
    """For ``checkpoint(make(m), x)`` (or a partial of it), where ``make`` is this file's factory that
    returns a nested def calling its parameter (``create_custom_forward(module)``), the arguments the
    call passes for the parameters the nested def calls: the modules that run under checkpoint."""
    call = site.node
    assert isinstance(call, cst.Call)
    args = positional(call)
    if model.qualname(call.func, site.scope) == PARTIAL:
        args = args[1:]
    made = args[0] if args else None
    if not isinstance(made, cst.Call) or not (model.qualname(made.func, site.scope) or "").startswith(
        "<local>."
    ):
        return []
    factory = model.definition(dotted(made.func) or "", site.scope)
    nested = _returned_def(model, factory) if isinstance(factory, cst.FunctionDef) else None
    nested_scope = model.scope_for(nested) if nested is not None else None
    if nested_scope is None or not isinstance(factory, cst.FunctionDef):
        return []
    called = {dotted(s.node.func) for s in model.calls_in(nested_scope)}  # type: ignore[attr-defined]
    params = [p.name.value for p in (*factory.params.posonly_params, *factory.params.params)]
    passed = positional(made)
    return [passed[i] for i, name in enumerate(params) if name in called and i < len(passed)]
