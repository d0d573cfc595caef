"""Whether a file can hold TL301's finding, read from CPython's tree before libcst is asked: a loss divided
by an accumulation step count on its way to a backward, in a file that shows padded or masked token data.

The walk mirrors ``FileModel``'s scopes (module, class, function, lambda; not comprehensions; a def's
decorators and defaults belong to it) and reads every node once: the padding evidence of
``tokens.TokenEvidence`` may be any identifier, keyword or string of the file. Program order is a
node's start in the source (``FileModel`` numbers nodes in a pre-order walk). Every shortcut errs
towards keeping the file.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from trainlint.model.gate_calls import BINDERS, Bindings, binding, last_name, names_bound_to
from trainlint.model.gate_loss_origin import Names, Traced
from trainlint.model.pyast import ast_dotted as dotted
from trainlint.model.pyast import of_last_tree
from trainlint.model.vocab import (
    BACKWARD_NAMES,
    CROSS_ENTROPY_CLASSES,
    CROSS_ENTROPY_FUNCTIONS,
    LM_DATA,
    LM_SUFFIXES,
    PADDING_DATA,
    PADDING_WORDS,
    PER_EXAMPLE_SUFFIXES,
    TOKEN_LOSS_FUNCTIONS,
    is_step_count_name,
)

# ``TokenEvidence._walk_file``: the ``padding=`` values that mean a tokenizer pads
_PADDING_MODES = frozenset({"max_length", "longest"})
# ``_returned_by_a_loss``: a function of these names returns the loss to callers elsewhere
_LOSS_FUNCTIONS = frozenset({"forward", "__call__"})
# ``TokenEvidence._binop_origin``: the operators through which a loss's origin is traced
_TRACED_OPERATORS = (ast.Div, ast.Mult, ast.Add, ast.Sub)
# The last names of the losses whose call ``TokenEvidence._call_origin`` may take for a token mean (or a
# token sum), and ``instantiate`` (``_configured_token_loss``): a callee's qualified name ends with one.
_TOKEN_LOSSES = frozenset(
    {q.rpartition(".")[2] for q in CROSS_ENTROPY_FUNCTIONS | CROSS_ENTROPY_CLASSES | TOKEN_LOSS_FUNCTIONS}
    | {"instantiate"}
)
# Fields that never hold a node or an identifier (contexts, operators, flags, comments): not read.
_SKIPPED = frozenset(
    {"ctx", "op", "ops", "kind", "conversion", "is_async", "level", "simple", "type_comment"}
)
_FIELDS: dict[type, tuple[str, ...]] = {}
_SCOPE_KINDS = {
    ast.FunctionDef: "function",
    ast.AsyncFunctionDef: "function",
    ast.Lambda: "lambda",
    ast.ClassDef: "class",
}

Position = tuple[int, int]
# ``_Instances``: the values of an assignment that may make or name another file's class
_BOUND_VALUES = (ast.Call, ast.Name, ast.Attribute)


class _Scope:
    """What one scope of ``FileModel`` holds that TL301's check reads."""

    __slots__ = (
        "added",
        "assigned",
        "backward",
        "bases",
        "calls",
        "kind",
        "name",
        "name_calls",
        "params",
        "parent",
        "returned",
        "self_calls",
    )

    def __init__(self, kind: str, node: ast.AST, parent: _Scope | None = None) -> None:
        self.kind = kind
        self.parent = parent
        # a def's or a class's name
        self.name: str = getattr(node, "name", "") if kind in ("function", "class") else ""
        # a class's bases as written (``_inherited_method``: ``self.f`` may be a base's of another file)
        self.bases = [b for b in map(dotted, node.bases) if b] if kind == "class" else []  # type: ignore[attr-defined]
        # ``counted_by_callers``: the positional parameters (``posonly_params`` and ``params``)
        arguments = node.args if kind == "function" else None  # type: ignore[attr-defined]
        self.params = {a.arg for a in (*arguments.posonlyargs, *arguments.args)} if arguments else set()
        self.backward = False  # a call named ``backward``/``manual_backward`` (``is_backward_call``)
        self.name_calls: set[str] = set()  # ``f(...)``: the file's functions it may run
        self.self_calls: set[str] = set()  # ``self.f(...)``: the methods it may run
        self.returned: list[ast.AST] = []  # the values of its own ``return <value>`` (``returns_division``)
        self.calls: list[ast.Call] = []  # the calls in the scope itself
        # ``TokenEvidence._assigns`` and ``_added_to``: name -> (statement or None for ``+=``, start)
        # of each ``name = ...``, ``a, name = ...``, ``name: T = v`` and ``name += ...`` of the scope
        self.assigned: dict[str, list[tuple[ast.AST | None, Position]]] = {}
        self.added: dict[str, list[ast.AST]] = {}  # what each ``name += value`` adds (``_added_to``)


