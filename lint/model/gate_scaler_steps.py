"""Whether a file can hold TL102's, TL103's or TL107's finding, read from CPython's tree before libcst is
asked: an optimizer stepped directly after a loss-scaled backward (TL102), ``scaler.update()`` on every
micro-step while ``scaler.step()`` runs under an accumulation condition (TL103), a loss-scaled backward
with only bf16 autocast around (TL107).

The walk mirrors what ``FileModel`` records for these rules: scopes (module, class, function, lambda; a
def's decorators, defaults and annotations belong to the def, comprehensions to their enclosing scope),
and for each call the ``if`` and loop frames around it (with the branch), which, as in the model, are not
reset where a nested function starts. Program order is a call's start in the text (unknown inside an
f-string, where CPython before 3.12 may misplace it). Names resolve over every import and assignment of
the file whatever its scope, a superset of ``FileModel.qualname``; an answer that rules a file out
rests only on facts that hold whatever the model resolves. Wherever it cannot be that sure it answers True.
"""

from __future__ import annotations

import ast
import weakref

from trainlint.model.gate_calls import BINDERS, Bindings, binding, enclosing_class, first_arg, names_bound_to
from trainlint.model.gate_sharding_order import Resolve, resolver
from trainlint.model.gate_zero_grad import (
    AccumulationConditions,
    accumulation_test,
    counter_reset,
)
from trainlint.model.pyast import ast_dotted as dotted
from trainlint.model.vocab import AUTOCAST_FUNCTIONS, NOT_OPTIMIZERS, OPTIMIZER_NAME, OPTIMIZER_PREFIXES

# A frame as ``FileModel`` records one: (kind, node, branch); only ``if`` and loop frames are kept.
Frame = tuple[str, ast.AST, str]
Frames = tuple[Frame, ...]
Where = tuple[int, int] | None

_SCOPES = {ast.FunctionDef: "function", ast.AsyncFunctionDef: "function", ast.Lambda: "lambda"}
_SCOPES[ast.ClassDef] = "class"
# Nodes naming what they bind in a string (except handlers, match captures, type parameters): names the
# model does not bind, or binds otherwise than by an import. (Defs and classes are scopes; an import's
# ``alias`` names what it imports.)
_NAMED = tuple(
    cls
    for cls in vars(ast).values()
    if isinstance(cls, type)
    and issubclass(cls, ast.AST)
    and {"name", "rest"} & set(getattr(cls, "_fields", ()))
    and cls is not ast.alias
    and cls not in _SCOPES
)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
# Statements whose target names ``FileModel`` binds where the statement starts (``with``: before the
# items' expressions), by field.
_TARGETS = {
    ast.Assign: "targets",
    ast.AnnAssign: "target",
    ast.AugAssign: "target",
    ast.Delete: "targets",
    ast.For: "target",
    ast.AsyncFor: "target",
    ast.With: "items",
    ast.AsyncWith: "items",
}
# The autocast functions whose second positional argument is the dtype (``autocast_dtype``).
_DTYPE_SECOND = frozenset({"torch.autocast", "torch.amp.autocast"})
# ``Training._accumulation_test`` gives up past this depth of ``not``/``and``/``or``.
_TEST_DEPTH = 4


class _Scope:
    __slots__ = ("kind", "parent")  # (not its node: what a walk keeps must not hold the module)

    def __init__(self, kind: str, parent: _Scope | None) -> None:
        self.kind = kind
        self.parent = parent

    @property
    def owner(self) -> _Scope | None:
        """``Scope.enclosing_class``: for a method (or a function nested in one), its class."""
        return enclosing_class(self)


class _Call:
    __slots__ = ("frames", "key", "node", "scope", "where")

    def __init__(self, node: ast.Call, scope: _Scope, frames: Frames, where: Where, key: str | None) -> None:
        self.node = node
        self.scope = scope
        self.frames = frames
        self.where = where  # the call's start; None inside an f-string
        self.key = key  # the dotted receiver (of ``scale`` for a scaled backward)


