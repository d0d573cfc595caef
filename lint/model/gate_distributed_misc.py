"""Whether a file can hold a finding of TL502, TL505 or TL506, read from CPython's tree before libcst is
asked (``Rule.gate_check``); one function per rule:

- TL502 ``token_count_division_under_data_parallel``: a data-parallel file with a loss divided by a
  count of tokens (``mask.sum()``, or a name computed from one) and a backward call;
- TL505 ``shuffling_sampler_and_epoch_loop``: torch's ``DistributedSampler`` built without
  ``shuffle=False`` for data not named for evaluation, in a file with a loop over epochs;
- TL506 ``fsdp_model_clipped_by_torch``: ``torch.nn.utils.clip_grad_norm_`` over the parameters of a name
  an FSDP1 wrap (not ``NO_SHARD``) is assigned to, where that code sees the name.

Names resolve as ``FileModel.qualname`` does (imports, ``as``, name-to-name assignments: see
``gate_sharding_order.resolver``), over every binding of the file whatever its scope: a superset of the
model's answer. Wherever the check cannot be as precise as the rule, it answers True.
"""

from __future__ import annotations

import ast
from collections import Counter

from trainlint.model.gate_calls import first_arg, keyword, last_name
from trainlint.model.gate_sharding_order import Resolve, resolver
from trainlint.model.pyast import ast_dotted as dotted
from trainlint.model.vocab import (
    BACKWARD_NAMES,
    CLIP_FUNCTIONS,
    COUNT_METHODS,
    CROSS_ENTROPY_CLASSES,
    CROSS_ENTROPY_FUNCTIONS,
    DATA_PARALLEL,
    DISTRIBUTED_SAMPLERS,
    FSDP_CLASSES,
    TOKEN_LOSS_FUNCTIONS,
)

_LEAVES = (ast.Name, ast.Constant)
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)
_SCOPES = (*_DEFS, ast.Lambda, ast.ClassDef)  # ``FileModel``'s scopes (a comprehension is none)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)


class _Names:
    """The bindings names resolve through: imports (as ``FileModel`` spells their targets) and plain or
    dotted names assigned to a name (``Opt = optim.AdamW``), whatever the scope."""

    def __init__(self) -> None:
        self.imports: dict[str, set[str]] = {}
        self.aliases: dict[str, list[str]] = {}

    def bind(self, node: ast.AST) -> None:
        kind = type(node)
        if kind is ast.Import:
            for alias in node.names:  # type: ignore[attr-defined]
                name, target = (alias.asname, alias.name) if alias.asname else (alias.name.split(".")[0],) * 2
                self.imports.setdefault(name, set()).add(target)
        elif kind is ast.ImportFrom:
            base = "." * node.level + (node.module or "")  # type: ignore[attr-defined]
            for alias in node.names:  # type: ignore[attr-defined]
                if alias.name != "*":
                    target = f"{base}.{alias.name}" if base else alias.name
                    self.imports.setdefault(alias.asname or alias.name, set()).add(target)
        elif kind is ast.Assign or kind is ast.AnnAssign or kind is ast.NamedExpr:
            value = node.value  # type: ignore[attr-defined]
            path = dotted(value) if value is not None else None
            if path is None:
                return
            targets = node.targets if kind is ast.Assign else [node.target]  # type: ignore[attr-defined]
            for target in targets:
                if type(target) is ast.Name:
                    self.aliases.setdefault(target.id, []).append(path)

    def resolver(self) -> Resolve:
        return resolver(self.imports, self.aliases)

    def imported(self) -> set[str]:
        """Every import target of the file."""
        return {target for targets in self.imports.values() for target in targets}


_BINDERS = frozenset({ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign, ast.NamedExpr})


def _is_false(value: ast.expr | None) -> bool:
    """``literal_false``: the literal ``False`` (a name in libcst's tree, a constant in CPython's)."""
    return type(value) is ast.Constant and value.value is False  # type: ignore[attr-defined]


def _resolves_to(call: ast.Call, resolve: Resolve, names: frozenset[str]) -> bool:
    return bool(resolve(dotted(call.func)) & names)


