"""Whether a file can hold TL105's finding, read from CPython's tree before libcst is asked: a module
converted to 16-bit storage (``model.half()``, ``model.to(torch.bfloat16)``) whose own parameters an
optimizer of the file is then built over (``torch.optim.AdamW(model.parameters())``).

The rule's findings that rest on this file alone are its ``_converted_here`` ones: a conversion event
written as a statement of its own (``converted_module``), and an optimizer whose params are the
converted name's ``.parameters()``/``.named_parameters()`` (``yields_parameters``), found in the
conversion's scope, a method of its class, a function a module-level model is used from, a same-file
function the module is passed to, or the caller that a builder function returns it to. Those of
``_converted_elsewhere`` rest on another file's facts: ``may_train_parameters_converted_elsewhere``
(``Rule.project_gate_check``) asks the same of the names a call of an imported name may leave converted.

Names resolve as ``FileModel.qualname`` does, but without scopes: a name may stand for whatever any of
its bindings in the file says (an import, ``x = torch.float16``, a ``def``), which errs towards True.
Only a dtype name looks at scopes, since ``values_of`` wants every value of it in one scope to be 16-bit
(``weight_dtype = torch.float32``, then ``torch.float16`` under a flag, converts nothing).
"""

from __future__ import annotations

import ast
import builtins

from trainlint.model.pyast import ast_dotted as dotted
from trainlint.model.pyast import of_last_tree
from trainlint.model.vocab import (
    LOW_PRECISION_DTYPES,
    MASTER_WEIGHT_CALLS,
    MASTER_WEIGHT_INITIALIZERS,
    MODULE_CHAIN,
    NOT_OPTIMIZERS,
    OPTIMIZER_PREFIXES,
    OPTIMIZER_WORDS,
    PARAM_CONTAINERS,
)

_BUILTINS = frozenset(dir(builtins))
# The last names of the calls that may be master-weight machinery (``master_weight_machinery``).
_MASTER_WORDS = MASTER_WEIGHT_CALLS | {"initialize", "MixedPrecisionPolicy"}
_PARAMETERS = frozenset({"parameters", "named_parameters"})
# A chain link past which the conversion no longer holds (``chain_contains`` answers None).
_UNDONE = frozenset({"float", "double", "eval"})
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_SCOPE_TYPES = frozenset({*_SCOPES, ast.ClassDef})
_LOOSE_TARGETS = frozenset({ast.For, ast.AsyncFor, ast.With, ast.AsyncWith, ast.comprehension})
_STATEMENTS = frozenset({ast.Expr, ast.Assign, ast.AnnAssign})
_OPERATORS = (ast.operator, ast.cmpop, ast.boolop, ast.unaryop)
# Nodes the walk has nothing to do for, nor below: names (a walrus's target is read at the walrus),
# literals, contexts and operators.
_LEAVES = frozenset(
    {ast.Name, ast.Constant, ast.Load, ast.Store, ast.Del, ast.Pass, ast.Break, ast.Continue}
    | {c for c in vars(ast).values() if isinstance(c, type) and issubclass(c, _OPERATORS)}
)
# Past ``FileModel.qualname``'s depth (9 names), an alias chain resolves to nothing.
_ALIAS_DEPTH = 9

# What a name may be bound to: an import's target, ``"<def>"`` for a def or class, or the Name or
# Attribute it is assigned (an alias).
Bound = str | ast.expr
# The defs, lambdas and classes around a node, outermost first: the model's scopes but the module.
Chain = tuple[ast.AST, ...]


