"""Syntax facts about libcst nodes: traversal, dotted names, call arguments and literal values.

Nothing here knows about scopes or files; ``filemodel`` builds on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import libcst as cst


def dotted(expr: cst.CSTNode | None) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts: list[str] = []
    while isinstance(expr, cst.Attribute):
        parts.append(expr.attr.value)
        expr = expr.value
    if isinstance(expr, cst.Name):
        parts.append(expr.value)
        return ".".join(reversed(parts))
    return None


def attr_name(call: cst.Call) -> str | None:
    """The method name of ``x.method(...)``, or the function name of ``f(...)``."""
    func = call.func
    if isinstance(func, cst.Attribute):
        return func.attr.value
    if isinstance(func, cst.Name):
        return func.value
    return None


def receiver(call: cst.Call) -> cst.BaseExpression | None:
    """``x`` in ``x.method(...)``."""
    return call.func.value if isinstance(call.func, cst.Attribute) else None


def keyword(call: cst.Call, name: str) -> cst.Arg | None:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == name:
            return arg
    return None


def has_star_kwargs(call: cst.Call) -> bool:
    return any(arg.star == "**" for arg in call.args)


def positional(call: cst.Call) -> list[cst.BaseExpression]:
    return [a.value for a in call.args if a.keyword is None and not a.star]


def first_arg(call: cst.Call, name: str | None = None) -> cst.BaseExpression | None:
    """The first positional argument, else the keyword argument ``name`` (when given)."""
    args = positional(call)
    if args:
        return args[0]
    if name is not None:
        kw = keyword(call, name)
        if kw is not None:
            return kw.value
    return None


# -- literals ------------------------------------------------------------------------------------------
def is_number(expr: cst.CSTNode | None) -> bool:
    if isinstance(expr, cst.Integer | cst.Float):
        return True
    return isinstance(expr, cst.UnaryOperation) and isinstance(expr.expression, cst.Integer | cst.Float)


def string_value(expr: cst.CSTNode | None) -> str | None:
    if isinstance(expr, cst.SimpleString):
        try:
            value = expr.evaluated_value
        except Exception:  # pragma: no cover - libcst raises on odd prefixes
            return None
        return value if isinstance(value, str) else None
    return None


def int_value(expr: cst.CSTNode | None, *, arithmetic: bool = False) -> int | None:
    """The value of an integer literal (``3``, ``0x3``, ``1_000``, ``-1``), else None; with
    ``arithmetic``, also of literal integer arithmetic (``5 * 8``, ``64 // 2``)."""
    if isinstance(expr, cst.Integer):
        return int(expr.value, 0)
    if (
        isinstance(expr, cst.UnaryOperation)
        and isinstance(expr.operator, cst.Minus)
        and isinstance(expr.expression, cst.Integer)
    ):
        return -int(expr.expression.value, 0)
    if arithmetic and isinstance(expr, cst.BinaryOperation):
        left, right = int_value(expr.left, arithmetic=True), int_value(expr.right, arithmetic=True)
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


def literal_false(arg: cst.Arg | None) -> bool:
    """An argument written as the literal ``False``."""
    return arg is not None and isinstance(arg.value, cst.Name) and arg.value.value == "False"


# -- fast traversal ------------------------------------------------------------------------------
# libcst's own traversal (``node.visit``, ``node.children``) rebuilds every node it passes, which costs
# as much as parsing. The model only needs the syntax nodes, in source order, so it reads the dataclass
# fields directly and skips the fields that only hold whitespace, comments and punctuation.
_TRIVIA_FIELDS = frozenset(
    {
        "asynchronous", "colon", "comma", "comment", "dot", "empty_lines", "equal", "first_colon",
        "first_line", "footer", "header", "last_line", "lbrace", "lbracket", "leading_lines",
        "leading_whitespace", "lines_after_decorators", "lpar", "newline", "rbrace", "rbracket",
        "relative", "rpar", "second_colon", "semicolon", "trailing_comma", "trailing_whitespace",
        "whitespace",
    }
)  # fmt: skip
# Classes whose dataclass field order is not their source order (``@decorator`` before ``def``,
# ``a if test else b``...). tests/test_performance.py checks every class against libcst's own order.
_SOURCE_ORDER = {
    "Arg": ("keyword", "value"),
    "ClassDef": ("decorators", "name", "type_parameters", "bases", "keywords", "body"),
    "ExceptHandler": ("type", "name", "body"),
    "ExceptStarHandler": ("type", "name", "body"),
    "FunctionDef": ("decorators", "name", "type_parameters", "params", "returns", "body"),
    "IfExp": ("body", "test", "orelse"),
    "MatchCase": ("pattern", "guard", "body"),
    "Parameters": ("posonly_params", "posonly_ind", "params", "star_arg", "kwonly_params", "star_kwarg"),
    "TypeAlias": ("name", "type_parameters", "value"),
}
_FIELDS: dict[type, tuple[str, ...]] = {}
_IS_NODE: dict[type, bool] = {}  # per class: is it a CSTNode (isinstance on libcst's ABCs is slow)


def child_fields(cls: type) -> tuple[str, ...]:
    """The fields of a node class that can hold syntax nodes, in source order."""
    found = _FIELDS.get(cls)
    if found is None:
        names = [
            f.name
            for f in dataclasses.fields(cls)
            if not f.name.startswith(("whitespace_", "_")) and f.name not in _TRIVIA_FIELDS
        ]
        order = _SOURCE_ORDER.get(cls.__name__)
        if order is not None:
            names = [n for n in order if n in names] + [n for n in names if n not in order]
        found = _FIELDS[cls] = tuple(names)
    return found


def _is_node(cls: type) -> bool:
    known = _IS_NODE.get(cls)
    if known is None:
        known = _IS_NODE[cls] = issubclass(cls, cst.CSTNode)
    return known


def children(node: cst.CSTNode) -> list[cst.CSTNode]:
    """The syntax children of a node in source order: ``node.children`` less whitespace, comments
    and punctuation, without the cost of libcst's rebuilding traversal."""
    out: list[cst.CSTNode] = []
    is_node = _IS_NODE
    for name in _FIELDS.get(type(node)) or child_fields(type(node)):
        value = getattr(node, name)
        kind = type(value)
        if kind is tuple or kind is list:
            for item in value:
                known = is_node.get(type(item))
                if known or (known is None and _is_node(type(item))):
                    out.append(item)
        else:
            known = is_node.get(kind)
            if known or (known is None and _is_node(kind)):
                out.append(value)
    return out


def walk(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """Every syntax node below ``node`` (pre-order, source order), ``node`` included. Whitespace,
    comment and punctuation nodes (commas, parentheses, colons) are not visited."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        kids = children(current)
        if kids:
            kids.reverse()
            stack.extend(kids)


# compared by exact type (libcst's node classes are never subclassed): ``isinstance`` asks ABCMeta for
# every node that is none of them, a fifth of what pre-commit's run spends in the rules
_SCOPE_NODES = frozenset({cst.FunctionDef, cst.ClassDef, cst.Lambda})


def walk_scope(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """Like ``walk`` but does not descend into nested function, lambda or class bodies."""
    stack = children(node)
    stack.reverse()
    while stack:
        current = stack.pop()
        yield current
        if type(current) in _SCOPE_NODES:
            continue
        kids = children(current)
        if kids:
            kids.reverse()
            stack.extend(kids)


def block_of(root: cst.CSTNode, statement: cst.CSTNode) -> cst.CSTNode | None:
    """The block (indented block or module) whose body lists ``statement`` directly."""
    for node in walk(root):
        if isinstance(node, cst.IndentedBlock | cst.Module) and any(s is statement for s in node.body):
            return node
    return None


def standalone_call(statement: cst.CSTNode, call: cst.Call) -> bool:
    """``statement`` is a line holding nothing but ``call``."""
    return (
        isinstance(statement, cst.SimpleStatementLine)
        and len(statement.body) == 1
        and isinstance(statement.body[0], cst.Expr)
        and statement.body[0].value is call
    )