# -- TL502 ---------------------------------------------------------------------------------------------
# ``TokenEvidence.is_local_token_count`` looks through these methods to their receiver
_COUNT_WRAPPERS = frozenset({"float", "clamp", "clamp_min", "max", "item"})
_CROSS_ENTROPY = CROSS_ENTROPY_FUNCTIONS | CROSS_ENTROPY_CLASSES | TOKEN_LOSS_FUNCTIONS


def token_count_division_under_data_parallel(tree: ast.Module) -> bool:
    """Whether the file trains with several processes, calls a backward, divides by something that may
    be a local token count, and has a summed or unreduced loss. TL502 reports only a ``/`` (or
    ``x * (1 / n)``, whose ``1 / n`` is a ``/`` by ``n``) whose divisor ``is_local_token_count`` accepts
    (a ``sum``/``count_nonzero`` call in it, through ``.float()``/``.clamp()``..., or a name assigned or
    ``+=``-added such a value), whose dividend's ``loss_origin`` is reduced ``sum`` or ``none`` (only a
    cross-entropy, or a criterion, given ``reduction='sum'``/``'none'`` or ``size_average=False``, or a
    mean multiplied by a local token count, make one), that reaches a backward call (a call of
    ``backward``/``manual_backward`` must be in the file), in a file ``_data_parallel`` accepts (a call or
    an import of one of ``DATA_PARALLEL``). Counts are followed through names of any scope and at any
    depth: a superset of the rule's."""
    names = _Names()
    backward = False
    not_means: list[ast.Call] = []  # calls given ``reduction='sum'``/``'none'`` or ``size_average=False``
    divisors: list[ast.expr] = []
    products: list[ast.expr] = []  # the two sides of every ``*``
    counted: list[tuple[str, ast.expr]] = []  # a name and a value assigned or added to it
    calls: list[ast.Call] = []
    for node in ast.walk(tree):
        kind = type(node)
        if kind is ast.Call:
            calls.append(node)  # type: ignore[arg-type]
            backward = backward or last_name(node.func) in BACKWARD_NAMES  # type: ignore[attr-defined]
            if node.keywords and _sums_or_keeps_tokens(node):  # type: ignore[attr-defined]
                not_means.append(node)  # type: ignore[arg-type]
        elif kind is ast.BinOp:
            op = type(node.op)  # type: ignore[attr-defined]
            if op is ast.Div:
                divisors.append(node.right)  # type: ignore[attr-defined]
            elif op is ast.Mult:
                products += (node.left, node.right)  # type: ignore[attr-defined]
        elif kind is ast.AugAssign:
            if type(node.op) is ast.Add and type(node.target) is ast.Name:  # type: ignore[attr-defined]
                counted.append((node.target.id, node.value))  # type: ignore[attr-defined]
        elif kind in _BINDERS:
            names.bind(node)
            if kind is ast.Assign or (kind is ast.AnnAssign and node.value is not None):  # type: ignore[attr-defined]
                targets = node.targets if kind is ast.Assign else [node.target]  # type: ignore[attr-defined]
                counted += ((t.id, node.value) for t in targets if type(t) is ast.Name)  # type: ignore[attr-defined]
    if not (backward and divisors):
        return False
    counts = _count_names(counted)
    if not any(_may_count_tokens(d, counts) for d in divisors):
        return False
    resolve = names.resolver()
    if not any(_may_be_cross_entropy(call, resolve) for call in not_means) and not any(
        _may_count_tokens(side, counts) for side in products
    ):
        return False
    if names.imported() & DATA_PARALLEL:
        return True
    return any(_resolves_to(call, resolve, DATA_PARALLEL) for call in calls)


def _sums_or_keeps_tokens(call: ast.Call) -> bool:
    """A call given ``reduction='sum'``/``'none'`` or ``size_average=False``: the only ways
    ``TokenEvidence._cross_entropy`` finds a loss that is not a mean (on the criterion's constructor or on
    its call: see ``_may_be_cross_entropy``)."""
    for given in call.keywords:
        value = given.value
        if given.arg == "reduction":
            if type(value) is ast.Constant and value.value in ("sum", "none"):  # type: ignore[attr-defined]
                return True
        elif given.arg == "size_average" and _is_false(value):
            return True
    return False