class _Division:
    """``dividend / divisor`` (``losses.Division``) at ``start``, in ``statement`` and ``scope``."""

    __slots__ = ("dividend", "divisor", "scope", "start", "statement")

    def __init__(
        self, node: ast.AST, dividend: ast.AST, divisor: ast.AST, scope: _Scope, statement: ast.AST
    ) -> None:
        self.dividend = dividend
        self.divisor = divisor
        self.scope = scope
        self.statement = statement
        self.start: Position = (node.lineno, node.col_offset)  # type: ignore[attr-defined]


class _Facts:
    """What the one walk of the tree keeps."""

    def __init__(self) -> None:
        self.padding = False  # ``TokenEvidence.padding`` may be non-empty
        self.minus_100 = False  # a ``-100`` (its "`-100` labels" evidence)
        # a name a token loss may be called by (``_TOKEN_LOSSES``, a language model's class or data:
        # ``lm_names``), a per-example model's (``per_example_names``), and next-token or masked targets
        # (``_shifted_targets``: ``[..., 1:]``; ``_masked_targets``: a negative integer assigned)
        self.token_loss = False
        self.per_example = False
        self.token_targets = False
        self.scopes: list[_Scope] = []
        self.divisions: list[_Division] = []
        self.modulo: set[str] = set()  # ``n`` of every ``x % n`` (``modulo_divisors``)
        self.bindings: Bindings = []  # for the names ``len`` goes by
        self.assigned_calls: list[tuple[str, ast.Call]] = []  # ``n = f(...)``
        self.call_args: list[tuple[str, list[ast.Call]]] = []  # ``g(..., f(...))``: (g, [f(...)])
        self.loops: set[str] = set()  # ``x`` of every ``for ... in x`` or ``in enumerate(x)``
        self.names: set[str] = set()  # every identifier of the file
        # ``FileModel.qualname``'s ways to another file: the names an import binds, with its targets
        # (spelled as ``summary.outline``'s imports); and the assignments (``=``, ``:=``) of a call or of
        # a plain or dotted name, with their scopes (read only for the project: ``_Values``, ``Names``)
        self.imported: dict[str, set[str]] = {}
        self.bound: list[tuple[ast.Assign | ast.AnnAssign | ast.NamedExpr, _Scope]] = []
        self._values: _Values | None = None
        self._qualnames: Names | None = None

    @property
    def values(self) -> _Values:
        if self._values is None:
            self._values = _Values(self)
        return self._values

    @property
    def qualnames(self) -> Names:
        if self._qualnames is None:
            self._qualnames = Names(self)
        return self._qualnames

    def read_names(self) -> None:
        """Reads the file's identifiers (each part of a dotted import: libcst's names) as
        ``TokenEvidence._scan`` and ``_walk_file`` read a name (a padding collator or data module's is
        taken for one imported from or called under its package)."""
        for name in self.names:
            for part in name.split(".") if "." in name else (name,):
                if part in PADDING_WORDS or part in PADDING_DATA:
                    self.padding = True
                if part in _TOKEN_LOSSES or part in LM_DATA or part.endswith(LM_SUFFIXES):
                    self.token_loss = True
                elif part.endswith(PER_EXAMPLE_SUFFIXES):
                    self.per_example = True


