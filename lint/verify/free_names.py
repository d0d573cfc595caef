"""The free names of a snippet on CPython's ``ast``: the answers of ``source.analyse_names_cst``
(libcst's scope and expression-context analysis) at about a fortieth of its cost.

Building the probes of a run resolves libcst's metadata for every snippet, and that was most of the
parent's time (155 snippets for fixtures/). This module follows libcst's rules, quirks included, so
that the probes built are the same: a class body binds names for the methods in it, an import binds
a top-level name only when it is a top-level statement, ``del x`` is not a binding for nested code,
keyword argument and imported module names are not reads. Where ``ast`` cannot say exactly what libcst
says (``global``/``nonlocal``, ``match``, ``TypeVar``/``NewType``, a name whose position is not its text,
code ``ast`` does not parse), ``analyse`` returns None and the caller uses the libcst version.
tests/verify/test_free_names_s6.py compares the two on every snippet the fixtures' probes build.
"""

from __future__ import annotations

import ast
import builtins
import warnings
from dataclasses import dataclass

from trainlint.model.pyast import ast_dotted

# positions compare as (line, column); columns are UTF-8 offsets here and characters in libcst, which
# order the names of one line the same way
Pos = tuple[int, int]
_BUILTINS = frozenset(dir(builtins))
# constructs whose libcst analysis this module does not reproduce: the libcst version answers
_UNSUPPORTED = tuple(
    getattr(ast, kind) for kind in ("Global", "Nonlocal", "Match", "TypeAlias") if hasattr(ast, kind)
)
_TRY = tuple(getattr(ast, kind) for kind in ("Try", "TryStar") if hasattr(ast, kind))
_UNSUPPORTED_TEXT = ("TypeVar", "NewType")  # libcst skips the first argument of these calls


@dataclass
class Names:
    free: list[str]  # names read before any assignment in the snippet, in order of first use
    assigned: set[str]
    attrs: list[str]  # dotted chains (``args.max_norm``) whose head is free


class _Scope:
    """A libcst scope: what it binds (assignments recorded in it) and the scope it sits in."""

    __slots__ = ("bound", "parent")

    def __init__(self, parent: _Scope | None) -> None:
        self.parent = parent
        self.bound: set[str] = set()


class _Unsupported(Exception):
    pass


def _start(node: ast.AST) -> Pos:
    return node.lineno, node.col_offset  # type: ignore[attr-defined]


def _end(node: ast.AST) -> Pos:
    return node.end_lineno, node.end_col_offset  # type: ignore[attr-defined]


