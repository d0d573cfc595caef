"""A file's facts for the project index, read with CPython's ``ast`` (no libcst parse: issue 20).

A summary is plain JSON data, so that it can be cached by the file's text hash and digested into the
result cache's key. Names are kept as written (``nn.BatchNorm2d``); the index resolves them through the
summary's ``imports``. Every fact carries the line and column (1-based) where it happens, for related
locations in other files.

- ``imports``: local name -> dotted target as imported (relative ones keep their leading dots);
- ``functions``: ``name`` or ``Class.method`` -> params (name, default, annotation), ``half`` (the
  params converted to 16-bit, with where), ``backward``/``scaled_backward``, ``returns_loss`` (the
  tensor whose backward it ran), ``returns`` (the callee of a returned call or of the call assigned to
  the returned name: a factory's product), ``calls`` (project-visible calls with argument names and
  whether a scaled backward/an unscale precede them in the function), ``returns_half`` (a local module
  converted to 16-bit and returned: its tuple position, the tuple's length, where, the parameter of an
  ``if`` guarding the conversion), ``returns_cls`` (a classmethod returns ``cls(...)``, maybe after
  passing it through ``cls.method``: an alternative constructor), ``keyword_only`` (the params after
  ``*``, where there are some);
- ``classes``: bases, ``batchnorm``/``dropout`` submodules (``self.x = ...``, ``add_module``), the
  effects its ``forward`` has (global or registry writes, collectives), and ``init_may_convert``
  (``__init__`` converts ``self`` or passes a submodule to an imported function).
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Callable
from typing import Any

from trainlint.model.pyast import ast_dotted

Summary = dict[str, Any]

_HALF_DTYPES = ("float16", "half", "bfloat16")
_COLLECTIVES = frozenset({"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"})
# methods that convert a whole module's storage to 16-bit (guided-diffusion's UNet, GLIDE)
_HALF_METHODS = frozenset({"convert_to_fp16", "convert_to_f16", "convert_to_half", "to_fp16"})
# a call that hands an auxiliary (load-balancing) loss to a tracker: Megatron's
# ``save_to_aux_losses_tracker``, ``tracker.add_aux_loss``, ``record_aux_loss``
_AUX_TRACKER = re.compile(
    r"(save|add|record|track|append|log|update)\w*aux\w*loss|aux\w*loss\w*(track|save|record)", re.I
)


def _where(node: ast.AST) -> list[int]:
    return [getattr(node, "lineno", 1), getattr(node, "col_offset", 0) + 1]


def _literal(node: ast.AST | None) -> Any:
    """A parameter default as JSON data: literals as themselves, names as ``{"name": ...}``."""
    if node is None:
        return None
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        name = ast_dotted(node)
        return {"name": name} if name else {"expr": True}
    return value if isinstance(value, bool | int | float | str) or value is None else {"expr": True}


def _is_half_call(call: ast.Call) -> bool:
    """``x.half()``, ``x.bfloat16()``, ``x.to(torch.float16)``/``x.to(dtype=torch.half)``."""
    if not isinstance(call.func, ast.Attribute):
        return False
    if call.func.attr in ("half", "bfloat16") and not call.args:
        return True
    if call.func.attr == "to":
        dtypes = [*call.args, *(k.value for k in call.keywords if k.arg == "dtype")]
        return any((ast_dotted(d) or "").endswith(_HALF_DTYPES) for d in dtypes)
    return False


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Call):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


_FIELDS: dict[type, tuple[str, ...]] = {}
# fields that hold a name or a number, never a node: not looked into (``ctx``: Load/Store, no fact)
_SCALAR_FIELDS = frozenset(
    {
        "ctx",
        "id",
        "attr",
        "arg",
        "asname",
        "module",
        "level",
        "kind",
        "conversion",
        "type_comment",
        "is_async",
        "simple",
    }
)


def _children(node: ast.AST, leaves: frozenset[type] = frozenset()) -> list[ast.AST]:
    """``list(ast.iter_child_nodes(node))`` less the ``ctx`` (Load/Store) nodes, which no fact looks
    at, and less the kinds of ``leaves`` (never listed to be dropped after), without its two
    generators' cost: the index walks every function of every file it reads."""
    fields = _FIELDS.get(type(node))
    if fields is None:
        fields = _FIELDS[type(node)] = tuple(f for f in node._fields if f not in _SCALAR_FIELDS)
    out: list[ast.AST] = []
    for name in fields:
        value = getattr(node, name, None)
        if isinstance(value, ast.AST):
            if type(value) not in leaves:
                out.append(value)
        elif isinstance(value, list):
            out += [item for item in value if isinstance(item, ast.AST) and type(item) not in leaves]
    return out


