"""Whether a file can hold TL302's finding, read from CPython's tree before libcst is asked: a running
total (``t += x``, ``t = t + x``, ``t.append(x)``) in a loop that adds, not detached, a loss that a
backward call of the same scope differentiates, the two sharing a loop.

The walk mirrors ``FileModel``'s sites: scopes are functions, lambdas and classes (not comprehensions);
a site's loops are every ``for``/``while`` around it, those outside its ``def`` included; a loop's
``iter`` or ``test`` is not inside it. Both sites of a finding sit in a loop, so only the code inside
loops is walked to the leaves (a fifth of a training script); outside them only the statements that
hold others are, and the helpers and methods a loop calls are read when it calls them. Every shortcut
errs towards keeping the file.

``returned_loss_may_be_kept`` asks the same of the findings that rest on another file's function (one
that runs the backward of the loss it returns): the added call, or the call the added key was assigned
from, must be one ``FileModel`` may resolve to another file (``crossfile.project_method``).
``kept_loss_callees`` names what those calls may resolve to (``Rule.project_callees``): only a
definition imported through one of those names can take part in such a finding.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field

from trainlint.model.pyast import ast_dotted as dotted
from trainlint.model.pyast import import_bindings, of_last_tree
from trainlint.model.vocab import BACKWARD_NAMES, is_step_count_name

# TL302's ``DETACHING_METHODS`` and the builtins of its ``DETACHING_FUNCTIONS``: their result holds no graph
_DETACHING_METHODS = frozenset({"item", "detach", "detach_", "tolist", "numpy"})
_DETACHING_BUILTINS = frozenset({"float", "int", "round"})

# The loops around a node, outermost first: (id of the loop node, "body" or "orelse").
Frames = tuple[tuple[int, str], ...]

# The fields that hold the statements of a statement outside any loop (the rest of it is not walked).
_BODIES: dict[type, tuple[str, ...]] = {
    ast.Module: ("body",),
    ast.FunctionDef: ("body",),
    ast.AsyncFunctionDef: ("body",),
    ast.ClassDef: ("body",),
    ast.If: ("body", "orelse"),
    ast.With: ("body",),
    ast.AsyncWith: ("body",),
    ast.Try: ("body", "handlers", "orelse", "finalbody"),
    ast.ExceptHandler: ("body",),
    ast.Match: ("cases",),
    ast.match_case: ("body",),
}
if hasattr(ast, "TryStar"):  # Python 3.11
    _BODIES[ast.TryStar] = _BODIES[ast.Try]
# Fields that never hold a node (names, flags, operators, contexts): not walked.
_NOT_NODES = frozenset(
    {"ctx", "op", "ops", "id", "attr", "arg", "name", "names", "asname", "module", "level", "kind"}
    | {
        "conversion",
        "is_async",
        "type_comment",
        "type_ignores",
        "kwd_attrs",
        "rest",
        "tag",
        "lineno",
        "simple",
    }
)
_FIELDS: dict[type, tuple[str, ...]] = {ast.Constant: (), ast.MatchSingleton: (), ast.Name: ()}


@dataclass
class _Addition:
    """``target += added`` (or ``target = target + added``, ``target.append(added)``)."""

    frames: Frames
    target: str  # dotted text; a subscript's base followed by "[]" (never equal to a dotted key)
    added: ast.AST


@dataclass
class _Scope:
    """What one scope of ``FileModel`` holds inside loops that TL302's check reads."""

    is_class: bool
    additions: list[_Addition] = field(default_factory=list)
    # the backward calls (``x.backward()``, ``fabric.backward(x)``): their frames and loss keys
    backwards: list[tuple[Frames, list[str]]] = field(default_factory=list)
    # calls by name that may run a helper of this file (frames, callee, loss-named argument keys)
    helper_calls: list[tuple[Frames, str, list[str]]] = field(default_factory=list)
    # ``key = self.method(...)`` (frames, method, key): with a project, the method may return its loss
    method_losses: list[tuple[Frames, str, str]] = field(default_factory=list)
    # ``for value in losses.values()`` / ``for name, value in losses.items()``: (losses, value)
    unpacks: list[tuple[str, str]] = field(default_factory=list)
    # names and dotted chains inside the scope's backward calls: a total among them is backpropagated
    in_backward: set[str] = field(default_factory=set)
    # ``key = call(...)`` (frames, key, call): with a project, the call may return the loss it
    # backpropagated (``backward_losses``)
    assigned_calls: list[tuple[Frames, str, ast.Call]] = field(default_factory=list)


