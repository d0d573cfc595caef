"""Whether a file can hold TL501's finding, read from CPython's tree before libcst is asked: in one scope
that names no gradient-synchronisation control, a backward inside a loop, a call of a model wrapped in
DistributedDataParallel (or prepared by Accelerate), and an optimizer step that makes the loop an
accumulation window.

The walk mirrors what ``FileModel`` records for the rule: scopes (module, class, function, lambda; a def's
decorators, defaults and annotations belong to the def, comprehensions to their enclosing scope), each
call with the ``if``/loop frames around it (not reset where a nested function starts, as in the model),
and the file's own functions a call may run (``f()``, ``self.f()``). Where it cannot be as precise it
keeps more: names resolve through every import and assignment of the file, a helper is every function
of the file with that name, and an ``if`` is an accumulation condition when any assignment could make it
one.
"""

from __future__ import annotations

import ast
from collections.abc import Callable

from trainlint.model.gate_calls import BINDERS
from trainlint.model.gate_sharding_order import resolver
from trainlint.model.gate_zero_grad import AccumulationConditions
from trainlint.model.pyast import ast_dotted as dotted
from trainlint.model.vocab import DDP_CLASSES, OTHER_ENGINES, SYNC_CONTROLS, is_step_count_name

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)
# Children that are no node or hold no call and no name: never pushed (``Name``s are read as children).
_SKIP = frozenset(
    {ast.Constant, ast.Pass, ast.Break, ast.Continue, type(None), str, int, bool}
    | {
        cls
        for base in (ast.expr_context, ast.operator, ast.unaryop, ast.cmpop, ast.boolop)
        for cls in base.__subclasses__()
    }
)
# Fields that hold no node: names as strings (noted by ``_note``), contexts, operators, flags.
_NOT_NODES = frozenset({"ctx", "op", "ops", "type_comment", "id", "attr", "name", "asname", "arg", "module"})
_NOT_NODES |= {"level", "kind", "conversion", "is_async", "simple"}
# The fields of a control statement, with the frame their children sit in (None: the outer frames); a
# frame starts at the branch's first statement, as libcst's block node, so tests and iterables sit outside.
_PARTS: dict[type, tuple[tuple[str, str | None, str], ...]] = {
    ast.If: (("test", None, ""), ("body", "if", "body"), ("orelse", "if", "orelse")),
    ast.For: (
        ("target", None, ""),
        ("iter", None, ""),
        ("body", "loop", "body"),
        ("orelse", "loop", "orelse"),
    ),
    ast.While: (("test", None, ""), ("body", "loop", "body"), ("orelse", "loop", "orelse")),
}
_PARTS[ast.AsyncFor] = _PARTS[ast.For]
# Nodes ``_note`` has nothing to read in.
_PLAIN = frozenset(_PARTS) | {ast.Expr, ast.BinOp, ast.Compare, ast.Subscript, ast.Return, ast.With}

Frame = tuple[str, ast.AST, str]  # (kind: "if"/"loop", node, branch: "body"/"orelse"), as ``model.Frame``
Frames = tuple[Frame, ...]


class _Scope:
    __slots__ = ("calls", "synced")

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.synced = False  # names a sync control where ``walk_scope`` of the scope's node sees it


class _Call:
    __slots__ = ("frames", "node", "where")

    def __init__(self, node: ast.Call, frames: Frames, where: tuple[int, int] | None) -> None:
        self.node = node
        self.frames = frames
        self.where = where  # start; None inside an f-string (CPython < 3.12 may misplace it)


class _Facts:
    """What one walk of the tree keeps."""

    def __init__(self) -> None:
        self.scopes: list[_Scope] = []
        self.defs: dict[str, list[_Scope]] = {}  # function name -> the scopes of the defs of that name
        self.imports: dict[str, set[str]] = {}  # local name -> import targets (as ``FileModel`` spells them)
        self.aliases: dict[str, list[str]] = {}  # name -> dotted values assigned to it (``W = nn.Foo``)
        self.assigned: list[tuple[ast.Call, list[ast.expr], bool]] = []  # (call, targets, ``=`` not ``:``)
        self.indexed: list[tuple[str | None, list[ast.expr]]] = []  # ``x = <base>[i]``: (base, targets)
        self.tests: list[tuple[str, ast.AST]] = []  # (name or ``self.attr``, a value assigned to it)
        self.words: set[str] = set()  # the identifiers libcst holds as ``Name`` nodes (some of them)