# nodes with no child a fact reads (their ``ctx`` aside): the walks that look for statements and calls
# neither list nor open them (half the nodes of a typical body): names, constants, operators
_LEAVES = frozenset(
    {ast.Name, ast.Constant}
    | {kind for base in (ast.operator, ast.cmpop, ast.unaryop, ast.boolop) for kind in base.__subclasses__()}
)


_NESTED_SCOPES = frozenset({ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda})


def _branches(node: ast.AST) -> list[ast.AST]:
    """``_walk`` without the leaves (``_LEAVES``), in the same order."""
    out = [node]
    for item in out:  # (the list grows while it is read: a queue)
        out += _children(item, _LEAVES)
    return out


def _walk(node: ast.AST) -> list[ast.AST]:
    """The nodes ``ast.walk`` yields (less ``ctx`` ones), in its breadth-first order, as a list."""
    out = [node]
    for item in out:  # (the list grows while it is read: a queue)
        out += _children(item)
    return out


def _converts_data(fn: ast.AST) -> list[int] | None:
    """Where a function used with ``model.apply(fn)`` converts a tensor to 16-bit, if it does."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and _is_half_call(node):
            return _where(node)
    return None


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[list[Any]]:
    """A function's parameters as [name, default, annotation] (``*args``/``**kwargs`` left out)."""
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.AST | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params = [
        [a.arg, _literal(d), _annotation(a.annotation)] for a, d in zip(positional, defaults, strict=True)
    ]
    params += [
        [a.arg, _literal(d), _annotation(a.annotation)]
        for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    return params


def _annotation(node: ast.AST | None) -> str | None:
    """An annotation's dotted name; ``X`` for ``Optional[X]`` and ``X | None`` (an updater's
    ``grad_scaler: Optional[GradScaler] = None``)."""
    if isinstance(node, ast.Subscript) and ast_dotted(node.value) in ("Optional", "typing.Optional"):
        return ast_dotted(node.slice)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        sides = [n for n in (node.left, node.right) if not (isinstance(n, ast.Constant) and n.value is None)]
        return ast_dotted(sides[0]) if len(sides) == 1 else None
    return ast_dotted(node)


class _Function:
    """The facts of one function body (nested defs excluded, except as ``apply`` callbacks)."""

    def __init__(self, node: ast.FunctionDef | ast.AsyncFunctionDef, local_defs: dict[str, ast.AST]) -> None:
        self.node = node
        self.local_defs = local_defs
        params = self.params = _params(node)
        self.names = {p[0] for p in params}
        self.facts: dict[str, Any] = {"line": node.lineno, "params": params, "half": {}, "calls": []}
        if node.args.kwonlyargs:  # (after ``*``/``*args``: no positional argument reaches them)
            self.facts["keyword_only"] = [a.arg for a in node.args.kwonlyargs]
        # a local module converted to 16-bit: name -> [line, column, the parameter guarding it or None]
        self.converted: dict[str, list[Any]] = {}
        self._guards: dict[int, str] | None = None  # read only for a converted local: rare
        self.siblings: dict[str, list[str]] = {}  # the names one tuple assignment binds together
        self.made_by_cls: set[str] = set()  # names assigned ``cls(...)`` (an alternative constructor)

    def guard_of(self, node: ast.AST) -> str | None:
        """The parameter of an ``if <param>:`` the node is under, if any."""
        if self._guards is None:
            self._guards = _guards(self.node, self.names)
        return self._guards.get(id(node))

    def body_nodes(self) -> list[ast.AST]:
        """The function's own nodes in source order, not those of nested defs and classes, nor the
        leaves (``_LEAVES``: no fact is read from a name or a constant alone)."""
        out: list[ast.AST] = []
        stack: list[ast.AST] = [n for n in reversed(self.node.body) if type(n) not in _LEAVES]
        while stack:
            node = stack.pop()
            out.append(node)
            if type(node) in _NESTED_SCOPES:
                continue
            children = _children(node, _LEAVES)
            children.reverse()
            stack += children
        return out

    def summarise(self) -> dict[str, Any]:
        facts = self.facts
        nodes = self.body_nodes()
        backward_of: dict[str, list[int]] = {}
        assigned: dict[str, str] = {}
        self.values: dict[str, list[ast.AST]] = {}  # name -> the values assigned to it, in order
        scaled: list[int] = []
        unscaled: list[int] = []
        for node in nodes:
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                self.values.setdefault(node.targets[0].id, []).append(node.value)
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                callee = ast_dotted(node.value.func)
                for target in node.targets:
                    if isinstance(target, ast.Name) and callee:
                        assigned[target.id] = callee
                        if callee == "cls":
                            self.made_by_cls.add(target.id)
                    elif isinstance(target, ast.Tuple):
                        names = [e.id for e in target.elts if isinstance(e, ast.Name)]
                        for name in names:
                            self.siblings[name] = names
            if not isinstance(node, ast.Call):
                continue
            self._call(node, backward_of, scaled, unscaled)
        for node in nodes:
            if isinstance(node, ast.Return) and node.value is not None:
                self._return(node.value, backward_of, assigned)
        if scaled:
            facts["scaled_backward"] = scaled[0]
        return facts

    def _call(
        self, node: ast.Call, backward_of: dict[str, list[int]], scaled: list[int], unscaled: list[int]
    ) -> None:
        facts = self.facts
        func = node.func
        if isinstance(func, ast.Attribute):
            recv = func.value
            if func.attr == "backward":
                facts.setdefault("backward", _where(node))
                inner = recv.args[0] if isinstance(recv, ast.Call) and recv.args else recv
                if (
                    isinstance(recv, ast.Call)
                    and isinstance(recv.func, ast.Attribute)
                    and recv.func.attr == "scale"
                ):
                    scaled.append(_where(node))
                name = ast_dotted(inner)
                if name:
                    backward_of.setdefault(name, _where(node))
            elif func.attr == "unscale_":
                unscaled.append(_where(node))
            elif _is_half_call(node) or (func.attr in _HALF_METHODS and not node.args):
                root = _root(recv)
                if root in self.names:
                    facts["half"].setdefault(root, _where(node))
                elif isinstance(recv, ast.Name):
                    self.converted.setdefault(recv.id, [*_where(node), self.guard_of(node)])
            elif func.attr == "apply" and node.args and isinstance(node.args[0], ast.Name):
                root = _root(recv)
                callback = self.local_defs.get(node.args[0].id)
                where = _converts_data(callback) if callback is not None else None
                if root in self.names and where is not None:
                    facts["half"].setdefault(root, _where(node))
        callee = ast_dotted(func)
        if callee is None:
            return
        line = node.lineno
        facts["calls"].append(
            {
                "callee": callee,
                "at": _where(node),
                "args": [ast_dotted(a) for a in node.args],
                "keywords": {k.arg: ast_dotted(k.value) for k in node.keywords if k.arg},
                "after_scaled_backward": any(s[0] < line for s in scaled),
                "after_unscale": any(u[0] < line for u in unscaled),
            }
        )

    def _return(self, value: ast.AST, backward_of: dict[str, list[int]], assigned: dict[str, str]) -> None:
        elements = value.elts if isinstance(value, ast.Tuple) else [value]
        for index, element in enumerate(elements):
            if isinstance(element, ast.Name) and element.id in self.converted:
                # which returned value is a 16-bit module: -1 for the whole value, else its tuple index
                position = index if isinstance(value, ast.Tuple) else -1
                half = self.facts.setdefault("returns_half", [])
                half.append([position, len(elements), *self.converted[element.id]])
        name = ast_dotted(value)
        # ``model = cls(...)``, maybe post-processed (``model = cls.init_weights(model)``), returned
        made = [name] if name else []
        if isinstance(value, ast.Call) and (ast_dotted(value.func) or "").split(".")[0] == "cls":
            made = (
                ["cls"] if ast_dotted(value.func) == "cls" else [ast_dotted(a) or "" for a in value.args[:1]]
            )
        if any(m == "cls" or m in self.made_by_cls for m in made):
            self.facts["returns_cls"] = True
        # ``loss, parts = criterion(...)``: the parts come out of the same graph as the loss
        for other in [name, *self.siblings.get(name or "", ())]:
            if other is not None and other in backward_of:
                self.facts["returns_loss"] = backward_of[other]
                break
        mean = _token_mean(value, self.values)
        if mean is not None:
            self.facts.setdefault("returns_token_mean", _where(mean))
        divided = _divided_token_mean(value, self.values)
        if divided is not None:
            self.facts.setdefault("returns_divided_token_mean", _where(divided))
        if isinstance(value, ast.Call):
            callee = ast_dotted(value.func)
        else:
            callee = assigned.get(name or "")
        if callee:
            self.facts.setdefault("returns", [callee, *_where(value)])


def _token_mean(value: ast.AST, values: dict[str, list[ast.AST]], depth: int = 0) -> ast.AST | None:
    """Where a returned loss is computed as a mean over the batch's valid tokens, written by hand:
    ``loss_sum / mask.sum()``, ``(loss * mask).sum() / mask.sum()`` (maybe through names)."""
    if isinstance(value, ast.Tuple) and value.elts:
        value = value.elts[0]
    if isinstance(value, ast.Name) and depth < 3 and values.get(value.id):
        return _token_mean(values[value.id][-1], values, depth + 1)
    if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Div)):
        return None
    if _counts(value.right, values, value) and _counts(value.left, values, value):
        return value if _about_tokens(value.right, values) else None
    return None


