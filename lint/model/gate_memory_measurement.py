"""Whether a file can hold a finding of the memory-measurement rules, read from CPython's tree before libcst
is asked: TL401 (a peak reading that measures a region with no reset before it), TL403 (``empty_cache()``
on every iteration of a loop that trains) and TL404 (a memory reading between an optimizer's construction
and its first step).

One walk mirrors what ``FileModel`` records for these rules: scopes (module, class, function, lambda; a
def's decorators, defaults and annotations belong to the def, comprehensions to the enclosing scope), the
names each scope binds, and for each call its control frames (``if``/``loop``/``with``/``try`` with the
branch, not reset where a nested function starts) and where it starts. Names resolve through imports and
name-to-name assignments (``gate_sharding_order.resolver``: a superset of ``FileModel.qualname``). Where
the walk cannot be as precise as the model, a check answers True.
"""

from __future__ import annotations

import ast
from collections.abc import Callable

from trainlint.model.gate_calls import CONTROL_PARTS, SCOPE_KINDS, enclosing_class, last_name
from trainlint.model.gate_sharding_order import resolver
from trainlint.model.pyast import ast_dotted as dotted
from trainlint.model.vocab import (
    CHECKPOINT_FUNCTIONS,
    CLIP_FUNCTIONS,
    EMPTY_CACHE,
    MEMORY_READINGS,
    NOT_OPTIMIZERS,
    OPTIMIZER_PREFIXES,
    OPTIMIZER_WORDS,
    OPTIMIZER_WRAPPERS,
    PEAK_READINGS,
    RESET_METHODS,
)

# the last names of every qualified name above: a call of none of them (nor of a name bound to one) is
# never a reading (``FileModel.qualname`` keeps a callee's last name unless it was bound under another)
_WANTED = frozenset(q.rpartition(".")[2] for q in MEMORY_READINGS | EMPTY_CACHE)
# the methods of TL403's work events (``TRAINING_WORK``: a backward or a step, ``Training._classify``)
_WORK = frozenset({"backward", "step"})

Frame = tuple[str, ast.AST, str]  # (kind, node, branch), as ``FileModel``'s ``Frame``
Frames = tuple[Frame, ...]
Where = tuple[int, int]  # (line, column)
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)
_CONTAINERS = frozenset({ast.Dict, ast.Tuple, ast.List, ast.Set})
# the nodes whose ``body`` is a block of statements (the ``else:``, ``finally:`` and handler blocks are
# not asked: a one-line one cannot be told from its header's line)
_BLOCK_OWNERS = frozenset(
    {ast.Module, *_DEFS, ast.ClassDef, ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith}
)


class _Scope:
    __slots__ = ("bound", "globals", "kind", "node", "parent")

    def __init__(self, kind: str, node: ast.AST, parent: _Scope | None) -> None:
        self.kind = kind
        self.node = node
        self.parent = parent
        # name -> what binds it here (a def node, else the binding node): more than the model binds
        # (an ``x += 1``), never less, so a name resolved here is resolved no further by the model
        self.bound: dict[str, list[ast.AST]] = {}
        self.globals: set[str] = set()

    @property
    def enclosing_class(self) -> _Scope | None:
        """``Scope.enclosing_class``: for a method (or a function nested in one), its class."""
        return enclosing_class(self)


class _Call:
    """A call with what ``Site`` knows of it: scope, frames, and bounds of where it starts (its own start,
    or its statement's start and end inside an f-string, where CPython 3.11 may misplace it)."""

    __slots__ = ("frames", "high", "low", "node", "scope")

    def __init__(self, node: ast.Call, scope: _Scope, frames: Frames, low: Where, high: Where) -> None:
        self.node = node
        self.scope = scope
        self.frames = frames
        self.low = low
        self.high = high


