"""Whether a file can hold TL507's finding, read from CPython's tree before libcst is asked: a module
wrapped in ``DistributedDataParallel`` (or the wrapper's ``.module``) called directly in a loop of a scope
that runs a backward, where the wrapper itself is not called in that loop.

The walk mirrors what ``FileModel`` records for the rule: scopes (module, class, function, lambda; a
def's decorators, defaults and annotations belong to the def, comprehensions to their enclosing scope),
and for each call the loops around it, which, as in the model, are not reset where a nested function
starts. Wherever it cannot be as precise it answers True.
"""

from __future__ import annotations

import ast

from trainlint.model.gate_calls import BINDERS, SCOPE_KINDS, Bindings, binding, first_arg, names_bound_to
from trainlint.model.pyast import ast_dotted as dotted
from trainlint.model.vocab import DDP_CLASSES

# the last part of every name in ``vocab.DDP_CLASSES``
_WRAPPERS = frozenset(name.rpartition(".")[2] for name in DDP_CLASSES)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
# Nodes that hold no call and bind nothing the check reads: not walked into.
_LEAVES = frozenset(
    {ast.Name, ast.Constant, ast.Global, ast.Nonlocal, ast.Pass, ast.Break, ast.Continue, ast.alias}
    | {
        cls
        for base in (ast.expr_context, ast.operator, ast.unaryop, ast.cmpop, ast.boolop)
        for cls in base.__subclasses__()
    }
)
Where = tuple[int, int] | None  # a call's start; None inside an f-string (CPython < 3.12 may misplace it)


class _Scope:
    """A scope of ``FileModel``: ``owner`` is its ``enclosing_class`` (the class whose ``self`` a method,
    or a function nested in one, sees); ``backward``: it makes an ``x.backward(...)`` call."""

    __slots__ = ("backward", "kind", "owner")

    def __init__(self, kind: str, parent: _Scope | None) -> None:
        self.kind = kind
        self.backward = False
        self.owner: _Scope | None = None
        if kind in ("function", "lambda") and parent is not None:
            self.owner = parent if parent.kind == "class" else parent.owner


# (scope, ids of the loops around, id of the innermost loop whose body holds it, inside an f-string)
_Context = tuple[_Scope, tuple[int, ...], int | None, bool]


class _Call:
    """A call of a dotted name in a loop: ``loop`` is the innermost loop whose body repeats it
    (``flow.innermost_loop``), ``loops`` every loop around it (either branch)."""

    __slots__ = ("loop", "loops", "name", "scope", "where")

    def __init__(
        self, name: str, scope: _Scope, where: Where, loops: tuple[int, ...], loop: int | None
    ) -> None:
        self.name = name
        self.scope = scope
        self.where = where
        self.loops = loops
        self.loop = loop


class _Wrap:
    """``outer = DistributedDataParallel(inner, ...)`` as ``_sharding.wraps`` finds it."""

    __slots__ = ("inner", "outer", "scope", "where")

    def __init__(self, outer: str, inner: str | None, scope: _Scope, where: Where) -> None:
        self.outer = outer
        self.inner = inner
        self.scope = scope
        self.where = where


class _Facts:
    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.assigned: list[tuple[ast.Call, list[str], _Scope]] = []  # ``a = b = call(...)``
        self.values: dict[str, list[ast.expr]] = {}  # name or ``self.attr`` -> values that may unwrap
        self.bindings: Bindings = []


def wrapped_module_may_be_called(tree: ast.Module) -> bool:
    """Whether some call ``name(...)`` sits in a loop body (``innermost_loop``, frames of enclosing
    scopes included) of a scope with an ``x.backward(...)`` call, not before (in program order, same
    scope) an assignment ``outer = W(inner, ...)`` where ``W`` may resolve to a DDP class (by its name, a
    name bound to it, or ``x.DistributedDataParallel``), no call of ``outer`` in that loop of that scope,
    and either ``name == inner != outer`` with the call in the wrap's scope (or, for ``self.`` names, a
    method of its class), or ``name`` is ``outer.module`` or a name / ``self.attr`` that some assignment
    of the file gives ``outer.module`` (either branch of a conditional, ``getattr(outer, "module", ...)``),
    with the call in the wrap's scope, its class, or anywhere when the wrap binds a plain global.

    TL507 reports only such calls (``WrappedModelBypassed.check``/``_bypasses``): each test is the
    rule's, or weaker (``no_grad`` is not asked, a global wrap is taken as seen from every scope, a
    name's values are those of every assignment of that name)."""
    facts = _walk(tree)
    names = names_bound_to(_WRAPPERS, facts.bindings)
    wraps = [
        _Wrap(outer, dotted(first_arg(call, "module")), scope, (call.lineno, call.col_offset))
        for call, targets, scope in facts.assigned
        if _may_be_wrapper(call.func, names)
        for outer in targets
    ]
    if not wraps:
        return False
    in_loop = {(id(c.scope), loop, c.name) for c in facts.calls for loop in c.loops}
    for call in facts.calls:
        if call.loop is None or not call.scope.backward:
            continue
        for wrap in wraps:
            if (id(call.scope), call.loop, wrap.outer) in in_loop or _before(call, wrap):
                continue
            owner = _same_owner(call.scope, wrap)
            if owner and wrap.inner and wrap.inner != wrap.outer and call.name == wrap.inner:
                return True
            seen = owner or (wrap.scope.kind == "module" and "." not in wrap.outer)
            if seen and _unwraps(call.name, wrap.outer, facts.values):
                return True
    return False