def _may_be_cross_entropy(call: ast.Call, resolve: Resolve) -> bool:
    """A call whose keywords ``_cross_entropy`` may read: one that may resolve to a cross-entropy
    function or class, one whose callee is no dotted name (``nn.CrossEntropyLoss(...)(x, y)``), or a
    criterion's name (``crit``, ``self.crit``: ``_criterion_constructor`` asks only those, through
    ``values_of``). ``F.kl_div(..., reduction='none')``, ``nn.MSELoss(reduction='sum')`` are none."""
    path = dotted(call.func)
    if path is None or "." not in path or (path.startswith("self.") and path.count(".") == 1):
        return True
    return bool(resolve(path) & _CROSS_ENTROPY)


def _may_count_tokens(expr: ast.expr, counts: set[str]) -> bool:
    """``is_local_token_count`` without scopes, order or depth: a ``sum``/``count_nonzero`` call inside,
    or, through ``.float()``, ``.clamp(...)``..., a name of ``counts``."""
    for node in ast.walk(expr):
        if type(node) is ast.Call and last_name(node.func) in COUNT_METHODS:  # type: ignore[attr-defined]
            return True
    while type(expr) is ast.Call and type(expr.func) is ast.Attribute and expr.func.attr in _COUNT_WRAPPERS:  # type: ignore[attr-defined]
        expr = expr.func.value  # type: ignore[attr-defined]
    return type(expr) is ast.Name and expr.id in counts  # type: ignore[attr-defined]


def _count_names(counted: list[tuple[str, ast.expr]]) -> set[str]:
    """The names assigned (or ``+=``-added) a value that may be a token count, until no new one."""
    counts: set[str] = set()
    grown = True
    while grown:
        grown = False
        for name, value in counted:
            if name not in counts and _may_count_tokens(value, counts):
                counts.add(name)
                grown = True
    return counts


# -- TL505 ---------------------------------------------------------------------------------------------
_EVALUATION_WORDS = frozenset({"eval", "val", "valid", "validation", "test", "dev", "evaluation"})


def shuffling_sampler_and_epoch_loop(tree: ast.Module) -> bool:
    """Whether the file has a loop over epochs and a call of torch's ``DistributedSampler`` that TL505
    may report. The rule reports a sampler call (``calls_to(*DISTRIBUTED_SAMPLERS)``) only when some
    ``for`` (its target or iterable) or ``while`` (its test) of the file names an epoch (a name, an
    attribute, a keyword or a lambda parameter of libcst's tree with "epoch" in it), and never one given
    ``shuffle=False``, one built inside (the body or ``else`` of, at any depth) such a loop with
    ``seed=``, one whose dataset (its first argument or ``dataset=``) is named for evaluation, nor one
    built in a function whose every caller in the file sits in a scope named for evaluation (asked here
    only of a module-level def whose name nothing else binds: every ``name(...)`` of the file calls it,
    and no ``self.name(...)`` does). The sampler's own name is not asked: True there."""
    found = _SamplerFile()
    found.collect(tree)
    if not found.epoch_loop:
        return False
    resolve = found.names.resolver()
    for call, inside, helper in found.samplers:
        if not _resolves_to(call, resolve, DISTRIBUTED_SAMPLERS) or _is_false(keyword(call, "shuffle")):
            continue
        if inside and any(k.arg == "seed" for k in call.keywords):
            continue  # built anew each epoch with its own seed (``_reseeded_per_epoch``)
        if _evaluation_name(dotted(first_arg(call, "dataset")) or ""):
            continue  # (``_for_evaluation``)
        callers = found.callers.get(helper or "", [])
        if helper and found.bound[helper] == 1 and callers and all(map(_evaluation_name, callers)):
            continue  # (``_built_for_evaluation_only``)
        return True
    return False