class _Facts:
    """What one walk keeps: the calls the rules' events are made of, and what names are bound to."""

    def __init__(self) -> None:
        self.scaled: list[_Call] = []  # ``X.scale(...).backward(...)``, X dotted (key X)
        self.plain: list[_Call] = []  # every other ``x.backward(...)``: a plain backward event
        self.steps: list[_Call] = []  # ``x.step(...)``
        self.updates: list[_Call] = []  # ``X.update(...)``, X dotted
        self.autocasts: list[_Call] = []  # calls of ``x.autocast`` or of a plain name (maybe an alias)
        self.used: set[str] = set()  # dotted receivers of ``step``/``update``/``unscale_`` calls
        self.stepped: set[str] = set()  # dotted first arguments of ``x.step(o)``/``x.unscale_(o)``
        # name or ``self.attr`` -> the values assigned to it (plain targets), with the scope assigning
        self.values: dict[str, list[tuple[ast.expr, _Scope]]] = {}
        self.tests: list[tuple[str, ast.AST]] = []  # the same pairs, for ``accumulating_names``
        self.params: set[str] = set()
        self.imports: dict[str, set[str]] = {}  # local name -> import targets (as ``FileModel``)
        self.aliases: dict[str, list[str]] = {}  # name -> dotted values assigned to it
        self.bindings: Bindings = []
        self.rebound: dict[str, int] = {}  # name -> how often it is bound otherwise than by an import
        self.module_imports: set[str] = set()  # names an import binds at module level
        self.mentions: set[str] = set()  # ``self.x`` texts read otherwise than as ``self.x.scale(``
        self.skip: set[int] = set()  # ``self.x`` nodes not counted as such a mention
        # (scope, name) -> where each binding of the name in the scope sits in the model's order
        # (None: unknown) and what binds it: the callee (dotted) of an assignment's call, "def" for a
        # def or class, else None
        self.binds: dict[tuple[_Scope, str], list[tuple[Where, str | None]]] = {}
        self.bind_at: dict[int, tuple[Where, str | None]] = {}  # target name node -> the same, made early
        self.globals: set[str] = set()
        self._resolve: Resolve | None = None

    def resolve(self, path: str | None) -> set[str]:
        """Every qualified name ``FileModel.qualname`` may give ``path`` (made on first use)."""
        if self._resolve is None:
            self._resolve = resolver(self.imports, self.aliases)
        return self._resolve(path)


# -- TL102 ---------------------------------------------------------------------------------------------
def step_may_bypass_scaler(tree: ast.Module) -> bool:
    """Whether some ``R.step(...)`` (R dotted, a possible optimizer) may come after a loss-scaled backward
    ``X.scale(...).backward(...)`` (X dotted, a possible scaler) the way TL102 pairs them:

    - in one scope: the backward starts before the step, not in the other branch of an ``if``; R is not X
      (the same text in one scope: a scaler, so the step is ``scaler_step``); and none of these lies
      between them, each of which ends the rule's pairing (or, X being no scaler, leaves no scaled
      backward): a plain backward (one not of that form) on the step's path and the backward's, or
      ``X.step(R)``; nor is ``X.step(...)`` in the other branch of an ``if`` from the step;
    - or X is ``self...``, its class has a method stepping R (another scope, same ``enclosing_class``),
      and the file does not read X, written as such, otherwise than as ``X.scale(`` (``_only_scales``
      counts such a text as a use).

    R is a possible optimizer (``is_optimizer_like``) when its last name is an optimizer's, it is passed
    to ``x.step()``/``x.unscale_()``, or it is assigned a call that may resolve to an optimizer class,
    and it is not surely the optimizer MS-AMP returned (``_from_msamp``); X a possible scaler
    (``is_scaler``) when it receives ``step``/``update``/``unscale_``, is assigned a call (another
    file's factory too), or is a parameter's name. The rule reports only such steps."""
    facts = _facts(tree)
    if not facts.scaled or not facts.steps:
        return False
    scaled = [b for b in facts.scaled if _may_be_scaler(b.key, facts)]  # type: ignore[arg-type]
    if not scaled:
        return False
    optimizers: dict[str, bool] = {}
    for step in facts.steps:
        key = step.key
        if key is None:
            continue
        if key not in optimizers:
            optimizers[key] = _may_be_optimizer(key, facts)
        if optimizers[key] and not _surely_msamp(key, step.scope, facts):
            if any(_pairs(b, step, facts) for b in scaled):
                return True
    return False