class _Facts:
    """What one walk of the tree keeps for the rule."""

    def __init__(self) -> None:
        self.bindings: dict[str, list[Bound]] = {}
        # each scope's names (``Scope.bindings``), by the scope's node (0: the module), with the value of
        # each binding that has one (``values_of``) or None
        self.scoped: dict[int, dict[str, list[Bound | None]]] = {}
        # (key, the value of a statement that may be a conversion, the scopes around it)
        self.statements: list[tuple[str, ast.expr, Chain]] = []
        # the receivers of ``x.parameters()``/``x.named_parameters()`` calls anywhere
        self.receivers: set[str] = set()
        # (the call, its first positional argument or ``params=``, the scopes around it)
        self.calls: list[tuple[ast.Call, ast.expr | None, Chain]] = []
        self.values: list[tuple[ast.expr, Chain]] = []  # the values assigned to plain names
        # the receivers of the ``.parameters()`` calls an optimizer's params may be made of (made once
        # a conversion is found), with the scopes around each call
        self.parameters: dict[str, list[Chain]] = {}
        self.name_calls: dict[str, list[ast.Call]] = {}  # ``f(...)``: the file's helpers, by name
        self.defs: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self.call_targets: dict[str, list[ast.expr]] = {}  # ``x = f(...)``: the targets, by f
        self.assigned: dict[int, ast.expr] = {}  # ``x = <call>``, one target: the target, by the call's id
        self.builders: dict[int, set[str]] = {}  # what a function returns to a caller that trains it
        self.passed: dict[str, set[str]] | None = None  # (``_helper_parameters``, once asked)
        self._names: dict[str, frozenset[str]] = {}
        self._optimizers: dict[str, bool] = {}
        self.fed = False  # ``parameters`` made (``_feed_parameters``)
        # (the check and the callees ask these of one tree in turn)
        self.by_calls: list[tuple[frozenset[str], str, Chain]] | None = None  # ``_converted_by_calls``
        self.unmastered: bool | None = None  # ``_optimizer_without_master_weights``

    def bind(self, name: str, what: Bound) -> None:
        self.bindings.setdefault(name, []).append(what)

    def bind_in(self, chain: Chain, name: str, value: Bound | None = None) -> None:
        scope = id(chain[-1]) if chain else 0
        self.scoped.setdefault(scope, {}).setdefault(name, []).append(value)

    def qualnames(self, path: str) -> frozenset[str]:
        """Every qualified name ``path`` may resolve to, for any binding of its first name."""
        head, _, rest = path.partition(".")
        bases = self._names.get(head)
        if bases is None:
            bases = self._names[head] = self._resolve(head, (head,))
        return frozenset(f"{b}.{rest}" for b in bases) if rest else bases

    def _resolve(self, head: str, path: tuple[str, ...]) -> frozenset[str]:
        """``FileModel.qualname`` follows one binding per name, the same scope all along: a name met
        again on the way loops until its depth limit and resolves to nothing. So the names along
        ``path`` are not followed again, and only whole answers (from the first name) are kept."""
        found = self.bindings.get(head)
        if found is None:
            return frozenset({f"builtins.{head}"}) if head in _BUILTINS else frozenset()
        out: set[str] = set()
        for what in found:
            if isinstance(what, str):
                out.add(f"<local>.{head}" if what == "<def>" else what)
                continue
            alias = dotted(what)
            if alias is None or len(path) > _ALIAS_DEPTH:
                continue
            inner, _, rest = alias.partition(".")
            if inner in path:
                continue
            bases = self._names.get(inner)
            if bases is None:
                bases = self._resolve(inner, (*path, inner))
            out.update((f"{b}.{rest}" for b in bases) if rest else bases)
        return frozenset(out)

    def may_be_16_bit(self, expr: ast.expr, chain: Chain) -> bool:
        """``Training.is_low_precision_dtype`` in the scope ``chain`` ends with: ``torch.float16``,
        ``torch.half`` or ``torch.bfloat16`` however spelled, or a name every value of which (in the
        nearest scope that binds it, ``values_of``) is one, or, bound without a value, imported as one."""
        if not isinstance(expr, ast.Name):
            return self.names_16_bit(expr)
        name = expr.id
        # ``values_of`` looks from the scope outwards, past classes but its own; any scope that binds
        # the name is tried, not only the nearest (a binding this walk makes and the model does not, or
        # misses, then costs only time)
        scopes = [id(s) for i, s in enumerate(reversed(chain)) if i == 0 or not isinstance(s, ast.ClassDef)]
        for scope in [*scopes, 0]:
            found = self.scoped.get(scope, {}).get(name)
            if not found:
                continue
            values = [v for v in found if isinstance(v, ast.expr)]
            if not values:  # (``qualname``: an import, a def or a binding with no value)
                if any(b in LOW_PRECISION_DTYPES for b in self.bindings.get(name, ()) if isinstance(b, str)):
                    return True
            elif all(map(self.names_16_bit, values)):
                return True
        return False

    def names_16_bit(self, expr: ast.expr) -> bool:
        """``qualname(expr) in LOW_PRECISION_DTYPES`` for some binding of each name on the way."""
        path = dotted(expr)
        return path is not None and not self.qualnames(path).isdisjoint(LOW_PRECISION_DTYPES)