_TOKEN_WORDS = ("mask", "token", "valid", "label", "pad", "ignore")


def _divided_token_mean(value: ast.AST, values: dict[str, list[ast.AST]]) -> ast.AST | None:
    """A loss wrapper's ``return loss / self.accum_steps`` where ``loss`` is a cross-entropy with
    ``ignore_index`` (a mean over the valid tokens): where the division is."""
    if isinstance(value, ast.Name) and values.get(value.id):
        value = values[value.id][-1]
    if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Div)):
        return None
    count = (ast_dotted(value.right) or "").rsplit(".", 1)[-1].lower()
    if "accum" not in count or any(w in count for w in ("token", "loss", "sum")):
        return None
    loss = value.left
    if isinstance(loss, ast.Name) and values.get(loss.id):
        loss = values[loss.id][0]
    if not (
        isinstance(loss, ast.Call) and (ast_dotted(loss.func) or "").endswith(("cross_entropy", "nll_loss"))
    ):
        return None
    keywords = {k.arg: k.value for k in loss.keywords}
    reduction = keywords.get("reduction")
    if "ignore_index" not in keywords or (reduction is not None and _literal(reduction) != "mean"):
        return None
    return value


def _about_tokens(count: ast.AST, values: dict[str, list[ast.AST]]) -> bool:
    """The count names tokens (a mask, valid tokens, labels, padding), directly or one name back: a
    weighted mean over examples (``(loss * w).sum() / w.sum()``) is not a token mean."""
    nodes = _walk(count)
    for node in list(nodes):
        if isinstance(node, ast.Name):
            for other in values.get(node.id, ())[-1:]:
                nodes += _walk(other)
    for node in nodes:
        word = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        if isinstance(node, ast.Constant) and node.value in ("-100", -100):
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            word = node.value
        if any(w in word.lower() for w in _TOKEN_WORDS):
            return True
    return False