def _pairs(backward: _Call, step: _Call, facts: _Facts) -> bool:
    """TL102's two ways to pair a scaled backward with a direct step (see ``step_may_bypass_scaler``)."""
    scaler = backward.key
    if step.key == scaler:
        return False
    if backward.scope is step.scope:
        if not _before(backward.where, step.where, strict=False) or _exclusive(backward.frames, step.frames):
            return False
        # (an event only when no callee may be an optimizer class: ``_classify`` asks that first)
        for plain in facts.plain:
            if (
                plain.scope is step.scope
                and _between(backward, plain, step)
                and not _exclusive(plain.frames, step.frames)
                and not _exclusive(plain.frames, backward.frames)
                and not _may_be_optimizer_class(plain.node, facts)
            ):
                return False
        for other in facts.steps:
            if (
                other.scope is not step.scope
                or other.key != scaler
                or _may_be_optimizer_class(other.node, facts)
            ):
                continue
            if _exclusive(other.frames, step.frames):
                return False  # ``scaler.step`` in the other branch: the direct one is the non-AMP path
            if _between(backward, other, step) and dotted(first_arg(other.node, "optimizer")) == step.key:
                return False
        return True
    owner = backward.scope.owner
    return (
        scaler.startswith("self.")  # type: ignore[union-attr]
        and owner is not None
        and step.scope.owner is owner
        and scaler not in facts.mentions
    )


def _surely_msamp(key: str, scope: _Scope, facts: _Facts) -> bool:
    """``_from_msamp`` surely holds: ``model.lookup`` takes the name to the last binding of it in the
    step's scope (no ``global`` of it in the file, no def or class of it there), and that is an
    assignment of a call that surely resolves under ``msamp.`` (``model, opt = msamp.initialize(...)``)."""
    entries = facts.binds.get((scope, key))
    if "." in key or key in facts.globals or not entries:
        return False
    if any(where is None or what == "def" for where, what in entries):
        return False
    last = max(where for where, _ in entries)  # type: ignore[type-var]
    return all(
        what is not None and (_surely(what, facts) or "").startswith("msamp.")
        for where, what in entries
        if where == last
    )


def _between(first: _Call, middle: _Call, last: _Call) -> bool:
    """``middle`` surely starts after ``first`` and before ``last`` (program order)."""
    return _before(first.where, middle.where, strict=True) and _before(middle.where, last.where, strict=True)


def _before(a: Where, b: Where, *, strict: bool) -> bool:
    """``a`` starts before ``b``; where one is unknown: not ``strict``ly known to (True otherwise)."""
    if a is None or b is None:
        return not strict
    return a < b


def _may_be_optimizer(key: str, facts: _Facts) -> bool:
    """``Training.is_optimizer_like``, or more: an optimizer's name, an argument of ``x.step()`` or
    ``x.unscale_()``, or assigned a call that may resolve to an optimizer class."""
    if (OPTIMIZER_NAME.match(key.rsplit(".", 1)[-1]) and "sched" not in key.lower()) or key in facts.stepped:
        return True
    return any(
        type(v) is ast.Call and _may_be_optimizer_class(v, facts) for v, _ in facts.values.get(key, ())
    )


def _may_be_optimizer_class(call: ast.Call, facts: _Facts) -> bool:
    """The callee may resolve to an optimizer class (``is_optimizer_class``): such a call is an
    ``optimizer`` event, whatever its method's name."""
    for callee in facts.resolve(dotted(call.func)):
        if callee.startswith(OPTIMIZER_PREFIXES) and not callee.startswith(NOT_OPTIMIZERS):
            return True
    return False