class _Facts:
    """What one walk keeps: every call, the bindings names resolve by, plain assignments, subtractions."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.imports: dict[str, set[str]] = {}  # local name -> import targets (as ``FileModel`` spells them)
        self.aliases: dict[str, list[str]] = {}  # local name -> dotted values assigned to it
        self.assigns: dict[str, list[ast.expr]] = {}  # dotted target of an ``=`` -> its values
        self.subtractions: list[tuple[ast.BinOp, _Scope]] = []
        self.module: _Scope | None = None
        self.named: dict[int, list[str]] = {}  # id of a call -> the names ``x = y = call`` binds it to
        # ``x = {...}`` (or a tuple, list, set): (its value, scope, where it starts)
        self.containers: list[tuple[ast.expr, _Scope, Where]] = []

    def by_scope(self) -> dict[_Scope, list[_Call]]:
        out: dict[_Scope, list[_Call]] = {}
        for call in self.calls:
            out.setdefault(call.scope, []).append(call)
        return out


# -- TL401 --------------------------------------------------------------------------------------------------
def peak_reading_may_measure_region(tree: ast.Module) -> bool:
    """TL401: whether some call that may resolve to a peak reading (``torch.cuda.max_memory_allocated``...)
    measures a region as the rule reads it, with no reset proven to come before it.

    - region: the reading sits in a loop body (the innermost) with another call of its scope in that
      body (not the call it is the callee of), or it is the minuend of a ``-`` of its scope (through
      ``/`` and names or ``self.x`` assigned it with ``=``) whose subtrahend is a memory reading that way;
    - reset: TL401 drops a reading with a ``reset_*`` method call (any receiver) in another function of
      its class, in an enclosing function, lambda or module scope (stopping at a class), or in its own
      scope before it (surely: it starts before) or in a loop around both, or there a call ``f()`` of
      the file's own function whose body resets, where the name can resolve to no other binding.

    Each condition is the rule's (``_measures_region``, ``_reset_before``) or weaker, so a file with no
    such reading holds no TL401 finding."""
    facts = _walk(tree)
    resolve = resolver(facts.imports, facts.aliases)
    peaks = [c for c in facts.calls if _resolves(c.node, resolve, PEAK_READINGS)]
    if not peaks:
        return False
    by_scope = facts.by_scope()
    subtracted = _minuends(facts, resolve, {id(c.node) for c in peaks})
    resets = _ResetProof(facts, by_scope)
    for reading in peaks:
        if id(reading.node) in subtracted or _read_every_iteration(reading, by_scope[reading.scope]):
            if not resets.before(reading):
                return True
    return False


def _read_every_iteration(reading: _Call, calls: list[_Call]) -> bool:
    """``_measures_region``'s loop: another call of the scope in the reading's innermost loop body."""
    loop = _innermost_loop(reading.frames)
    if loop is None:
        return False
    node = reading.node
    return any(
        c.node is not node and c.node.func is not node and loop in c.frames  # (the frame, by equality)
        for c in calls
    )


def _minuends(facts: _Facts, resolve: Callable[[str | None], set[str]], peak: set[int]) -> set[int]:
    """The ids of the peak readings ``_measures_region`` finds a baseline subtracted from: ``a - b`` in
    the reading's scope, ``a`` the reading (or a name bound to it), ``b`` any memory reading so."""
    if not facts.subtractions:
        return set()
    scope_of = {id(c.node): c.scope for c in facts.calls}
    memory = {id(c.node) for c in facts.calls if _resolves(c.node, resolve, MEMORY_READINGS)}
    out: set[int] = set()
    for node, scope in facts.subtractions:
        if not _reaches(node.right, facts.assigns, memory):
            continue
        found = _reached(node.left, facts.assigns, peak)
        out.update(i for i in found if scope_of.get(i) is scope)
    return out


def _reached(expr: ast.expr, assigns: dict[str, list[ast.expr]], calls: set[int]) -> set[int]:
    """``_is_reading``'s walk: the calls of ``calls`` that ``expr`` is (left of ``/``), or that a name it is
    was assigned (``=``, any scope), followed through names (each once: the rule would recurse for ever)."""
    found: set[int] = set()
    pending, seen = [expr], set()
    while pending:
        value = pending.pop()
        while type(value) is ast.BinOp and type(value.op) is ast.Div:
            value = value.left
        if type(value) is ast.Call:
            if id(value) in calls:
                found.add(id(value))
            continue
        key = dotted(value)
        if key is not None and key not in seen:
            seen.add(key)
            pending.extend(assigns.get(key, ()))
    return found