class _SamplerFile:
    """One walk of a file for TL505: its calls (inside an epoch loop or not, and the module-level def
    they sit in directly), whether it loops over epochs, and what the names are bound to and called from."""

    def __init__(self) -> None:
        self.names = _Names()
        self.samplers: list[tuple[ast.Call, bool, str | None]] = []
        self.epoch_loop = False
        self.bound: Counter[str] = Counter()  # how many times each name is bound, anywhere
        self.callers: dict[str, list[str]] = {}  # ``name(...)`` -> the names of the scopes it sits in

    def collect(self, tree: ast.Module) -> None:
        # (node, (inside an epoch loop, scope's name, the module-level def of the scope, at module level))
        stack: list[tuple[ast.AST, tuple[bool, str, str | None, bool]]] = [
            (tree, (False, "<module>", None, True))
        ]
        bound = self.bound
        while stack:
            node, context = stack.pop()
            kind = type(node)
            if kind is ast.Name:
                if type(node.ctx) is not ast.Load:  # type: ignore[attr-defined]
                    bound[node.id] += 1  # type: ignore[attr-defined]
                continue
            if kind is ast.Constant:
                continue
            if kind is ast.Call:
                self.samplers.append((node, context[0], context[2]))  # type: ignore[arg-type]
                if type(node.func) is ast.Name:  # type: ignore[attr-defined]
                    self.callers.setdefault(node.func.id, []).append(context[1])  # type: ignore[attr-defined]
            elif kind in _BINDERS:
                self.names.bind(node)
            elif kind in _SCOPES:
                name = "<lambda>" if kind is ast.Lambda else node.name  # type: ignore[attr-defined]
                if kind is not ast.Lambda:
                    bound[name] += 1
                helper = name if context[3] and kind in _DEFS else None
                context = (context[0], name, helper, False)
            elif kind in _LOOPS:
                heads = (node.test,) if kind is ast.While else (node.target, node.iter)  # type: ignore[attr-defined]
                if any(_names_epoch(head) for head in heads):
                    self.epoch_loop = True
                    # (a ``Frame`` of the loop covers its body and its ``else``, not its head)
                    stack.extend((head, context) for head in heads)
                    inside = (True, *context[1:])
                    stack.extend((child, inside) for child in (*node.body, *node.orelse))  # type: ignore[attr-defined]
                    continue
            else:
                bound.update(_bound_names(node))
            stack.extend((child, context) for child in ast.iter_child_nodes(node))


def _bound_names(node: ast.AST) -> list[str]:
    """The names a node other than a def, a class or a target binds (a superset of ``FileModel``'s)."""
    kind = type(node)
    if kind is ast.arg:
        return [node.arg]  # type: ignore[attr-defined]
    if kind is ast.alias:
        return [node.asname or node.name.split(".")[0]]  # type: ignore[attr-defined]
    if kind is ast.Global or kind is ast.Nonlocal:
        return list(node.names)  # type: ignore[attr-defined]
    name = getattr(node, "name", None) or getattr(node, "rest", None)  # except ... as, match patterns
    return [name] if isinstance(name, str) else []


def _names_epoch(node: ast.AST) -> bool:
    """``_names_epoch``: libcst's names of an expression are CPython's names, attributes, keywords and
    lambda parameters (a dotted name says epoch only when one of its parts does)."""
    for inner in ast.walk(node):
        kind = type(inner)
        if kind is ast.Name:
            word = inner.id  # type: ignore[attr-defined]
        elif kind is ast.Attribute:
            word = inner.attr  # type: ignore[attr-defined]
        elif kind is ast.keyword:
            word = inner.arg or ""  # type: ignore[attr-defined]
        elif kind is ast.arg:
            word = inner.arg  # type: ignore[attr-defined]
        else:
            continue
        if "epoch" in word.lower():
            return True
    return False


def _evaluation_name(name: str) -> bool:
    return bool(set(name.lower().replace(".", "_").split("_")) & _EVALUATION_WORDS)


