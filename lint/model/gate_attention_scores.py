"""Whether a file can hold TL405's finding, read from CPython's tree before libcst is asked: a method of a
module class that calls a softmax and multiplies queries by transposed keys and the result by values,
in a file that does not call the fused attention kernel."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from trainlint.model.gate_calls import BINDERS, Bindings, binding, last_name, names_bound_to
from trainlint.model.pyast import ast_dotted as dotted
from trainlint.model.vocab import SDPA

SDPA_NAMES = frozenset(name.rpartition(".")[2] for name in SDPA)
_SOFTMAX_NAMES = frozenset({"softmax", "log_softmax"})  # the rule's ``attr_name(call)`` filter
_TRANSPOSES = frozenset({"transpose", "swapaxes"})
_KEY_AXES = ({-2, -1}, {2, 3})
# compound statements: a product, softmax or values product in their header is in no
# ``SimpleStatementLine``, where ``_softmax_then_values`` looks (their bodies' statements are)
_COMPOUND = (
    ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.Match,
    ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
    *((ast.TryStar,) if hasattr(ast, "TryStar") else ()),
)  # fmt: skip
_Use = tuple[int, int, str | None]  # (the line of its simple statement, the node's id, callee's last name)
# a score product: its line, its id, and its (queries, keys) where ``_score_product`` surely reads them so
_Score = tuple[int, int, tuple[ast.expr, ast.expr] | None]
_NORMALIZE = frozenset({"torch.nn.functional.normalize"})


@dataclass
class _Function:
    """What TL405 needs of one function, seen from its own scope (``walk_scope``)."""

    in_module_class: bool  # its ``Scope.enclosing_class`` has a base whose dotted name ends with Module
    softmax: bool = False  # a call named softmax/log_softmax in its scope (not in a lambda)
    # score products (``_score_product``) of its simple statements, not in a lambda
    scores: list[_Score] = field(default_factory=list)
    # in its simple statements, lambdas included: ``@`` operations (callee None) and calls
    uses: list[_Use] = field(default_factory=list)
    # the values assigned to plain names in its own scope (``FileModel.values_of`` finds them first)
    assigned: dict[str, list[ast.expr]] = field(default_factory=dict)


def hand_written_attention(tree: ast.Module) -> bool:
    """Whether some function may hold attention written out by hand, as TL405 reports it, in a file
    that does not surely call ``scaled_dot_product_attention``.

    TL405 reports a score product (``q @ k.transpose(-2, -1)``, ``k.mT``, ``torch.matmul(q, ...)``)
    found by ``walk_scope`` in a function that is the scope of a call named ``softmax``/``log_softmax``,
    whose ``enclosing_class`` (the class of a method, or of the method a function is nested in) has a
    base whose dotted name ends with ``Module``, when ``_softmax_then_values`` finds a softmax of the
    scores and then a product of its result: all three in the function's ``SimpleStatementLine``s
    (lambdas included for the last two), the softmax's statement not before the product's, the values
    product (another ``@``, or ``torch.matmul`` through any name bound to it) not before the softmax's.
    A product whose queries are one token or whose queries and keys are normalised is excused, as the
    rule excuses it, where the model surely sees that (``_excused``). The rule reports nothing in a
    file where a call resolves to the fused kernel: that is taken only where the callee's head name has
    no binding but module-level imports that make it one (``FileModel.qualname`` then resolves it from
    any scope). (A simple statement of a one-line suite counts too: a superset of the rule's lines.)"""
    found = _Found()
    # (node, the function whose scope it is in, in a lambda, the enclosing class's flag, statement line)
    stack: list[tuple[ast.AST, _Function | None, bool, bool | None, int | None]] = [
        (tree, None, False, None, None)
    ]
    while stack:
        node, function, in_lambda, module_class, line = stack.pop()
        kind = type(node)
        if kind is ast.ClassDef:
            found.others.add(node.name)  # type: ignore[attr-defined]
            # (its decorators and bases sit in the class's own scope: no function's)
            function, in_lambda, line = None, False, None
            module_class = any(_is_module_base(base) for base in node.bases)  # type: ignore[attr-defined]
        elif kind is ast.FunctionDef or kind is ast.AsyncFunctionDef:
            found.others.add(node.name)  # type: ignore[attr-defined]
            function, line = _Function(bool(module_class)), None
            found.functions.append(function)
        elif isinstance(node, ast.stmt):
            line = None if isinstance(node, _COMPOUND) else node.lineno
            if kind in BINDERS:
                binding(node, found.bindings)
                if (
                    function is not None
                    and not in_lambda
                    and kind is not ast.Import
                    and kind is not ast.ImportFrom
                ):
                    _assigned(node, function)
        elif kind is ast.Lambda:
            in_lambda = True
        elif kind is ast.Call:
            found.call(node, function, in_lambda, line)  # type: ignore[arg-type]
        elif kind is ast.BinOp and type(node.op) is ast.MatMult:  # type: ignore[attr-defined]
            found.product(node, function, in_lambda, line)  # type: ignore[arg-type]
        elif kind is ast.NamedExpr:
            binding(node, found.bindings)
            if function is not None and not in_lambda:
                _assigned(node, function)
        _bound(node, function is None and module_class is None, found.imports, found.others)
        stack.extend((child, function, in_lambda, module_class, line) for child in ast.iter_child_nodes(node))
    return found.may_report()


@dataclass
class _Found:
    """TL405's facts, gathered over the tree."""

    functions: list[_Function] = field(default_factory=list)
    bindings: Bindings = field(default_factory=list)
    fused: list[str] = field(default_factory=list)  # dotted callees named as the fused kernel
    imports: dict[str, set[str]] = field(default_factory=dict)  # module-level: name -> qualified names
    others: set[str] = field(default_factory=set)  # names bound any other way, anywhere

    def call(self, call: ast.Call, function: _Function | None, in_lambda: bool, line: int | None) -> None:
        callee = last_name(call.func)
        if callee in SDPA_NAMES:
            path = dotted(call.func)
            if path is not None:
                self.fused.append(path)
        if function is None or callee is None:
            return
        if line is not None:
            function.uses.append((line, id(call), callee))
        if in_lambda:
            return
        if callee in _SOFTMAX_NAMES:
            function.softmax = True
        elif callee == "matmul" and line is not None and len(call.args) + len(call.keywords) == 2:
            # (libcst's second argument may be a keyword's, or follow a ``*``: any may be the keys)
            values = [a.value if type(a) is ast.Starred else a for a in call.args]
            values += [k.value for k in call.keywords]
            if any(_transposed_key(v) for v in values):
                plain = not call.keywords and not any(type(a) is ast.Starred for a in call.args)
                function.scores.append((line, id(call), (call.args[0], call.args[1]) if plain else None))

    def product(self, node: ast.BinOp, function: _Function | None, in_lambda: bool, line: int | None) -> None:
        if function is None or line is None:
            return
        function.uses.append((line, id(node), None))
        if not in_lambda and _transposed_key(node.right):
            function.scores.append((line, id(node), (node.left, node.right)))

    def may_report(self) -> bool:
        softmax = names_bound_to(_SOFTMAX_NAMES, self.bindings)
        matmul = names_bound_to(frozenset({"matmul"}), self.bindings)
        if not any(self._may_report(function, softmax, matmul) for function in self.functions):
            return False
        return not any(self.surely(callee, SDPA) for callee in self.fused)

    def _may_report(self, function: _Function, softmax: set[str], matmul: set[str]) -> bool:
        """A score product the rule does not excuse, a softmax (``_is_softmax``: by a name bound to one)
        in a statement not before it, and another product (``_matmul_left``) in a statement not before
        that softmax's."""
        if not (function.in_module_class and function.softmax and function.scores):
            return False
        softmaxes = sorted(line for line, _, callee in function.uses if callee in softmax)
        products = [(line, key) for line, key, callee in function.uses if callee is None or callee in matmul]
        for line, key, operands in function.scores:
            first = next((at for at in softmaxes if at >= line), None)
            if first is None or not any(at >= first and other != key for at, other in products):
                continue
            if operands is None or not self._excused(function, *operands):
                return True
        return False

    def _excused(self, function: _Function, queries: ast.expr, keys: ast.expr) -> bool:
        """``_single_query`` (one query token: ``x[:, 0:1]``) or ``_channel_attention`` (queries and
        keys L2-normalised by ``F.normalize``), each read where the model surely reads it: in the
        operand, or in a value the function itself assigns to the operand's name."""
        if any(_one_token(value) for value in _values(function, queries)):
            return True
        return all(
            any(self._normalized(value) for value in _values(function, operand))
            for operand in (queries, keys)
        )

    def _normalized(self, expr: ast.expr) -> bool:
        for node in ast.walk(expr):
            if type(node) is ast.Call:
                path = dotted(node.func)  # type: ignore[attr-defined]
                if path is not None and self.surely(path, _NORMALIZE):
                    return True
        return False

    def surely(self, path: str, wanted: frozenset[str]) -> bool:
        """``FileModel.qualname`` resolves ``path`` to one of ``wanted`` from any scope: its head is
        bound only by module-level imports, each of which makes it one."""
        head, _, rest = path.partition(".")
        targets = self.imports.get(head)
        if not targets or head in self.others:
            return False
        return all((f"{target}.{rest}" if rest else target) in wanted for target in targets)


def _assigned(node: ast.AST, function: _Function) -> None:
    """Notes the value a plain-name target of an assignment gets (``_bind_target``: not a tuple's)."""
    value = node.value  # type: ignore[attr-defined]
    if value is None:
        return
    targets = node.targets if type(node) is ast.Assign else [node.target]  # type: ignore[attr-defined]
    for target in targets:
        if type(target) is ast.Name:
            function.assigned.setdefault(target.id, []).append(value)


def _values(function: _Function, expr: ast.expr) -> list[ast.expr]:
    """What ``values_of`` surely includes for a name (the function's own assignments of it: its scope
    is the first the model looks in), else the expression itself (the rule reads it so)."""
    if type(expr) is ast.Name:
        return function.assigned.get(expr.id, [])  # type: ignore[attr-defined]
    return [expr]


def _one_token(expr: ast.expr) -> bool:
    """A subscript ``[..., 0:1, ...]`` (or ``:1``) inside ``expr``."""
    for node in ast.walk(expr):
        if type(node) is ast.Subscript:
            index = node.slice  # type: ignore[attr-defined]
            for element in index.elts if type(index) is ast.Tuple else [index]:  # type: ignore[attr-defined]
                if type(element) is ast.Slice and _int_value(element.upper) == 1:  # type: ignore[attr-defined]
                    lower = element.lower  # type: ignore[attr-defined]
                    if lower is None or _int_value(lower) == 0:
                        return True
    return False


def _transposed_key(expr: ast.expr) -> bool:
    """``k.mT``, or ``k.transpose(a, b)``/``k.swapaxes(a, b)`` with {a, b} = {-2, -1} or {2, 3}."""
    if type(expr) is ast.Attribute:
        return expr.attr == "mT"  # type: ignore[attr-defined]
    if type(expr) is not ast.Call or last_name(expr.func) not in _TRANSPOSES:  # type: ignore[attr-defined]
        return False
    axes = [_int_value(a) for a in expr.args if type(a) is not ast.Starred]  # type: ignore[attr-defined]
    if len(axes) != 2 or None in axes:
        return False
    return set(axes) in _KEY_AXES


def _int_value(expr: ast.expr) -> int | None:
    """``syntax.int_value``: an integer literal, or one negated (``True`` is a name to libcst)."""
    negative = type(expr) is ast.UnaryOp and type(expr.op) is ast.USub  # type: ignore[attr-defined]
    if negative:
        expr = expr.operand  # type: ignore[attr-defined]
    if type(expr) is not ast.Constant or type(expr.value) is not int:  # type: ignore[attr-defined]
        return None
    return -expr.value if negative else expr.value  # type: ignore[attr-defined]


def _is_module_base(base: ast.expr) -> bool:
    path = dotted(base.value if type(base) is ast.Starred else base)  # type: ignore[attr-defined]
    return path is not None and path.endswith("Module")


def _bound(node: ast.AST, module_level: bool, imports: dict[str, set[str]], others: set[str]) -> None:
    """Notes the names ``node`` binds: module-level imports with their targets (``visit_Import``,
    ``visit_ImportFrom``), every other binding (``ClassDef``/``FunctionDef`` are noted by the caller)."""
    kind = type(node)
    if kind is ast.Import or kind is ast.ImportFrom:
        base = ""
        if kind is ast.ImportFrom:
            base = "." * node.level + (node.module or "")  # type: ignore[attr-defined]
        for alias in node.names:  # type: ignore[attr-defined]
            if alias.name == "*":
                continue
            if kind is ast.ImportFrom:
                name, target = alias.asname or alias.name, f"{base}.{alias.name}" if base else alias.name
            elif alias.asname:
                name, target = alias.asname, alias.name
            else:
                name = target = alias.name.partition(".")[0]
            if module_level:
                imports.setdefault(name, set()).add(target)
            else:
                others.add(name)
    elif kind is ast.Name:
        if type(node.ctx) is not ast.Load:  # type: ignore[attr-defined]
            others.add(node.id)  # type: ignore[attr-defined]
    elif kind is ast.arg:
        others.add(node.arg)  # type: ignore[attr-defined]
    elif kind is ast.ExceptHandler or kind is ast.MatchAs or kind is ast.MatchStar:
        if node.name:  # type: ignore[attr-defined]
            others.add(node.name)  # type: ignore[attr-defined]
    elif kind is ast.MatchMapping and node.rest:  # type: ignore[attr-defined]
        others.add(node.rest)  # type: ignore[attr-defined]
