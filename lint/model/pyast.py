"""Small readings of CPython's ``ast`` that the project index's summaries, the gate checks and
``--verify``'s name finder share, and how an import reaches a qualified name (kept apart from ``summary`` so that a gate check does not load, or
count as, the index)."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

_Facts = TypeVar("_Facts")


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


def of_last_tree(walk: Callable[[ast.Module], _Facts]) -> Callable[[ast.Module], _Facts]:
    """``walk``, kept for the tree asked last: a rule's gate checks ask the same tree in turn (its own
    findings, the cross-file ones, their callees). One tuple, replaced whole: a thread (the language
    server verifies in one) never reads another tree's facts."""
    last: list[tuple[Any, Any]] = [(None, None)]
    _HELD.append(last)

    def facts_of(tree: ast.Module) -> _Facts:
        held = last[0]
        if held[0] is not tree:
            held = last[0] = (tree, walk(tree))
        return held[1]  # type: ignore[no-any-return]

    return facts_of


# The memo of every ``of_last_tree`` walk: a tree left in one once the gate has answered survives to be
# scanned by the garbage collector's young generations, every node of it (5 % of a cold run's CPU).
_HELD: list[list[tuple[Any, Any]]] = []


def forget_trees() -> None:
    """Let go of the trees the walks were asked last (a file's gate is done with them)."""
    for last in _HELD:
        last[0] = (None, None)


def import_bindings(node: ast.Import | ast.ImportFrom) -> Iterator[tuple[str, str]]:
    """The names an import binds, each with the dotted target ``FileModel`` resolves it to: ``import
    a.b`` binds ``a`` (to ``a``), ``import a.b as c`` binds ``c`` to ``a.b``, ``from .m import f as g``
    binds ``g`` to ``.m.f``; a star import binds none that can be named."""
    base = "." * node.level + (node.module or "") if isinstance(node, ast.ImportFrom) else None
    for alias in node.names:
        if base is None:
            bound = alias.asname or alias.name.partition(".")[0]
            yield bound, alias.name if alias.asname else bound
        elif alias.name != "*":
            yield alias.asname or alias.name, f"{base}.{alias.name}" if base else alias.name