def _counts(expr: ast.AST, values: dict[str, list[ast.AST]], division: ast.AST) -> bool:
    """``expr`` sums (``x.sum()``, ``count_nonzero``), directly or through a name assigned one, other
    than the division that is being looked at (``loss = loss / mask.sum()``)."""
    for node in _walk(expr):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("sum", "count_nonzero"):
                return True
        if isinstance(node, ast.Name):
            for other in values.get(node.id, ()):
                if other is not division and any(
                    isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Attribute)
                    and n.func.attr in ("sum", "count_nonzero")
                    for n in _walk(other)
                ):
                    return True
    return False


def _guards(function: ast.AST, params: set[str]) -> dict[int, str]:
    """The nodes under ``if <param>:`` (the param's name), so that a caller passing False is known
    to skip them."""
    out: dict[int, str] = {}
    for node in _walk(function):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id in params:
            for statement in node.body:
                for inner in _walk(statement):
                    out.setdefault(id(inner), node.test.id)
    return out


def class_facts(node: ast.ClassDef) -> dict[str, Any]:
    """Submodules made in any method (``self.x = C(...)``, ``self.add_module("x", C(...))``) and the
    effects of ``forward``: writes to globals or to module-level containers, collectives."""
    submodules: dict[str, list[Any]] = {}
    effects: list[list[Any]] = []
    calls: list[list[Any]] = []
    for item in node.body:
        if not isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        # (the other methods give submodules only, made by calls: their names need no visit)
        walked = _walk(item) if item.name == "forward" else _branches(item)
        # (globals matter to ``forward``'s effects only)
        declared_global = (
            {n for s in walked if isinstance(s, ast.Global) for n in s.names}
            if item.name == "forward"
            else set()
        )
        # a container ``forward`` binds itself (``out = {}; out["a"] = y``) is no registry
        bound_here = (
            {s.id for s in walked if isinstance(s, ast.Name) and isinstance(s.ctx, ast.Store)}
            - declared_global
            if item.name == "forward"
            else set()
        )
        for sub in walked:
            made = _made(sub.value) if isinstance(sub, ast.Assign) else None
            if isinstance(sub, ast.Assign) and made is not None:
                callee = ast_dotted(made.func)
                for target in sub.targets:
                    name = ast_dotted(target)
                    if callee and name and name.startswith("self.") and name.count(".") == 1:
                        submodules.setdefault(name[5:], [callee, *_where(made), _track_stats(made)])
            elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute):
                if sub.func.attr == "add_module" and len(sub.args) == 2 and isinstance(sub.args[1], ast.Call):
                    label = sub.args[0].value if isinstance(sub.args[0], ast.Constant) else "?"
                    callee = ast_dotted(sub.args[1].func)
                    if callee:
                        submodules.setdefault(
                            str(label), [callee, *_where(sub.args[1]), _track_stats(sub.args[1])]
                        )
            if item.name != "forward":
                continue
            if isinstance(sub, ast.Call) and (callee := ast_dotted(sub.func)):
                calls.append([callee, *_where(sub)])
                if _AUX_TRACKER.search(callee.rsplit(".", 1)[-1]):
                    effects.append([f"records an auxiliary loss with `{callee}`", *_where(sub)])
            if (
                isinstance(sub, ast.Call)
                and isinstance(sub.func, ast.Attribute)
                and sub.func.attr in _COLLECTIVES
            ):
                effects.append(["runs the collective `" + sub.func.attr + "`", *_where(sub)])
            elif isinstance(sub, ast.Assign | ast.AugAssign):
                for target in sub.targets if isinstance(sub, ast.Assign) else [sub.target]:
                    if isinstance(target, ast.Name) and target.id in declared_global:
                        effects.append([f"writes the global `{target.id}`", *_where(sub)])
                    elif (
                        isinstance(target, ast.Subscript)
                        and isinstance(target.value, ast.Name)
                        and target.value.id not in bound_here
                    ):
                        effects.append([f"writes to `{target.value.id}[...]`", *_where(sub)])
    return {
        "line": node.lineno,
        "bases": [b for b in (ast_dotted(base) for base in node.bases) if b],
        "submodules": submodules,
        "forward_effects": effects,
        "forward_calls": calls,
    }