def _bind_import(facts: _Facts, node: ast.Import | ast.ImportFrom, chain: Chain) -> None:
    """The bindings ``FileModel``'s ``visit_Import``/``visit_ImportFrom`` make."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.asname or alias.name.split(".")[0]
            target = alias.name if alias.asname else name
            facts.bind(name, target)
            facts.bind_in(chain, name, target)
        return
    base = "." * node.level + (node.module or "")
    for alias in node.names:
        if alias.name != "*":
            target = f"{base}.{alias.name}" if base else alias.name
            facts.bind(alias.asname or alias.name, target)
            facts.bind_in(chain, alias.asname or alias.name, target)


def _bind_target(facts: _Facts, chain: Chain, target: ast.expr, value: ast.expr | None = None) -> None:
    """``_Builder._bind_target``: a plain name gets the value (an alias when it is a Name/Attribute);
    the names of a tuple or list target get none."""
    if isinstance(target, ast.Name):
        facts.bind_in(chain, target.id, value)
        if value is not None:
            facts.values.append((value, chain))
        if isinstance(value, ast.Name | ast.Attribute):
            facts.bind(target.id, value)
    elif isinstance(target, ast.Tuple | ast.List):
        for element in target.elts:
            _bind_target(facts, chain, element.value if isinstance(element, ast.Starred) else element)


def _bind_scope(facts: _Facts, node: ast.AST, chain: Chain) -> Chain:
    """A def, lambda or class: its name bound where it stands, its parameters in its own scope (a
    lambda's ``*args``/``**kwargs`` not, as in the model); returns the chain of its own scope."""
    inner = (*chain, node)
    if isinstance(node, ast.Lambda | ast.FunctionDef | ast.AsyncFunctionDef):
        args = node.args
        stars = [args.vararg, args.kwarg] if not isinstance(node, ast.Lambda) else []
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, *stars]:
            if arg is not None:
                facts.bind_in(inner, arg.arg)
    if not isinstance(node, ast.Lambda):
        assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        facts.bind(node.name, "<def>")
        facts.bind_in(chain, node.name, "<def>")
        if not isinstance(node, ast.ClassDef):
            facts.defs.setdefault(node.name, []).append(node)
    return inner


def _statement(facts: _Facts, node: ast.stmt, chain: Chain) -> None:
    """A statement that may be ``converted_module``'s: ``x.half()``, ``y = x.to(...)``; and the
    targets of ``y = helper(...)`` (the caller path of a builder function)."""
    if isinstance(node, ast.Expr):
        value, root = node.value, node.value
        while isinstance(root, ast.Call) and isinstance(root.func, ast.Attribute):
            root = root.func.value  # (``chain_root``: past any method, not only the chain's)
        key = dotted(root)
    elif isinstance(node, ast.Assign):
        for target in node.targets:
            _bind_target(facts, chain, target, node.value)
        value = node.value
        if isinstance(value, ast.Call) and len(node.targets) == 1:
            facts.assigned[id(value)] = node.targets[0]
            if isinstance(value.func, ast.Name):
                facts.call_targets.setdefault(value.func.id, []).append(node.targets[0])
        key = dotted(node.targets[0]) if len(node.targets) == 1 else None
    else:
        assert isinstance(node, ast.AnnAssign)
        _bind_target(facts, chain, node.target, node.value)
        if node.value is None:
            return
        value, key = node.value, dotted(node.target)
    if key is not None and isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
        facts.statements.append((key, value, chain))


def _collect(tree: ast.Module) -> _Facts:
    """One walk: bindings, the statements a conversion may be, calls, defs. The scopes around a node
    (``Chain``) are ``FileModel``'s, which start at the ``def`` (decorators and defaults inside)."""
    facts = _Facts()
    stack: list[tuple[ast.AST, Chain]] = [(tree, ())]
    pop, push = stack.pop, stack.append
    call, attribute, node_type, leaves = ast.Call, ast.Attribute, ast.AST, _LEAVES
    while stack:
        node, chain = pop()
        kind = type(node)
        if kind is attribute:  # (most nodes are names and attributes: the cheapest path first)
            push((node.value, chain))
            continue
        if kind is call:
            _call(facts, node, chain)
        elif kind in _STATEMENTS:
            _statement(facts, node, chain)
        elif kind in _SCOPE_TYPES:
            chain = _bind_scope(facts, node, chain)
        elif kind in _LOOSE_TARGETS:  # (for, with, a comprehension's ``for``: names without a value)
            for target in _loose_targets(node):
                _bind_target(facts, chain, target)
        elif kind is ast.Import or kind is ast.ImportFrom:
            _bind_import(facts, node, chain)
            continue
        elif kind is ast.NamedExpr:
            _bind_target(facts, chain, node.target, node.value)
        for field in node._fields:  # ``ast.iter_child_nodes``, without its generator's cost
            value = getattr(node, field, None)
            if type(value) is list:
                for child in value:
                    if isinstance(child, node_type) and type(child) not in leaves:
                        push((child, chain))
            elif isinstance(value, node_type) and type(value) not in leaves:
                push((value, chain))
    return facts