# -- TL506 ---------------------------------------------------------------------------------------------
_NORM_CLIPS = ("clip_grad_norm_", "clip_grad_norm")
_Where = tuple[int, int | None]  # id of the scope's node, id of its ``Scope.enclosing_class`` (or None)


def fsdp_model_clipped_by_torch(tree: ast.Module) -> bool:
    """Whether torch's norm clipping is given the parameters of an FSDP1-wrapped name where that name is
    seen. TL506 reports only a call that resolves to ``torch.nn.utils[.clip_grad].clip_grad_norm[_]``
    (a ``clip`` event) whose first argument (or ``parameters=``) holds ``<outer>.parameters()`` or
    ``<outer>.named_parameters()``, where ``outer`` is a dotted name an ``FullyShardedDataParallel(...)``
    call without ``sharding_strategy=...NO_SHARD`` is assigned to (``wraps``), in the same scope, or, for
    ``self.`` names, in a scope of the same ``enclosing_class`` (``same_owner``). Scopes are
    ``FileModel``'s: module, class, function, lambda (a def's decorators and defaults belong to it)."""
    names = _Names()
    calls: list[tuple[ast.Call, _Where]] = []
    assigned: dict[int, list[str]] = {}  # id of a call -> the dotted names its value is assigned to
    stack: list[tuple[ast.AST, _Where, bool]] = [(tree, (id(tree), None), False)]
    while stack:
        node, where, in_class = stack.pop()
        kind = type(node)
        if kind in _LEAVES:
            continue
        if kind is ast.Call:
            calls.append((node, where))  # type: ignore[arg-type]
        elif kind in _SCOPES:
            if kind is ast.ClassDef:
                where, in_class = (id(node), None), True
            else:
                # ``enclosing_class``: the class this function sits in, through functions and lambdas only
                where, in_class = (id(node), where[0] if in_class else where[1]), False
        elif kind in _BINDERS:
            names.bind(node)
            if (kind is ast.Assign or kind is ast.AnnAssign) and type(node.value) is ast.Call:  # type: ignore[attr-defined]
                targets = node.targets if kind is ast.Assign else [node.target]  # type: ignore[attr-defined]
                assigned[id(node.value)] = [n for n in map(dotted, targets) if n]  # type: ignore[attr-defined]
        stack.extend((child, where, in_class) for child in ast.iter_child_nodes(node))
    resolve = names.resolver()
    wrapped = [
        (outer, where)
        for call, where in calls
        if id(call) in assigned
        and _resolves_to(call, resolve, FSDP_CLASSES)
        and (dotted(keyword(call, "sharding_strategy")) or "").rsplit(".", 1)[-1] != "NO_SHARD"
        for outer in assigned[id(call)]
    ]
    if not wrapped:
        return False
    for call, where in calls:
        if not _clips_by_norm(call, resolve):
            continue
        params = first_arg(call, "parameters")
        owners = _parameters_of(params) if params is not None else set()
        for outer, wrap_where in wrapped:
            if outer in owners and _same_owner(where, wrap_where, outer):
                return True
    return False


def _clips_by_norm(call: ast.Call, resolve: Resolve) -> bool:
    return any(
        c in CLIP_FUNCTIONS and c.rsplit(".", 1)[-1] in _NORM_CLIPS for c in resolve(dotted(call.func))
    )


def _parameters_of(expr: ast.AST) -> set[str]:
    """``mentions_parameters_of``: every ``key`` of a ``<key>.parameters()``/``named_parameters()`` inside."""
    return {
        key
        for node in ast.walk(expr)
        if type(node) is ast.Call
        and type(node.func) is ast.Attribute  # type: ignore[attr-defined]
        and node.func.attr in ("parameters", "named_parameters")  # type: ignore[attr-defined]
        and (key := dotted(node.func.value))  # type: ignore[attr-defined]
    }


def _same_owner(where: _Where, wrap: _Where, outer: str) -> bool:
    """``same_owner``: the wrap's own scope, or, for ``self.`` names, a scope of the same class."""
    if where[0] == wrap[0]:
        return True
    return outer.startswith("self.") and where[1] is not None and where[1] == wrap[1]