def mean_of_means_possible(tree: ast.Module) -> bool:
    """Whether the file shows padded or masked token data (``TokenEvidence.padding``: a padding word as
    an identifier, attribute, keyword or string, a ``-100``, a non-literal ``ignore_index=``, a padding
    tokenizer call, a padding collator or data module's name), may compute a token-mean loss (a name a
    cross-entropy, ``instantiate`` or a language model's class or data goes by; else, with no per-example
    model's name, next-token targets ``[..., 1:]``, a negative label assigned or a ``-100``: the leaves
    of ``TokenEvidence._origin`` that can be a mean), and has a division (``x / n``, ``x * (1 / n)``,
    ``x /= n``, ``x *= 1 / n``, ``x.div(n)``) whose dividend may have an origin (a call, an arithmetic
    of one, ``.loss``, ``["loss"]``/``[0]``, ``x[key]`` of one, a name assigned or added to earlier in
    the scope, not in the division's own statement), whose divisor may be an accumulation step count
    (``_is_step_count``, ``counts_loop_items``: a name, key or method ``is_step_count_name`` accepts, a
    ``%`` divisor of the file, ``len(x)`` or a name assigned it or a parameter its function's caller
    passes it, where a ``for`` loop goes over ``x``), in a scope that may backpropagate it: one with a
    backward call or a call of a file's function that has one (``division_reaches_backward``), or a
    function that returns a value and is a loss function or is called from such a scope
    (``_returned_by_a_loss``, ``_returned_to_backward``).

    TL301 reports, for a file alone, only such a division: without padding evidence ``check`` returns
    before any finding, and a division whose dividend has no origin, or one that is no token mean, is
    skipped. Each test is the rule's or the model's, or weaker (any ``for`` loop, any assignment, any
    return). With a project, a model built by another file's function may be a language model: that
    finding rests on the other file's facts (``returned_callee``)."""
    facts = _facts_of(tree)
    if not facts.padding or not facts.divisions:
        return False
    if not facts.token_loss and (facts.per_example or not (facts.token_targets or facts.minus_100)):
        return False  # no origin of a loss can be a token mean
    return _backpropagated_division(facts, padding=True)


def _backpropagated_division(facts: _Facts, padding: bool) -> bool:
    return next(_backpropagated_divisions(facts, padding), None) is not None


def _backpropagated_divisions(facts: _Facts, padding: bool) -> Iterator[_Division]:
    """The divisions of the file whose dividend may have an origin (without ``padding`` evidence, one
    that may be another file's: ``_may_have_origin``), whose divisor may count accumulation steps and
    that a scope may backpropagate (``division_reaches_backward``, ``_returned_by_a_loss``)."""
    counts = _Counts(facts)
    helpers = _backward_helpers(facts)
    for division in facts.divisions:
        scope = division.scope
        if not _may_have_origin(division.dividend, division, padding) or not counts.may_count_steps(
            division.divisor, scope
        ):
            continue
        if _backpropagates(scope, helpers):
            yield division
        elif scope.kind != "function" or not scope.returned:
            continue
        elif scope.name in _LOSS_FUNCTIONS or "loss" in scope.name.lower():
            yield division
        elif any(
            other is not scope
            and (scope.name in other.name_calls or scope.name in other.self_calls)
            and _backpropagates(other, helpers)
            for other in facts.scopes
        ):
            yield division


def _backward_helpers(facts: _Facts) -> set[str]:
    """The names of the file's functions that run a backward (``backward_calls``' local callees)."""
    return {s.name for s in facts.scopes if s.kind == "function" and s.backward}