def total_may_hold_loss_graph(tree: ast.Module) -> bool:
    """Whether some addition to a running total may keep a backpropagated loss's graph: an addition
    inside a loop (not the one micro-step loop of a window, its total not named in a backward call of
    its scope) that adds, outside ``.item()``/``.detach()``/``float()``..., a key TL302's
    ``backward_losses`` takes from a backward call of the same scope (its differentiated names; a
    loss-named argument of a call of a helper of this file that runs a backward; with a project, the
    target of ``key = self.method(...)`` where a method of this file calls ``.backward``), the two
    sharing a loop as TL302 asks (the addition in the backward's innermost loop or the reverse), or that
    adds ``self.method(...)`` itself (its returned-loss finding). TL302 reports only such additions,
    and follows helpers the same way; its other conditions (``no_grad``, resets, totals used later)
    are only narrowing, so leaving them out keeps more files, never fewer."""
    return _walk_of(tree).may_fire()


def _walked(tree: ast.Module) -> _Walk:
    walk = _Walk(tree)
    walk.run()
    return walk


_walk_of = of_last_tree(_walked)  # (TL302's three checks: its own findings, the cross-file ones, callees)


class _Walk:
    """One iterative pass over the tree (to the leaves inside loops only) that fills a ``_Scope`` per
    scope; the helpers and methods that loops call are read afterwards, only when called."""

    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.scopes: list[_Scope] = [_Scope(is_class=False)]
        # every function by name, with whether it is a method (defined in a class body)
        self.defs: dict[str, list[tuple[ast.AST, bool]]] = {}
        self.for_iters: dict[int, ast.AST] = {}  # what each ``for`` loop walks, by the loop's id
        self.answers: dict[tuple[str, str], bool] = {}  # helpers and methods read so far
        self.bound: set[str] | None = None  # detaching builtins the file rebinds, read when needed
        # what ``FileModel.qualname`` and ``values_of`` follow, for the whole file (every scope): each
        # name imported with its import targets (as ``FileModel`` binds them), each name assigned a
        # chain with the chains, each name or ``self.x`` assigned a call with its callees' chains, the
        # chains of classes' bases
        self.imports: dict[str, list[str]] = {}
        self.aliases: dict[str, list[str]] = {}
        self.instances: dict[str, list[str]] = {}
        self.bases: set[str] = set()
        self.all_bindings = False  # whether the ``:=`` outside loops were read too (``_named_values``)
        self.reaches_import: dict[str, bool] = {}  # ``_imported``'s answers, until a name is bound anew

    def run(self) -> None:
        # (node, scope index, loops around it)
        stack: list[tuple[ast.AST, int, Frames]] = [(self.tree, 0, ())]
        push = stack.append
        while stack:
            node, scope, frames = stack.pop()
            kind = type(node)
            if kind is ast.Name or kind is ast.Constant:
                continue
            if kind is ast.Call:
                self._call(node, self.scopes[scope], frames)  # type: ignore[arg-type]
            elif kind is ast.For or kind is ast.AsyncFor or kind is ast.While:
                self._loop(node, scope, frames, stack)
                continue
            elif kind is ast.FunctionDef or kind is ast.AsyncFunctionDef or kind is ast.Lambda:
                scope = self._function(node, scope)
            elif kind is ast.ClassDef:
                self.scopes.append(_Scope(is_class=True))
                scope = len(self.scopes) - 1
                self.bases.update(filter(None, map(dotted, node.bases)))  # type: ignore[attr-defined]
            elif kind is ast.AugAssign:
                if type(node.op) is ast.Add:  # type: ignore[attr-defined]
                    self._add(self.scopes[scope], frames, node.target, node.value)  # type: ignore[attr-defined]
            elif kind is ast.Assign:
                self._assign(node, self.scopes[scope], frames)  # type: ignore[arg-type]
            elif kind is ast.AnnAssign or kind is ast.NamedExpr:
                self._bind(node.target, node.value)  # type: ignore[attr-defined]
            elif kind is ast.Import or kind is ast.ImportFrom:
                self._import(node)
            if not frames:  # outside loops: only the statements that hold statements
                for name in _BODIES.get(kind, ()):
                    for statement in getattr(node, name):
                        push((statement, scope, frames))
                continue
            fields = _FIELDS.get(kind)
            if fields is None:
                # (a scalar field this list misses is popped once and walks to nothing)
                fields = _FIELDS[kind] = tuple(f for f in getattr(kind, "_fields", ()) if f not in _NOT_NODES)
            for name in fields:
                value = getattr(node, name)
                if type(value) is list:
                    for item in value:
                        if item is not None:  # (a dict's ``**`` key)
                            push((item, scope, frames))
                elif value is not None:
                    push((value, scope, frames))

    def _function(self, node: ast.AST, scope: int) -> int:
        """Enter a function or lambda: its decorators, defaults and body are sites of its own scope (as
        ``FileModel`` pushes the scope before it visits them)."""
        self.scopes.append(_Scope(is_class=False))
        inner = len(self.scopes) - 1
        if type(node) is not ast.Lambda:
            name: str = node.name  # type: ignore[attr-defined]
            self.defs.setdefault(name, []).append((node, self.scopes[scope].is_class))
        return inner

    def _loop(
        self, node: ast.AST, scope: int, frames: Frames, stack: list[tuple[ast.AST, int, Frames]]
    ) -> None:
        """Push a loop's parts: its ``iter``/``test`` and target in the frames around it, its body and
        ``else:`` each in a frame of its own."""
        loop = id(node)
        if type(node) is ast.While:
            stack.append((node.test, scope, frames))  # type: ignore[attr-defined]
        else:
            source: ast.AST = node.iter  # type: ignore[attr-defined]
            self.for_iters[loop] = source
            self._unpack(self.scopes[scope], source, node.target)  # type: ignore[attr-defined]
            stack.append((source, scope, frames))
            stack.append((node.target, scope, frames))  # type: ignore[attr-defined]
        body = (*frames, (loop, "body"))
        stack.extend((s, scope, body) for s in node.body)  # type: ignore[attr-defined]
        orelse = (*frames, (loop, "orelse"))
        stack.extend((s, scope, orelse) for s in node.orelse)  # type: ignore[attr-defined]

    @staticmethod
    def _unpack(scope: _Scope, source: ast.AST, target: ast.AST) -> None:
        """``for value in losses``, ``for value in losses.values()`` and ``for name, value in
        losses.items()`` (TL302's ``_unpacked``: a plain iteration of the losses too)."""
        value: ast.AST | None = target
        func = source.func if type(source) is ast.Call else None  # type: ignore[attr-defined]
        no_args = func is not None and not source.args and not source.keywords  # type: ignore[attr-defined]
        # (not a function of its own named ``values``)
        if no_args and type(func) is ast.Attribute and func.attr in ("items", "values"):  # type: ignore[union-attr]
            if func.attr == "items":  # type: ignore[union-attr]
                pair = type(target) is ast.Tuple and len(target.elts) == 2  # type: ignore[attr-defined]
                value = target.elts[1] if pair else None  # type: ignore[attr-defined]
                if type(value) is ast.Starred:
                    value = value.value  # type: ignore[attr-defined]
            source = func.value  # type: ignore[union-attr]
        losses, key = dotted(source), dotted(value)
        if losses is not None and key is not None and "." not in key:
            scope.unpacks.append((losses, key))

    @staticmethod
    def _call(node: ast.Call, scope: _Scope, frames: Frames) -> None:
        func = node.func
        name = _last_name(func)
        if name in BACKWARD_NAMES:
            scope.backwards.append((frames, _backward_keys(node)))
            scope.in_backward.update(_names_in(node))
        elif type(func) is ast.Name:
            values = [a.value if type(a) is ast.Starred else a for a in node.args]  # type: ignore[attr-defined]
            keys = [dotted(v) for v in [*values, *(k.value for k in node.keywords)]]
            losses = [k for k in keys if k is not None and "loss" in k.rpartition(".")[2].lower()]
            if losses:
                scope.helper_calls.append((frames, func.id, losses))
        elif name == "append" and len(node.args) + len(node.keywords) == 1:
            added = node.args[0] if node.args else node.keywords[0].value
            if type(added) is ast.Starred:
                added = added.value
            _Walk._add(scope, frames, func.value, added)  # type: ignore[attr-defined]

    def _import(self, node: ast.Import | ast.ImportFrom) -> None:
        """The bindings ``FileModel``'s ``visit_Import``/``visit_ImportFrom`` make, with their targets."""
        for name, target in import_bindings(node):
            self.imports.setdefault(name, []).append(target)
        self.reaches_import.clear()

    @staticmethod
    def _add(scope: _Scope, frames: Frames, target: ast.AST, added: ast.AST) -> None:
        key = _target_key(target)
        if key is not None and frames:  # (TL302 reports only additions inside a loop)
            scope.additions.append(_Addition(frames, key, added))

    def _bind(self, target: ast.AST, value: ast.AST | None) -> None:
        """``name = chain`` (``qualname`` follows it), ``name = call(...)`` and ``self.x = call(...)``
        (``constructed_class`` reads the call)."""
        kind = type(value)
        if type(target) is ast.Name and (kind is ast.Name or kind is ast.Attribute):
            chain = dotted(value)
            if chain is not None:
                self.aliases.setdefault(target.id, []).append(chain)
                self.reaches_import.clear()
        elif kind is ast.Call:
            key = dotted(target)
            if key is not None and (key.count(".") == 0 or (key.startswith("self.") and key.count(".") == 1)):
                callee = dotted(value.func)  # type: ignore[union-attr]
                if callee is not None:
                    self.instances.setdefault(key, []).append(callee)

    def _assign(self, node: ast.Assign, scope: _Scope, frames: Frames) -> None:
        for target in node.targets:
            self._bind(target, node.value)
        if len(node.targets) != 1 or not frames:
            return
        target, value = node.targets[0], node.value
        if type(value) is ast.BinOp and type(value.op) is ast.Add:
            # ``t = t + x`` or ``t = x + t``; both sides where both are the total (kept, never lost)
            if _same_target(value.left, target):
                _Walk._add(scope, frames, target, value.right)
            if _same_target(value.right, target):
                _Walk._add(scope, frames, target, value.left)
        elif type(value) is ast.Call:
            method, key = dotted(value.func), dotted(target)
            if key is not None:
                scope.assigned_calls.append((frames, key, value))
            if (
                key is not None
                and method is not None
                and method.startswith("self.")
                and method.count(".") == 1
            ):
                scope.method_losses.append((frames, method[5:], key))

    def may_fire(self) -> bool:
        for scope in self.scopes:
            if not scope.additions:
                continue
            backwards = list(scope.backwards)
            backwards += [(f, keys) for f, name, keys in scope.helper_calls if self._helper(name)]
            backwards += [(f, [key]) for f, name, key in scope.method_losses if self._loss_method(name)]
            for losses, value in scope.unpacks:
                backwards += [(f, [value]) for f, keys in backwards if losses in keys]
            for addition in scope.additions:
                if self._window(addition.frames):
                    continue
                if self._backpropagated(scope, addition.target):
                    continue
                if self._adds_method_loss(addition.added):
                    return True
                if any(self._adds_loss(addition, f, keys) for f, keys in backwards):
                    return True
        return False

    def kept_project_calls(self) -> Iterator[ast.Call]:
        """The calls of the findings ``backward_returned`` makes (``may_fire`` for them), each as soon
        as found: for an addition (in a loop, not the window's, its total not backpropagated), each call
        it adds, not detached, that may name another file's function, and each call whose key it adds,
        assigned in a loop it shares (or a value unpacked from that key)."""
        for scope in self.scopes:
            if not scope.additions:
                continue
            returned = [(f, [key], call) for f, key, call in scope.assigned_calls]
            for losses, value in scope.unpacks:
                returned += [(f, [value], call) for f, keys, call in returned if losses in keys]
            for addition in scope.additions:
                if self._window(addition.frames) or self._backpropagated(scope, addition.target):
                    continue
                yield from self._added_project_calls(addition.added)
                for f, keys, call in returned:
                    # (the call's callee read last: its names may send ``_imported`` to read the whole tree)
                    if self._adds_loss(addition, f, keys) and self._project_call(call):
                        yield call

    def _added_project_calls(self, added: ast.AST) -> Iterator[ast.Call]:
        """The calls in ``added`` outside a detaching call that may name another file's function
        (TL302's ``_attached_calls`` handed to ``backward_returned``)."""
        stack = [added]
        while stack:
            node = stack.pop()
            if self._detaching(node):
                continue
            if type(node) is ast.Call and self._project_call(node):  # type: ignore[arg-type]
                yield node  # type: ignore[misc]
            stack.extend(ast.iter_child_nodes(node))

    def callee_names(self, call: ast.Call) -> set[str]:
        """The qualified names, rooted at an import, under which ``project_method`` may look up the
        facts of what ``call`` calls: the callee itself (``imported_fact``), ``Base.method`` for
        ``self.method`` and each class base (``own_method``'s inherited facts), and the constructor
        of the instance whose method it is: ``Class`` of ``Class(...).m``, or of ``x.m`` and
        ``self.x.m`` with ``x``/``self.x`` assigned ``Class(...)`` or ``Class.make(...)`` anywhere
        (``constructed_class``; the method's class is that callee or the name it is under)."""
        func = call.func
        out = self._qualnames(dotted(func))
        if not isinstance(func, ast.Attribute):
            return out
        owner = func.value
        if isinstance(owner, ast.Name) and owner.id == "self":
            out |= {f"{name}.{func.attr}" for base in self.bases for name in self._qualnames(base)}
        if isinstance(owner, ast.Call):
            out |= self._qualnames(dotted(owner.func))
        else:
            key = dotted(owner)
            for made in self.instances.get(key, ()) if key is not None else ():
                out |= self._qualnames(made)
        return out

    def _qualnames(self, chain: str | None) -> set[str]:
        """Every name ``FileModel.qualname`` may resolve ``chain`` to through an import: for any import
        or alias of its first name anywhere in the file (aliases followed, none twice on one way)."""
        if chain is None:
            return set()
        head, _, rest = chain.partition(".")
        return {f"{target}.{rest}" if rest else target for target in self._targets(head, (head,))}

    def _targets(self, name: str, way: tuple[str, ...]) -> set[str]:
        """The import targets ``name`` may stand for, along the aliases ``way`` has not passed (up to
        ``qualname``'s depth)."""
        out = set(self.imports.get(name, ()))
        for alias in set(self.aliases.get(name, ())) if len(way) <= 9 else ():
            inner, _, rest = alias.partition(".")
            if inner not in way:
                out |= {f"{t}.{rest}" if rest else t for t in self._targets(inner, (*way, inner))}
        return out

    def _project_call(self, call: ast.Call) -> bool:
        """Whether ``project_method`` may find the callee's facts: a chain whose first name is imported
        (``imported_fact``), ``self.method`` where a method of that name here calls ``.backward`` or a
        class's base is imported (``own_method``), a method of ``Class(...)``, of a name or of
        ``self.x`` assigned ``Class(...)`` or ``Class.make(...)`` (``constructed_class``)."""
        func = call.func
        if self._imported(_head(func)):
            return True
        if type(func) is not ast.Attribute:
            return False
        owner = func.value  # type: ignore[attr-defined]
        if type(owner) is ast.Name and owner.id == "self":  # type: ignore[attr-defined]
            if self._loss_method(func.attr) or any(self._imported(_first(b)) for b in self.bases):  # type: ignore[attr-defined]
                return True
        if type(owner) is ast.Call:
            return self._imported(_head(owner.func))  # type: ignore[attr-defined]
        key = dotted(owner)
        return key is not None and self._instance(key)

    def _imported(self, name: str | None) -> bool:
        """``qualname`` may resolve the name to an import: it is imported, or assigned a chain whose
        first name is (up to ``qualname``'s depth of 9 aliases)."""
        if name is None:
            return False
        if name not in self.reaches_import:
            self.reaches_import[name] = self._alias_reaches_import(name)
        if self.reaches_import[name] or self.all_bindings:
            return self.reaches_import[name]
        self._named_values()
        return self._imported(name)

    def _alias_reaches_import(self, name: str) -> bool:
        """Whether an imported name is at most 9 aliases away from ``name`` (breadth first: each name
        once, at its least distance; following every way there took 44 million calls on one torch file)."""
        seen, layer = {name}, [name]
        for _distance in range(10):
            if any(n in self.imports for n in layer):
                return True
            layer = [f for n in layer for f in map(_first, self.aliases.get(n, ())) if f not in seen]
            seen.update(layer)
        return False

    def _instance(self, key: str) -> bool:
        """``values_of`` may find ``Class(...)`` (or ``Class.make(...)``) assigned to ``key`` (a name or
        ``self.x``), the class's first name imported (``constructed_class``)."""
        if any(self._imported(_first(c)) for c in self.instances.get(key, ())):
            return True
        if not self.all_bindings:
            self._named_values()
            return self._instance(key)
        return False

    def _named_values(self) -> None:
        """Read the ``name := value`` the walk did not reach (outside loops), once: asked only when a
        name resolves to nothing the rest of the file binds (a second walk, of the whole tree)."""
        self.all_bindings = True
        stack: list[ast.AST] = [self.tree]
        while stack:
            node = stack.pop()
            kind = type(node)
            if kind is ast.Name or kind is ast.Constant:
                continue
            if kind is ast.NamedExpr:
                self._bind(node.target, node.value)  # type: ignore[attr-defined]
            fields = _FIELDS.get(kind)
            if fields is None:
                fields = _FIELDS[kind] = tuple(f for f in getattr(kind, "_fields", ()) if f not in _NOT_NODES)
            for name in fields:
                value = getattr(node, name)
                if type(value) is list:
                    stack.extend(item for item in value if item is not None)
                elif value is not None:
                    stack.append(value)

    def _helper(self, name: str) -> bool:
        """A function of this file by that name calls a backward in its own scope (not in a function,
        lambda or class nested in it): TL302's ``backward_calls`` follows a call of it by name."""
        if ("helper", name) not in self.answers:
            self.answers["helper", name] = any(_calls_backward(node) for node, _ in self.defs.get(name, ()))
        return self.answers["helper", name]

    def _loss_method(self, name: str) -> bool:
        """A method of this file by that name calls ``.backward()``: with a project, the file's own summary
        may say it returns its loss (``own_method``)."""
        if ("method", name) not in self.answers:
            self.answers["method", name] = any(
                is_method and any(_is_attribute_backward(n) for n in ast.walk(node))
                for node, is_method in self.defs.get(name, ())
            )
        return self.answers["method", name]

    def _window(self, frames: Frames) -> bool:
        """The addition's only loop is a ``for`` over a step count, the micro-step loop of one window
        (TL302's ``_window_loop``: it skips the addition)."""
        source = self.for_iters.get(frames[0][0]) if len(frames) == 1 else None
        return source is not None and any(is_step_count_name(n.rpartition(".")[2]) for n in _names_in(source))

    @staticmethod
    def _backpropagated(scope: _Scope, target: str) -> bool:
        """The total is named in a backward call of its scope (TL302's ``_total_is_backpropagated``, from
        the backward calls inside loops only: fewer names, fewer additions skipped)."""
        head = target.partition(".")[0].partition("[")[0]
        return (head != "self" and head in scope.in_backward) or target in scope.in_backward

    def _adds_loss(self, addition: _Addition, backward: Frames, keys: list[str]) -> bool:
        """One loop holds both (the backward in the addition's innermost loop, or the reverse) and a
        key of the backward other than the total is added outside any detaching call."""
        frames = addition.frames
        mine, theirs = _innermost(frames), _innermost(backward)
        if not ((mine is not None and mine in backward) or (theirs is not None and theirs in frames)):
            return False
        return any(key != addition.target and self._attached(addition.added, key) for key in keys)

    def _attached(self, added: ast.AST, key: str) -> bool:
        """``key`` occurs in ``added`` outside a detaching call, as TL302's ``_references`` finds it:
        as a dotted chain, or as any single name libcst holds as a ``Name`` (an attribute, a keyword,
        a lambda's parameter)."""
        stack = [(added, False)]
        while stack:
            node, detached = stack.pop()
            if dotted(node) == key:
                if not detached:
                    return True
                continue
            detached = detached or self._detaching(node)
            kind = type(node)
            if kind is ast.Attribute:
                if node.attr == key and not detached:  # type: ignore[attr-defined]
                    return True
                stack.append((node.value, detached))  # type: ignore[attr-defined]
                continue
            if (kind is ast.keyword or kind is ast.arg) and node.arg == key and not detached:  # type: ignore[attr-defined]
                return True
            stack.extend((child, detached) for child in ast.iter_child_nodes(node))
        return False

    def _adds_method_loss(self, added: ast.AST) -> bool:
        """``self.method(...)`` in ``added`` outside a detaching call, the method one of this file's
        that calls ``.backward()`` (with a project, TL302's ``_returned_loss``)."""
        stack = [added]
        while stack:
            node = stack.pop()
            if self._detaching(node):
                continue
            if type(node) is ast.Call:
                func = dotted(node.func)  # type: ignore[attr-defined]
                if func is not None and func.startswith("self.") and self._loss_method(func[5:]):
                    return True
            stack.extend(ast.iter_child_nodes(node))
        return False

    def _detaching(self, node: ast.AST) -> bool:
        """TL302's ``_is_detaching``; a builtin only where the file never binds its name."""
        kind = type(node)
        if kind is ast.Call:
            func = node.func  # type: ignore[attr-defined]
            if type(func) is ast.Attribute:
                return func.attr in _DETACHING_METHODS
            if type(func) is not ast.Name or func.id not in _DETACHING_BUILTINS:
                return False
            if self.bound is None:
                self.bound = _bound_builtins(self.tree)
            return func.id not in self.bound
        return kind is ast.Attribute and node.attr == "data"  # type: ignore[attr-defined]