def _made(value: ast.AST) -> ast.Call | None:
    """The construction assigned: ``C(...)``, or the branch of ``nn.Dropout(p) if p > 0 else
    nn.Identity()`` that is not the placeholder."""
    if isinstance(value, ast.IfExp):
        options = [v for v in (value.body, value.orelse) if isinstance(v, ast.Call)]
        real = [v for v in options if not (ast_dotted(v.func) or "").endswith("Identity")]
        return (real or options or [None])[0]
    return value if isinstance(value, ast.Call) else None


def _track_stats(call: ast.Call) -> bool:
    return not any(
        k.arg == "track_running_stats" and isinstance(k.value, ast.Constant) and k.value.value is False
        for k in call.keywords
    )


_HOLDERS = (ast.stmt, ast.excepthandler, ast.match_case)  # statements, and the clauses holding some


def _statements(tree: ast.Module) -> list[ast.AST]:
    """The statements (and the except and case clauses holding some) of ``ast.walk(tree)``, in its
    order: no expression holds a statement, so skipping them keeps the order and saves most nodes."""
    out: list[ast.AST] = [tree]
    for node in out:  # (the list grows while it is read: a queue)
        for name in node._fields:
            value = getattr(node, name, None)
            if isinstance(value, list):
                out += [item for item in value if isinstance(item, _HOLDERS)]
    return out