def _reaches(expr: ast.expr, assigns: dict[str, list[ast.expr]], calls: set[int]) -> bool:
    return bool(_reached(expr, assigns, calls))


class _ResetProof:
    """Whether TL401's ``_reset_before`` surely holds for a reading (False where unsure)."""

    def __init__(self, facts: _Facts, by_scope: dict[_Scope, list[_Call]]) -> None:
        self.by_scope = by_scope
        resets = [c for c in facts.calls if last_name(c.node.func) in RESET_METHODS]
        self.classes = {c.scope.enclosing_class for c in resets} - {None}
        self.resetting = {c.scope.node for c in resets}  # the defs (and others) with a reset of their own
        self.module = facts.module

    def before(self, reading: _Call) -> bool:
        cls = reading.scope.enclosing_class
        if cls is not None and cls in self.classes:
            return True
        scope: _Scope | None = reading.scope
        first = True
        while scope is not None and scope.kind != "class":
            for call in self.by_scope.get(scope, ()):
                if not self._resets(call):
                    continue
                if not first or _surely_before(call, reading) or _share_loop(call, reading):
                    return True
            first, scope = False, scope.parent
        return False

    def _resets(self, call: _Call) -> bool:
        """A reset, or a call ``f()`` of the file's own function whose body resets: every def the name may
        resolve to (``FileModel.local_function``) resets in its own scope. (A ``self.f()`` method that
        resets makes its class reset, which ``before`` asks first.)"""
        func = call.node.func
        if type(func) is ast.Attribute:
            return func.attr in RESET_METHODS
        if type(func) is not ast.Name:
            return False
        if func.id in RESET_METHODS:
            return True
        where = _lookup(func.id, call.scope, self.module)
        bound = where.bound[func.id] if where is not None else ()
        return bool(bound) and all(type(b) in _DEFS and b in self.resetting for b in bound)


def _lookup(name: str, scope: _Scope, module: _Scope | None) -> _Scope | None:
    """``FileModel.lookup``: the scope whose bindings of ``name`` decide (class scopes skipped but the
    first, ``global`` sends to the module)."""
    current: _Scope | None = scope
    first = True
    while current is not None:
        if current.kind != "class" or first:
            if name in current.globals and current is not module:
                current, first = module, False
                continue
            if name in current.bound:
                return current
        first = False
        current = current.parent
    return None


# -- TL403 --------------------------------------------------------------------------------------------------
def empty_cache_in_training_loop(tree: ast.Module) -> bool:
    """TL403: whether some call that may resolve to ``torch.cuda.empty_cache`` (or ``torch.xpu``'s) sits in
    the body of its innermost loop with no ``if``, loop or ``except``/``else``/``finally`` between (``with``
    and ``try`` bodies, nested functions and lambdas do not count, as in the model's frames), and the same
    scope has an ``x.backward(...)`` or ``x.step(...)`` call whose innermost loop body is that loop.

    TL403 reports only such a call: its work events (backward, scaled backward, step, scaler step) are
    all such method calls, of the reading's scope and loop (``events_in``, ``_loop_of``)."""
    facts = _walk(tree)
    resolve = resolver(facts.imports, facts.aliases)
    work: set[tuple[_Scope, ast.AST]] = set()
    empties: list[tuple[_Call, Frame]] = []
    for call in facts.calls:
        loop = _innermost_loop(call.frames)
        if loop is None:
            continue
        func = call.node.func
        if type(func) is ast.Attribute and func.attr in _WORK:
            work.add((call.scope, loop[1]))
        elif _resolves(call.node, resolve, EMPTY_CACHE) and _directly_in(call.frames, loop):
            empties.append((call, loop))
    return any((call.scope, loop[1]) in work for call, loop in empties)


def _directly_in(frames: Frames, loop: Frame) -> bool:
    """No ``if``, loop or ``try`` branch but the body between the loop's body and the site
    (``frames_inside``)."""
    inside = frames[frames.index(loop) + 1 :]
    return not any(k in ("if", "loop") or (k == "try" and b != "body") for k, _n, b in inside)