def returned_loss_may_be_kept(tree: ast.Module) -> bool:
    """Whether a running total may keep a loss another file's function backpropagated and returned
    (TL302's findings through ``backward_returned``; ``Rule.project_gate_check``): an addition inside a
    loop (not the one micro-step loop of a window, its total not named in a backward call of its scope)
    that adds, outside ``.item()``/``.detach()``/``float()``..., a call ``project_method`` may resolve
    (``total += step(b)``, ``losses.append(self.trainer.step(b))``), or the key of ``key = call(...)``
    (such a call, in the scope) the two sharing a loop as TL302 asks (or a value unpacked from the
    key by ``.items()``/``.values()``). What another file's summary holds is unknown here: any callee
    that may name an import, a method of this class or an imported class's instance is kept."""
    return next(_walk_of(tree).kept_project_calls(), None) is not None


def kept_loss_callees(tree: ast.Module) -> frozenset[str]:
    """The qualified names (through the file's imports and aliases, as ``FileModel.qualname`` resolves
    them) under which TL302 may look up another file's function for a cross-file finding
    (``Rule.project_callees``): those of the calls ``returned_loss_may_be_kept`` keeps the file for
    (``_Walk.callee_names``). Only a definition imported through one of these can return the loss a
    finding here rests on; empty where that check holds for no call."""
    walk = _walk_of(tree)
    calls = {id(call): call for call in walk.kept_project_calls()}.values()
    if calls and not walk.all_bindings:
        walk._named_values()  # (every binding of a name counts, those of ``:=`` outside loops too)
    return frozenset(name for call in calls for name in walk.callee_names(call))


