"""Whether a file can hold a finding of TL101 (a clip before ``unscale_``), TL104 (``unscale_`` twice) or
TL108 (a clip after the step), read from CPython's tree before libcst is asked.

The three rules compare training events of one scope (``Training.events_in``): calls classified by their
method name (``x.backward()``, ``x.scale(l).backward()``, ``x.step()``, ``x.unscale_()``, ``x.update()``)
or by their callee (torch's clip functions), in program order, on the same path (not in the two branches
of one ``if``), in the same loops. The walk mirrors what ``FileModel`` builds: scopes (module, class,
function, lambda; a def's decorators, defaults and annotations belong to the def, comprehensions to their
enclosing scope), the ``if`` and loop frames around each call (kept across nested scopes), program order
(the calls' starts: a call starting first comes first, equal starts are nested calls and left open) and
name resolution through imports and name-to-name assignments (``gate_sharding_order.resolver``: a
superset of ``FileModel.qualname``).

Each condition asks for the events a finding needs, read generously (a method call of that name stands
for the event when its receiver may be a scaler, or an optimizer, by any of the model's signs), and
drops a finding only for an event that is sure: a call on a receiver that is also called as
``<receiver>.scale(...)`` somewhere in the file is a GradScaler's (``Training.is_scaler``: by use), and
a callee whose head no import or alias binds is classified by its method name alone. Where the order or
a name cannot be known the answer is True.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from trainlint.model.gate_sharding_order import Resolve, resolver
from trainlint.model.pyast import ast_dotted as dotted
from trainlint.model.pyast import of_last_tree
from trainlint.model.vocab import (
    CLIP_FUNCTIONS,
    GRAD_SCALERS,
    NOT_OPTIMIZERS,
    OPTIMIZER_NAME,
    OPTIMIZER_PREFIXES,
    SCALER_CLASS_SUFFIX,
)

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
# Nodes with nothing below them that the walk reads (a name is read where it is met).
_LEAVES = frozenset(
    {ast.Name, ast.Constant, ast.Load, ast.Store, ast.Del, ast.Pass, ast.Break, ast.Continue}
    | {cls for base in (ast.operator, ast.unaryop, ast.cmpop, ast.boolop) for cls in base.__subclasses__()}
)
_BINDERS = (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign, ast.NamedExpr)
# the last names of ``CLIP_FUNCTIONS``: a dotted callee keeps its last name whatever its head resolves to
_CLIP_NAMES = frozenset(name.rsplit(".", 1)[1] for name in CLIP_FUNCTIONS)
# ``Training.accumulation_condition`` stops past this depth of ``not``/``and``/``or`` and names
_MAX_DEPTH = 4

Frame = tuple[str, ast.AST, str]  # ("if" | "loop", the statement, "body" | "orelse")
Context = tuple[int, tuple[Frame, ...], bool]  # scope (id of its node), frames, inside an f-string


@dataclass(eq=False, slots=True)
class _Call:
    node: ast.Call
    scope: int
    frames: tuple[Frame, ...]
    where: tuple[int, int] | None  # start; None inside an f-string (CPython < 3.12 may misplace it)

    @property
    def key(self) -> str | None:
        """The receiver as dotted text (``Event.key``), for a method call."""
        func = self.node.func
        return dotted(func.value) if type(func) is ast.Attribute else None  # type: ignore[attr-defined]


@dataclass(eq=False)
class _File:
    calls: dict[str, list[_Call]] = field(default_factory=dict)  # by the callee's last name
    imports: dict[str, set[str]] = field(default_factory=dict)  # local name -> import targets
    aliases: dict[str, list[str]] = field(default_factory=dict)  # name -> dotted values assigned to it
    values: dict[str, list[ast.expr]] = field(default_factory=dict)  # name -> values (``values_of``)
    self_values: dict[str, list[ast.expr]] = field(default_factory=dict)  # attr -> ``self.attr`` values
    defs: dict[str, list[int]] = field(default_factory=dict)  # def name -> ids of the defs
    scaler_params: set[str] = field(default_factory=set)  # parameters annotated with a GradScaler
    resolve: Resolve | None = None
    keys: dict[str, set[str]] = field(default_factory=dict)  # method name -> dotted receivers

    def methods(self, name: str) -> list[_Call]:
        """The calls ``<receiver>.name(...)`` (a method call: the model's events need a receiver)."""
        return [c for c in self.calls.get(name, ()) if type(c.node.func) is ast.Attribute]

    def resolved(self, path: str | None) -> set[str]:
        """Every qualified name ``FileModel.qualname`` may give ``path``."""
        if self.resolve is None:
            self.resolve = resolver(self.imports, self.aliases)
        return self.resolve(path)

    def callees(self, call: _Call) -> set[str]:
        return self.resolved(dotted(call.node.func))

    def receivers(self, name: str) -> set[str]:
        """The dotted receivers of ``x.name(...)`` anywhere in the file (``_method_receivers``)."""
        if name not in self.keys:
            self.keys[name] = {key for c in self.methods(name) if (key := c.key) is not None}
        return self.keys[name]


# -- TL101 -----------------------------------------------------------------------------------------------
def clip_may_precede_unscale(tree: ast.Module) -> bool:
    """Whether some torch clip call has, later in its scope and on its path, a ``x.step(...)`` on a dotted
    receiver, and either (a) before it, in its scope and on its path, ``x.scale(...).backward()`` with no
    sure ``unscale_`` or scaler ``step`` between the last one and the clip, or (b) the receiver of one
    such step is called as ``<it>.scale(...).backward()`` in another scope, is never surely unscaled in
    the file, and no sure ``unscale_`` or scaler ``step`` comes before the clip on its path.

    TL101 reports a clip (``CLIP_FUNCTIONS``) followed by a scaler step of its scope; its scaled backward
    is (a) the last one before it in the scope, with no unscale or scaler step after it and before the
    clip, or (b) one in another method or function on the step's scaler (``_backward_elsewhere``), which
    must not be unscaled anywhere, with no unscale or scaler step before the clip. A finding through a
    caller in another file (``scaled_by_caller``) rests on the project: that path is its own gate."""
    found = _found(tree)
    clips = _clips(found)
    if not clips:
        return False
    # (without the project: a scaler by construction is a ``GRAD_SCALERS`` call, not another file's factory)
    steps = _by_scope(c for c in found.methods("step") if _may_be_scaler(found, c.key, factories=False))
    scaled = [
        (c, key)
        for c in found.methods("backward")
        if (key := _scale_receiver(c)) is not None and _may_be_scaler(found, key, factories=False)
    ]
    if not steps or not scaled:
        return False
    sure_unscales = [c for c in found.methods("unscale_") if _sure(c, found)]
    unscaled = {c.key for c in sure_unscales}
    # the unscales and scaler steps that end a window: after them the clip is not this rule's
    closing = _by_scope([*sure_unscales, *(c for c in found.methods("step") if _sure(c, found))])
    backwards = _by_scope(c for c, _ in scaled)
    for clip in clips:
        later = [t for t in steps.get(clip.scope, ()) if _may_precede(clip, t) and not _exclusive(t, clip)]
        if not later:
            continue
        ends = [e for e in closing.get(clip.scope, ()) if not _exclusive(e, clip)]
        before = [
            b for b in backwards.get(clip.scope, ()) if _may_precede(b, clip) and not _exclusive(b, clip)
        ]
        if before:
            last = _last(before)
            if last is None or not _surely_between(ends, last, clip):
                return True
        if _surely_between(ends, None, clip):
            continue
        for key in {t.key for t in later} - unscaled:
            if any(key == k and b.scope != clip.scope for b, k in scaled):
                return True
    return False


# -- TL104 -----------------------------------------------------------------------------------------------
def unscale_may_repeat(tree: ast.Module) -> bool:
    """Whether some ``x.unscale_(...)`` (dotted ``x``) has, earlier in its scope and on its path, either
    another ``x.unscale_`` of the same optimizer text or a call of a def of the file (by name, or
    ``self.name``) whose own scope calls ``x.unscale_`` and surely never ``update()``, with no sure
    ``update()`` between the last of them and it; or else it repeats in a loop (not surely under an
    accumulation condition inside it) whose ``update()`` calls of the scope on its path may all be under
    one (none surely is not).

    TL104 reports an unscale preceded on its path by an unscale of the same scaler key and optimizer, or
    by a call of the file's own helper that unscales that key and does not update, when no update comes
    in between; without either, an unscale in a loop whose updates in that loop all run under an
    accumulation condition while it does not (``Training.under_accumulation``)."""
    found = _found(tree)
    # (a scaler built by another file's factory counts: this rule has no path through the project)
    unscales = _by_scope(c for c in found.methods("unscale_") if _may_be_scaler(found, c.key, factories=True))
    if not unscales:
        return False
    updates = _by_scope(c for c in found.methods("update") if _may_be_scaler(found, c.key, factories=True))
    sure_updates = {s: [c for c in calls if _sure(c, found)] for s, calls in updates.items()}
    helpers = _unscaling_helpers(found, unscales, sure_updates)
    for scope, calls in unscales.items():
        for unscale in calls:
            ends = [u for u in sure_updates.get(scope, ()) if not _exclusive(u, unscale)]
            optimizer = _optimizer(unscale.node)
            earlier = [
                e
                for e in calls
                if e is not unscale
                and e.key == unscale.key
                and _optimizer(e.node) == optimizer
                and _may_precede(e, unscale)
                and not _exclusive(e, unscale)
            ]
            if earlier:
                # an earlier unscale decides (the rule returns after it, finding or not) when it surely is one
                last = _last(earlier)
                if last is None or not all(_surely_before(e, unscale) for e in earlier):
                    return True
                if not _surely_between(ends, last, unscale):
                    return True
                continue
            names = {name for name, key in helpers if key == unscale.key}
            called = [c for c in _calls_of(found, names, scope) if _may_precede(c, unscale)]
            called = [c for c in called if not _exclusive(c, unscale)]
            if called:
                last = _last(called)
                if last is None or not _surely_between(ends, last, unscale):
                    return True
            if _repeats_in_loop(found, unscale, updates.get(scope, ())):
                return True
    return False


def _unscaling_helpers(
    found: _File, unscales: dict[int, list[_Call]], sure_updates: dict[int, list[_Call]]
) -> set[tuple[str, str | None]]:
    """(def name, scaler key) for the defs whose own scope unscales that key and surely never updates
    (``_helper_unscales``)."""
    out = set()
    for name, ids in found.defs.items():
        for scope in ids:
            if scope in unscales and not sure_updates.get(scope):
                out.update((name, c.key) for c in unscales[scope])
    return out


def _calls_of(found: _File, names: set[str], scope: int) -> list[_Call]:
    """The calls of ``scope`` that ``FileModel.local_callee`` may take to a def called one of ``names``:
    ``name(...)`` or ``self.name(...)``."""
    out = []
    for name in names:
        for call in found.calls.get(name, ()):
            func = call.node.func
            if call.scope == scope and (type(func) is ast.Name or dotted(func.value) == "self"):  # type: ignore[attr-defined]
                out.append(call)
    return out


def _repeats_in_loop(found: _File, unscale: _Call, updates: Iterable[_Call]) -> bool:
    """The rule's per-micro-step case may hold: ``unscale`` sits in a loop, under no condition inside it
    that is surely an accumulation one, and the scope's ``update()`` calls on its path whose innermost
    loop is that one are there, some may run under an accumulation condition inside it, and no sure one
    runs under none that may be."""
    loop = _innermost_loop(unscale)
    if loop is None:
        return False
    if any(
        kind == "if" and _accumulation(found, node, sure=True) for kind, node, _ in _inside(unscale, loop)
    ):
        return False
    in_loop = [u for u in updates if _innermost_loop(u) is loop and not _exclusive(u, unscale)]
    conditioned = [
        any(kind == "if" and _accumulation(found, node, sure=False) for kind, node, _ in _inside(u, loop))
        for u in in_loop
    ]
    if any(not c and _sure(u, found) for u, c in zip(in_loop, conditioned, strict=True)):
        return False
    return any(conditioned)


def _accumulation(found: _File, node: ast.AST, *, sure: bool) -> bool:
    """``Training.accumulation_condition`` of an ``if``: surely true (``sure``), or possibly true."""
    test = node.test  # type: ignore[attr-defined]
    if _accumulation_test(found, test, 0, sure=sure):
        return True
    return not sure and _may_reset_counter(node)


def _accumulation_test(found: _File, test: ast.expr, depth: int, *, sure: bool) -> bool:
    """``Training._accumulation_test`` on CPython's tree. ``and``/``or`` chains are n-ary here and nested
    pairs in libcst: an operand's depth there lies between one and the chain's length less one, so a sure
    answer counts the longest, a possible one the shortest. A name's values are every value assigned to
    it in the file: one that may be a condition is enough for a possible answer, and none is sure."""
    if depth > _MAX_DEPTH:
        return False
    kind = type(test)
    if kind is ast.UnaryOp and type(test.op) is ast.Not:  # type: ignore[attr-defined]
        return _accumulation_test(found, test.operand, depth + 1, sure=sure)  # type: ignore[attr-defined]
    if kind is ast.BoolOp:
        values = test.values  # type: ignore[attr-defined]
        inner = depth + (len(values) - 1 if sure else 1)
        return any(_accumulation_test(found, v, inner, sure=sure) for v in values)
    if kind is ast.Attribute and test.attr == "sync_gradients":  # type: ignore[attr-defined]
        return True
    if _modulo(test, sure) or (
        kind is ast.Compare and (_modulo(test.left, sure) or any(_modulo(c, sure) for c in test.comparators))  # type: ignore[attr-defined]
    ):
        return True
    if sure:
        return False
    values: list[ast.expr] = []
    if kind is ast.Name:
        values = found.values.get(test.id, [])  # type: ignore[attr-defined]
    elif kind is ast.Attribute and dotted(test.value) == "self":  # type: ignore[attr-defined]
        values = found.self_values.get(test.attr, [])  # type: ignore[attr-defined]
    return any(_accumulation_test(found, v, depth + 1, sure=False) for v in values)


def _modulo(expr: ast.expr, sure: bool) -> bool:
    """``training.is_modulo``: surely, a ``%`` whose divisor is not written ``2`` (a literal 2 may be
    ``0x2`` to libcst) and whose left side is not a string; possibly, any ``%``."""
    if type(expr) is not ast.BinOp or type(expr.op) is not ast.Mod:  # type: ignore[attr-defined]
        return False
    if not sure:
        return True
    right, left = expr.right, expr.left  # type: ignore[attr-defined]
    if type(right) is ast.Constant and type(right.value) is int and right.value == 2:
        return False
    return not (
        type(left) is ast.JoinedStr or (type(left) is ast.Constant and isinstance(left.value, str | bytes))
    )


def _may_reset_counter(node: ast.AST) -> bool:
    """``Training._counter_reset``: ``if count == n:`` (or ``>=``) whose body sets a compared name to 0."""
    test = node.test  # type: ignore[attr-defined]
    if type(test) is not ast.Compare or type(test.ops[0]) not in (ast.Eq, ast.GtE):
        return False
    names = {dotted(test.left), *map(dotted, test.comparators)} - {None}
    for statement in node.body:  # type: ignore[attr-defined]
        for sub in ast.walk(statement):
            if type(sub) is ast.Assign and type(sub.value) is ast.Constant and sub.value.value == 0:
                if any(dotted(t) in names for t in sub.targets):
                    return True
    return False


# -- TL108 -----------------------------------------------------------------------------------------------
def clip_may_follow_step(tree: ast.Module) -> bool:
    """Whether some torch clip call has, before it in its scope and on its path, a ``x.backward()`` and,
    after the last one, a ``x.step()`` on its path in the same loops under no condition the clip lacks,
    with no sure step (not on a ``*sched*`` receiver) after the clip and before the next backward.

    TL108 reports a clip (``CLIP_FUNCTIONS``) that follows the last backward event before it (every
    ``x.backward(...)``) and, between the two, an optimizer step (a subset of the ``x.step(...)`` calls)
    that ``runs_with`` it; it skips a clip followed, before the next backward, by a step event whose
    receiver text lacks ``sched``. (Its skip of an infinite threshold is not read here.)"""
    found = _found(tree)
    clips = _clips(found)
    if not clips:
        return False
    backwards = _by_scope(found.methods("backward"))
    steps = _by_scope(found.methods("step"))
    if not backwards or not steps:
        return False
    for clip in clips:
        ours = [b for b in backwards.get(clip.scope, ()) if not _exclusive(b, clip)]
        before = [b for b in ours if _may_precede(b, clip)]
        if not before:
            continue
        # (a backward event is every ``x.backward()`` whose callee the model does not take for an optimizer
        # class: where one might be, the first backward bounds the window instead of the last)
        certain = all(_plain(b, found) and _surely_before(b, clip) for b in before)
        start = _last(before) if certain else _first(before)
        near = [t for t in steps.get(clip.scope, ()) if not _exclusive(t, clip) and _may_precede(t, clip)]
        near = [
            t for t in near if _may_be_optimizer(found, t.key) or _may_be_scaler(found, t.key, factories=True)
        ]
        if not any((start is None or _may_precede(start, t)) and _runs_with(clip, t) for t in near):
            continue
        if not _stepped_again(found, clip, ours, steps.get(clip.scope, ())):
            return True
    return False


def _stepped_again(found: _File, clip: _Call, backwards: list[_Call], steps: Iterable[_Call]) -> bool:
    """A sure step event after ``clip`` on its path, before the next backward, not on a ``*sched*``
    receiver: the rule skips the clip."""
    after = [b for b in backwards if _may_precede(clip, b)]
    bound = _first(after) if after else None
    if after and bound is None:
        return False  # (the next backward is not known)
    sure = [
        s
        for s in steps
        if not _exclusive(s, clip) and "sched" not in (s.key or "").lower() and _plain(s, found)
    ]
    return _surely_between(sure, clip, bound)


# -- the walk --------------------------------------------------------------------------------------------
def _collect(tree: ast.Module) -> _File:
    """One iterative walk: every call with a named callee, with its scope, frames and start, and the
    bindings names resolve by."""
    found = _File()
    calls = found.calls
    stack: list[tuple[ast.AST, Context]] = [(tree, (id(tree), (), False))]
    pop, push, extend = stack.pop, stack.append, stack.extend
    while stack:
        node, context = pop()
        kind = type(node)
        if kind in _LEAVES:
            continue
        if kind is ast.Call:
            func = node.func  # type: ignore[attr-defined]
            name = func.id if type(func) is ast.Name else func.attr if type(func) is ast.Attribute else None
            if name is not None:
                where = None if context[2] else (node.lineno, node.col_offset)  # type: ignore[attr-defined]
                calls.setdefault(name, []).append(_Call(node, context[0], context[1], where))  # type: ignore[arg-type]
        elif kind is ast.If or kind in _LOOPS:
            # the model's frame covers the body and the else branch, not the test, target or iterable
            scope, frames, in_fstring = context
            frame_kind = "if" if kind is ast.If else "loop"
            for branch in ("body", "orelse"):
                inside = (scope, (*frames, (frame_kind, node, branch)), in_fstring)
                extend((child, inside) for child in getattr(node, branch))
            push((node.test if kind is not ast.For and kind is not ast.AsyncFor else node.iter, context))  # type: ignore[attr-defined]
            if kind is not ast.While and kind is not ast.If:
                push((node.target, context))  # type: ignore[attr-defined]
            continue
        elif kind in _SCOPES:
            if kind in _DEFS:
                found.defs.setdefault(node.name, []).append(id(node))  # type: ignore[attr-defined]
            context = (id(node), context[1], context[2])  # decorators, defaults: the def's, as in the model
        elif kind is ast.JoinedStr:
            context = (context[0], context[1], True)
        elif kind is ast.arg and node.annotation is not None:  # type: ignore[attr-defined]
            if any(
                (dotted(n) or "").endswith(SCALER_CLASS_SUFFIX)
                for n in ast.walk(node.annotation)  # type: ignore[attr-defined]
                if type(n) is ast.Name or type(n) is ast.Attribute
            ):
                found.scaler_params.add(node.arg)  # type: ignore[attr-defined]
        elif kind in _BINDERS:
            _bind(node, found)
        extend((child, context) for child in ast.iter_child_nodes(node))
    return found


_found = of_last_tree(_collect)  # (the three checks of one file share one walk)


def _bind(node: ast.AST, found: _File) -> None:
    """What an import or an assignment binds, as ``FileModel``'s builder records it."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            name, target = (alias.asname, alias.name) if alias.asname else (alias.name.split(".")[0],) * 2
            found.imports.setdefault(name, set()).add(target)
        return
    if isinstance(node, ast.ImportFrom):
        base = "." * node.level + (node.module or "") if node.level else node.module or ""
        for alias in node.names:
            if alias.name != "*":
                target = f"{base}.{alias.name}" if base else alias.name
                found.imports.setdefault(alias.asname or alias.name, set()).add(target)
        return
    value = node.value  # type: ignore[attr-defined]
    if value is None:
        return
    path = dotted(value)
    for target in node.targets if type(node) is ast.Assign else [node.target]:  # type: ignore[attr-defined]
        if type(target) is ast.Name:
            found.values.setdefault(target.id, []).append(value)
            if path is not None:
                found.aliases.setdefault(target.id, []).append(path)
        elif type(target) is ast.Attribute and dotted(target.value) == "self":
            found.self_values.setdefault(target.attr, []).append(value)


# -- events ----------------------------------------------------------------------------------------------
def _clips(found: _File) -> list[_Call]:
    """The calls whose callee may resolve to one of ``CLIP_FUNCTIONS``: a dotted callee ending in one of
    their names, or a plain name an import or an alias binds to one."""
    out = []
    names = set(_CLIP_NAMES)
    names.update(n for n in (*found.imports, *found.aliases) if found.resolved(n) & CLIP_FUNCTIONS)
    for name in names:
        for call in found.calls.get(name, ()):
            if (type(call.node.func) is ast.Name or name in _CLIP_NAMES) and found.callees(
                call
            ) & CLIP_FUNCTIONS:
                out.append(call)
    return out


def _scale_receiver(call: _Call) -> str | None:
    """``x`` of ``x.scale(...).backward()`` (a scaled backward's key), dotted."""
    inner = call.node.func.value  # type: ignore[attr-defined]
    if type(inner) is ast.Call and type(inner.func) is ast.Attribute and inner.func.attr == "scale":
        return dotted(inner.func.value)
    return None


def _may_be_scaler(found: _File, key: str | None, *, factories: bool) -> bool:
    """``Training.is_scaler`` may hold for ``key``: by use (``key.scale(...)`` and ``key.step``/``update``/
    ``unscale_`` called somewhere), a parameter by its name or annotation, or by construction: a value
    assigned to the name or ``self.attr`` (anywhere) that is, or has a branch that is, a call that may
    resolve to one of ``GRAD_SCALERS`` (with ``factories``: any call, another file's factory)."""
    if key is None:
        return False
    if key in found.receivers("scale") and any(
        key in found.receivers(m) for m in ("step", "update", "unscale_")
    ):
        return True
    if "." not in key:
        lowered = key.lower()
        if key in found.scaler_params or (
            lowered.endswith("scaler") and not lowered.startswith(("lr", "sched"))
        ):
            return True
        values = found.values.get(key, [])
    elif key.startswith("self.") and key.count(".") == 1:
        values = found.self_values.get(key[5:], [])
    else:
        return False
    for value in values:
        for option in (value.body, value.orelse) if type(value) is ast.IfExp else (value,):  # type: ignore[attr-defined]
            if type(option) is ast.Call and (factories or found.resolved(dotted(option.func)) & GRAD_SCALERS):
                return True
    return False


def _may_be_optimizer(found: _File, key: str | None) -> bool:
    """``Training.is_optimizer_like`` may hold for ``key``: a value that is a call of an optimizer class, an
    argument given to a ``step``/``unscale_`` call, or an optimizer's name (``OPTIMIZER_NAME``)."""
    if key is None:
        return False
    last = key.rsplit(".", 1)[-1]
    if OPTIMIZER_NAME.match(last) and "sched" not in key.lower():
        return True
    if key in _stepped_arguments(found):
        return True
    if "." not in key:
        values = found.values.get(key, [])
    elif key.startswith("self.") and key.count(".") == 1:
        values = found.self_values.get(key[5:], [])
    else:
        return False
    for value in values:
        if type(value) is ast.Call:
            for callee in found.resolved(dotted(value.func)):  # type: ignore[attr-defined]
                if callee.startswith(OPTIMIZER_PREFIXES) and not callee.startswith(NOT_OPTIMIZERS):
                    return True
    return False


def _stepped_arguments(found: _File) -> set[str]:
    """The dotted optimizers given to ``x.step(...)``/``x.unscale_(...)`` calls (``_scaler_arguments``)."""
    if "<args>" not in found.keys:
        calls = [*found.methods("step"), *found.methods("unscale_")]
        found.keys["<args>"] = {key for c in calls if (key := _optimizer(c.node)) is not None}
    return found.keys["<args>"]


def _plain(call: _Call, found: _File) -> bool:
    """No import or alias binds the callee's head: the model classifies the call by its method name
    alone (its callee is no clip, checkpoint or optimizer class)."""
    return not found.callees(call)


def _sure(call: _Call, found: _File) -> bool:
    """A method call that is surely the scaler event of its name (``step``, ``update``, ``unscale_``): on a
    scaler by use (``x.scale(...)`` somewhere), and classified by its name."""
    return call.key in found.receivers("scale") and _plain(call, found)


def _optimizer(call: ast.Call) -> str | None:
    """``optimizer_text``: the dotted first positional argument, else ``optimizer=``."""
    args = [a for a in call.args if type(a) is not ast.Starred]
    if args:
        return dotted(args[0])
    return next((dotted(k.value) for k in call.keywords if k.arg == "optimizer"), None)


def _by_scope(calls: Iterable[_Call]) -> dict[int, list[_Call]]:
    out: dict[int, list[_Call]] = {}
    for call in calls:
        out.setdefault(call.scope, []).append(call)
    return out


# -- order and paths -------------------------------------------------------------------------------------
def _may_precede(a: _Call, b: _Call) -> bool:
    """``a.order < b.order`` may hold: ``a`` starts first, or at the same place (one holds the other), or
    a start is unknown."""
    return a.where is None or b.where is None or a.where <= b.where


def _surely_before(a: _Call, b: _Call) -> bool:
    """``a.order < b.order`` surely holds: ``a`` starts first (a call that holds another starts with it)."""
    return a.where is not None and b.where is not None and a.where < b.where


def _surely_between(calls: Iterable[_Call], low: _Call | None, high: _Call | None) -> bool:
    """Some call of ``calls`` surely comes after ``low`` and before ``high`` (None: no bound)."""
    for call in calls:
        if call.where is None:
            continue
        if low is not None and not _surely_before(low, call):
            continue
        if high is not None and not _surely_before(call, high):
            continue
        return True
    return False


def _first(calls: list[_Call]) -> _Call | None:
    """The call that starts first, None when a start is unknown or shared."""
    return _extreme(calls, min)


def _last(calls: list[_Call]) -> _Call | None:
    """The call that starts last, None when a start is unknown or shared."""
    return _extreme(calls, max)


def _extreme(calls: list[_Call], pick: Callable[..., _Call]) -> _Call | None:
    if any(c.where is None for c in calls):
        return None
    best = pick(calls, key=lambda c: c.where)
    if sum(c.where == best.where for c in calls) > 1:
        return None
    return best


def _exclusive(a: _Call, b: _Call) -> bool:
    """``model.exclusive``: the two sit in different branches of one ``if``."""
    branches = {id(node): branch for kind, node, branch in a.frames if kind == "if"}
    return any(kind == "if" and branches.get(id(node), branch) != branch for kind, node, branch in b.frames)


def _runs_with(inner: _Call, outer: _Call) -> bool:
    """``flow.runs_with``: the same loops, and every ``if`` branch around ``outer`` is around ``inner``."""
    if [id(n) for k, n, _ in inner.frames if k == "loop"] != [
        id(n) for k, n, _ in outer.frames if k == "loop"
    ]:
        return False
    inner_ifs = {(id(n), b) for k, n, b in inner.frames if k == "if"}
    return {(id(n), b) for k, n, b in outer.frames if k == "if"} <= inner_ifs


def _innermost_loop(call: _Call) -> ast.AST | None:
    """``flow.innermost_loop(site, orelse=True)``'s statement."""
    return next((node for kind, node, _ in reversed(call.frames) if kind == "loop"), None)


def _inside(call: _Call, loop: ast.AST) -> tuple[Frame, ...]:
    """The frames of ``call`` inside ``loop`` (``Training.under_accumulation``)."""
    index = next(i for i, (_, node, _) in enumerate(call.frames) if node is loop)
    return call.frames[index + 1 :]
