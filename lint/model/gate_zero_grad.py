"""Whether a file can hold TL303's finding, read from CPython's tree before libcst is asked: a ``zero_grad()``
that runs on every iteration of a loop whose optimizer step runs only under an accumulation condition.

The walk mirrors what ``FileModel`` records for the rule: scopes (module, class, function, lambda; not
comprehensions), and for each call the control frames around it (``if``/``loop``/``with``/``try`` with the
branch), which, as in the model, are not reset where a nested function starts.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

from trainlint.model.gate_calls import CONTROL_PARTS, SCOPE_KINDS
from trainlint.model.pyast import ast_dotted as dotted

# A frame as ``FileModel`` records one: (kind, node, branch).
Frame = tuple[str, ast.AST, str]
Frames = tuple[Frame, ...]

# Methods the framework runs once per batch (``flow.FRAMEWORK_STEP_METHODS``).
_STEP_METHODS = frozenset({"training_step"})
# The method names the rule's events are made of (``Training._classify``, the rule's ``manual_backward``).
_METHODS = frozenset({"step", "zero_grad", "backward", "manual_backward"})
# Assigned values that may be an accumulation test (``Training.accumulation_test``): others never are.
_TEST_VALUES = (ast.UnaryOp, ast.BoolOp, ast.Attribute, ast.BinOp, ast.Compare, ast.Name)
# How far a name assigned a name is followed: ``accumulation_test`` gives up past depth 4, so a test
# reaches a value through at most 4 names, each found in one more round.
_NAME_HOPS = 5


class _Scope:
    __slots__ = ("kind", "node", "parent")

    def __init__(self, kind: str, node: ast.AST, parent: _Scope | None) -> None:
        self.kind = kind
        self.node = node
        self.parent = parent


class _Site:
    __slots__ = ("frames", "node", "scope")

    def __init__(self, node: ast.Call, scope: _Scope, frames: Frames) -> None:
        self.node = node
        self.scope = scope
        self.frames = frames


class _Facts:
    """What one walk of the tree keeps: the calls of the rule's methods by scope, and assignments."""

    def __init__(self) -> None:
        self.steps: list[_Site] = []
        self.zeros: dict[_Scope, list[_Site]] = {}
        self.backwards: dict[_Scope, list[_Site]] = {}
        self.tests: list[tuple[str, ast.AST]] = []  # (target, value) that may be an accumulation test
        self.calls: dict[str, list[ast.Call]] = {}  # target -> Call values (an optimizer's construction)


def zero_grad_may_run_every_microstep(tree: ast.Module) -> bool:
    """Whether some ``X.step(...)`` call (its optimizer, the receiver or the first positional argument, a
    dotted name) sits in a loop (the innermost loop body around it, or else a class's
    ``training_step(self, batch, batch_idx)``) under an ``if`` inside that loop that may be an
    accumulation condition, with, in the same scope and loop, a backward (``x.backward()``,
    ``self.manual_backward()``) and none under that ``if``, and a ``Y.zero_grad()`` with no ``if``, loop
    or ``except`` between it and the loop body, in no ``with ...accumulate()``/``no_sync()``, where ``Y``
    is the optimizer or is named in ``Y.parameters()`` in a call assigned to it.

    TL303 reports only such a ``zero_grad`` (``ZeroGradEveryMicrostep.check``): every event it uses is a
    method call in the step's own scope (no helper is followed), its loop is ``flow.iteration_frame``,
    and each test here is that of the rule or the model, or weaker: the optimizer may be either
    candidate (a scaler is not told apart), an accumulation test on a name or ``self.attr`` holds when any
    assignment of that name anywhere may be one, and every ``if`` that may be the condition is tried."""
    facts = _walk(tree)
    if not facts.steps or not facts.zeros:
        return False
    is_condition = AccumulationConditions(facts.tests)

    for step in facts.steps:
        keys = _optimizer_keys(step.node)
        loop = _iteration_loop(step)
        if not keys or loop is None:
            continue
        node, at = loop
        candidates = [f[1] for f in step.frames[at:] if f[0] == "if" and is_condition(f[1])]  # type: ignore[arg-type]
        if not candidates:
            continue
        backwards = [b.frames for b in facts.backwards.get(step.scope, ()) if _in_loop(b, node)]
        if not backwards or all(any(f[1] is c for fs in backwards for f in fs) for c in candidates):
            continue
        if any(_clears(zero, node, keys, facts) for zero in facts.zeros.get(step.scope, ())):
            return True
    return False


