"""Whether a file can hold TL106's or TL109's finding, read from CPython's tree before libcst is asked: a
``x.backward()`` inside an autocast region (TL106), or a plain backward whose loss comes from an fp16
autocast region in a file with no sign of loss scaling (TL109).

The walk mirrors what ``FileModel`` and the amp family's ``autocast_frames`` see around a call: its scope
(module, class, function, lambda; a def's decorators and defaults belong to the def, comprehensions to
their enclosing scope), the ``with`` statements whose body holds it (kept across nested scopes, as the
model's frames are) and the functions whose decorators count (the enclosing functions up to the first
class or lambda). Names resolve as ``FileModel.qualname`` and ``values_of`` do, but over every binding of
the file whatever its scope: a superset of what the model finds.
"""

from __future__ import annotations

import ast
from collections.abc import Callable

from trainlint.model.gate_calls import Bindings, binding, names_bound_to
from trainlint.model.pyast import ast_dotted as dotted
from trainlint.model.vocab import AUTOCAST_FUNCTIONS, SCALING_FRAMEWORKS

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_WITHS = (ast.With, ast.AsyncWith)
# Nodes with nothing below them that the checks read (a name is read where it is met).
_LEAVES = frozenset(
    {ast.Constant, ast.Load, ast.Store, ast.Del, ast.Pass, ast.Break, ast.Continue}
    | {cls for base in (ast.operator, ast.unaryop, ast.cmpop, ast.boolop) for cls in base.__subclasses__()}
)
# The autocast functions whose second positional argument is the dtype (``autocast_dtype``).
_DTYPE_SECOND = frozenset({"torch.autocast", "torch.amp.autocast"})
# The last part of the fp16 names in ``vocab.LOW_PRECISION_DTYPES`` (``torch.float16``, ``torch.half``).
_FP16 = frozenset({"float16", "half"})
# Where a call sits: (scope node, enclosing ``with`` statements, the functions whose decorators count,
# the innermost statement). Shared by siblings, made anew only where one of them changes.
Context = tuple[ast.AST, tuple[ast.AST, ...], tuple[ast.AST, ...], ast.AST]
Entry = tuple[ast.AST, Context]
_STATEMENTS = frozenset(
    cls
    for cls in vars(ast).values()
    if isinstance(cls, type) and issubclass(cls, ast.stmt) and cls is not ast.stmt
)


class _Facts:
    """What one walk keeps: the backward calls and the assignments inside a ``with`` or a function, with
    their context, and the bindings that names resolve through."""

    __slots__ = ("assigns", "backwards", "bindings", "imports", "self_values", "values")

    def __init__(self) -> None:
        self.backwards: list[tuple[ast.Call, Context]] = []
        self.assigns: list[tuple[ast.Assign | ast.AnnAssign, Context]] = []
        self.imports: dict[str, list[str]] = {}  # local name -> import targets, as ``FileModel`` spells them
        self.values: dict[str, list[ast.expr]] = {}  # name -> values assigned to it (``values_of``)
        self.self_values: dict[str, list[ast.expr]] = {}  # attr -> values assigned to ``self.attr``
        self.bindings: Bindings = []  # for the names bound to an fp16 dtype


def backward_may_run_in_autocast(tree: ast.Module) -> bool:
    """Whether some ``x.backward(...)`` call (a method call: TL106's ``backward`` and ``scaled_backward``
    events) sits in the body of a ``with`` one of whose items may be an autocast constructor not written
    ``enabled=False``, or in a function (or a function nested in one, up to a class or lambda) decorated
    with such a call.

    TL106 reports a backward only when the innermost autocast region ``autocast_frames`` finds around it
    is enabled: that region is one of these. An item counts as ``autocast_call`` reads it: a call, either
    branch of a conditional, or any value assigned to the name or ``self.attr`` it is, whose callee may
    resolve to one of ``AUTOCAST_FUNCTIONS`` through imports and name-to-name assignments."""
    facts = _walk(tree, scaling=False)
    if facts is None or not facts.backwards:
        return False
    resolver = _Resolver(facts)
    return any(resolver.in_region(context, fp16=False) for _, context in facts.backwards)