def ddp_backward_may_accumulate_without_no_sync(tree: ast.Module) -> bool:
    """Whether some scope of the file that names no sync control (``no_sync``, ``accumulate``,
    ``require_backward_grad_sync``, ``sync_gradients``...) has a backward (``x.backward()``, or a call of
    a function of the file that runs one) inside a loop body, calls a wrapped model (a dotted name
    assigned a call that may resolve to ``vocab.DDP_CLASSES``, or ``<...accelerator...>.prepare(...)`` in a file
    that names no DeepSpeed nor FSDP), itself or through the file's functions it calls, and has a step
    (``x.step()``, or a call of a function of the file that runs one) either in that loop under an ``if``
    inside it that may be an accumulation condition and that does not hold the backward, or, when the
    loop is a ``for`` over a name that says accumulation steps, outside that loop and not before it.

    TL501 reports only such a backward (``DdpAccumulationWithoutNoSync.check``, ``training.backward_sites``,
    ``sites_doing``, ``helper_scopes``): each test here is that of the rule or weaker. A sync control is
    looked for in the scope alone (the rule also looks in its helpers), the steps and backwards are every
    ``step``/``backward`` method call (the model's events, less the ones it classifies otherwise), and an
    ``if`` counts when any of its accumulation conditions would, not only the innermost one."""
    facts = _walk(tree)
    wrapped = _wrapped(facts)
    if not wrapped:
        return False
    backward_helpers = {
        name for name, scopes in facts.defs.items() if any(_runs(s, "backward") for s in scopes)
    }
    step_helpers = {name for name, scopes in facts.defs.items() if any(_runs(s, "step") for s in scopes)}
    is_condition = AccumulationConditions(facts.tests)

    for scope in facts.scopes:
        if scope.synced:
            continue
        backwards = [c for c in scope.calls if _does(c.node, "backward", backward_helpers)]
        steps = [c for c in scope.calls if _does(c.node, "step", step_helpers)] if backwards else []
        if not steps or not _uses_wrapped(scope, wrapped, facts):
            continue
        for backward in backwards:
            loop = next((f[1] for f in reversed(backward.frames) if f[0] == "loop" and f[2] == "body"), None)
            if loop is None:
                continue
            if any(_steps_under_condition(step, backward, loop, is_condition) for step in steps):
                return True
            if _counts_microsteps(loop) and any(_steps_after(step, backward, loop) for step in steps):
                return True
    return False


def _walk(tree: ast.Module) -> _Facts:
    """One iterative walk: each call with its scope and frames, the names each scope mentions, the
    file's functions by name, and the assignments names resolve by."""
    facts = _Facts()
    module = _Scope()
    facts.scopes.append(module)
    words = facts.words
    stack: list[tuple[ast.AST, _Scope, Frames, bool]] = [(tree, module, (), False)]
    pop, push, parts_of, sync = stack.pop, stack.append, _PARTS.get, SYNC_CONTROLS
    while stack:
        node, scope, frames, in_fstring = pop()
        kind = type(node)
        if kind is ast.Call:
            where = None if in_fstring else (node.lineno, node.col_offset)  # type: ignore[attr-defined]
            scope.calls.append(_Call(node, frames, where))  # type: ignore[arg-type]
        elif kind is ast.Attribute:
            _mention(node.attr, scope, words)  # type: ignore[attr-defined]
        elif kind in _SCOPES:
            # the def's own name, decorators, defaults and annotations belong to its scope, as in the model
            scope = _Scope()
            facts.scopes.append(scope)
            if kind is not ast.Lambda:
                _mention(node.name, scope, words)  # type: ignore[attr-defined]
            if kind in _DEFS:
                facts.defs.setdefault(node.name, []).append(scope)  # type: ignore[attr-defined]
        elif kind is ast.JoinedStr:
            in_fstring = True
        elif kind not in _PLAIN:
            _note(node, kind, scope, facts)
        for field, frame, branch in parts_of(kind) or _parts(kind):
            value = getattr(node, field)
            inner = frames if frame is None else (*frames, (frame, node, branch))
            for child in value if type(value) is list else (value,):
                if type(child) is ast.Name:  # (a third of all nodes: read here, not pushed)
                    words.add(child.id)  # type: ignore[attr-defined]
                    if child.id in sync:  # type: ignore[attr-defined]
                        scope.synced = True
                elif type(child) not in _SKIP:
                    push((child, scope, inner, in_fstring))
    return facts