def _backpropagates(scope: _Scope, helpers: set[str]) -> bool:
    """``backward_calls`` of the scope may not be empty."""
    return scope.backward or not scope.name_calls.isdisjoint(helpers)


def mean_of_means_possible_elsewhere(tree: ast.Module) -> bool:
    """Whether TL301, run with the project's facts (``Rule.project_gate_check``), may report on the file:
    a division as ``mean_of_means_possible`` asks, whatever names the file gives its loss and model (a
    builder of another file may make a language model, ``returned_callee``; a function or method there
    may return a token mean, ``_project_origin``), its dividend a call, an arithmetic of one or a name
    assigned earlier where the file shows no padding (only another file's token mean needs none); or a
    call, in a scope that may backpropagate it, of a name or ``self.name`` assigned ``C(...)`` or
    ``C.make(...)`` where ``C`` may be imported (an import or an assigned alias), the loss class of
    another file whose ``forward`` divides by the steps (``_through_loss_wrappers``,
    ``constructed_class``)."""
    facts = _facts_of(tree)
    if _backpropagated_division(facts, padding=facts.padding):
        return True
    return next(_called_instances(facts), None) is not None


def _called_instances(facts: _Facts) -> Iterator[ast.expr]:
    """The constructors (``C``, ``C.make``, as written) of the instances of another file's class that a
    scope which may backpropagate calls (``_through_loss_wrappers``: ``criterion(...)``,
    ``self.criterion(...)``)."""
    helpers = _backward_helpers(facts)
    instances = None
    for scope in facts.scopes:
        if not _backpropagates(scope, helpers) or not (scope.self_calls or scope.name_calls):
            continue
        instances = instances or _Instances(facts)
        for name in scope.self_calls:
            yield from instances.attributes.get(name, ())
        for name in scope.name_calls:
            yield from instances.held(name, scope)


class _Values:
    """``FileModel.values_of``'s calls: those assigned (``=``, ``:=``) to a name, by scope, and to a
    ``self`` attribute (in any class)."""

    def __init__(self, facts: _Facts) -> None:
        self.names: dict[tuple[int, str], list[ast.Call]] = {}
        self.attributes: dict[str, list[ast.Call]] = {}
        for node, scope in facts.bound:
            value = node.value
            if type(value) is not ast.Call:
                continue
            for target in node.targets if type(node) is ast.Assign else [node.target]:
                if type(target) is ast.Name:
                    self.names.setdefault((id(scope), target.id), []).append(value)
                elif type(target) is ast.Attribute and dotted(target.value) == "self":
                    self.attributes.setdefault(target.attr, []).append(value)

    def of(self, expr: ast.AST, scope: _Scope) -> list[ast.Call]:
        """The calls ``values_of(expr)`` may hold: ``self.x``'s in any class, a name's in any scope out."""
        path = dotted(expr)
        if path is not None and path.startswith("self.") and path.count(".") == 1:
            return self.attributes.get(path[5:], [])
        if path is None or "." in path:
            return []
        out: list[ast.Call] = []
        current: _Scope | None = scope
        while current is not None:
            out += self.names.get((id(current), path), ())
            current = current.parent
        return out