def _may_be_scaler(key: str, facts: _Facts) -> bool:
    """``Training.is_scaler`` for a receiver of ``scale``, or more: by use (``step``/``update``/
    ``unscale_`` called on it), by construction (a call, or a conditional with one, assigned to it) or
    as a parameter (a name some function takes)."""
    if key in facts.used or ("." not in key and key in facts.params):
        return True
    for value, _ in facts.values.get(key, ()):
        options = (value.body, value.orelse) if type(value) is ast.IfExp else (value,)  # type: ignore[attr-defined]
        if any(type(option) is ast.Call for option in options):
            return True
    return False


# -- TL103 ---------------------------------------------------------------------------------------------
def update_may_run_every_microstep(tree: ast.Module) -> bool:
    """Whether some ``K.update(...)`` (K dotted, a possible scaler as for TL102) sits in a loop body (its
    innermost, as ``innermost_loop``) under no ``if`` inside that loop that surely is an accumulation
    condition, while ``K.step(...)`` (the same K: both events' keys must match) sits in the same scope
    and innermost loop body, not in the other branch of an ``if``, under an ``if`` inside that loop that
    may be one.

    TL103 reports only such an update: ``under_accumulation(update)`` must find no condition and
    ``under_accumulation(step)`` one. A test surely is one when ``accumulation_test`` holds for it
    without any name and within the model's depth, or it is a counter reset whose ``0`` is written so;
    it may be one as TL303's check reads it (``accumulation_test`` over the names that may hold one, or
    ``counter_reset``)."""
    facts = _facts(tree)
    if not facts.updates or not facts.steps:
        return False
    steps: dict[tuple[_Scope, str], list[_Call]] = {}
    for step in facts.steps:
        loop = _innermost_loop(step.frames)
        if step.key is not None and loop is not None:
            steps.setdefault((step.scope, step.key), []).append(step)
    is_condition = AccumulationConditions(facts.tests)
    for update in facts.updates:
        loop = _innermost_loop(update.frames)
        candidates = steps.get((update.scope, update.key))  # type: ignore[arg-type]
        if loop is None or not candidates or not _may_be_scaler(update.key, facts):  # type: ignore[arg-type]
            continue
        if any(_surely_accumulation(node, update.scope, facts) for node in _ifs_inside(update.frames, loop)):
            continue
        for step in candidates:
            if _innermost_loop(step.frames) is not loop or _exclusive(step.frames, update.frames):
                continue
            if any(is_condition(node) for node in _ifs_inside(step.frames, loop)):  # type: ignore[arg-type]
                return True
    return False


def _innermost_loop(frames: Frames) -> ast.AST | None:
    """``flow.innermost_loop``: the innermost loop whose body (not ``else:``) holds the site."""
    for kind, node, branch in reversed(frames):
        if kind == "loop" and branch == "body":
            return node
    return None


def _ifs_inside(frames: Frames, loop: ast.AST) -> list[ast.AST]:
    """The ``if`` statements around a site inside ``loop`` (``under_accumulation``'s frames)."""
    for index, frame in enumerate(frames):
        if frame[1] is loop:
            return [node for kind, node, _ in frames[index + 1 :] if kind == "if"]
    return []


def _surely_accumulation(node: ast.If, scope: _Scope, facts: _Facts) -> bool:
    """``Training.accumulation_condition`` surely holds (for a site in ``scope``): a test it finds
    within its depth (an ``and``/``or`` of n operands nests at most n - 1 deep in libcst) through names
    whose values ``values_of`` surely gives, or a counter reset whose ``0`` is the text ``0`` (libcst's
    ``Integer("0")``)."""
    if _surely_test(node.test, 0, scope, facts):
        return True
    if not counter_reset(node):
        return False
    test = node.test
    names = {dotted(test.left), *(dotted(c) for c in test.comparators)} - {None}  # type: ignore[attr-defined]
    for statement in node.body:
        for sub in ast.walk(statement):
            if type(sub) is ast.Assign and any(dotted(t) in names for t in sub.targets):
                value = sub.value
                if type(value) is ast.Constant and value.value == 0 and _one_character(value):
                    return True
    return False