def _parts(kind: type) -> tuple[tuple[str, str | None, str], ...]:
    """The fields of any other node that may hold nodes, all in the outer frames (made once per type)."""
    _PARTS[kind] = tuple((f, None, "") for f in kind._fields if f not in _NOT_NODES)  # type: ignore[attr-defined]
    return _PARTS[kind]


def _note(node: ast.AST, kind: type, scope: _Scope, facts: _Facts) -> None:
    """Bindings and assignments, and the names libcst holds as ``Name`` nodes outside expressions."""
    if kind is ast.Import or kind is ast.ImportFrom:
        _import(node, facts)  # type: ignore[arg-type]
        for part in (getattr(node, "module", None) or "").split("."):
            _mention(part, scope, facts.words)
    elif kind in BINDERS:
        _assignment(node, kind, facts)
    elif kind is ast.alias:
        for part in node.name.split("."):  # type: ignore[attr-defined]
            _mention(part, scope, facts.words)
        if node.asname:  # type: ignore[attr-defined]
            _mention(node.asname, scope, facts.words)  # type: ignore[attr-defined]
    elif kind is ast.keyword or kind is ast.arg:
        if node.arg:  # type: ignore[attr-defined]
            _mention(node.arg, scope, facts.words)  # type: ignore[attr-defined]
    elif kind is ast.Global or kind is ast.Nonlocal:
        for name in node.names:  # type: ignore[attr-defined]
            _mention(name, scope, facts.words)
    elif kind is ast.ExceptHandler and node.name:  # type: ignore[attr-defined]
        _mention(node.name, scope, facts.words)  # type: ignore[attr-defined]


def _import(node: ast.Import | ast.ImportFrom, facts: _Facts) -> None:
    """What an import binds, as ``FileModel``'s builder spells it (a star import binds nothing)."""
    if type(node) is ast.Import:
        for alias in node.names:
            name, target = (alias.asname, alias.name) if alias.asname else (alias.name.split(".")[0],) * 2
            facts.imports.setdefault(name, set()).add(target)
        return
    base = "." * node.level + (node.module or "") if node.level else node.module or ""  # type: ignore[union-attr]
    for alias in node.names:
        if alias.name != "*":
            target = f"{base}.{alias.name}" if base else alias.name
            facts.imports.setdefault(alias.asname or alias.name, set()).add(target)


def _mention(name: str, scope: _Scope, words: set[str]) -> None:
    """An identifier libcst holds as a ``Name`` node: ``mentions_sync_control`` and
    ``names_other_engine`` read those (only such identifiers are noted, so neither is ever wrongly set)."""
    if name in SYNC_CONTROLS:
        scope.synced = True
    words.add(name)


def _assignment(node: ast.AST, kind: type, facts: _Facts) -> None:
    """``x = call(...)`` (the wrapped models), ``x = prepared[0]``, and the values of names and
    ``self.attr`` (``values_of``: the accumulation flags)."""
    value = node.value  # type: ignore[attr-defined]
    if value is None:
        return
    targets = node.targets if kind is ast.Assign else [node.target]  # type: ignore[attr-defined]
    path = dotted(value)
    if path is not None:
        for target in targets:
            if type(target) is ast.Name:
                facts.aliases.setdefault(target.id, []).append(path)  # type: ignore[attr-defined]
    if type(value) is ast.Call and kind is not ast.NamedExpr:
        facts.assigned.append((value, targets, kind is ast.Assign))
    elif type(value) is ast.Subscript and kind is ast.Assign:
        facts.indexed.append((dotted(value.value), targets))
    for target in targets:
        key = dotted(target)
        if key is not None and ("." not in key or (key.startswith("self.") and key.count(".") == 1)):
            facts.tests.append((key, value))


