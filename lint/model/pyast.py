"""Small readings of CPython's ``ast`` that the project index's summaries, the gate checks and
``--verify``'s name finder share (kept apart from ``summary`` so that a gate check does not load, or
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
