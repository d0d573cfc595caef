"""What the gate checks (``Rule.gate_check``) share about CPython's tree: the scopes and the frames of
control statements as ``FileModel`` makes them, a callee's last name, and the names bound to a wanted
one under another name, the ways ``FileModel`` resolves a call through (an import ``as``, or an
assignment of a plain or dotted name: ``f = x.name``, as ``Rule.gate``'s ``alias``)."""

from __future__ import annotations

import ast
from typing import Any, Protocol, TypeVar

# The nodes that open a scope of ``FileModel`` (a comprehension opens none), by the scope's kind
SCOPE_KINDS = {
    ast.FunctionDef: "function",
    ast.AsyncFunctionDef: "function",
    ast.Lambda: "lambda",
    ast.ClassDef: "class",
}
# The fields of a control statement, each with the frame its children sit in (None: the outer frames).
CONTROL_PARTS: dict[type, tuple[tuple[str, str | None, str], ...]] = {
    ast.If: (("test", None, ""), ("body", "if", "body"), ("orelse", "if", "orelse")),
    ast.For: (
        ("target", None, ""),
        ("iter", None, ""),
        ("body", "loop", "body"),
        ("orelse", "loop", "orelse"),
    ),
    ast.While: (("test", None, ""), ("body", "loop", "body"), ("orelse", "loop", "orelse")),
    ast.With: (("items", None, ""), ("body", "with", "body")),
    # (not ``try``/``except*``: the model keeps no frame for it)
    ast.Try: (
        ("body", "try", "body"),
        ("handlers", "try", "handler"),
        ("orelse", "try", "else"),
        ("finalbody", "try", "finally"),
    ),
}
CONTROL_PARTS[ast.AsyncFor] = CONTROL_PARTS[ast.For]
CONTROL_PARTS[ast.AsyncWith] = CONTROL_PARTS[ast.With]


class ScopeLike(Protocol):
    """A check's own scope record: its kind (``SCOPE_KINDS``' values, or "module") and the scope around."""

    @property
    def kind(self) -> str: ...
    @property
    def parent(self) -> Any: ...


S = TypeVar("S", bound=ScopeLike)


def enclosing_class(scope: S) -> S | None:
    """``Scope.enclosing_class``: for a method (or a function nested in one), its class."""
    current: S | None = scope
    while current is not None and current.kind in ("function", "lambda"):
        if current.parent is not None and current.parent.kind == "class":
            return current.parent
        current = current.parent
    return None


Bindings = list[tuple[str, str]]  # (name bound, the last name of what it is bound to)
# the statements that may bind a name under another one (see ``binding``)
BINDERS = frozenset({ast.Assign, ast.AnnAssign, ast.NamedExpr, ast.Import, ast.ImportFrom})


def last_name(node: ast.AST) -> str | None:
    """``f`` of ``f`` and of ``x.f``; None for any other callee."""
    if type(node) is ast.Name:
        return node.id  # type: ignore[attr-defined]
    if type(node) is ast.Attribute:
        return node.attr  # type: ignore[attr-defined]
    return None


def positional(call: ast.Call) -> list[ast.expr]:
    """``syntax.positional``: the arguments without a keyword or a star."""
    return [a for a in call.args if type(a) is not ast.Starred]


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    """The value of the keyword argument ``name``, if given."""
    return next((k.value for k in call.keywords if k.arg == name), None)


def first_arg(call: ast.Call, name: str) -> ast.expr | None:
    """``syntax.first_arg``: the first positional argument, else the keyword ``name``."""
    args = positional(call)
    return args[0] if args else keyword(call, name)


def binding(node: ast.AST, into: Bindings) -> None:
    """Adds to ``into`` the names ``node`` (one of ``BINDERS``) binds to a plain or dotted name."""
    kind = type(node)
    if kind is ast.Import or kind is ast.ImportFrom:
        into.extend((a.asname, a.name.rpartition(".")[2]) for a in node.names if a.asname)  # type: ignore[attr-defined]
        return
    value = last_name(node.value) if node.value is not None else None  # type: ignore[attr-defined]
    if value is None:
        return
    targets = node.targets if kind is ast.Assign else [node.target]  # type: ignore[attr-defined]
    into.extend((t.id, value) for t in targets if type(t) is ast.Name)


def names_bound_to(wanted: frozenset[str], bindings: Bindings) -> set[str]:
    """``wanted`` and every name bound to one of them (or to a name bound to one), until no new one."""
    names = set(wanted)
    grown = bool(bindings)
    while grown:
        grown = False
        for name, value in bindings:
            if value in names and name not in names:
                names.add(name)
                grown = True
    return names