class _Instances:
    """The names and ``self`` attributes ``constructed_class`` may find an instance of another file's
    class in: assigned ``C(...)`` or ``C.make(...)`` where ``C`` (its head) may resolve through an
    import (``FileModel.qualname``: a name an import binds, or one assigned a plain or dotted name),
    with the constructors (as written)."""

    def __init__(self, facts: _Facts) -> None:
        importable = set(facts.imported) | set(facts.qualnames.aliases)

        def made(calls: list[ast.Call]) -> list[ast.expr]:
            return [c.func for c in calls if (dotted(c.func) or ".").partition(".")[0] in importable]

        values = facts.values
        # (id(scope), name) -> the constructors of such instances assigned to the name there
        self.names = {key: found for key, calls in values.names.items() if (found := made(calls))}
        # ``n`` of ``self.n`` so assigned (in any class) -> the constructors
        self.attributes = {key: found for key, calls in values.attributes.items() if (found := made(calls))}

    def held(self, name: str, scope: _Scope) -> list[ast.expr]:
        """``FileModel.values_of`` the name in the scope: the values of the first scope out (class scopes
        skipped but the first) that binds it (an assignment or a positional parameter; other bindings
        are looked past)."""
        current: _Scope | None = scope
        while current is not None:
            if current.kind != "class" or current is scope:
                found = self.names.get((id(current), name))
                if found:
                    return found
                if name in current.params or any(s is not None for s, _ in current.assigned.get(name, ())):
                    return []
            current = current.parent
        return []


def token_mean_callees(tree: ast.Module) -> frozenset[str]:
    """The qualified names (``FileModel.qualname``: through the file's imports and aliases) of the
    callees through which TL301 may look up another file's facts for a finding here (``Rule.
    project_callees``): those ``Traced`` finds from the dividend of each division
    ``mean_of_means_possible_elsewhere`` keeps, and the constructors of the instances of another file's
    loss class a scope that may backpropagate calls (``_called_instances``). Of the definitions the file
    imports, only one reached through these names can take part in a cross-file finding."""
    facts = _facts_of(tree)
    traced = Traced(facts)
    for division in _backpropagated_divisions(facts, padding=facts.padding):
        traced.push("origin", division.dividend, division.scope)
    traced.run()
    for constructor in _called_instances(facts):
        traced.add(dotted(constructor))
    return frozenset(traced.found)


def _may_have_origin(expr: ast.AST, division: _Division, padding: bool = True) -> bool:
    """``TokenEvidence._origin`` of the dividend may be other than None (it may be a token mean); without
    ``padding``, one with ``elsewhere`` (a call ``_project_origin`` may resolve, maybe through names and
    arithmetic): a model's ``.loss`` (``_model_output_origin``) and a selection of a per-token loss
    (``x[mask]``) are never another file's."""
    kind = type(expr)
    if kind is ast.Name:
        return any(
            start < division.start and statement is not division.statement
            for statement, start in division.scope.assigned.get(expr.id, ())  # type: ignore[attr-defined]
        )
    if kind is ast.Call:
        return True
    if kind is ast.Attribute:
        return padding and expr.attr == "loss"  # type: ignore[attr-defined]
    if kind is ast.Subscript:
        return padding and _may_select_a_loss(expr, division)  # type: ignore[arg-type]
    if kind is ast.BinOp and isinstance(expr.op, _TRACED_OPERATORS):  # type: ignore[attr-defined]
        left = _may_have_origin(expr.left, division, padding)  # type: ignore[attr-defined]
        return left or (
            type(expr.op) is not ast.Div and _may_have_origin(expr.right, division, padding)  # type: ignore[attr-defined]
        )
    return False


def _may_select_a_loss(expr: ast.Subscript, division: _Division) -> bool:
    """``x["loss"]`` or ``x[0]`` (a model output's loss), or ``x[key]`` of a per-token loss ``x``
    (``_subscript_key``: a key that is no string or integer literal, a slice first excepted; an implicit
    concatenation of strings, which libcst leaves unread, is taken for its value)."""
    key = expr.slice
    literal = key.operand if type(key) is ast.UnaryOp and type(key.op) is ast.USub else key
    if type(literal) is ast.Constant and type(literal.value) is int:
        return literal.value == 0
    if type(key) is ast.Constant and type(key.value) is str:
        return key.value == "loss"
    first = key.elts[0] if type(key) is ast.Tuple and key.elts else key
    return type(first) is not ast.Slice and _may_have_origin(expr.value, division)