def _imports(tree: ast.Module) -> dict[str, str]:
    out: dict[str, str] = {}
    for node in _statements(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    out[alias.asname] = alias.name
                else:
                    out[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            for alias in node.names:
                if alias.name != "*":
                    joined = f"{base}.{alias.name}" if base and not base.endswith(".") else base + alias.name
                    out[alias.asname or alias.name] = joined
    return out


def _parse(text: str) -> ast.Module | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def summarize(text: str, tree: ast.Module | None = None) -> Summary | None:
    """The facts of one file, or None when CPython cannot parse it. ``tree``: the text's tree, where
    the caller has parsed it already (the engine's gate)."""
    if tree is None:
        tree = _parse(text)
        if tree is None:
            return None
    functions: dict[str, Any] = {}
    classes: dict[str, Any] = {}
    module_defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    for node in tree.body:
        add_entries(node, functions, classes, module_defs)
    imports = _imports(tree)
    for name, facts in classes.items():
        class_methods(name, facts, functions, imports.__contains__)
    return {"imports": imports, "functions": functions, "classes": classes}


def add_entries(
    node: ast.stmt,
    functions: dict[str, Any],
    classes: dict[str, Any],
    module_defs: dict[str, ast.AST] | None,
    module_defines: Callable[[str], bool] | None = None,
) -> None:
    """Add the entries of one statement of a module's top level: a function's, or a class's and its
    methods' (``Class.method``). ``module_defs``, ``module_defines``: as for ``function_facts``."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        functions[node.name] = function_facts(node, module_defs, module_defines)
    elif isinstance(node, ast.ClassDef):
        classes[node.name] = class_facts(node)
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                functions[f"{node.name}.{item.name}"] = function_facts(item, module_defs, module_defines)


def class_methods(
    name: str, facts: dict[str, Any], functions: dict[str, Any], imported: Callable[[str], bool]
) -> None:
    """Add to a class's facts those read from its methods' (``functions``, where ``Class.method``
    entries are). ``imported``: whether the file's imports bind a name (not dotted)."""
    # methods a subclass in another file may call as ``self.method(...)`` (see ``own_method``)
    methods = [(key.split(".", 1)[1], f) for key, f in functions.items() if key.startswith(f"{name}.")]
    for fact in ("returns_loss", "returns_token_mean", "returns_divided_token_mean"):
        named = [method for method, f in methods if fact in f]
        if named:
            facts[f"{fact}_methods"] = named
    init = functions.get(f"{name}.__init__")
    # the constructor converts the module itself or hands a submodule to an imported helper (which
    # may convert it: the index decides): instances may hold 16-bit parameters
    facts["init_may_convert"] = init is not None and (
        "self" in init["half"]
        or any(
            any((a or "").startswith("self.") for a in c["args"])
            and "." not in c["callee"]  # (an import binds a plain name)
            and imported(c["callee"])
            for c in init["calls"]
        )
    )


class Incomplete(Exception):
    """A fact of a definition needs another statement of its module than those at hand."""


class _NestedOnly(dict[str, ast.AST]):
    """A function's own nested definitions, standing for those it may see where the module's others
    are not at hand: asking for another that the module may define raises ``Incomplete``."""

    def __init__(self, nested: dict[str, ast.AST], module_defines: Callable[[str], bool]) -> None:
        super().__init__(nested)
        self.module_defines = module_defines

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        if key in self:
            return self[key]
        if self.module_defines(key):
            raise Incomplete(key)
        return default


def function_facts(
    node: ast.FunctionDef | ast.AsyncFunctionDef,
    module_defs: dict[str, ast.AST] | None,
    module_defines: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    """The facts of a function or method. ``module_defs``: the module's functions by name (an
    ``apply`` callback may be one); None where they are not at hand: ``module_defines`` tells then
    whether the module may define a function of that name (``Incomplete`` if one is asked for)."""
    nested = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    if module_defs is None:
        local: dict[str, ast.AST] = _NestedOnly(nested, module_defines or (lambda name: True))
    else:
        local = {**module_defs, **nested}
    return _Function(node, local).summarise()


def outline(text: str, tree: ast.Module | None = None) -> Summary | None:
    """What a file's cache key and its imported facts need of its own text, without a walk of every
    body: its ``imports`` and the ``params`` of its ``functions`` and methods (as in ``summarize``),
    or None when CPython cannot parse it. ``tree``: as in ``summarize``."""
    if tree is None:
        tree = _parse(text)
        if tree is None:
            return None
    functions = {
        n.name: {"params": _params(n)}
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    for node in tree.body:  # methods too: an updater's ``step`` may receive the scaler
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    functions[f"{node.name}.{item.name}"] = {"params": _params(item)}
    return {"imports": _imports(tree), "functions": functions}


def instance_calls(summary: Summary, function: str, classes: set[str], method: str) -> set[str]:
    """The callees ``self.x.method`` in the method ``function`` (``Class.name``) of a class whose
    ``self.x`` is assigned an instance of one of ``classes`` (local names) in any of its methods."""
    owner = function.split(".")[0] if "." in function else None
    facts = summary["classes"].get(owner) if owner else None
    if facts is None:
        return set()
    return {f"self.{label}.{method}" for label, made in facts["submodules"].items() if made[0] in classes}