def _walk(tree: ast.Module) -> _Facts:
    """One iterative walk: each node with its scope and frames (a frame starts at the branch's first
    statement, as libcst's block node, so ``if``/``while`` tests and ``for`` iterables sit outside)."""
    facts = _Facts()
    stack: list[tuple[ast.AST, _Scope, Frames]] = [(tree, _Scope("module", tree, None), ())]
    pop, push, parts_of = stack.pop, stack.append, CONTROL_PARTS.get
    while stack:
        node, scope, frames = pop()
        kind = type(node)
        if kind is ast.Call:
            _note_call(node, scope, frames, facts)  # type: ignore[arg-type]
        elif kind is ast.Assign or kind is ast.AnnAssign or kind is ast.NamedExpr:
            _note_assignment(node, facts)
        elif kind in SCOPE_KINDS:
            # decorators, defaults and bases belong to the new scope too, as in the model
            scope = _Scope(SCOPE_KINDS[kind], node, scope)
        for field, frame, branch in parts_of(kind) or _parts(kind):
            value = getattr(node, field, None)
            inner = frames if frame is None else (*frames, (frame, node, branch))
            if type(value) is list:
                for child in value:
                    if isinstance(child, ast.AST) and type(child) not in _LEAVES:
                        push((child, scope, inner))
            elif isinstance(value, ast.AST) and type(value) not in _LEAVES:
                push((value, scope, inner))
    return facts


# Fields that hold no node that can hold a call: contexts, operators.
_NO_CALLS = frozenset({"ctx", "op", "ops", "type_comment"})
# Nodes that hold no call: they are not walked into.
_LEAVES = frozenset(
    {ast.Name, ast.Constant, ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal, ast.Pass, ast.Break}
    | {ast.Continue, ast.alias}
    | {
        cls
        for base in (ast.expr_context, ast.operator, ast.unaryop, ast.cmpop, ast.boolop)
        for cls in base.__subclasses__()
    }
)


def _parts(kind: type) -> tuple[tuple[str, str | None, str], ...]:
    """The fields of any other node, all in the outer frames (made once per node type)."""
    CONTROL_PARTS[kind] = tuple((field, None, "") for field in kind._fields if field not in _NO_CALLS)  # type: ignore[attr-defined]
    return CONTROL_PARTS[kind]


def _note_call(node: ast.Call, scope: _Scope, frames: Frames, facts: _Facts) -> None:
    func = node.func
    if type(func) is not ast.Attribute or func.attr not in _METHODS:
        return
    name = func.attr
    if name == "step":
        facts.steps.append(_Site(node, scope, frames))
    elif name == "zero_grad":
        facts.zeros.setdefault(scope, []).append(_Site(node, scope, frames))
    elif name == "backward" or (type(func.value) is ast.Name and func.value.id == "self"):
        facts.backwards.setdefault(scope, []).append(_Site(node, scope, frames))


def _note_assignment(node: ast.AST, facts: _Facts) -> None:
    """Keep what ``values_of`` can return for a name or ``self.attr``: the values of plain targets."""
    value = node.value  # type: ignore[attr-defined]
    if value is None:
        return
    targets = node.targets if type(node) is ast.Assign else [node.target]  # type: ignore[attr-defined]
    for target in targets:
        key = dotted(target)
        if key is None or ("." in key and not (key.startswith("self.") and key.count(".") == 1)):
            continue
        if isinstance(value, _TEST_VALUES):
            facts.tests.append((key, value))
        elif type(value) is ast.Call:
            facts.calls.setdefault(key, []).append(value)


def _optimizer_keys(call: ast.Call) -> set[str]:
    """The optimizer of ``opt.step()`` (the receiver) or of ``scaler.step(opt)`` (the first positional
    argument): which one the model takes depends on whether the receiver is a scaler, so both count."""
    keys = {dotted(call.func.value)}  # type: ignore[attr-defined]
    positional = [a for a in call.args if type(a) is not ast.Starred]
    if positional:
        keys.add(dotted(positional[0]))
    keys.discard(None)
    return keys  # type: ignore[return-value]


def _iteration_loop(site: _Site) -> tuple[ast.AST, int] | None:
    """``flow.iteration_frame``: the innermost loop body around the site (with the index of its frames
    after that loop), else the ``training_step(self, batch, batch_idx)`` method it is in (index 0: all of
    its frames count)."""
    frames = site.frames
    for index in range(len(frames) - 1, -1, -1):
        if frames[index][0] == "loop" and frames[index][2] == "body":
            return frames[index][1], index + 1
    scope = site.scope
    node = scope.node
    if (
        scope.kind == "function"
        and scope.parent is not None
        and scope.parent.kind == "class"
        and node.name in _STEP_METHODS  # type: ignore[attr-defined]
        and len(node.args.args) >= 3  # type: ignore[attr-defined]
    ):
        return node, 0
    return None


def _in_loop(site: _Site, loop: ast.AST) -> bool:
    """``flow.in_loop``: the site sits in the loop's body, or the loop is the site's method."""
    return loop is site.scope.node or any(f[1] is loop and f[2] == "body" for f in site.frames)


def _inside(site: _Site, loop: ast.AST) -> Frames:
    """``flow.frames_inside``: the frames of the site nested inside the loop's body."""
    for index, frame in enumerate(site.frames):
        if frame[1] is loop and frame[2] == "body":
            return site.frames[index + 1 :]
    return site.frames if loop is site.scope.node else ()