def _surely_test(test: ast.AST, depth: int, scope: _Scope, facts: _Facts) -> bool:
    """``Training._accumulation_test`` surely holds at this depth."""
    if depth > _TEST_DEPTH:
        return False
    kind = type(test)
    if kind is ast.UnaryOp:
        return type(test.op) is ast.Not and _surely_test(test.operand, depth + 1, scope, facts)  # type: ignore[attr-defined]
    if kind is ast.BoolOp:
        deeper = depth + len(test.values) - 1  # type: ignore[attr-defined]
        return any(_surely_test(value, deeper, scope, facts) for value in test.values)  # type: ignore[attr-defined]
    if accumulation_test(test, set()):  # (without names: what it finds in the test itself)
        return True
    values = _surely_values(dotted(test), scope, facts, every=True)
    return bool(values) and all(_surely_test(value, depth + 1, scope, facts) for value in values)


def _surely_values(key: str | None, scope: _Scope, facts: _Facts, *, every: bool) -> list[ast.expr]:
    """Values that ``values_of(key, scope)`` surely gives (all of them with ``every``, else some): for
    ``self.x``, every value assigned to it in the class; for a name that ``scope`` assigns, the values
    ``scope`` assigns (all of them when the file binds the name only by such assignments)."""
    if not key:
        return []
    entries = facts.values.get(key, ())
    if "." not in key:
        if every and (key in facts.imports or facts.rebound.get(key, 0) != len(entries)):
            return []
        return [value for value, where in entries if where is scope]
    owner = scope.owner
    if owner is None or key.count(".") != 1 or not key.startswith("self."):
        return []
    return [value for value, where in entries if where.owner is owner]


def _one_character(node: ast.AST) -> bool:
    return node.end_lineno == node.lineno and (node.end_col_offset or 0) - node.col_offset == 1  # type: ignore[attr-defined]


# -- TL107 ---------------------------------------------------------------------------------------------
def scaled_backward_may_meet_bf16(tree: ast.Module) -> bool:
    """Whether some loss-scaled backward ``X.scale(...).backward(...)`` (X dotted, a possible scaler as
    for TL102) sits in a scope with no autocast call that surely is not bf16, and either that scope or,
    when the file has no such call at all, the file has an autocast call that may be bf16.

    TL107 reports a scaled backward only when the autocast calls of its scope, or of the whole file
    when its scope has none, are all bf16 (``autocast_dtype``) and there is one. A call may be an
    autocast when its callee may resolve to one of ``AUTOCAST_FUNCTIONS``; it surely is one when every
    binding of its head in the file is the same import, one at module level. It may be bf16 for one of
    those callees: a ``dtype`` (or the second positional argument of ``torch.autocast``) that is
    ``x.bfloat16`` or a name bound to ``bfloat16``; else a ``torch.cpu.amp`` callee, or the device
    string ``"cpu"`` for those not under ``torch.cuda.amp``. Given the callee, that test is exact."""
    facts = _facts(tree)
    if not facts.autocasts:
        return False
    scopes = {
        b.scope
        for b in facts.scaled
        if _may_be_scaler(b.key, facts) and not _surely_disabled(b, facts)  # type: ignore[arg-type]
    }
    if not scopes:
        return False
    autocast_names = names_bound_to(frozenset({"autocast"}), facts.bindings)
    bf16_names = names_bound_to(frozenset({"bfloat16"}), facts.bindings)
    maybe: set[_Scope] = set()  # scopes with an autocast that may be bf16
    surely_not: set[_Scope] = set()  # scopes with an autocast that surely is not
    for call in facts.autocasts:
        func = call.node.func
        if type(func) is ast.Name and func.id not in autocast_names:
            continue
        path = dotted(func)
        callees = facts.resolve(path) & AUTOCAST_FUNCTIONS
        if any(_may_be_bf16(call.node, callee, bf16_names) for callee in callees):
            maybe.add(call.scope)
        else:
            callee = _surely(path, facts)
            if callee in AUTOCAST_FUNCTIONS and not _may_be_bf16(call.node, callee, bf16_names):
                surely_not.add(call.scope)
    if not maybe:
        return False
    return any(scope not in surely_not and (scope in maybe or not surely_not) for scope in scopes)