class _Counts:
    """What may be an accumulation step count in the file (``_is_step_count``, ``counts_loop_items``)."""

    def __init__(self, facts: _Facts) -> None:
        self.modulo = facts.modulo
        self.lens = names_bound_to(frozenset({"len"}), facts.bindings)
        self.loops = facts.loops
        # the functions some call passes ``len(batches)`` (``counted_by_callers``), and the names
        # assigned ``len(batches)``
        self.counted = {g for g, calls in facts.call_args if any(self.len_of_a_loop(c) for c in calls)}
        self.assigned = {n for n, call in facts.assigned_calls if self.len_of_a_loop(call)}

    def len_of_a_loop(self, call: ast.Call) -> bool:
        """``_len_of_a_loop``: ``len(batches)`` where some ``for`` loop goes over ``batches``."""
        return last_name(call.func) in self.lens and any(dotted(v) in self.loops for v in _arguments(call))

    def may_count_steps(self, expr: ast.AST, scope: _Scope) -> bool:
        """``_is_step_count`` or ``counts_loop_items`` may hold for the divisor ``expr`` in ``scope``."""
        kind = type(expr)
        if kind is ast.Call:
            if self.len_of_a_loop(expr):  # type: ignore[arg-type]
                return True
            name = last_name(expr.func)  # type: ignore[attr-defined]
            values = _arguments(expr)  # type: ignore[arg-type]
            if name in ("float", "int") and len(values) == 1:
                return self.may_count_steps(values[0], scope)
            return name is not None and is_step_count_name(name)
        if kind is ast.Subscript:
            key = expr.slice  # type: ignore[attr-defined]
            keys = key.elts if type(key) is ast.Tuple else [key]  # type: ignore[attr-defined]
            return any(
                type(k) is ast.Constant and type(k.value) is str and is_step_count_name(k.value)  # type: ignore[attr-defined]
                for k in keys
            )
        path = dotted(expr)
        if path is None:
            return False
        if is_step_count_name(path.rpartition(".")[2]) or path in self.modulo:
            return True
        if kind is not ast.Name:
            return False
        name = expr.id  # type: ignore[attr-defined]
        # ``counted_by_callers`` (a parameter of the function some call passes ``len(batches)``), or
        # ``counts_loop_items`` (a name assigned ``len(batches)``)
        return (name in scope.params and scope.name in self.counted) or name in self.assigned


def _arguments(call: ast.Call) -> list[ast.AST]:
    """The values of a call's arguments (libcst's ``Arg.value``: a ``*`` splat's too)."""
    values = [a.value if type(a) is ast.Starred else a for a in call.args]
    return values + [k.value for k in call.keywords]


def _walk(tree: ast.Module) -> _Facts:
    """One iterative walk of every node, each with its scope and statement."""
    facts = _Facts()
    module = _Scope("module", tree)
    facts.scopes.append(module)
    stack: list[tuple[ast.AST, _Scope, ast.AST]] = [(tree, module, tree)]
    pop, push, names = stack.pop, stack.append, facts.names
    while stack:
        node, scope, statement = pop()
        kind = type(node)
        if kind in _STATEMENTS:
            statement = node
        if kind in _SCOPE_KINDS:
            scope = _Scope(_SCOPE_KINDS[kind], node, scope)
            facts.scopes.append(scope)
        else:
            handler = _HANDLERS.get(kind)
            if handler is not None:
                handler(node, scope, statement, facts)  # type: ignore[operator]
        fields = _FIELDS.get(kind)
        if fields is None:
            fields = _FIELDS[kind] = tuple(f for f in kind._fields if f not in _SKIPPED)  # type: ignore[attr-defined]
        for field in fields:
            value = getattr(node, field, None)
            if type(value) is list:
                for item in value:
                    if isinstance(item, ast.AST):
                        push((item, scope, statement))
                    elif type(item) is str:
                        names.add(item)  # ``global``/``nonlocal`` names
            elif isinstance(value, ast.AST):
                push((value, scope, statement))
            elif type(value) is str:
                if kind is not ast.Constant:
                    names.add(value)  # a name, attribute, parameter, def, import, keyword
                elif value in PADDING_WORDS:
                    facts.padding = True  # a string key
    facts.read_names()
    return facts