def fp16_backward_may_lack_scaler(tree: ast.Module) -> bool:
    """Whether the file has no sign of loss scaling and some ``x.backward(...)`` call either sits in an
    autocast region (as for TL106) that may be fp16, or, in the same scope and not after it, an assignment
    in such a region binds a name that the backward's receiver holds.

    TL109 returns nothing from a file with an identifier (not a def's or class's name) containing
    ``scaler`` or an import of a ``SCALING_FRAMEWORKS`` package; otherwise it reports a backward (not a
    scaled one) whose innermost region, or that of an earlier assignment of the same scope binding one of
    the receiver's names, is enabled and fp16 (``autocast_dtype``): a ``dtype`` that may be
    ``float16``/``half``; else a ``torch.cuda.amp`` callee, or a ``cuda`` device string for the others.
    The names compared are every identifier of the receiver and of the targets, as the rule's ``walk``."""
    facts = _walk(tree, scaling=True)
    if facts is None or not facts.backwards:
        return False
    resolver = _Resolver(facts)
    if any(resolver.in_region(context, fp16=True) for _, context in facts.backwards):
        return True
    scopes: dict[int, list[tuple[tuple[int, int], set[str]]]] = {}
    for call, context in facts.backwards:
        receiver = call.func.value  # type: ignore[attr-defined]
        scopes.setdefault(id(context[0]), []).append((_start(context[3]), _identifiers(receiver)))
    for node, context in facts.assigns:
        backwards = scopes.get(id(context[0]))
        if not backwards or not resolver.in_region(context, fp16=True):
            continue
        where = _start(node)
        targets = node.targets if type(node) is ast.Assign else [node.target]  # type: ignore[union-attr]
        bound = set().union(*(_identifiers(t) for t in targets))
        # (``assign.order > site.order``: an assignment starting after the backward's statement)
        if any(where <= at and bound & names for at, names in backwards):
            return True
    return False


def _walk(tree: ast.Module, *, scaling: bool) -> _Facts | None:
    """One iterative walk. With ``scaling``, None as soon as a sign of loss scaling is met."""
    facts = _Facts()
    stack: list[Entry] = [(tree, (tree, (), (), tree))]
    pop, push = stack.pop, stack.append
    leaves, attribute, name, call = _LEAVES, ast.Attribute, ast.Name, ast.Call
    while stack:
        node, context = pop()
        kind = type(node)
        if kind in leaves:
            continue
        if kind is name:
            if scaling and "scaler" in node.id.lower():  # type: ignore[attr-defined]
                return None
            continue
        if kind is attribute:
            if scaling and "scaler" in node.attr.lower():  # type: ignore[attr-defined]
                return None
            push((node.value, context))  # type: ignore[attr-defined]
            continue
        if kind is call and type(node.func) is attribute and node.func.attr == "backward":  # type: ignore[attr-defined]
            facts.backwards.append((node, context))  # type: ignore[arg-type]
        elif kind in _STATEMENTS:
            context = (*context[:3], node)
            if kind in _WITHS:
                _push_with(node, context, push)  # type: ignore[arg-type]
                continue
            if kind is ast.Assign or kind is ast.AnnAssign or kind is ast.Import or kind is ast.ImportFrom:
                if _bind(node, context, facts, scaling):
                    return None
            elif kind in _FUNCTIONS:
                context = (node, context[1], (*context[2], node), node)
            elif kind is ast.ClassDef:
                context = (node, context[1], (), node)
        elif kind is ast.Lambda:
            context = (node, context[1], (), context[3])
        elif kind is ast.NamedExpr:
            _bind(node, context, facts, scaling)
        elif scaling and _names_scaler(node, kind):
            return None
        for child in ast.iter_child_nodes(node):
            push((child, context))
    return facts


def _push_with(node: ast.With | ast.AsyncWith, context: Context, push: Callable[[Entry], None]) -> None:
    """The items sit outside the region the ``with`` opens (the model's frame starts at its body)."""
    for item in node.items:
        push((item, context))
    inside = (context[0], (*context[1], node), context[2], context[3])
    for statement in node.body:
        push((statement, inside))