def _calls_backward(function: ast.AST) -> bool:
    """A call named ``backward``/``manual_backward`` in the function's own scope: its decorators,
    defaults and body, not a function, lambda or class nested in it."""
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        kind = type(node)
        if (
            kind is ast.FunctionDef
            or kind is ast.AsyncFunctionDef
            or kind is ast.Lambda
            or kind is ast.ClassDef
        ):
            continue
        if kind is ast.Call and _last_name(node.func) in BACKWARD_NAMES:  # type: ignore[attr-defined]
            return True
        stack.extend(ast.iter_child_nodes(node))
    return False


def _is_attribute_backward(node: ast.AST) -> bool:
    """``x.backward(...)``: what the project summary records as a function's ``backward``."""
    return type(node) is ast.Call and type(node.func) is ast.Attribute and node.func.attr == "backward"  # type: ignore[attr-defined]


def _bound_builtins(tree: ast.Module) -> set[str]:
    """The detaching builtins' names the file binds anywhere (assigned, a parameter, imported, defined):
    ``FileModel`` may then resolve a call of one to something else."""
    out = set()
    for node in ast.walk(tree):
        kind = type(node)
        if kind is ast.Name and type(node.ctx) is not ast.Load:  # type: ignore[attr-defined]
            out.add(node.id)  # type: ignore[attr-defined]
        elif kind is ast.arg:
            out.add(node.arg)  # type: ignore[attr-defined]
        elif kind is ast.FunctionDef or kind is ast.AsyncFunctionDef or kind is ast.ClassDef:
            out.add(node.name)  # type: ignore[attr-defined]
        elif kind is ast.alias:
            out.add(node.asname or node.name.partition(".")[0])  # type: ignore[attr-defined]
    return out & _DETACHING_BUILTINS