_facts_of = of_last_tree(_collect)  # (TL105's three checks ask one tree in turn)


def _loose_targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.With | ast.AsyncWith):
        return [item.optional_vars for item in node.items if item.optional_vars is not None]
    assert isinstance(node, ast.For | ast.AsyncFor | ast.comprehension)
    return [node.target]


def _call(facts: _Facts, node: ast.Call, chain: Chain) -> None:
    func = node.func
    if type(func) is ast.Attribute and func.attr in _PARAMETERS:
        owner = dotted(func.value)
        if owner is not None:
            facts.receivers.add(owner)
    elif type(func) is ast.Name:
        facts.name_calls.setdefault(func.id, []).append(node)
    # (``first_arg(call, "params")``)
    first = next((a for a in node.args if not isinstance(a, ast.Starred)), None)
    if first is None:
        first = next((k.value for k in node.keywords if k.arg == "params"), None)
    facts.calls.append((node, first, chain))


def _converts(facts: _Facts, value: ast.expr, chain: Chain) -> bool:
    """A conversion event on the statement's module-method chain (``chain_contains``): ``.half()``,
    ``.bfloat16()``, or ``.to(...)`` given a 16-bit dtype, before any ``.float()``/``.eval()`` link or
    a method that is no module's (``Net().cuda().half()``, not ``x.half().float()``)."""
    while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
        name = value.func.attr
        if name in ("half", "bfloat16") and not value.args and not value.keywords:
            return True
        if name == "to":
            # (``Training.low_precision_conversion``: the positional arguments, ``*args``, ``**kw``, dtype=)
            candidates = [a.value if isinstance(a, ast.Starred) else a for a in value.args]
            candidates += [k.value for k in value.keywords if k.arg is None or k.arg == "dtype"]
            if any(facts.may_be_16_bit(c, chain) for c in candidates):
                return True
        if name in _UNDONE or name not in MODULE_CHAIN:
            return False
        value = value.func.value
    return False


def _passed_to_helper(facts: _Facts, key: str) -> bool:
    """``_optimizer_in_callee``: ``key`` passed to a function of the file (called by name) whose
    parameter that receives it has its ``.parameters()`` taken (where the helper's optimizer is)."""
    if facts.passed is None:
        facts.passed = _helper_parameters(facts)
    return any(p in facts.parameters for p in facts.passed.get(key, ()))


def _helper_parameters(facts: _Facts) -> dict[str, set[str]]:
    """The names given to the file's functions called by name, with the parameters receiving each."""
    out: dict[str, set[str]] = {}
    for name, calls in facts.name_calls.items():
        defs = facts.defs.get(name)
        if not defs:
            continue
        for call in calls:
            for keyword in call.keywords:
                key = dotted(keyword.value) if keyword.arg is not None else None
                if key is not None:
                    out.setdefault(key, set()).add(keyword.arg)
            positional = [a for a in call.args if not isinstance(a, ast.Starred)]
            for index, key in enumerate(map(dotted, positional)):
                if key is not None:
                    params = [f.args.args[index].arg for f in defs if index < len(f.args.args)]
                    out.setdefault(key, set()).update(params)
    return out


def _reaches_parameters(facts: _Facts, key: str, chain: Chain | None) -> bool:
    """Whether an optimizer can take ``key``'s parameters (``_optimizer_for``). ``chain``: the scopes
    around a conversion of a plain local (or ``args.model``) in a function or class, whose optimizer
    must then sit in that scope (its params, or the values of the names in them, written there or in
    a scope around it); None where another scope may build it (``self.x``, module level)."""
    chains = facts.parameters.get(key)
    if chains is not None:
        if chain is None or any(c == chain[: len(c)] for c in chains):
            return True
    return _passed_to_helper(facts, key)


