"""Whether a file can hold TL503's finding, read from CPython's tree before libcst is asked: an optimizer
built over a module's parameters before, in the same scope, that module is sharded (an FSDP wrap,
``fully_shard``, or an accelerate ``prepare``).

The check mirrors the file model where the rule relies on it: scopes (module, class, function, lambda;
a def's decorators, defaults and annotations belong to the def, comprehensions to their enclosing scope,
as ``FileModel`` builds them), program order, the two branches of one ``if``, and name resolution through
imports and name-to-name assignments. Wherever it cannot be as precise it answers True.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from trainlint.model.gate_calls import first_arg, positional
from trainlint.model.pyast import ast_dotted as dotted
from trainlint.model.vocab import (
    FSDP_CLASSES,
    FULLY_SHARD,
    NOT_OPTIMIZERS,
    OPTIMIZER_NAME,
    OPTIMIZER_PREFIXES,
    OPTIMIZER_WORDS,
)

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_LEAVES = (ast.Name, ast.Constant)
_BINDERS = (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign, ast.NamedExpr)
# ``FileModel.qualname`` gives up past this many hops through assignments
_MAX_HOPS = 9

Frames = tuple[tuple[int, str], ...]  # the enclosing ``if`` branches: (id of the ``if``, "body"/"orelse")
Resolve = Callable[[str | None], set[str]]  # a dotted path -> the qualified names it may resolve to


@dataclass(eq=False)
class _Call:
    node: ast.Call
    scope: int  # id of the scope's node
    where: tuple[int, int] | None  # start; None inside an f-string (CPython < 3.12 may misplace it)
    frames: Frames
    targets: tuple[str, ...] = ()  # dotted names an assignment binds the call's value to directly
    annotated: bool = False  # that assignment is ``x: T = call``


@dataclass
class _File:
    calls: list[_Call]
    imports: dict[str, set[str]]  # local name -> import targets (as ``FileModel`` spells them)
    aliases: dict[str, list[str]]  # local name -> dotted values assigned to it (``opt_cls = optim.AdamW``)


def optimizer_may_precede_sharding(tree: ast.Module) -> bool:
    """Whether some scope of the file has a sharding call and, not after it and not in the other branch
    of an ``if``, an optimizer call over the sharded module, each as TL503's ``check`` finds them:

    - sharding: a call that may resolve to ``FullyShardedDataParallel`` (its value assigned to a name,
      without ``use_orig_params=True``) or to ``fully_shard``, with a dotted first argument (or
      ``module=``); or ``<...accelerator...>.prepare(x, ...)`` with a dotted ``x`` (the rule asks for
      "fsdp" in the text too, comments included, which the tree does not hold: not asked here);
    - optimizer: a call that may resolve to an optimizer class (by prefix, or a name with an optimizer's
      word that another project file may define), or whose value is assigned to an optimizer's name and
      that has a receiver or first argument; over the module: ``<module>.parameters()`` or
      ``named_parameters()`` inside it, or the module as its receiver or first argument; and, for
      ``prepare``, not prepared by that same call.

    The rule reports only such pairs (same ``Site.scope``, ``order`` not after, not ``exclusive``), so a
    file without one cannot hold its finding. Names resolve over every import and every name-to-name
    assignment of the file, whatever their scope: a superset of ``FileModel.qualname``'s answer."""
    found = _collect(tree)
    resolve = resolver(found.imports, found.aliases)
    shards: dict[int, list[tuple[_Call, str]]] = {}
    for call in found.calls:
        for inner in _sharded(call, resolve):
            shards.setdefault(call.scope, []).append((call, inner))
    if not shards:
        return False
    for call in found.calls:
        if call.scope in shards and _may_be_optimizer(call, resolve):
            if any(_precedes(call, shard, inner) for shard, inner in shards[call.scope]):
                return True
    return False


def _collect(tree: ast.Module) -> _File:
    """One walk: every call with its scope, start and ``if`` branches, and the bindings names resolve by."""
    found = _File([], {}, {})
    assigned: dict[int, tuple[tuple[str, ...], bool]] = {}
    # (node, (scope, frames, inside an f-string)): the context is shared by siblings, not rebuilt
    stack: list[tuple[ast.AST, tuple[int, Frames, bool]]] = [(tree, (id(tree), (), False))]
    while stack:
        node, context = stack.pop()
        kind = type(node)
        if kind in _LEAVES:
            continue
        if kind is ast.Call:
            scope, frames, in_fstring = context
            where = None if in_fstring else (node.lineno, node.col_offset)  # type: ignore[attr-defined]
            call = _Call(node, scope, where, frames)  # type: ignore[arg-type]
            call.targets, call.annotated = assigned.get(id(node), ((), False))  # (parents come first)
            found.calls.append(call)
        elif kind is ast.If:
            # a statement of one branch and one of the other never both run (``exclusive``)
            scope, frames, in_fstring = context
            stack.append((node.test, context))  # type: ignore[attr-defined]
            for branch in ("body", "orelse"):
                inside = (scope, (*frames, (id(node), branch)), in_fstring)
                stack.extend((child, inside) for child in getattr(node, branch))
            continue
        elif kind in _SCOPES:
            context = (id(node), *context[1:])  # its decorators, defaults, annotations: as in ``FileModel``
        elif kind is ast.JoinedStr:
            context = (*context[:2], True)
        elif kind in _BINDERS:
            _bind(node, found, assigned)
        stack.extend((child, context) for child in ast.iter_child_nodes(node))
    return found