def _backward_keys(call: ast.Call) -> list[str]:
    """TL302's ``backward_losses`` for one backward call: the names in its first positional argument (or
    its receiver), inside ``scaler.scale(...)``."""
    args = [a for a in call.args if type(a) is not ast.Starred]
    if args:
        expr: ast.AST = args[0]
    elif type(call.func) is ast.Attribute:
        expr = call.func.value
    else:
        return []
    if type(expr) is ast.Call and _last_name(expr.func) == "scale":  # type: ignore[attr-defined]
        inner = [a for a in expr.args if type(a) is not ast.Starred]  # type: ignore[attr-defined]
        if inner:
            expr = inner[0]
    return _value_references(expr)


def _value_references(expr: ast.AST) -> list[str]:
    """TL302's ``_value_references``: the maximal dotted chains that are values (a called function's
    own name is not), and the names libcst holds as ``Name`` outside them (``loss`` of ``f(x).loss``)."""
    out = []
    stack = [expr]
    while stack:
        node = stack.pop()
        key = dotted(node)
        if key is not None:
            out.append(key)
            continue
        kind = type(node)
        if kind is ast.Call:
            func = node.func  # type: ignore[attr-defined]
            if type(func) is ast.Attribute:
                stack.append(func.value)
            stack.extend(node.args)  # type: ignore[attr-defined]
            stack.extend(k.value for k in node.keywords)  # type: ignore[attr-defined]
            continue
        if kind is ast.Attribute:
            out.append(node.attr)  # type: ignore[attr-defined]
        elif kind is ast.arg:
            out.append(node.arg)  # type: ignore[attr-defined]
        stack.extend(ast.iter_child_nodes(node))
    return out