class _Walk:
    """One pass over the tree: reads with their scope, module-level bindings with the point where
    they take effect, attribute chains read, and each scope's bindings."""

    def __init__(self, lines: list[bytes]) -> None:
        self.lines = lines
        self.top = _Scope(None)
        self.scope = self.top
        self.loads: list[tuple[Pos, str, _Scope]] = []
        self.first_store: dict[str, Pos] = {}
        self.assigned: set[str] = set()
        self.attrs: list[tuple[tuple[int, int, int, int], str]] = []

    # -- recording ------------------------------------------------------------------------------

    def check(self, node: ast.Name) -> None:
        """A name whose recorded position is not its text (an f-string part on some Pythons, a name
        ``ast`` normalises): positions could order names differently from libcst's."""
        line = self.lines[node.lineno - 1] if node.lineno <= len(self.lines) else b""
        if node.end_lineno != node.lineno or line[node.col_offset : node.end_col_offset] != node.id.encode():
            raise _Unsupported

    def bind(self, name: str, where: Pos | None) -> None:
        """A binding in the current scope; ``where``: the point it takes effect at module level."""
        self.scope.bound.add(name)
        if where is not None and self.scope is self.top:
            self.assigned.add(name)
            self.first_store[name] = min(self.first_store.get(name, where), where)

    def target(self, node: ast.AST, where: Pos) -> None:
        """An assignment target: names bound (``where`` at module level), attributes and subscripts
        read inside it."""
        if isinstance(node, ast.Name):
            self.check(node)
            if isinstance(node.ctx, ast.Del):
                if self.scope is self.top:  # a deletion counts as a module-level binding, not a scope's
                    self.assigned.add(node.id)
                    self.first_store[node.id] = min(self.first_store.get(node.id, where), where)
                return
            self.bind(node.id, where)
        elif isinstance(node, ast.Tuple | ast.List):
            for elt in node.elts:
                self.target(elt, where)
        elif isinstance(node, ast.Starred):
            self.target(node.value, where)
        else:  # attribute or subscript: its parts are reads
            self.expr(node)

    # -- statements -----------------------------------------------------------------------------

    def body(self, stmts: list[ast.stmt]) -> None:
        for stmt in stmts:
            self.stmt(stmt)

    def stmt(self, node: ast.stmt) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            self.function(node)
        elif isinstance(node, ast.ClassDef):
            self.klass(node)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign | ast.Delete):
            self.assignment(node)
        elif isinstance(node, ast.For | ast.AsyncFor):
            self.expr(node.iter)
            self.target(node.target, _end(node.iter))
            self.body(node.body)
            self.body(node.orelse)
        elif isinstance(node, ast.With | ast.AsyncWith):
            for item in node.items:
                self.expr(item.context_expr)
                if item.optional_vars is not None:
                    self.target(item.optional_vars, _end(item.optional_vars))
            self.body(node.body)
        elif isinstance(node, _TRY):
            self.body(node.body)
            for handler in node.handlers:
                if handler.type is not None:
                    self.expr(handler.type)
                if handler.name is not None:  # bound at the name, which follows the type
                    where = _end(handler.type) if handler.type is not None else _start(handler)
                    self.bind(handler.name, where)
                self.body(handler.body)
            self.body(node.orelse)
            self.body(node.finalbody)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            self.imported(node)
        elif isinstance(node, _UNSUPPORTED):
            raise _Unsupported
        else:  # if, while, expression, return, raise, assert...: expressions and bodies
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    self.stmt(child)
                elif isinstance(child, ast.expr):
                    self.expr(child)

    def assignment(self, node: ast.Assign | ast.AnnAssign | ast.AugAssign | ast.Delete) -> None:
        """Targets are bound once the whole statement has run (``loss = loss / n`` reads first)."""
        where = _end(node)
        if isinstance(node, ast.Delete):
            for tgt in node.targets:
                self.target(tgt, where)
            return
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            self.check(node.target)
            self.loads.append((_start(node.target), node.target.id, self.scope))  # ``n += 1`` reads n
        if isinstance(node, ast.AnnAssign):
            self.expr(node.annotation)
        if node.value is not None:
            self.expr(node.value)
        for tgt in node.targets if isinstance(node, ast.Assign) else [node.target]:
            self.target(tgt, where)

    def imported(self, node: ast.Import | ast.ImportFrom) -> None:
        """Imports bind in their scope; the module paths are attribute reads for libcst."""
        if isinstance(node, ast.ImportFrom):
            if node.module and "." in node.module:
                self.module_path(node.module, _start(node))
            for alias in node.names:
                if alias.name != "*":
                    self.scope.bound.add(alias.asname or alias.name)
            return
        for alias in node.names:
            self.module_path(alias.name, _start(alias))
            if alias.asname is not None:
                self.scope.bound.add(alias.asname)
                continue
            parts = alias.name.split(".")
            for i in range(1, len(parts) + 1):
                self.scope.bound.add(".".join(parts[:i]))

    def module_path(self, path: str, where: Pos) -> None:
        parts = path.split(".")
        for i in range(len(parts), 1, -1):  # the whole path first, as a pre-order walk meets them
            self.attrs.append(((where[0], where[1], -where[0], -(where[1] + i)), ".".join(parts[:i])))

    def function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        """Decorators, defaults, annotations and the name in the enclosing scope; parameters and
        body in the function's."""
        if getattr(node, "type_params", None):
            raise _Unsupported
        args = node.args
        for default in [*args.defaults, *(d for d in args.kw_defaults if d is not None)]:
            self.expr(default)
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        params += [a for a in (args.vararg, args.kwarg) if a is not None]
        if not isinstance(node, ast.Lambda):
            for dec in node.decorator_list:
                self.expr(dec)
            for param in params:
                if param.annotation is not None:
                    self.expr(param.annotation)
            if node.returns is not None:
                self.expr(node.returns)
            self.bind(node.name, _start(node))  # the ``def`` keyword: nothing is read before the name
        outer, self.scope = self.scope, _Scope(self.scope)
        for param in params:
            self.scope.bound.add(param.arg)
        if isinstance(node, ast.Lambda):
            self.expr(node.body)
        else:
            self.body(node.body)
        self.scope = outer

    def klass(self, node: ast.ClassDef) -> None:
        if getattr(node, "type_params", None):
            raise _Unsupported
        for part in [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]:
            self.expr(part)
        self.bind(node.name, _start(node))
        outer, self.scope = self.scope, _Scope(self.scope)
        self.body(node.body)
        self.scope = outer

    # -- expressions ----------------------------------------------------------------------------

    def expr(self, node: ast.expr) -> None:
        if isinstance(node, ast.Name):
            if not isinstance(node.ctx, ast.Load):
                raise _Unsupported  # a binding outside the targets read above
            self.check(node)
            self.loads.append((_start(node), node.id, self.scope))
            return
        if isinstance(node, ast.Attribute):
            path = ast_dotted(node)
            if path is not None and isinstance(node.ctx, ast.Load):
                self.attrs.append(((*_start(node), -node.end_lineno, -node.end_col_offset), path))  # type: ignore[operator]
            self.expr(node.value)
            return
        if isinstance(node, ast.NamedExpr):
            self.expr(node.value)
            self.target(node.target, _end(node))
            return
        if isinstance(node, ast.Lambda):
            self.function(node)
            return
        if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            self.comprehension(node)
            return
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self.expr(child)
            elif isinstance(child, ast.keyword):
                self.expr(child.value)
            elif isinstance(child, ast.comprehension | ast.arguments):  # not reached: handled above
                raise _Unsupported
            # slices and the like are expressions; operators and contexts hold no names

    def comprehension(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp) -> None:
        """The first iterable is read outside the comprehension's scope, the rest inside it."""
        first, *rest = node.generators
        self.expr(first.iter)
        outer, self.scope = self.scope, _Scope(self.scope)
        self.target(first.target, _end(first.iter))
        for cond in first.ifs:
            self.expr(cond)
        for gen in rest:
            self.expr(gen.iter)
            self.target(gen.target, _end(gen.iter))
            for cond in gen.ifs:
                self.expr(cond)
        for part in (node.key, node.value) if isinstance(node, ast.DictComp) else (node.elt,):
            self.expr(part)
        self.scope = outer