_facts_of = of_last_tree(_walk)  # (the file's check, the project's and the callees ask one tree)


def _note_for(node: ast.For | ast.AsyncFor, _scope: _Scope, _statement: ast.AST, facts: _Facts) -> None:
    source = node.iter
    if type(source) is ast.Call and dotted(source.func) == "enumerate":
        sources = _arguments(source)[:1] + [k.value for k in source.keywords[:1]]
    else:
        sources = [source]
    facts.loops.update(key for key in map(dotted, sources) if key is not None)


def _note_return(node: ast.Return, scope: _Scope, _statement: ast.AST, _facts: _Facts) -> None:
    if node.value is not None:
        scope.returned.append(node.value)


def _note_binder(node: ast.AST, scope: _Scope, _statement: ast.AST, facts: _Facts) -> None:
    binding(node, facts.bindings)
    kind = type(node)
    if kind is ast.Import or kind is ast.ImportFrom:  # (``FileModel``: a star import binds nothing)
        base = "." * node.level + (node.module or "") if kind is ast.ImportFrom else None  # type: ignore[attr-defined]
        for alias in node.names:  # type: ignore[attr-defined]
            if alias.name == "*":
                continue
            if base is None:
                target = alias.name if alias.asname else alias.name.partition(".")[0]
            else:
                target = f"{base}.{alias.name}" if base and not base.endswith(".") else base + alias.name
            facts.imported.setdefault(alias.asname or alias.name.partition(".")[0], set()).add(target)
        return
    value = node.value  # type: ignore[attr-defined]
    if value is None:
        return
    if kind is not ast.NamedExpr:
        _note_assignment(node, scope, facts)  # type: ignore[arg-type]
    if type(value) in _BOUND_VALUES:
        facts.bound.append((node, scope))  # type: ignore[arg-type]


def _note_keyword(node: ast.keyword, _scope: _Scope, _statement: ast.AST, facts: _Facts) -> None:
    """``TokenEvidence._walk_file``'s keywords (a padding word as a keyword is read as a name)."""
    value = node.value
    if node.arg == "ignore_index":
        # a non-negative integer literal is a segmentation label, not token padding
        if not (type(value) is ast.Constant and type(value.value) is int):
            facts.padding = True
    elif node.arg == "padding" and type(value) is ast.Constant:
        if value.value is True or (type(value.value) is str and value.value in _PADDING_MODES):
            facts.padding = True


def _note_unary(node: ast.UnaryOp, _scope: _Scope, _statement: ast.AST, facts: _Facts) -> None:
    if _negative_int(node) and node.operand.value == 100:  # type: ignore[attr-defined]
        facts.minus_100 = facts.padding = True


def _note_slice(node: ast.Slice, _scope: _Scope, _statement: ast.AST, facts: _Facts) -> None:
    lower = node.lower
    if node.upper is None and type(lower) is ast.Constant and type(lower.value) is int and lower.value == 1:
        facts.token_targets = True


def _note_call(node: ast.Call, scope: _Scope, statement: ast.AST, facts: _Facts) -> None:
    func = node.func
    name = last_name(func)
    scope.calls.append(node)
    if name in BACKWARD_NAMES:
        scope.backward = True
    if type(func) is ast.Name:
        scope.name_calls.add(name)  # type: ignore[arg-type]
    elif type(func) is ast.Attribute and type(func.value) is ast.Name and func.value.id == "self":
        scope.self_calls.add(name)  # type: ignore[arg-type]
    else:
        name = None
    if name is not None:
        passed = [a for a in node.args if type(a) is ast.Call]
        passed += [k.value for k in node.keywords if type(k.value) is ast.Call]
        if passed:
            facts.call_args.append((name, passed))
    if type(func) is ast.Attribute and func.attr == "div":
        positional = [a for a in node.args if type(a) is not ast.Starred]
        if len(positional) == 1:
            facts.divisions.append(_Division(node, func.value, positional[0], scope, statement))