def _names_in(node: ast.AST) -> set[str]:
    """Names, attributes and dotted chains below ``node``: each one libcst's walk finds there too."""
    out = set()
    for inner in ast.walk(node):
        kind = type(inner)
        if kind is ast.Name:
            out.add(inner.id)  # type: ignore[attr-defined]
        elif kind is ast.Attribute:
            out.add(inner.attr)  # type: ignore[attr-defined]
            chain = dotted(inner)
            if chain is not None:
                out.add(chain)
    return out


def _innermost(frames: Frames) -> tuple[int, str] | None:
    """The innermost loop whose body holds the site (an ``else:`` runs once)."""
    for frame in reversed(frames):
        if frame[1] == "body":
            return frame
    return None


def _first(chain: str) -> str:
    """The first name of a dotted chain."""
    return chain.partition(".")[0]


def _head(node: ast.AST) -> str | None:
    """The first name of a Name/Attribute chain (``a`` of ``a.b.c``), else None."""
    while type(node) is ast.Attribute:
        node = node.value  # type: ignore[attr-defined]
    return node.id if type(node) is ast.Name else None  # type: ignore[attr-defined]


def _last_name(func: ast.AST) -> str | None:
    if type(func) is ast.Attribute:
        return func.attr  # type: ignore[attr-defined]
    if type(func) is ast.Name:
        return func.id  # type: ignore[attr-defined]
    return None


def _target_key(target: ast.AST) -> str | None:
    """TL302's ``_target_key``: the dotted total, or a subscript of one (its base then ``[]``)."""
    key = dotted(target)
    if key is None and type(target) is ast.Subscript:
        base = dotted(target.value)  # type: ignore[attr-defined]
        return base + "[]" if base is not None else None
    return key


def _same_target(expr: ast.AST, target: ast.AST) -> bool:
    """The same total: equal dotted text, or subscripts of one base with the same index (CPython's
    structure: every text libcst calls equal has it)."""
    if type(expr) is ast.Subscript and type(target) is ast.Subscript:
        base = dotted(expr.value)  # type: ignore[attr-defined]
        return (
            base is not None
            and base == dotted(target.value)  # type: ignore[attr-defined]
            and ast.dump(expr.slice) == ast.dump(target.slice)  # type: ignore[attr-defined]
        )
    key = dotted(expr)
    return key is not None and key == dotted(target)