def _surely_disabled(backward: _Call, facts: _Facts) -> bool:
    """``scaler_constructions`` surely holds a ``GradScaler(enabled=...)`` with anything but ``True``
    (the rule then leaves the backward alone): the backward's scope assigns one to the scaler's name, or
    its class to ``self.x``, and the callee surely resolves to a name ending in ``GradScaler``."""
    for value in _surely_values(backward.key, backward.scope, facts, every=False):
        options = (value.body, value.orelse) if type(value) is ast.IfExp else (value,)  # type: ignore[attr-defined]
        for option in options:
            if type(option) is not ast.Call or not (_surely(dotted(option.func), facts) or "").endswith(
                "GradScaler"
            ):
                continue
            enabled = next((k.value for k in option.keywords if k.arg == "enabled"), None)
            if enabled is not None and not (type(enabled) is ast.Constant and enabled.value is True):
                return True
    return False


def _may_be_bf16(call: ast.Call, callee: str, bf16_names: set[str]) -> bool:
    """``autocast_dtype`` may give ``"bf16"`` for this call of ``callee``."""
    keywords = {k.arg: k.value for k in call.keywords if k.arg}
    positional = [a for a in call.args if type(a) is not ast.Starred]
    dtype = keywords.get("dtype")
    if dtype is None and callee in _DTYPE_SECOND and len(positional) > 1:
        dtype = positional[1]
    if dtype is not None:
        # only a dotted name ending in ``bfloat16`` or a name bound to one resolves to ``torch.bfloat16``
        if type(dtype) is ast.Attribute:
            return dtype.attr == "bfloat16"
        return type(dtype) is ast.Name and dtype.id in bf16_names
    if callee.startswith("torch.cuda.amp"):
        return False
    if callee.startswith("torch.cpu.amp"):
        return True
    device = keywords.get("device_type", positional[0] if positional else None)
    return type(device) is ast.Constant and device.value == "cpu"


def _surely(path: str | None, facts: _Facts) -> str | None:
    """What ``FileModel.qualname`` gives ``path`` from any scope, when every binding of its head in the
    file is an import of one same target and one of them is at module level (else None)."""
    if path is None:
        return None
    head, _, rest = path.partition(".")
    targets = facts.imports.get(head, ())
    if head in facts.rebound or head not in facts.module_imports or len(targets) != 1:
        return None
    (target,) = targets
    return f"{target}.{rest}" if rest else target


# -- the walk ------------------------------------------------------------------------------------------
# The facts of the last tree walked: the engine asks the three checks of one tree in a row. The entry
# goes when the tree does (or when another is walked); the facts hold no reference to the module.
_WALKED: dict[int, _Facts] = {}


def _facts(tree: ast.Module) -> _Facts:
    facts = _WALKED.get(id(tree))
    if facts is None:
        _WALKED.clear()
        facts = _WALKED[id(tree)] = _walk(tree)
        weakref.finalize(tree, _WALKED.pop, id(tree), None)
    return facts