def _names_scaler(node: ast.AST, kind: type) -> bool:
    """The identifiers libcst holds as names besides ``Name`` and ``Attribute``: parameters, keywords,
    imported names (a dotted one contains ``scaler`` only if one of its names does)."""
    if kind is ast.arg:
        text = node.arg  # type: ignore[attr-defined]
    elif kind is ast.keyword:
        text = node.arg or ""  # type: ignore[attr-defined]
    elif kind is ast.alias:
        text = f"{node.name} {node.asname or ''}"  # type: ignore[attr-defined]
    else:
        return False
    return "scaler" in text.lower()


def _bind(node: ast.AST, context: Context, facts: _Facts, scaling: bool) -> bool:
    """Record what ``node`` (an assignment or import) binds; True when, with ``scaling``, it imports a
    framework that scales the loss itself or names a scaler (``uses_scaling_framework``,
    ``scaler_in_file``)."""
    kind = type(node)
    binding(node, facts.bindings)
    if kind is ast.Import:
        for alias in node.names:  # type: ignore[attr-defined]
            head = alias.name.split(".")[0]
            if scaling and head in SCALING_FRAMEWORKS:
                return True
            local, target = (alias.asname, alias.name) if alias.asname else (head, head)
            facts.imports.setdefault(local, []).append(target)
        return False
    if kind is ast.ImportFrom:
        module = node.module or ""  # type: ignore[attr-defined]
        if scaling and "scaler" in module.lower():
            return True
        if node.level or not module or node.names[0].name == "*":  # type: ignore[attr-defined]
            return False  # (a relative import never resolves to torch; ``*`` binds nothing in the model)
        if scaling and module.split(".")[0] in SCALING_FRAMEWORKS:
            return True
        for alias in node.names:  # type: ignore[attr-defined]
            facts.imports.setdefault(alias.asname or alias.name, []).append(f"{module}.{alias.name}")
        return False
    value = node.value  # type: ignore[attr-defined]
    if value is None:
        return False
    targets = node.targets if kind is ast.Assign else [node.target]  # type: ignore[attr-defined]
    for target in targets:
        if type(target) is ast.Name:
            facts.values.setdefault(target.id, []).append(value)
        elif type(target) is ast.Attribute and type(target.value) is ast.Name and target.value.id == "self":
            facts.self_values.setdefault(target.attr, []).append(value)
    if kind is not ast.NamedExpr and (context[1] or context[2]):
        facts.assigns.append((node, context))  # type: ignore[arg-type]
    return False