# -- TL404 --------------------------------------------------------------------------------------------------
def memory_read_before_first_step(tree: ast.Module) -> bool:
    """TL404: whether some call that may resolve to a memory reading (``torch.cuda.memory_allocated``...)
    has, in its own scope, a call that may build an optimizer and may come before it, no ``x.step()``
    call of that scope that surely comes before it or sits in a loop with it, and one such optimizer
    whose value is not surely handed over between the two.

    TL404 reports a reading only after an optimizer event of its scope (a class under an optimizer
    prefix, or another project file's class with an optimizer's word in its name: both kept here), and
    drops it when a step or scaler-step event of the scope (every ``x.step(...)`` the model does not take
    for a clip, checkpoint or optimizer call) comes before it or shares a loop with it, or when the first
    optimizer escapes before it (``_handed_over``): asked of every candidate, whichever is the first."""
    facts = _walk(tree)
    resolve = resolver(facts.imports, facts.aliases)
    readings = [c for c in facts.calls if _resolves(c.node, resolve, MEMORY_READINGS)]
    if not readings:
        return False
    by_scope = facts.by_scope()
    for reading in readings:
        calls = by_scope[reading.scope]
        built = [
            c
            for c in calls
            if c is not reading and not _surely_before(reading, c) and _may_build_optimizer(c.node, resolve)
        ]
        if not built or any(
            _is_step(c.node, resolve) and (_surely_before(c, reading) or _share_loop(c, reading))
            for c in calls
        ):
            continue
        if not all(_escapes(optimizer, reading, calls, facts) for optimizer in built):
            return True
    return False


def _escapes(optimizer: _Call, reading: _Call, calls: list[_Call], facts: _Facts) -> bool:
    """A name ``optimizer`` is assigned to (``x = Optim(...)``) surely escapes after it and before the
    reading, in their scope: an argument of a call but a wrapper's (``train(model, x)``), or in a
    container assigned to a name (``state = {"optimizer": x}``). Whichever of the candidates the model
    takes for the first optimizer, its names are among the rule's, so ``_handed_over`` holds when every
    candidate escapes so."""
    names = facts.named.get(id(optimizer.node))
    if not names:
        return False
    for call in calls:
        node = call.node
        if (
            _surely_before(optimizer, call)
            and _surely_before(call, reading)
            and last_name(node.func) not in OPTIMIZER_WRAPPERS
            and any(_mentions(v, names) for v in (*node.args, *(k.value for k in node.keywords)))
        ):
            return True
    return any(
        scope is reading.scope and optimizer.high < where < reading.low and _mentions(value, names)
        for value, scope, where in facts.containers
    )


def _mentions(expr: ast.expr, names: list[str]) -> bool:
    """A name of ``names`` in ``expr`` (libcst's ``walk`` finds these, and attribute names too)."""
    return any(type(n) is ast.Name and n.id in names for n in ast.walk(expr))  # type: ignore[attr-defined]


def _optimizer_callee(qualname: str) -> bool:
    """``training.is_optimizer_class``, or a name ``crossfile.project_optimizer_class`` may take."""
    if qualname.startswith(OPTIMIZER_PREFIXES) and not qualname.startswith(NOT_OPTIMIZERS):
        return True
    return OPTIMIZER_WORDS.search(qualname.rpartition(".")[2]) is not None


def _may_build_optimizer(call: ast.Call, resolve: Callable[[str | None], set[str]]) -> bool:
    return any(_optimizer_callee(q) for q in resolve(dotted(call.func)))


def _is_step(call: ast.Call, resolve: Callable[[str | None], set[str]]) -> bool:
    """Surely a step event: ``x.step(...)`` that no name resolution makes a clip, checkpoint or optimizer
    call (``Training._classify`` asks those first)."""
    func = call.func
    if type(func) is not ast.Attribute or func.attr != "step":
        return False
    return not any(
        q in CLIP_FUNCTIONS or q in CHECKPOINT_FUNCTIONS or _optimizer_callee(q)
        for q in resolve(dotted(func))
    )