def _walk(tree: ast.Module) -> _Facts:
    """One iterative walk: each node with its scope, frames and whether it is inside an f-string."""
    facts = _Facts()
    stack: list[tuple[ast.AST, _Scope, Frames, bool]] = [(tree, _Scope("module", None), (), False)]
    pop, push = stack.pop, stack.append
    while stack:
        node, scope, frames, fstring = pop()
        kind = type(node)
        if kind is ast.Name:
            if type(node.ctx) is not ast.Load:  # type: ignore[attr-defined]
                _rebind(node.id, facts)  # type: ignore[attr-defined]
                where = None if fstring else (node.lineno, node.col_offset)  # type: ignore[attr-defined]
                what = facts.bind_at.pop(id(node), (where, None))
                facts.binds.setdefault((scope, node.id), []).append(what)  # type: ignore[attr-defined]
            continue
        if kind in _TARGETS:
            _note_targets(node, facts)
        if kind is ast.Constant:
            continue
        if kind is ast.Call:
            _note_call(node, scope, frames, None if fstring else (node.lineno, node.col_offset), facts)  # type: ignore[arg-type,attr-defined]
        elif kind is ast.Attribute:
            if not fstring and type(node.ctx) is ast.Load and id(node) not in facts.skip:  # type: ignore[attr-defined]
                _note_mention(node, facts)  # type: ignore[arg-type]
        elif kind is ast.If or kind in _LOOPS:
            _push_branches(node, scope, frames, fstring, stack)
            continue
        elif kind in _SCOPES:
            if kind is not ast.Lambda:
                _rebind(node.name, facts)  # type: ignore[attr-defined]
                where = (node.lineno, node.col_offset)  # type: ignore[attr-defined]
                facts.binds.setdefault((scope, node.name), []).append((where, "def"))  # type: ignore[attr-defined]
            scope = _Scope(_SCOPES[kind], scope)
        elif kind is ast.JoinedStr:
            fstring = True
        elif kind in BINDERS:
            _bind(node, scope, facts)
        elif kind is ast.arg:
            facts.params.add(node.arg)  # type: ignore[attr-defined]
            _rebind(node.arg, facts)  # type: ignore[attr-defined]
            # a function binds its parameters first of all (its decorators' names come after them)
            facts.binds.setdefault((scope, node.arg), []).append(((0, 0), None))  # type: ignore[attr-defined]
            if node.annotation is not None:  # type: ignore[attr-defined]
                facts.skip.add(id(node.annotation))  # type: ignore[attr-defined]  # (``x: self.a = 1``)
        elif kind in _NAMED:
            for field in ("name", "rest"):
                value = getattr(node, field, None)
                if type(value) is str:
                    _rebind(value, facts)
                    facts.binds.setdefault((scope, value), []).append((None, None))
        elif kind is ast.Global:
            facts.globals.update(node.names)  # type: ignore[attr-defined]
        for child in ast.iter_child_nodes(node):
            push((child, scope, frames, fstring))
    return facts


def _note_targets(node: ast.AST, facts: _Facts) -> None:
    """Where the names a statement binds sit in the model's order (the statement's start), and, for an
    assignment of a call, its callee."""
    where = (node.lineno, node.col_offset)  # type: ignore[attr-defined]
    value = getattr(node, "value", None)
    what = dotted(value.func) if type(node) is ast.Assign and type(value) is ast.Call else None  # type: ignore[union-attr]
    targets = getattr(node, _TARGETS[type(node)])
    pending = list(targets) if type(targets) is list else [targets]
    while pending:
        target = pending.pop()
        kind = type(target)
        if kind is ast.withitem:
            pending.extend([target.optional_vars] if target.optional_vars is not None else [])  # type: ignore[attr-defined]
        elif kind is ast.Name:
            facts.bind_at[id(target)] = (where, what)
        elif kind is ast.Tuple or kind is ast.List:
            pending.extend(target.elts)  # type: ignore[attr-defined]
        elif kind is ast.Starred:
            pending.append(target.value)  # type: ignore[attr-defined]


def _push_branches(
    node: ast.AST,
    scope: _Scope,
    frames: Frames,
    fstring: bool,
    stack: list[tuple[ast.AST, _Scope, Frames, bool]],
) -> None:
    """An ``if`` or a loop: its test, target and iterable outside, each branch in a frame of its own (the
    model's frame starts at the block)."""
    kind = "if" if type(node) is ast.If else "loop"
    for field in ("test", "target", "iter"):
        child = getattr(node, field, None)
        if child is not None:
            stack.append((child, scope, frames, fstring))
    for branch in ("body", "orelse"):
        inside = (*frames, (kind, node, branch))
        stack.extend((child, scope, inside, fstring) for child in getattr(node, branch))


