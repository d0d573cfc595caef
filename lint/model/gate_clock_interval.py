"""Whether a file can hold TL402's finding, read from CPython's tree before libcst is asked: a wall-clock
interval (``clock() - t0``, or ``t1 = clock()`` then ``t1 - t0``) around training work, with no call that
waits for the device between its two clock reads or anywhere in the loop that repeats the closing read.

The check mirrors the file model where the rule relies on it: scopes (module, class, function, lambda;
a def's decorators, defaults and annotations belong to the def, comprehensions to their enclosing scope),
the names each scope binds and how ``FileModel.lookup``/``qualname`` pick among them, program order (a
pre-order walk in source order, as libcst's), and the loop frames around each call (not reset where a
nested function starts). Where it cannot be as precise it answers True: what may be training work is a
superset of the rule's, and every subtraction that may close an interval is tried.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from trainlint.model.gate_calls import SCOPE_KINDS, enclosing_class
from trainlint.model.pyast import ast_dotted as dotted
from trainlint.model.vocab import CLOCKS, SYNC_METHODS

_CLOCK_NAMES = frozenset(c.rpartition(".")[2] for c in CLOCKS)
# the methods of ``TRAINING_WORK``'s events (``Training._classify``: ``x.backward()``, ``x.step()``)
_WORK_METHODS = frozenset({"backward", "step"})
_MODEL_NAMES = frozenset({"model", "module", "net", "engine", "forward"})
_MODEL_ENDINGS = ("_model", "_net", "_engine")
# ``FileModel.qualname`` gives up past this depth of name-to-name assignments
_MAX_DEPTH = 8
# (None: a keyword-only parameter's missing default in ``arguments.kw_defaults``)
_LEAVES = frozenset({ast.Name, ast.Constant, ast.Pass, ast.Break, ast.Continue, ast.Nonlocal, type(None)})
# the nodes ``_bind`` records a binding of
_BINDERS = frozenset(
    {ast.Assign, ast.AnnAssign, ast.NamedExpr, ast.With, ast.AsyncWith, ast.comprehension}
    | {ast.Import, ast.ImportFrom}
)
# fields that hold no node (names, flags) or only operators and contexts; the lists of names among them
# (``Global.names``, ``MatchClass.kwd_attrs``) must not be walked
_NO_NODES = frozenset({"ctx", "op", "ops", "type_comment", "names", "kwd_attrs"})
_FIELDS: dict[type, tuple[str, ...]] = {ast.Import: (), ast.ImportFrom: ()}
# the statements with blocks, which libcst writes as a ``SimpleStatementSuite`` when on the ``:``'s line
_COMPOUND = frozenset(
    {ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.ExceptHandler}
    | {ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.match_case}
    | ({ast.TryStar} if hasattr(ast, "TryStar") else set())
)

Binding = tuple[str, object]  # (kind as ``filemodel.Binding``'s, import target / def node / assigned value)
Loops = tuple[tuple[ast.AST, str], ...]  # the enclosing loop frames: (loop node, "body"/"orelse")


class _Scope:
    __slots__ = ("bindings", "global_names", "kind", "parent")

    def __init__(self, kind: str, parent: _Scope | None) -> None:
        self.kind = kind
        self.parent = parent
        self.bindings: dict[str, list[Binding]] = {}
        self.global_names: set[str] = set()

    def bind(self, name: str, kind: str, data: object = None) -> None:
        self.bindings.setdefault(name, []).append((kind, data))

    @property
    def enclosing_class(self) -> _Scope | None:
        """``Scope.enclosing_class``: for a method (or a function nested in one), its class."""
        return enclosing_class(self)


class _Call:
    __slots__ = ("loops", "node", "order", "scope")

    def __init__(self, node: ast.Call, scope: _Scope, order: int, loops: Loops) -> None:
        self.node = node
        self.scope = scope
        self.order = order
        self.loops = loops


class _File:
    """What the walk keeps: the calls in program order, the scopes of defs, and the subtractions."""

    def __init__(self, module: _Scope) -> None:
        self.module = module
        self.calls: list[_Call] = []
        self.by_scope: dict[_Scope, list[_Call]] = {}
        self.def_scopes: dict[int, _Scope] = {}  # id of a def node -> its scope
        # id of a call that is an operand of ``-`` -> the name it is subtracted from (``call - t0``), or
        # None when it is the right operand or the left one is no name (``_subtracted_from``: no interval)
        self.subtracted: dict[int, str | None] = {}
        # id of a call that is the value of ``a = b = call`` -> the plain names assigned (``assigned_to``)
        self.assigned: dict[int, list[str]] = {}
        # ids of such calls whose assignment may sit in a one-line block (``if c: t0 = clock()``): libcst
        # makes that a ``SimpleStatementSuite``, for which ``assigned_to`` finds no name, and the tree
        # cannot tell it from a block on the next lines; both are tried
        self.maybe_unassigned: set[int] = set()
        self.suite_statements: set[int] = set()  # ids of the statements that may sit in a one-line block
        # per scope: ``a - b`` of two names inside an assignment, a call, or a ``*``/``/`` of that scope
        # (the sites ``_subtracted_from`` walks): (order, a, b)
        self.subs: dict[_Scope, list[tuple[int, str, str]]] = {}


def interval_may_miss_sync(tree: ast.Module) -> bool:
    """Whether some scope holds two clock reads (calls ``FileModel.qualname`` resolves to one of
    ``CLOCKS``) that TL402 pairs as an interval (``_intervals``: the closing one is ``clock() - t0`` or
    ``t1 = clock()`` with a later ``t1 - t0`` in a site of the scope; its start is the last earlier read
    bound to ``t0``, else the last earlier read), such that between them (program order, same scope) a
    call may be training work (``x.backward()``, ``x.step()``, or a model call as ``_model_call``) that
    ``_bounded`` accepts, no call waits for the device (``_waits``, helpers of the file one level deep),
    and no call of the scope inside the innermost loop around the closing read waits.

    TL402 reports only such closing reads; the other tests of its ``check`` ("cuda" in the text) are the
    prefilter's. Each test here is the rule's on the same facts, or weaker: work is any of the rule's
    two kinds (it uses model calls only when no event is found), and when several ``t1 - t0`` follow
    ``t1 = clock()``, each is tried (the rule takes the first)."""
    found = _collect(tree)
    clocks: dict[_Scope, list[_Call]] = {}
    for call in found.calls:
        if _is_clock(call, found):
            clocks.setdefault(call.scope, []).append(call)
    for scope_clocks in clocks.values():
        if len(scope_clocks) < 2:
            continue
        for close, start in _intervals(scope_clocks, found):
            if _may_report(close, start, found):
                return True
    return False


# -- the walk ------------------------------------------------------------------------------------------
def _collect(tree: ast.Module) -> _File:
    """One iterative pre-order walk in source order (libcst's ``order``): each call with its scope and
    loop frames, the bindings of each scope, and the facts of subtractions and assignments of calls.
    ``sites`` holds the scopes of the assignments, calls and ``*``/``/`` around a node (``_subtracted_from``
    finds ``t1 - t0`` inside such sites of the clock's scope, lambdas included)."""
    module = _Scope("module", None)
    found = _File(module)
    stack: list[tuple[ast.AST, _Scope, Loops, tuple[_Scope, ...]]] = [(tree, module, (), ())]
    pop, push = stack.pop, stack.append
    order = 0
    while stack:
        node, scope, loops, sites = pop()
        order += 1
        kind = type(node)
        if kind in _LEAVES:
            continue
        if kind in _COMPOUND:
            _note_blocks(node, found)
        children: list[ast.AST] | None = None
        if kind is ast.Call:
            call = _Call(node, scope, order, loops)  # type: ignore[arg-type]
            found.calls.append(call)
            found.by_scope.setdefault(scope, []).append(call)
            if not sites or sites[-1] is not scope:
                sites = (*sites, scope)
            children = _call_children(node)  # type: ignore[arg-type]
        elif kind is ast.BinOp:
            op = type(node.op)  # type: ignore[attr-defined]
            if op is ast.Sub:
                _note_subtraction(node, order, sites, found)  # type: ignore[arg-type]
            elif (op is ast.Mult or op is ast.Div) and (not sites or sites[-1] is not scope):
                sites = (*sites, scope)
        elif kind is ast.For or kind is ast.AsyncFor or kind is ast.While:
            _push_loop(node, scope, loops, sites, stack)
            continue
        elif kind in SCOPE_KINDS:
            scope, children = _enter_scope(node, scope, found)
        elif kind is ast.IfExp:
            children = [node.body, node.test, node.orelse]  # type: ignore[attr-defined]
        elif kind is ast.Dict:
            children = [n for pair in zip(node.keys, node.values, strict=True) for n in pair if n is not None]  # type: ignore[attr-defined]
        elif kind is ast.Global:
            scope.global_names.update(node.names)  # type: ignore[attr-defined]
            continue
        elif kind in _BINDERS:
            if _bind(node, kind, scope, found) and (not sites or sites[-1] is not scope):
                sites = (*sites, scope)
        if children is None:
            children = []
            fields = _FIELDS.get(kind)
            for field in _fields(kind) if fields is None else fields:
                value = getattr(node, field)
                if type(value) is list:
                    children.extend(value)
                elif isinstance(value, ast.AST):
                    children.append(value)
        for child in reversed(children):
            if type(child) not in _LEAVES:  # (a leaf holds nothing: not pushed, and no order is needed)
                push((child, scope, loops, sites))
    return found


def _fields(kind: type) -> tuple[str, ...]:
    """The fields of a node type that may hold a node with a call or a binding (made once per type)."""
    _FIELDS[kind] = tuple(f for f in kind._fields if f not in _NO_NODES)  # type: ignore[attr-defined]
    return _FIELDS[kind]


def _note_blocks(node: ast.AST, found: _File) -> None:
    """The assignments that may sit in a one-line block of this compound statement: those on the line of
    the block's first statement (whether the ``:`` before it is on that line, the tree does not say)."""
    for field in ("body", "orelse", "finalbody"):
        block = getattr(node, field, None)
        if type(block) is not list or not block or not isinstance(block[0], ast.stmt):
            continue
        line = block[0].lineno
        for statement in block:
            if statement.lineno != line:
                break
            if type(statement) is ast.Assign:
                found.suite_statements.add(id(statement))


def _call_children(node: ast.Call) -> list[ast.AST]:
    """A call's parts in source order: a ``*args`` may follow a keyword (``f(k=1, *rest)``)."""
    parts: list[ast.AST] = [node.func, *node.args, *node.keywords]
    if node.keywords and any(type(a) is ast.Starred for a in node.args):
        parts[1:] = sorted(parts[1:], key=lambda n: (n.lineno, n.col_offset))  # type: ignore[attr-defined]
    return parts


def _push_loop(
    node: ast.AST,
    scope: _Scope,
    loops: Loops,
    sites: tuple[_Scope, ...],
    stack: list[tuple[ast.AST, _Scope, Loops, tuple[_Scope, ...]]],
) -> None:
    """A loop's parts: its body and ``else:`` inside a loop frame, the target, iterable or test outside
    (libcst's frame starts at the block); a ``for`` target is bound as ``other``."""
    if type(node) is not ast.While:
        _bind_target(node.target, scope)  # type: ignore[attr-defined]
        head = [node.target, node.iter]  # type: ignore[attr-defined]
    else:
        head = [node.test]  # type: ignore[attr-defined]
    parts = [(child, loops) for child in head]
    for branch in ("body", "orelse"):
        inner = (*loops, (node, branch))
        parts.extend((child, inner) for child in getattr(node, branch))
    for child, frames in reversed(parts):
        stack.append((child, scope, frames, sites))


def _enter_scope(node: ast.AST, scope: _Scope, found: _File) -> tuple[_Scope, list[ast.AST]]:
    """A def, class or lambda: bound in the scope around it (not a lambda), and a new scope holding its
    parameters and all its parts, decorators first, as ``FileModel``'s builder makes them."""
    kind = type(node)
    inner = _Scope(SCOPE_KINDS[kind], scope)
    if kind is ast.Lambda:
        args = node.args  # type: ignore[attr-defined]
        for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs):  # (not ``*a``/``**k``: as the model)
            inner.bind(arg.arg, "param")
        return inner, [args, node.body]  # type: ignore[attr-defined]
    found.def_scopes[id(node)] = inner
    if kind is ast.ClassDef:
        scope.bind(node.name, "class", node)  # type: ignore[attr-defined]
        return inner, [*node.decorator_list, *node.bases, *node.keywords, *node.body]  # type: ignore[attr-defined]
    scope.bind(node.name, "def", node)  # type: ignore[attr-defined]
    args = node.args  # type: ignore[attr-defined]
    for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
        if arg is not None:
            inner.bind(arg.arg, "param")
    returns = [node.returns] if node.returns is not None else []  # type: ignore[attr-defined]
    return inner, [*node.decorator_list, args, *returns, *node.body]  # type: ignore[attr-defined]


def _bind(node: ast.AST, kind: type, scope: _Scope, found: _File) -> bool:
    """Record what an import, assignment, ``with`` or comprehension binds, as ``FileModel``'s builder
    does (``AugAssign`` binds nothing there); True when the node is a site ``_subtracted_from`` walks
    (an assignment with a value)."""
    if kind is ast.Assign:
        value = node.value  # type: ignore[attr-defined]
        for target in node.targets:  # type: ignore[attr-defined]
            _bind_target(target, scope, value)
        if type(value) is ast.Call:
            found.assigned[id(value)] = [t.id for t in node.targets if type(t) is ast.Name]  # type: ignore[attr-defined]
            if id(node) in found.suite_statements:
                found.maybe_unassigned.add(id(value))
        return True
    if kind is ast.AnnAssign or kind is ast.NamedExpr:
        _bind_target(node.target, scope, node.value)  # type: ignore[attr-defined]
        return kind is ast.AnnAssign and node.value is not None  # type: ignore[attr-defined]
    if kind is ast.With or kind is ast.AsyncWith:
        for item in node.items:  # type: ignore[attr-defined]
            if item.optional_vars is not None:
                _bind_target(item.optional_vars, scope)
    elif kind is ast.comprehension:
        _bind_target(node.target, scope)  # type: ignore[attr-defined]
    elif kind is ast.Import:
        for alias in node.names:  # type: ignore[attr-defined]
            if alias.asname:
                scope.bind(alias.asname, "import", alias.name)
            else:
                head = alias.name.split(".")[0]
                scope.bind(head, "import", head)
    elif kind is ast.ImportFrom:
        level = node.level  # type: ignore[attr-defined]
        base = ("." * level if level else "") + (node.module or "")  # type: ignore[attr-defined]
        for alias in node.names:  # type: ignore[attr-defined]
            if alias.name != "*":
                scope.bind(
                    alias.asname or alias.name, "import", f"{base}.{alias.name}" if base else alias.name
                )
    return False


def _bind_target(target: ast.AST, scope: _Scope, value: ast.AST | None = None) -> None:
    """``_Builder._bind_target``: a name is ``assign`` with a value, else ``other``; tuple and list
    elements (starred or not) are ``other``; attributes and subscripts bind no name."""
    kind = type(target)
    if kind is ast.Name:
        if value is None:
            scope.bind(target.id, "other")  # type: ignore[attr-defined]
        else:
            scope.bind(target.id, "assign", value)  # type: ignore[attr-defined]
    elif kind is ast.Tuple or kind is ast.List:
        for element in target.elts:  # type: ignore[attr-defined]
            _bind_target(element.value if type(element) is ast.Starred else element, scope)


def _note_subtraction(node: ast.BinOp, order: int, sites: tuple[_Scope, ...], found: _File) -> None:
    left, right = node.left, node.right
    if type(left) is ast.Call:
        found.subtracted[id(left)] = right.id if type(right) is ast.Name else None
    if type(right) is ast.Call:
        found.subtracted[id(right)] = None
    if type(left) is ast.Name and type(right) is ast.Name:
        for scope in sites:
            found.subs.setdefault(scope, []).append((order, left.id, right.id))


# -- names ---------------------------------------------------------------------------------------------
def _lookup(name: str, scope: _Scope, module: _Scope) -> Binding | None:
    """``FileModel.lookup``: class scopes skipped but the first, ``global`` jumps to the module; in the
    scope that binds the name, a def or class wins, else the last binding."""
    current: _Scope | None = scope
    first = True
    while current is not None:
        if current.kind != "class" or first:
            if name in current.global_names and current is not module:
                current, first = module, False
                continue
            bindings = current.bindings.get(name)
            if bindings:
                return next((b for b in bindings if b[0] in ("def", "class")), bindings[-1])
        first = False
        current = current.parent
    return None


def _qualname(expr: ast.AST, scope: _Scope, module: _Scope, depth: int = 0) -> str | None:
    """``FileModel.qualname`` (a builtin's name, which is never a clock nor ``torch.save``, is None)."""
    path = dotted(expr)
    if path is None or depth > _MAX_DEPTH:
        return None
    head, _, rest = path.partition(".")
    binding = _lookup(head, scope, module)
    if binding is None:
        return None
    kind, data = binding
    if kind == "import":
        base: str | None = data  # type: ignore[assignment]
    elif kind in ("def", "class"):
        base = f"<local>.{head}"
    elif kind == "assign" and type(data) in (ast.Name, ast.Attribute):
        base = _qualname(data, scope, module, depth + 1)  # type: ignore[arg-type]
    else:
        return None
    if base is None:
        return None
    return f"{base}.{rest}" if rest else base


def _is_clock(call: _Call, found: _File) -> bool:
    func = call.node.func
    if type(func) is ast.Attribute and func.attr not in _CLOCK_NAMES:
        return False  # (the last part of a dotted callee stays the last part of its qualified name)
    return _qualname(func, call.scope, found.module) in CLOCKS


# -- the rule's tests ----------------------------------------------------------------------------------
def _intervals(scope_clocks: list[_Call], found: _File) -> Iterator[tuple[_Call, _Call]]:
    """``_intervals``: (closing read, opening read) pairs, for every start name that may be subtracted
    and every opening read the rule may take (a read in a one-line block may be bound or not)."""
    opening: dict[str, list[_Call]] = {}
    for clock in scope_clocks:
        for name in found.assigned.get(id(clock.node), ()):
            opening.setdefault(name, []).append(clock)
    for close in scope_clocks:
        seen: set[int] = set()
        for name in _start_names(close, found):
            for start in _starts(close, opening.get(name, ()), scope_clocks, found):
                if id(start) not in seen:
                    seen.add(id(start))
                    yield close, start


def _starts(close: _Call, opening: list[_Call], scope_clocks: list[_Call], found: _File) -> list[_Call]:
    """The last earlier read bound to the start name, else (``t0 = t1`` rolling timers) the last earlier
    read: where some of those reads may be unbound, each answer some choice of them gives."""
    earlier = [s for s in opening if s.order < close.order]
    sure = [s for s in earlier if id(s.node) not in found.maybe_unassigned]
    if sure:  # the last sure one, or an unsure one after it
        return [s for s in earlier if s.order >= sure[-1].order]
    return earlier + [s for s in scope_clocks if s.order < close.order][-1:]


def _start_names(clock: _Call, found: _File) -> set[str]:
    """``_subtracted_from``: ``t0`` of ``clock() - t0``; or, for ``t1 = clock()``, the ``t0`` of every
    ``t1 - t0`` after it in a site of its scope (the rule takes the first one it finds)."""
    key = id(clock.node)
    if key in found.subtracted:
        name = found.subtracted[key]
        return {name} if name is not None else set()
    names = found.assigned.get(key)
    if not names:
        return set()
    subs = found.subs.get(clock.scope, ())
    return {right for at, left, right in subs if at > clock.order and left in names}


def _may_report(close: _Call, start: _Call, found: _File) -> bool:
    """The body of TL402's ``check`` for one interval."""
    calls = found.by_scope[close.scope]
    between = [c for c in calls if start.order < c.order < close.order]
    if not any(_bounded(c, close) for c in between if _may_be_work(c, found)):
        return False
    if any(_waits(c, found) for c in between):
        return False
    loop = next((node for node, branch in reversed(close.loops) if branch == "body"), None)
    if loop is None:
        return True
    return not any(_waits(c, found) for c in calls if any(node is loop for node, _ in c.loops))


def _may_be_work(call: _Call, found: _File) -> bool:
    """A training event of ``TRAINING_WORK`` (``x.backward()``, ``x.step()``: a superset), or the rule's
    ``_model_call``: a callee named like a model that resolves to no name."""
    func = call.node.func
    if type(func) is ast.Attribute and func.attr in _WORK_METHODS:
        return True
    path = dotted(func)
    if path is None:
        return False
    last = path.rpartition(".")[2].lower()
    if last not in _MODEL_NAMES and not last.endswith(_MODEL_ENDINGS):
        return False
    return _qualname(func, call.scope, found.module) is None


def _bounded(work: _Call, close: _Call) -> bool:
    """``_bounded``: every loop around the work but those around the closing read is a ``for`` over
    ``range(<integer literal>)``."""
    closing = {id(node) for node, _ in close.loops}
    for node, _ in work.loops:
        if id(node) in closing:
            continue
        if type(node) is ast.For or type(node) is ast.AsyncFor:
            it = node.iter  # type: ignore[attr-defined]
            if type(it) is ast.Call and type(it.func) is ast.Name and it.func.id == "range":
                args = [a for a in it.args if type(a) is not ast.Starred]  # (``positional``)
                if len(args) == 1 and type(args[0]) is ast.Constant and type(args[0].value) is int:
                    continue
        return False
    return True


def _waits(call: _Call, found: _File) -> bool:
    """``_waits``: the call waits for the device, or calls a function of this file (``f()``,
    ``self.f()``) one of whose own calls does."""
    if _waits_directly(call, found):
        return True
    definition = _local_function(call, found)
    if definition is None:
        return False
    inner = found.def_scopes.get(id(definition))
    return inner is not None and any(_waits_directly(c, found) for c in found.by_scope.get(inner, ()))


def _waits_directly(call: _Call, found: _File) -> bool:
    func = call.node.func
    if type(func) is ast.Attribute:
        name = func.attr.lower()
        if name in SYNC_METHODS:
            return True
    else:
        name = func.id.lower() if type(func) is ast.Name else ""
    if "synchronize" in name or "generate" in name:
        return True
    return _qualname(func, call.scope, found.module) == "torch.save"


def _local_function(call: _Call, found: _File) -> ast.AST | None:
    """``FileModel.local_function``: the def a name resolves to, or ``self.f``'s method of the class."""
    func = call.node.func
    if type(func) is ast.Name:
        binding = _lookup(func.id, call.scope, found.module)
        if binding is not None and binding[0] == "def":
            return binding[1]  # type: ignore[return-value]
        return None
    if type(func) is ast.Attribute and type(func.value) is ast.Name and func.value.id == "self":
        cls = call.scope.enclosing_class
        bindings = cls.bindings.get(func.attr) if cls is not None else None
        if bindings and bindings[-1][0] == "def":
            return bindings[-1][1]  # type: ignore[return-value]
    return None