# -- shared ------------------------------------------------------------------------------------------------
def _resolves(call: ast.Call, resolve: Callable[[str | None], set[str]], names: frozenset[str]) -> bool:
    """The callee may resolve to one of ``names`` (``FileModel.callee``)."""
    func = call.func
    if type(func) is ast.Attribute and func.attr not in _WANTED:
        return False  # (an attribute keeps its last name)
    return not resolve(dotted(func)).isdisjoint(names)


def _innermost_loop(frames: Frames) -> Frame | None:
    """``flow.innermost_loop``: the innermost loop frame of a body (an ``else:`` runs once)."""
    for frame in reversed(frames):
        if frame[0] == "loop" and frame[2] == "body":
            return frame
    return None


def _share_loop(a: _Call, b: _Call) -> bool:
    """``flow.share_loop``: one loop around both (any branch)."""
    loops = {id(f[1]) for f in a.frames if f[0] == "loop"}
    return any(f[0] == "loop" and id(f[1]) in loops for f in b.frames)


def _surely_before(a: _Call, b: _Call) -> bool:
    """``a.order < b.order`` surely: ``a`` starts before ``b`` (an ancestor or an earlier subtree in the
    model's pre-order, whose children come in source order)."""
    return a.high < b.low


# -- the walk ------------------------------------------------------------------------------------------------
def _walk(tree: ast.Module) -> _Facts:
    """One iterative walk: each call with its scope, frames and start; bindings; assignments."""
    facts = _Facts()
    module = facts.module = _Scope("module", tree, None)
    origin = (1, 0)
    # (node, scope, frames, statement's (start, end), inside an f-string)
    stack: list[tuple[ast.AST, _Scope, Frames, tuple[Where, Where], bool]] = [
        (tree, module, (), (origin, origin), False)
    ]
    pop, push, parts_of = stack.pop, stack.append, CONTROL_PARTS.get
    while stack:
        node, scope, frames, statement, fstring = pop()
        kind = type(node)
        if kind is ast.Name:
            if type(node.ctx) is ast.Store:  # type: ignore[attr-defined]
                scope.bound.setdefault(node.id, []).append(node)  # type: ignore[attr-defined]
            continue
        if kind is ast.Call:
            where = statement if fstring else ((node.lineno, node.col_offset),) * 2  # type: ignore[attr-defined]
            facts.calls.append(_Call(node, scope, frames, where[0], where[1]))  # type: ignore[arg-type]
        elif isinstance(node, ast.stmt):
            statement = (_start(node), (node.end_lineno or 0, node.end_col_offset or 0))
            _note_statement(node, scope, facts)
        elif kind is ast.JoinedStr:
            fstring = True
        elif kind is ast.BinOp and type(node.op) is ast.Sub:  # type: ignore[attr-defined]
            facts.subtractions.append((node, scope))  # type: ignore[arg-type]
        elif kind is ast.arg:
            scope.bound.setdefault(node.arg, []).append(node)  # type: ignore[attr-defined]
        elif kind is ast.NamedExpr:
            _alias(node.target, node.value, facts)  # type: ignore[attr-defined]
        if kind in _BLOCK_OWNERS:
            _note_block(node, facts)
        if kind in SCOPE_KINDS:
            # decorators, defaults and bases belong to the new scope too, as in the model
            scope = _Scope(SCOPE_KINDS[kind], node, scope)
        for field, frame, branch in parts_of(kind) or _parts(kind):
            value = getattr(node, field, None)
            inner = frames if frame is None else (*frames, (frame, node, branch))
            if type(value) is list:
                push_all = [(c, scope, inner, statement, fstring) for c in value if isinstance(c, ast.AST)]
                stack.extend(reversed(push_all))
            elif isinstance(value, ast.AST):
                push((value, scope, inner, statement, fstring))
    return facts