def _wrapped(facts: _Facts) -> set[str]:
    """``ddp_models | prepared_models``, or more: the dotted names assigned a call that may resolve to
    ``DistributedDataParallel`` (``=`` or ``x: T =``), and those an ``=`` unpacks from an
    ``<...accelerator...>.prepare(...)`` (then from ``x = prepared[i]``), unless the file names DeepSpeed
    or FSDP."""
    resolve = resolver(facts.imports, facts.aliases)
    out: set[str] = set()
    prepared: set[str] = set()
    other_engine: list[bool] = []  # ``names_other_engine`` of some name of the file, asked when needed
    for call, targets, plain in facts.assigned:
        func = call.func
        if resolve(dotted(func)) & DDP_CLASSES:
            out.update(name for name in map(dotted, targets) if name)
        if (
            plain
            and type(func) is ast.Attribute
            and func.attr == "prepare"
            and "accelerator" in (dotted(func.value) or "").lower()
        ):
            if not other_engine:
                other_engine.append(any(e in w.lower() for w in facts.words for e in OTHER_ENGINES))
            if not other_engine[0]:
                prepared.update(_unpacked(targets))
    grown = bool(prepared)
    while grown:  # (the model follows them in one pass of the file: a fixed point is a superset)
        grown = False
        for base, targets in facts.indexed:
            if base in prepared:
                new = _unpacked(targets) - prepared
                prepared |= new
                grown = grown or bool(new)
    return out | prepared


def _unpacked(targets: list[ast.expr]) -> set[str]:
    """``training.bound_names``: the dotted targets, tuples and lists unpacked (a starred one too)."""
    out: set[str] = set()
    for target in targets:
        elements = target.elts if type(target) in (ast.Tuple, ast.List) else [target]  # type: ignore[attr-defined]
        for element in elements:
            if type(element) is ast.Starred:
                element = element.value  # type: ignore[attr-defined]
            name = dotted(element)
            if name:
                out.add(name)
    return out


def _method(call: ast.Call) -> str | None:
    return call.func.attr if type(call.func) is ast.Attribute else None  # type: ignore[attr-defined]


def _helper(call: ast.Call) -> str | None:
    """The name of the file's function ``call`` may run (``model.local_callee``): ``f()``, ``self.f()``."""
    func = call.func
    if type(func) is ast.Name:
        return func.id  # type: ignore[attr-defined]
    if type(func) is ast.Attribute and type(func.value) is ast.Name and func.value.id == "self":  # type: ignore[attr-defined]
        return func.attr  # type: ignore[attr-defined]
    return None


def _runs(scope: _Scope, method: str) -> bool:
    return any(_method(c.node) == method for c in scope.calls)


def _does(call: ast.Call, method: str, helpers: set[str]) -> bool:
    """An event of the rule (a ``method`` call) or a call of a function of the file that has one."""
    return _method(call) == method or _helper(call) in helpers


def _uses_wrapped(scope: _Scope, wrapped: set[str], facts: _Facts) -> bool:
    """``_ddp_model_used``: the scope, or a function of the file it calls, calls a wrapped model."""
    if any(dotted(c.node.func) in wrapped for c in scope.calls):
        return True
    helpers = {_helper(c.node) for c in scope.calls} & facts.defs.keys()
    return any(
        dotted(c.node.func) in wrapped
        for name in helpers
        for helper in facts.defs[name]
        for c in helper.calls
    )


def _steps_under_condition(
    step: _Call, backward: _Call, loop: ast.AST, is_condition: Callable[[ast.If], bool]
) -> bool:
    """Shape 1 (``under_accumulation``): the step in the loop, under an ``if`` inside it that may be an
    accumulation condition and that has the backward in neither branch."""
    index = next((i for i, f in enumerate(step.frames) if f[1] is loop), None)
    if index is None:
        return False
    around = {id(f[1]) for f in backward.frames}
    return any(
        kind == "if" and id(node) not in around and is_condition(node)
        for kind, node, _branch in step.frames[index + 1 :]
    )


def _counts_microsteps(loop: ast.AST) -> bool:
    """Shape 2: a ``for`` whose iterable names an accumulation count (any name libcst holds as a
    ``Name`` there: an attribute's last part, a keyword, a parameter)."""
    if type(loop) not in (ast.For, ast.AsyncFor):
        return False
    for node in ast.walk(loop.iter):  # type: ignore[attr-defined]
        kind = type(node)
        name = (
            node.id  # type: ignore[attr-defined]
            if kind is ast.Name
            else node.attr  # type: ignore[attr-defined]
            if kind is ast.Attribute
            else node.arg  # type: ignore[attr-defined]
            if kind is ast.keyword or kind is ast.arg
            else None
        )
        if name and is_step_count_name(name):
            return True
    return False


def _steps_after(step: _Call, backward: _Call, loop: ast.AST) -> bool:
    """Shape 2's step: outside the loop and not before the backward (``order``: the model visits nodes
    in source order, so a later node starts no earlier)."""
    if any(f[1] is loop for f in step.frames):
        return False
    return step.where is None or backward.where is None or step.where >= backward.where