def _returned_to_caller(facts: _Facts, key: str, function: ast.AST) -> bool:
    """``_optimizer_in_caller``: the builder function returns ``key`` (alone or in a tuple), and a
    caller binds the result with ``x = build(...)``/``a, x = build(...)`` and trains ``x``. (Both
    answers are kept by function: the cross-file check asks of many names in the same one.)"""
    if not isinstance(function, _FUNCTIONS):
        return False
    known = facts.builders.get(id(function))
    if known is None:
        known = facts.builders[id(function)] = (
            _returned(function) if _caller_trains(facts, function) else set()
        )
    return key in known


def _returned(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The dotted names ``function`` returns, alone or in a tuple (not those of nested scopes)."""
    out: set[str] = set()
    stack: list[ast.AST] = list(function.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Return) and node.value is not None:
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            out.update(name for name in map(dotted, values) if name is not None)
        elif not isinstance(node, (*_SCOPES, ast.ClassDef)):  # (``walk_scope``: not into nested ones)
            stack.extend(ast.iter_child_nodes(node))
    return out


def _caller_trains(facts: _Facts, function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    local = f"<local>.{function.name}"
    for called, targets in facts.call_targets.items():
        # (``build(...)``, or an alias of it: ``model.callee`` follows ``make = build``)
        if called != function.name and local not in facts.qualnames(called):
            continue
        for target in targets:
            names = target.elts if isinstance(target, ast.Tuple | ast.List) else [target]
            for name in map(dotted, [target, *names]):
                if name is not None and _reaches_parameters(facts, name, None):
                    return True
    return False


def _may_build_optimizer(facts: _Facts, call: ast.Call) -> bool:
    """A call ``Training`` may classify as an optimizer's construction: its callee may resolve to a
    class of ``OPTIMIZER_PREFIXES``, or to an imported class whose name says optimizer (another project
    file's ``torch.optim.Optimizer`` subclass: ``project_optimizer_class``)."""
    path = dotted(call.func)
    if path is None:
        return False
    known = facts._optimizers.get(path)
    if known is None:
        known = facts._optimizers[path] = any(
            (name.startswith(OPTIMIZER_PREFIXES) and not name.startswith(NOT_OPTIMIZERS))
            or (
                not name.startswith(("<local>.", "builtins."))
                and OPTIMIZER_WORDS.search(name.rsplit(".", 1)[-1]) is not None
            )
            for name in facts.qualnames(path)
        )
    return known


def _feed_parameters(facts: _Facts) -> None:
    """``facts.parameters``: the ``x.parameters()`` calls ``yields_parameters`` can reach from an
    optimizer's params (its first positional argument, else ``params=``), or from a value assigned to
    a name (which those params may name): through ``list``/``tuple``/``filter``/``sorted``/``chain``/
    ``iter`` calls, list, tuple and set displays, dict values, comprehensions over plain names and
    ``+``. Not, say, ``for p in model.parameters()`` or ``sum(p.numel() for p in ...)``. The search
    stays in the scope of the value (no lambda), so each call gets the value's scopes."""
    if facts.fed:
        return
    facts.fed = True
    roots = [
        (first, chain)
        for call, first, chain in facts.calls
        if first is not None and _may_build_optimizer(facts, call)
    ]
    stack = [*roots, *facts.values]
    while stack:
        expr, chain = stack.pop()
        if isinstance(expr, ast.Call):
            func = expr.func
            if isinstance(func, ast.Attribute) and func.attr in _PARAMETERS:
                owner = dotted(func.value)
                if owner is not None:
                    facts.parameters.setdefault(owner, []).append(chain)
                    continue
            path = dotted(func)
            if path is not None and not facts.qualnames(path).isdisjoint(PARAM_CONTAINERS):
                stack += [(a.value if isinstance(a, ast.Starred) else a, chain) for a in expr.args]
                stack += [(k.value, chain) for k in expr.keywords]
        elif isinstance(expr, ast.List | ast.Tuple | ast.Set):
            stack += [(e.value if isinstance(e, ast.Starred) else e, chain) for e in expr.elts]
        elif isinstance(expr, ast.Dict):
            stack += [(v, chain) for k, v in zip(expr.keys, expr.values, strict=True) if k is not None]
        elif isinstance(expr, ast.ListComp | ast.GeneratorExp | ast.SetComp):
            elements = expr.elt.elts if isinstance(expr.elt, ast.Tuple) else [expr.elt]
            # (a copy such as ``p.detach().float()`` is no parameter; ``(n, p)`` pairs carry it)
            if all(isinstance(e.value if isinstance(e, ast.Starred) else e, ast.Name) for e in elements):
                stack += [(g.iter, chain) for g in expr.generators]
        elif isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
            stack += [(expr.left, chain), (expr.right, chain)]


def _callees(facts: _Facts, path: str) -> set[str] | None:
    """Every name ``model.callee(site) or dotted(call.func)`` may give a call of ``path``, or None
    when an alias makes that unsure. A name bound only at module level (by imports, defs) resolves to
    one of those bindings from anywhere; elsewhere, or unbound, it may also resolve to nothing."""
    head, _, rest = path.partition(".")
    found = [(scope, what) for scope, names in facts.scoped.items() for what in names.get(head, ())]
    out = set()
    for scope, what in found:
        if isinstance(what, ast.Name | ast.Attribute):
            return None
        if isinstance(what, str):
            base = f"<local>.{head}" if what == "<def>" else what
            out.add(f"{base}.{rest}" if rest else base)
        if scope != 0 or not isinstance(what, str):
            out.add(path)  # (a parameter, a loop variable...: ``qualname`` None, the dotted text)
    if not found:
        out.add(f"builtins.{path}" if head in _BUILTINS else path)
    return out


def _keeps_master_weights(facts: _Facts) -> bool:
    """``master_weight_machinery`` surely holds (the rule then reports nothing): a call of apex's
    ``FP16_Optimizer``, Megatron's ``fully_shard_optimizer``..., ``deepspeed.initialize``, or a
    ``MixedPrecisionPolicy(main_params_dtype=torch.float32)``, whatever its name resolves to."""
    for call, _, _ in facts.calls:
        path = dotted(call.func)
        last = path.rsplit(".", 1)[-1] if path is not None else ""
        if last not in _MASTER_WORDS:  # (a call spelled otherwise is not looked into: that keeps a file)
            continue
        callees = _callees(facts, path) if path is not None else None
        if callees and all(_master_weight_callee(c, call) for c in callees):
            return True
    return False


def _master_weight_callee(callee: str, call: ast.Call) -> bool:
    last = callee.rsplit(".", 1)[-1]
    if last in MASTER_WEIGHT_CALLS or callee.startswith(MASTER_WEIGHT_INITIALIZERS):
        return True
    return last == "MixedPrecisionPolicy" and any(
        k.arg == "main_params_dtype" and (dotted(k.value) or "").rsplit(".", 1)[-1] in ("float32", "float")
        for k in call.keywords
    )


def may_train_half_parameters(tree: ast.Module) -> bool:
    """TL105 on this file alone needs: (1) a conversion event on the module-method chain of a
    statement of its own (``x.half()``, ``y = Net().to(dtype=torch.bfloat16)``; the name it converts,
    ``converted_module``), (2) an optimizer built over that name's own parameters, which
    ``yields_parameters`` finds only through a ``<name>.parameters()``/``.named_parameters()`` call
    in the optimizer's params or in a value assigned to a name, (3) a call that may construct an
    optimizer, and (4) no sure master-weight machinery. (2) is asked where the rule looks for the
    optimizer: the conversion's scope and the scopes around it for a local; anywhere for ``self.x``
    (another method) and a module-level name (a function using it); the parameter a same-file helper
    receives the name under; the names a caller binds a builder's returned module to. False only when
    one fails: then ``_converted_here`` reports nothing.
    """
    facts = _facts_of(tree)
    if not facts.receivers or not facts.statements:
        return False
    return _may_train(facts, _converted_here(facts))


def _converted_here(facts: _Facts) -> list[tuple[str, Chain]]:
    return [(key, chain) for key, value, chain in facts.statements if _converts(facts, value, chain)]


def _may_train(facts: _Facts, converted: list[tuple[str, Chain]]) -> bool:
    """(2) to (4) for the names ``converted`` (with the scopes of their conversion)."""
    if not converted or not _optimizer_without_master_weights(facts):
        return False
    return any(_trained(facts, key, chain) for key, chain in dict.fromkeys(converted))


def _optimizer_without_master_weights(facts: _Facts) -> bool:
    """(3) and (4): a call that may build an optimizer and no sure master-weight machinery; with the
    ``.parameters()`` calls its params may reach made (``_feed_parameters``) where both hold."""
    if facts.unmastered is None:
        facts.unmastered = any(
            _may_build_optimizer(facts, call) for call, _, _ in facts.calls
        ) and not _keeps_master_weights(facts)
        if facts.unmastered:
            _feed_parameters(facts)
    return facts.unmastered


def _trained(facts: _Facts, key: str, chain: Chain) -> bool:
    """Whether an optimizer the rule finds may train ``key``, converted in the scope ``chain`` ends with
    (``_optimizer_for``, ``_optimizer_in_caller``)."""
    local = bool(chain) and not key.startswith("self.")
    if _reaches_parameters(facts, key, chain if local else None):
        return True
    return bool(chain) and _returned_to_caller(facts, key, chain[-1])


def _converted_by_imports(facts: _Facts) -> list[tuple[str, Chain]]:
    return [(key, chain) for _, key, chain in _converted_by_calls(facts)]


def _converted_by_calls(facts: _Facts) -> list[tuple[frozenset[str], str, Chain]]:
    """The names a function or class of another file may leave converted (``_converted_elsewhere``),
    at a call whose callee may be imported (``imported_fact``: a name bound by an import, or an alias
    of one): each argument that is a dotted name (``converted_arguments``) and the names of the target
    of ``x = call(...)``/``a, x = call(...)`` (``returned_half_modules``; ``assigned_name`` for a class
    ``converted_when_built``), with the scopes around the call and the callee's qualified names."""
    if facts.by_calls is not None:
        return facts.by_calls
    out: list[tuple[frozenset[str], str, Chain]] = []
    imported: dict[str, frozenset[str]] = {}
    for call, _, chain in facts.calls:
        path = dotted(call.func)
        if path is None:
            continue
        names = imported.get(path)
        if names is None:
            names = imported[path] = frozenset(
                n for n in facts.qualnames(path) if not n.startswith(("<local>.", "builtins."))
            )
        if not names:
            continue
        passed = [a.value if isinstance(a, ast.Starred) else a for a in call.args]
        passed += [k.value for k in call.keywords if k.arg is not None]
        out += [(names, key, chain) for key in map(dotted, passed) if key is not None]
        target = facts.assigned.get(id(call))
        if target is not None:
            elements = target.elts if isinstance(target, ast.Tuple) else []
            elements = [e.value if isinstance(e, ast.Starred) else e for e in elements]
            out += [(names, key, chain) for key in map(dotted, [target, *elements]) if key is not None]
    facts.by_calls = out  # (whole: a failure half-way keeps nothing)
    return out


def may_train_parameters_converted_elsewhere(tree: ast.Module) -> bool:
    """TL105's cross-file findings (``_converted_elsewhere``) need: (1) a call of a name that may be
    imported (the project's helper, loader or class), (2) a name it may leave converted: a dotted
    argument (the helper converts it in place) or the target it is assigned to (a loader returns a
    converted module, a class converts itself when built), (3) an optimizer over that name's own
    parameters where the rule looks for it (as for ``may_train_half_parameters``, the call standing for
    the conversion; the caller of a builder function that returns an assigned name), (4) a call that may
    construct an optimizer (an imported class named like one may be the project's own subclass) and
    (5) no sure master-weight machinery. Whatever the other files hold, the rule reports nothing here
    without them. Not asked: the order of the call and the optimizer, freezes and inference contexts.
    The conversion statements of ``may_train_half_parameters`` count too (``_converted_here`` runs in
    the cross-file path as well; the prefilter already keeps those files from it, at no cost here).
    """
    facts = _facts_of(tree)
    if not facts.receivers:
        return False
    return _may_train(facts, _converted_by_imports(facts) + _converted_here(facts))


def trained_callees(tree: ast.Module) -> frozenset[str]:
    """The qualified names (``FileModel.qualname``: through the file's imports and aliases) of the
    callees whose call may leave a name converted that an optimizer here then trains: of all the names
    this file imports, only a function or class reached through one of these can take part in a
    cross-file finding (``_converted_elsewhere`` reports at such a call, with the callee's facts).
    Empty where ``may_train_parameters_converted_elsewhere`` holds for no imported call."""
    facts = _facts_of(tree)
    if not facts.receivers or not _optimizer_without_master_weights(facts):
        return frozenset()
    out: set[str] = set()
    for names, key, chain in _converted_by_calls(facts):
        if not names <= out and _trained(facts, key, chain):
            out |= names
    return frozenset(out)