def _note_binop(node: ast.BinOp, scope: _Scope, statement: ast.AST, facts: _Facts) -> None:
    op = type(node.op)
    if op is ast.Div:
        facts.divisions.append(_Division(node, node.left, node.right, scope, statement))
    elif op is ast.Mult:
        for mine, other in ((node.right, node.left), (node.left, node.right)):
            count = _reciprocal(mine)
            if count is not None:
                facts.divisions.append(_Division(node, other, count, scope, statement))
    elif op is ast.Mod:
        key = dotted(node.right)
        if key is not None:
            facts.modulo.add(key)


def _note_augassign(node: ast.AugAssign, scope: _Scope, statement: ast.AST, facts: _Facts) -> None:
    op, target = type(node.op), node.target
    if op is ast.Div:
        facts.divisions.append(_Division(node, target, node.value, scope, statement))
    elif op is ast.Mult:
        count = _reciprocal(node.value)
        if count is not None:
            facts.divisions.append(_Division(node, target, count, scope, statement))
    elif op is ast.Add and type(target) is ast.Name:
        scope.assigned.setdefault(target.id, []).append((None, (node.lineno, node.col_offset)))
        scope.added.setdefault(target.id, []).append(node.value)


def _note_assignment(node: ast.Assign | ast.AnnAssign, scope: _Scope, facts: _Facts) -> None:
    """The names an assignment binds in the scope (a tuple's or list's elements too), and ``n = f(...)``."""
    targets = node.targets if type(node) is ast.Assign else [node.target]
    start = (node.lineno, node.col_offset)
    for target in targets:
        elements = target.elts if type(target) is ast.Tuple or type(target) is ast.List else [target]  # type: ignore[attr-defined]
        for element in elements:
            if type(element) is ast.Name:
                scope.assigned.setdefault(element.id, []).append((node, start))
    if type(node) is ast.Assign and _negative_int(node.value):
        facts.token_targets = True
    if type(node) is ast.Assign and type(node.value) is ast.Call:
        value = node.value
        facts.assigned_calls.extend((t.id, value) for t in node.targets if type(t) is ast.Name)


def _reciprocal(expr: ast.AST) -> ast.AST | None:
    """``losses._reciprocal``: ``n`` in ``1 / n`` or ``1.0 / n``."""
    if type(expr) is not ast.BinOp or type(expr.op) is not ast.Div:  # type: ignore[attr-defined]
        return None
    left = expr.left  # type: ignore[attr-defined]
    if type(left) is ast.Constant and type(left.value) in (int, float) and left.value == 1:
        return expr.right  # type: ignore[attr-defined]
    return None


def _negative_int(node: ast.AST) -> bool:
    """``tokens._is_negative``: a negative integer literal."""
    return (
        type(node) is ast.UnaryOp
        and type(node.op) is ast.USub  # type: ignore[attr-defined]
        and type(node.operand) is ast.Constant  # type: ignore[attr-defined]
        and type(node.operand.value) is int  # type: ignore[attr-defined]
    )


_HANDLERS = {
    ast.Call: _note_call,
    ast.BinOp: _note_binop,
    ast.AugAssign: _note_augassign,
    ast.Return: _note_return,
    ast.For: _note_for,
    ast.AsyncFor: _note_for,
    ast.keyword: _note_keyword,
    ast.UnaryOp: _note_unary,
    ast.Slice: _note_slice,
    **dict.fromkeys(BINDERS, _note_binder),
}
_STATEMENTS = frozenset(ast.stmt.__subclasses__())
