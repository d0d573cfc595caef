"""Small readings of CPython's ``ast`` that the project index's summaries, the gate checks and
``--verify``'s name finder share, and how an import reaches a qualified name (kept apart from ``summary`` so that a gate check does not load, or
count as, the index)."""

from __future__ import annotations

import ast


def ast_dotted(node: ast.AST | None) -> str | None:
    """``a.b.c`` for a Name/Attribute chain of CPython's tree, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def reached_through(target: str, callees: frozenset[str]) -> bool:
    """Whether an imported definition reached through the import ``target`` (``pkg.mod.f``, or a
    module ``pkg.mod`` imported whole) may be what one of ``callees`` (qualified names) calls: the
    target itself, or a name under it (``pkg.mod.f``, ``pkg.Net.from_pretrained``). Leading dots
    are ignored: the index and the checks spell ``from . import x`` differently."""
    bare = target.lstrip(".")
    return any(c.lstrip(".") == bare or c.lstrip(".").startswith(bare + ".") for c in callees)