def _bind(node: ast.AST, found: _File, assigned: dict[int, tuple[tuple[str, ...], bool]]) -> None:
    """Record what an import or an assignment binds, as ``FileModel``'s builder does."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            name, target = (alias.asname, alias.name) if alias.asname else (alias.name.split(".")[0],) * 2
            found.imports.setdefault(name, set()).add(target)
    elif isinstance(node, ast.ImportFrom):
        base = "." * node.level + (node.module or "") if node.level else node.module or ""
        for alias in node.names:
            if alias.name != "*":
                target = f"{base}.{alias.name}" if base else alias.name
                found.imports.setdefault(alias.asname or alias.name, set()).add(target)
    elif isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        value = node.value
        if value is None:
            return
        path = dotted(value)
        for target in targets:
            if isinstance(target, ast.Name) and path is not None:
                found.aliases.setdefault(target.id, []).append(path)
        if isinstance(value, ast.Call) and not isinstance(node, ast.NamedExpr):
            names = tuple(n for n in map(dotted, targets) if n)
            assigned[id(value)] = (names, isinstance(node, ast.AnnAssign))


def resolver(imports: dict[str, set[str]], aliases: dict[str, list[str]]) -> Resolve:
    """A function from a dotted path to every qualified name ``FileModel.qualname`` may give it: the
    head through any import of that name, or any name-to-name assignment followed up to its hop limit
    (chains of fewer hops first: each round adds one)."""
    known: dict[str, set[str]] = {name: set(targets) for name, targets in imports.items()}
    for _ in range(_MAX_HOPS):
        grown = False
        for name, values in aliases.items():
            have = known.setdefault(name, set())
            for value in values:
                new = _expand(value, known) - have
                if new:
                    have |= new
                    grown = True
        if not grown:
            break

    def resolve(path: str | None) -> set[str]:
        return _expand(path, known) if path else set()

    return resolve


def _expand(path: str, known: dict[str, set[str]]) -> set[str]:
    head, _, rest = path.partition(".")
    bases = known.get(head)
    if not bases:
        return set()
    return {f"{base}.{rest}" for base in bases} if rest else set(bases)


def _sharded(call: _Call, resolve: Resolve) -> list[str]:
    """The dotted names of the modules a call shards, as TL503 finds its sharding calls."""
    node = call.node
    out: list[str] = []
    callees = resolve(dotted(node.func))
    if callees & FSDP_CLASSES and call.targets and not _keyword_true(node, "use_orig_params"):
        out.append(dotted(first_arg(node, "module")) or "")
    if callees & FULLY_SHARD:
        out.append(dotted(first_arg(node, "module")) or "")
    if _attr_name(node) == "prepare" and "accelerator" in (dotted(_receiver(node)) or "").lower():
        args = positional(node)
        out.append((dotted(args[0]) or "") if args else "")
    return [inner for inner in out if inner]


def _may_be_optimizer(call: _Call, resolve: Resolve) -> bool:
    """An optimizer event (``training.is_optimizer_class`` or ``project_optimizer_class``), or a call
    given a model whose value is bound to an optimizer's name (``_optimizers_from_models``)."""
    for callee in resolve(dotted(call.node.func)):
        if not callee.startswith(NOT_OPTIMIZERS) and callee.startswith(OPTIMIZER_PREFIXES):
            return True
        if OPTIMIZER_WORDS.search(callee.rsplit(".", 1)[-1]):
            return True
    return bool(_models_of(call.node)) and any(
        OPTIMIZER_NAME.match(t.rsplit(".", 1)[-1]) for t in call.targets
    )


def _precedes(optimizer: _Call, shard: _Call, inner: str) -> bool:
    """The rule's pairing: the optimizer not after the shard, not in the other branch of an ``if``, not
    prepared by that same ``prepare`` call, and built over ``inner``."""
    if optimizer.where is not None and shard.where is not None and optimizer.where > shard.where:
        return False
    if _exclusive(optimizer.frames, shard.frames):
        return False
    if _attr_name(shard.node) == "prepare" and not optimizer.annotated:
        prepared = {dotted(arg) for arg in positional(shard.node)}
        if prepared & set(optimizer.targets):
            return False
    return inner in _models_of(optimizer.node) or _mentions_parameters_of(optimizer.node, inner)


def _exclusive(a: Frames, b: Frames) -> bool:
    """``model.exclusive``: the two sit in different branches of one ``if``."""
    branches = dict(a)
    return any(branches.get(node, branch) != branch for node, branch in b)


def _mentions_parameters_of(node: ast.AST, key: str) -> bool:
    """``training.mentions_parameters_of``: ``<key>.parameters()`` or ``named_parameters()`` inside."""
    for inner in ast.walk(node):
        if (
            isinstance(inner, ast.Call)
            and isinstance(inner.func, ast.Attribute)
            and inner.func.attr in ("parameters", "named_parameters")
            and dotted(inner.func.value) == key
        ):
            return True
    return False


def _models_of(call: ast.Call) -> set[str]:
    """TL503's ``_models_of``: the receiver and the first positional argument, dotted."""
    args = positional(call)
    names = {dotted(_receiver(call)), dotted(args[0]) if args else None}
    return {n for n in names if n}


# -- ``syntax``'s helpers, on CPython's tree (``dotted`` is ``summary.ast_dotted``) --------------------------------------------------------------
def _attr_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _receiver(call: ast.Call) -> ast.AST | None:
    return call.func.value if isinstance(call.func, ast.Attribute) else None


def _keywords(keywords: Iterable[ast.keyword], name: str) -> Iterable[ast.expr]:
    return (k.value for k in keywords if k.arg == name)


def _keyword_true(call: ast.Call, name: str) -> bool:
    """``keyword_is(call, name, "True")``: libcst's ``True`` is a name, CPython's a constant."""
    value = next(_keywords(call.keywords, name), None)
    if isinstance(value, ast.Constant):
        return value.value is True
    return (dotted(value) or "").rsplit(".", 1)[-1] == "True"