class _Resolver:
    """Names resolved over every binding of the file (memoised): what autocast calls a ``with`` item or
    decorator may be, and whether one may be an enabled (fp16) region."""

    def __init__(self, facts: _Facts) -> None:
        self.facts = facts
        self.paths: dict[str, set[str]] = {}
        self.regions: dict[tuple[int, bool], bool] = {}
        self.fp16_names: set[str] | None = None

    def in_region(self, context: Context, *, fp16: bool) -> bool:
        """Whether some region around a site (a ``with`` item, a decorator) may be enabled (and fp16)."""
        _, withs, functions, _ = context
        for node in withs:
            key = (id(node), fp16)
            if key not in self.regions:
                items = node.items  # type: ignore[attr-defined]
                self.regions[key] = any(
                    self._opens(c, fp16) for i in items for c in self._calls(i.context_expr)
                )
            if self.regions[key]:
                return True
        for node in functions:
            key = (id(node), fp16)
            if key not in self.regions:
                decorators = node.decorator_list  # type: ignore[attr-defined]
                self.regions[key] = any(type(d) is ast.Call and self._opens(d, fp16) for d in decorators)
            if self.regions[key]:
                return True
        return False

    def _calls(self, expr: ast.expr) -> list[ast.expr]:
        """The calls ``autocast_call`` may take ``expr`` to be: itself, or the values assigned to the name
        or ``self.attr`` it is; either branch of a conditional."""
        options: list[ast.expr] = [expr]
        if type(expr) is ast.Name:
            options = self.facts.values.get(expr.id, [])
        elif type(expr) is ast.Attribute:
            is_self = type(expr.value) is ast.Name and expr.value.id == "self"
            options = self.facts.self_values.get(expr.attr, []) if is_self else []
        out = []
        for option in options:
            out += [option.body, option.orelse] if type(option) is ast.IfExp else [option]
        return [c for c in out if type(c) is ast.Call]

    def _opens(self, call: ast.Call, fp16: bool) -> bool:
        """``call`` may be an autocast constructor not written ``enabled=False`` (and may be fp16)."""
        callees = self._resolve(dotted(call.func)) & AUTOCAST_FUNCTIONS
        if not callees:
            return False
        keywords = {k.arg: k.value for k in call.keywords if k.arg}
        enabled = keywords.get("enabled")
        if type(enabled) is ast.Constant and enabled.value is False:
            return False
        return not fp16 or any(self._may_be_fp16(call, keywords, c) for c in callees)

    def _may_be_fp16(self, call: ast.Call, keywords: dict[str | None, ast.expr], callee: str) -> bool:
        """``autocast_dtype`` may be ``"fp16"`` for this callee."""
        positional = [a for a in call.args if type(a) is not ast.Starred]
        dtype = keywords.get("dtype")
        if dtype is None and callee in _DTYPE_SECOND and len(positional) > 1:
            dtype = positional[1]
        if dtype is not None:
            # a dotted dtype resolves to an fp16 one only when its last part is one; a plain name only
            # when it is bound to one (imported, or assigned a name that is)
            if type(dtype) is ast.Attribute:
                return dtype.attr in _FP16
            if self.fp16_names is None:
                self.fp16_names = names_bound_to(_FP16, self.facts.bindings)
            return type(dtype) is ast.Name and dtype.id in self.fp16_names
        if callee.startswith("torch.cuda.amp"):
            return True
        if callee.startswith("torch.cpu.amp"):
            return False
        device = keywords.get("device_type", positional[0] if positional else None)
        return type(device) is ast.Constant and device.value == "cuda"

    def _resolve(self, path: str | None, seen: frozenset[str] = frozenset()) -> set[str]:
        """Every qualified name ``FileModel.qualname`` may give ``path`` from some scope: an import of
        its head, or a name or dotted value assigned to it, resolved in turn."""
        if path is None or path in seen:
            return set()
        if path in self.paths:
            return self.paths[path]
        head, _, rest = path.partition(".")
        tail = f".{rest}" if rest else ""
        out = {target + tail for target in self.facts.imports.get(head, ())}
        for value in self.facts.values.get(head, ()):
            if type(value) is ast.Name or type(value) is ast.Attribute:
                out |= {base + tail for base in self._resolve(dotted(value), seen | {path})}
        if not seen:  # (a result cut short by a cycle is not kept)
            self.paths[path] = out
        return out


def _identifiers(node: ast.AST) -> set[str]:
    """The names libcst's ``walk`` finds in an expression: names, attributes, keywords, parameters, and
    ``None``/``True``/``False`` (names to libcst)."""
    out: set[str] = set()
    for sub in ast.walk(node):
        kind = type(sub)
        if kind is ast.Name:
            out.add(sub.id)  # type: ignore[attr-defined]
        elif kind is ast.Attribute:
            out.add(sub.attr)  # type: ignore[attr-defined]
        elif kind is ast.keyword and sub.arg:  # type: ignore[attr-defined]
            out.add(sub.arg)  # type: ignore[attr-defined]
        elif kind is ast.arg:
            out.add(sub.arg)  # type: ignore[attr-defined]
        elif kind is ast.Constant and (sub.value is None or sub.value is True or sub.value is False):  # type: ignore[attr-defined]
            out.add(str(sub.value))  # type: ignore[attr-defined]
    return out


def _start(node: ast.AST) -> tuple[int, int]:
    return (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))