def _note_block(owner: ast.AST, facts: _Facts) -> None:
    """The names ``x = y = call`` binds a call to, for the statements of ``owner``'s body that surely sit
    on lines of their own (libcst's ``SimpleStatementLine``: TL404's ``assigned_to`` reads only those,
    not a body on the line of its colon, ``if x: opt = SGD(p)``). Surely: the module's, or a block that
    starts below its header and has two statements at one column on two lines (a one-line body would
    need a line continuation lined up under its first statement)."""
    block = owner.body  # type: ignore[attr-defined]
    if type(owner) is not ast.Module:
        first = block[0]
        if first.lineno <= _header_end(owner) or not any(
            s.col_offset == first.col_offset and s.lineno != first.lineno for s in block[1:]
        ):
            return
    for statement in block:
        if type(statement) is ast.Assign and type(statement.value) is ast.Call:
            names = [t.id for t in statement.targets if type(t) is ast.Name]
            facts.named.setdefault(id(statement.value), []).extend(names)


def _header_end(owner: ast.AST) -> int:
    """The last line of a compound statement's header that a node of it reaches (its own first line at
    least): a test, an iterable, ``with`` items, decorators, parameters, bases."""
    last = owner.lineno  # type: ignore[attr-defined]
    for field, value in ast.iter_fields(owner):
        if field in ("body", "orelse"):
            continue
        for part in value if type(value) is list else [value]:
            if isinstance(part, ast.AST):
                last = max(last, *(getattr(n, "end_lineno", None) or 0 for n in ast.walk(part)))
    return last


def _start(node: ast.stmt) -> Where:
    """Where a statement starts: a def's or class's decorators come before its own position."""
    decorators = getattr(node, "decorator_list", None)
    first = decorators[0] if decorators else node
    return (first.lineno, first.col_offset)


def _note_statement(node: ast.stmt, scope: _Scope, facts: _Facts) -> None:
    """What a statement binds in ``scope`` (a def or class its name, imports their names) and the
    assignments names resolve by."""
    kind = type(node)
    if kind in SCOPE_KINDS:
        scope.bound.setdefault(node.name, []).append(node)  # type: ignore[attr-defined]
    elif kind is ast.Import or kind is ast.ImportFrom:
        _bind_imports(node, scope, facts)  # type: ignore[arg-type]
    elif kind is ast.Global:
        scope.globals.update(node.names)  # type: ignore[attr-defined]
    elif kind is ast.Assign:
        value = node.value  # type: ignore[attr-defined]
        for target in node.targets:  # type: ignore[attr-defined]
            _alias(target, value, facts)
            key = dotted(target)
            if key is not None:
                facts.assigns.setdefault(key, []).append(value)
        if type(value) in _CONTAINERS:
            facts.containers.append((value, scope, (node.lineno, node.col_offset)))
    elif kind is ast.AnnAssign and node.value is not None:  # type: ignore[attr-defined]
        _alias(node.target, node.value, facts)  # type: ignore[attr-defined]


def _bind_imports(node: ast.Import | ast.ImportFrom, scope: _Scope, facts: _Facts) -> None:
    """Record an import as ``FileModel``'s builder does (``import a.b`` binds ``a``; no ``*``)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            name, target = (alias.asname, alias.name) if alias.asname else (alias.name.split(".")[0],) * 2
            facts.imports.setdefault(name, set()).add(target)
            scope.bound.setdefault(name, []).append(node)
        return
    base = "." * node.level + (node.module or "") if node.level else node.module or ""
    for alias in node.names:
        if alias.name != "*":
            local = alias.asname or alias.name
            facts.imports.setdefault(local, set()).add(f"{base}.{alias.name}" if base else alias.name)
            scope.bound.setdefault(local, []).append(node)


def _alias(target: ast.AST, value: ast.AST, facts: _Facts) -> None:
    """A name assigned a dotted name: the model's qualname follows it."""
    path = dotted(value)
    if type(target) is ast.Name and path is not None:
        facts.aliases.setdefault(target.id, []).append(path)


# The fields of a control statement, each with the frame its children sit in (None: the outer frames): a
# Fields that hold no node the walk needs: contexts, operators.
_SKIPPED = frozenset({"ctx", "op", "ops", "type_comment"})


def _parts(kind: type) -> tuple[tuple[str, str | None, str], ...]:
    """The fields of any other node, all in the outer frames (made once per node type)."""
    CONTROL_PARTS[kind] = tuple((f, None, "") for f in kind._fields if f not in _SKIPPED)  # type: ignore[attr-defined]
    return CONTROL_PARTS[kind]