def _walk(tree: ast.Module) -> _Facts:
    """One iterative walk: each node with its scope, the loops around it, the innermost loop whose
    body holds it, and whether it sits in an f-string."""
    facts = _Facts()
    stack: list[tuple[ast.AST, _Context]] = [(tree, (_Scope("module", None), (), None, False))]
    pop, push = stack.pop, stack.append
    while stack:
        node, context = pop()
        kind = type(node)
        if kind is ast.Call:
            _note_call(node, context, facts)  # type: ignore[arg-type]
        elif kind in BINDERS:
            binding(node, facts.bindings)
            if kind is not ast.Import and kind is not ast.ImportFrom:
                _note_assignment(node, context[0], facts)
        elif kind in SCOPE_KINDS:
            # decorators, defaults and bases belong to the new scope too, as in the model
            context = (_Scope(SCOPE_KINDS[kind], context[0]), *context[1:])  # type: ignore[assignment]
        elif kind is ast.JoinedStr:
            context = (*context[:3], True)  # type: ignore[assignment]
        elif kind in _LOOPS:
            scope, loops, loop, fstring = context
            around = (*loops, id(node))
            push_all = [(c, (scope, around, id(node), fstring)) for c in node.body]  # type: ignore[attr-defined]
            push_all += [(c, (scope, around, loop, fstring)) for c in node.orelse]  # type: ignore[attr-defined]
            stack.extend(push_all)
            heads = (node.test,) if kind is ast.While else (node.target, node.iter)  # type: ignore[attr-defined]
            stack.extend((c, context) for c in heads)
            continue
        for child in ast.iter_child_nodes(node):
            if type(child) not in _LEAVES:
                push((child, context))
    return facts


def _note_call(node: ast.Call, context: _Context, facts: _Facts) -> None:
    scope, loops, loop, fstring = context
    func = node.func
    if type(func) is ast.Attribute and func.attr == "backward":
        scope.backward = True  # (``Training._classify``: a ``backward`` method call is the event)
    if loops:
        name = dotted(func)
        if name is not None:
            where = None if fstring else (node.lineno, node.col_offset)
            facts.calls.append(_Call(name, scope, where, loops, loop))


def _note_assignment(node: ast.AST, scope: _Scope, facts: _Facts) -> None:
    """Keep the calls assigned to dotted names (the wraps), and the values ``values_of`` may return for
    a name or ``self.attr`` that may be a wrapper's ``.module``."""
    value = node.value  # type: ignore[attr-defined]
    if value is None:
        return
    targets = node.targets if type(node) is ast.Assign else [node.target]  # type: ignore[attr-defined]
    kind = type(value)
    if kind is ast.Call and type(node) is not ast.NamedExpr:
        names = [n for n in map(dotted, targets) if n]
        if names:
            facts.assigned.append((value, names, scope))
    if kind is ast.IfExp or kind is ast.Call or (kind is ast.Attribute and value.attr == "module"):
        for target in targets:
            key = dotted(target)
            if key is not None and ("." not in key or (key.startswith("self.") and key.count(".") == 1)):
                facts.values.setdefault(key, []).append(value)


def _may_be_wrapper(func: ast.expr, names: set[str]) -> bool:
    """``qualname`` of ``func`` may be one of ``DDP_CLASSES``: ``x.DistributedDataParallel``, or a name
    that is the class's or bound to it (by an import ``as`` or an assignment)."""
    if type(func) is ast.Attribute:
        return func.attr in _WRAPPERS
    return type(func) is ast.Name and func.id in names


def _before(call: _Call, wrap: _Wrap) -> bool:
    """The call runs before the wrap in its scope: ``site.order < wrap.site.order``. A call that starts
    strictly before another is before it in the model's pre-order (it cannot sit inside it)."""
    return (
        call.scope is wrap.scope
        and call.where is not None
        and wrap.where is not None
        and call.where < wrap.where
    )


def _same_owner(scope: _Scope, wrap: _Wrap) -> bool:
    """``_sharding.same_owner``: the wrap's own scope, or a method of its class for ``self.`` names."""
    if scope is wrap.scope:
        return True
    return wrap.outer.startswith("self.") and scope.owner is not None and scope.owner is wrap.scope.owner


def _unwraps(name: str, outer: str, values: dict[str, list[ast.expr]]) -> bool:
    """TL507's ``_unwraps``: ``outer.module`` itself, or a name or ``self.attr`` assigned from it."""
    if name == f"{outer}.module":
        return True
    head, _, attr = name.partition(".")
    if attr and (head != "self" or "." in attr):
        return False
    return any(_module_of(value, outer) for value in values.get(name, ()))


def _module_of(expr: ast.expr, outer: str) -> bool:
    """TL507's ``_module_of``: ``outer.module``, either branch of a conditional, or
    ``getattr(outer, "module", ...)``."""
    if type(expr) is ast.IfExp:
        return _module_of(expr.body, outer) or _module_of(expr.orelse, outer)
    if type(expr) is ast.Call:
        if type(expr.func) is not ast.Name or expr.func.id != "getattr":
            return False
        # libcst keeps the arguments in source order, keywords and splats included
        args = [a.value if type(a) is ast.Starred else a for a in expr.args] + [
            k.value for k in expr.keywords
        ]
        if len(args) < 2:
            return False
        if expr.keywords:
            args.sort(key=lambda a: (a.lineno, a.col_offset))
        attr = args[1]
        return dotted(args[0]) == outer and type(attr) is ast.Constant and attr.value == "module"
    return dotted(expr) == f"{outer}.module"