def _bound_on_the_way(name: str, scope: _Scope, top: _Scope) -> bool:
    """Whether a scope from ``scope`` up to ``top`` (not included) binds ``name``: class bodies count,
    as in libcst's scope chain."""
    current: _Scope | None = scope
    while current is not None and current is not top:
        if name in current.bound:
            return True
        current = current.parent
    return False


def _top_level_definitions(module: ast.Module, walk: _Walk) -> None:
    """Defs, classes and imports written as top-level statements bind from the start of their line
    (libcst's statement line: ``x = os.sep; import os`` reads ``os`` after its binding)."""
    line_start: Pos = (0, 0)
    previous: ast.stmt | None = None  # the simple statement before, on a line that may go on
    for stmt in module.body:
        simple = not hasattr(stmt, "body") and not isinstance(stmt, _UNSUPPORTED)
        if not (simple and previous is not None and stmt.lineno == previous.end_lineno):
            line_start = _start(stmt)  # a new line; ``a; b`` keeps the start of ``a``
        previous = stmt if simple else None
        names: list[str] = []
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names = [stmt.name]
        elif isinstance(stmt, ast.Import):
            names = [a.asname or a.name.split(".")[0] for a in stmt.names]
        elif isinstance(stmt, ast.ImportFrom):
            names = [a.asname or a.name for a in stmt.names if a.name != "*"]
        for name in names:
            walk.assigned.add(name)
            walk.first_store[name] = min(walk.first_store.get(name, line_start), line_start)


def analyse(code: str) -> Names | None:
    """Names read before being bound, names bound, and attribute chains of the free names, as
    libcst's analysis gives them; None where this module cannot be sure of that."""
    if any(text in code for text in _UNSUPPORTED_TEXT) or "\r" in code or "\f" in code:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ``"\d"`` in a snippet: not the user's concern here
            module = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError):
        return None
    walk = _Walk(code.encode().split(b"\n"))
    try:
        walk.body(module.body)
    except _Unsupported:
        return None
    _top_level_definitions(module, walk)
    free: list[str] = []
    for where, name, scope in sorted(walk.loads, key=lambda item: item[0]):
        if scope is not walk.top:
            # inside a nested def/lambda/comprehension: free when no scope on the way binds it
            if _bound_on_the_way(name, scope, walk.top) or name in walk.first_store:
                continue
        elif name in walk.first_store and walk.first_store[name] < where:
            continue
        if name in _BUILTINS or name in free:
            continue
        free.append(name)
    heads = set(free)
    attrs: list[str] = []
    for _, path in sorted(walk.attrs, key=lambda item: item[0]):
        if path.split(".")[0] in heads and path not in attrs:
            attrs.append(path)
    return Names(free, walk.assigned, attrs)