def _note_call(node: ast.Call, scope: _Scope, frames: Frames, where: Where, facts: _Facts) -> None:
    func = node.func
    if type(func) is ast.Name:
        facts.autocasts.append(_Call(node, scope, frames, where, None))
        return
    if type(func) is not ast.Attribute:
        return
    name, receiver = func.attr, func.value
    if name == "backward":
        inner = receiver.func if type(receiver) is ast.Call else None  # type: ignore[attr-defined]
        key = dotted(inner.value) if type(inner) is ast.Attribute and inner.attr == "scale" else None
        (facts.scaled if key else facts.plain).append(_Call(node, scope, frames, where, key))
    elif name == "scale":
        facts.skip.add(id(receiver))  # ``self.x.scale(`` is no other use of ``self.x``
    elif name == "autocast":
        facts.autocasts.append(_Call(node, scope, frames, where, None))
    elif name in ("step", "update", "unscale_"):
        key = dotted(receiver)
        if key:
            facts.used.add(key)
        if name == "step":
            facts.steps.append(_Call(node, scope, frames, where, key))
        elif name == "update" and key:
            facts.updates.append(_Call(node, scope, frames, where, key))
        if name != "update":
            arg = dotted(first_arg(node, "optimizer"))
            if arg:
                facts.stepped.add(arg)


def _note_mention(node: ast.Attribute, facts: _Facts) -> None:
    """A read of ``self.x`` (``self.x.y``...) whose text is exactly that: ``_only_scales``'s pattern
    finds it there and it is neither ``self.x.scale(`` (marked in ``skip``) nor an assignment ``self.x =``
    (a read is followed by ``=`` only as an annotation, marked too, or in an f-string, not looked at)."""
    base = node.value
    while type(base) is ast.Attribute:
        base = base.value  # type: ignore[attr-defined]
    if type(base) is not ast.Name or base.id != "self":  # type: ignore[attr-defined]
        return
    text = dotted(node)
    if text is not None and node.end_lineno == node.lineno:
        if (node.end_col_offset or 0) - node.col_offset == len(text.encode("utf-8")):
            facts.mentions.add(text)


def _rebind(name: str, facts: _Facts) -> None:
    facts.rebound[name] = facts.rebound.get(name, 0) + 1


def _bind(node: ast.AST, scope: _Scope, facts: _Facts) -> None:
    """Record what an import or an assignment binds, as ``FileModel``'s builder does."""
    binding(node, facts.bindings)
    kind = type(node)
    if kind is ast.Import or kind is ast.ImportFrom:
        base = "." * node.level + (node.module or "") if kind is ast.ImportFrom else None  # type: ignore[attr-defined]
        for alias in node.names:  # type: ignore[attr-defined]
            if base is None:
                local, target = (
                    (alias.asname, alias.name) if alias.asname else (alias.name.split(".")[0],) * 2
                )
            elif alias.name == "*":
                continue
            else:
                local, target = alias.asname or alias.name, f"{base}.{alias.name}" if base else alias.name
            facts.imports.setdefault(local, set()).add(target)
            where = (node.lineno, node.col_offset)  # type: ignore[attr-defined]
            facts.binds.setdefault((scope, local), []).append((where, None))
            if scope.kind == "module":
                facts.module_imports.add(local)
        return
    if kind is ast.AnnAssign:
        facts.skip.add(id(node.annotation))  # type: ignore[attr-defined]
    value = node.value  # type: ignore[attr-defined]
    if value is None:
        return
    path = dotted(value)
    for target in node.targets if kind is ast.Assign else [node.target]:  # type: ignore[attr-defined]
        key = dotted(target)
        if key is None or ("." in key and not (key.startswith("self.") and key.count(".") == 1)):
            continue
        facts.values.setdefault(key, []).append((value, scope))
        facts.tests.append((key, value))
        if path is not None and "." not in key:
            facts.aliases.setdefault(key, []).append(path)


def _exclusive(a: Frames, b: Frames) -> bool:
    """``model.exclusive``: the two sit in different branches of one ``if``."""
    branches = {id(node): branch for kind, node, branch in a if kind == "if"}
    return any(kind == "if" and branches.get(id(node), branch) != branch for kind, node, branch in b)