def _clears(zero: _Site, loop: ast.AST, keys: set[str], facts: _Facts) -> bool:
    """The rule's tests of a ``zero_grad`` against the step's loop and optimizer."""
    key = dotted(zero.node.func.value)  # type: ignore[attr-defined]
    if key is None or not _in_loop(zero, loop):
        return False
    for kind, _node, branch in _inside(zero, loop):
        if kind in ("if", "loop") or (kind == "try" and branch == "handler"):
            return False
    for kind, node, _branch in zero.frames:
        if kind == "with" and any(_accumulates(item.context_expr) for item in node.items):  # type: ignore[attr-defined]
            return False
    return key in keys or any(
        _mentions_parameters_of(value, key) for k in keys for value in facts.calls.get(k, ())
    )


def _accumulates(expr: ast.AST) -> bool:
    """``accelerator.accumulate(model)``, ``model.no_sync()`` (``attr_name``: a plain name too)."""
    if not isinstance(expr, ast.Call):
        return False
    func = expr.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return name in ("accumulate", "no_sync")


def _mentions_parameters_of(value: ast.AST, key: str) -> bool:
    """``training.mentions_parameters_of``: ``<key>.parameters()`` or ``.named_parameters()`` in it."""
    for node in ast.walk(value):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("parameters", "named_parameters")
            and dotted(node.func.value) == key
        ):
            return True
    return False


class AccumulationConditions:
    """Whether an ``if`` may be an accumulation condition (``accumulation_test`` of its test, or a
    ``counter_reset``), each asked once; the names that may hold a test are gathered at the first."""

    def __init__(self, tests: Iterable[tuple[str, ast.AST]]) -> None:
        self._tests = tests
        self._names: set[str] | None = None
        self._answers: dict[int, bool] = {}

    def __call__(self, node: ast.If) -> bool:
        if id(node) not in self._answers:
            if self._names is None:
                self._names = accumulating_names(self._tests)
            self._answers[id(node)] = accumulation_test(node.test, self._names) or counter_reset(node)
        return self._answers[id(node)]


def accumulating_names(tests: Iterable[tuple[str, ast.AST]]) -> set[str]:
    """The names and ``self.attr``s some assignment of which may be an accumulation test, following
    names assigned such names as far as the model does."""
    names: set[str] = set()
    pending = list(tests)
    for _ in range(_NAME_HOPS):
        grown = [key for key, value in pending if key not in names and accumulation_test(value, names)]
        if not grown:
            break
        names.update(grown)
    return names


def accumulation_test(test: ast.AST, names: set[str]) -> bool:
    """``Training.accumulation_test``, where a name or ``self.attr`` holds when it is in ``names``."""
    if isinstance(test, ast.UnaryOp):
        return isinstance(test.op, ast.Not) and accumulation_test(test.operand, names)
    if isinstance(test, ast.BoolOp):
        return any(accumulation_test(v, names) for v in test.values)
    if isinstance(test, ast.Attribute) and test.attr == "sync_gradients":
        return True
    if _is_modulo(test) or (
        isinstance(test, ast.Compare)
        and (_is_modulo(test.left) or any(_is_modulo(c) for c in test.comparators))
    ):
        return True
    if isinstance(test, ast.Name | ast.Attribute):
        return dotted(test) in names
    return False


def _is_modulo(expr: ast.AST) -> bool:
    """``training.is_modulo``: ``a % b`` but for the literal ``2`` (written as one character, as libcst's
    ``Integer("2")``) and for a string's ``%`` formatting."""
    if not isinstance(expr, ast.BinOp) or not isinstance(expr.op, ast.Mod):
        return False
    right, left = expr.right, expr.left
    if (
        isinstance(right, ast.Constant)
        and type(right.value) is int
        and right.value == 2
        and right.end_lineno == right.lineno
        and (right.end_col_offset or 0) - right.col_offset == 1
    ):
        return False
    return not (
        isinstance(left, ast.JoinedStr)
        or (isinstance(left, ast.Constant) and type(left.value) in (str, bytes))
    )


def counter_reset(node: ast.If) -> bool:
    """``Training.counter_reset``: ``if n == k:`` (or ``>=``) whose body sets ``n = 0`` (or ``k = 0``)."""
    test = node.test
    if not isinstance(test, ast.Compare) or not isinstance(test.ops[0], ast.Eq | ast.GtE):
        return False
    names = {dotted(test.left), *(dotted(c) for c in test.comparators)} - {None}
    for statement in node.body:
        for sub in ast.walk(statement):
            if (
                isinstance(sub, ast.Assign)
                and isinstance(sub.value, ast.Constant)
                and type(sub.value.value) is int
                and sub.value.value == 0
                and any(dotted(t) in names for t in sub.targets)
            ):
                return True
    return False
