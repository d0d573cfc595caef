"""What TL301's check may ask the project about on its way from a loss to where it is computed
(``TokenEvidence.loss_origin``), read from CPython's tree: the callees of another file it may look up
(``Rule.project_callees``, see ``gate_mean_of_means.token_mean_callees``). Each step errs towards
naming more: a name missed could hide a finding, one too many only keeps the file.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import TYPE_CHECKING

from trainlint.model.gate_calls import enclosing_class, last_name, positional
from trainlint.model.pyast import ast_dotted as dotted
from trainlint.model.vocab import MODEL_WRAPPERS

if TYPE_CHECKING:
    from trainlint.model.gate_mean_of_means import _Facts as Facts
    from trainlint.model.gate_mean_of_means import _Scope as Scope

# ``FileModel.qualname`` gives up past this depth of name-to-name assignments
_ALIAS_DEPTH = 9
# ``TokenEvidence._class_kind``: the loaders read past to the model's class (or builder)
_LOADERS = frozenset({"from_pretrained", "from_config"})


class Names:
    """``FileModel.qualname`` without scopes: every import target a dotted name may resolve to, through
    any import of its first name or any assignment of a plain or dotted name to it (an alias)."""

    def __init__(self, facts: Facts) -> None:
        self.imported = facts.imported
        self.aliases: dict[str, set[str]] = {}
        for node, _ in facts.bound:
            alias = dotted(node.value) if type(node.value) is not ast.Call else None
            for target in node.targets if type(node) is ast.Assign else [node.target]:
                if alias is not None and type(target) is ast.Name:
                    self.aliases.setdefault(target.id, set()).add(alias)
        self._heads: dict[str, set[str]] = {}

    def of(self, path: str | None) -> set[str]:
        if path is None:
            return set()
        head, _, rest = path.partition(".")
        bases = self._heads.get(head)
        if bases is None:
            bases = self._heads[head] = self._resolve(head, (head,))
        return {f"{b}.{rest}" for b in bases} if rest else bases

    def _resolve(self, head: str, path: tuple[str, ...]) -> set[str]:
        """(A name met again on the way resolves to nothing, as past ``qualname``'s depth.)"""
        out = set(self.imported.get(head, ()))
        for alias in self.aliases.get(head, ()) if len(path) <= _ALIAS_DEPTH else ():
            inner, _, rest = alias.partition(".")
            if inner not in path:
                out.update(f"{b}.{rest}" if rest else b for b in self._resolve(inner, (*path, inner)))
        return out


class Traced:
    """What ``TokenEvidence.loss_origin`` may ask the project on its way from a dividend, each step
    weaker than the model's (every assignment of a name in the scope, whatever its order or depth; every
    return of any function of the callee's name): the callees ``_project_origin`` looks up
    (``project_method``: an imported function, ``self.f`` of a base class, a method of an instance of a
    class), and, where the file shows padding (an origin that is no other file's needs it), those
    ``_class_kind`` looks up for the model whose ``.loss``, ``[0]`` or ``a, loss = model(...)`` a loss
    may be: the model's builder (through the model wrappers), or what a local model class calls.

    Steps: ``origin`` (``_origin`` of an expression), ``output`` (``_model_output_origin`` of what a
    ``.loss`` is read from), ``model`` (``_model_kind`` of a callee), ``class`` (``_class_kind`` of a
    call)."""

    def __init__(self, facts: Facts) -> None:
        self.facts = facts
        self.found: set[str] = set()
        self._todo: list[tuple[str, ast.AST, Scope]] = []
        self._seen: set[tuple[str, int, int]] = set()
        self._steps = {
            "origin": self._origin,
            "output": self._output,
            "model": self._model,
            "class": self._class,
        }
        self._functions: dict[str, list[Scope]] = {}
        self._classes: dict[str, list[Scope]] = {}
        self._inner: dict[int, list[Scope]] = {}
        for scope in facts.scopes:
            if scope.kind == "function" or scope.kind == "class":
                named = self._functions if scope.kind == "function" else self._classes
                named.setdefault(scope.name, []).append(scope)
            if scope.parent is not None:
                self._inner.setdefault(id(scope.parent), []).append(scope)

    def add(self, path: str | None) -> None:
        self.found |= self.facts.qualnames.of(path)

    def push(self, step: str, node: ast.AST, scope: Scope) -> None:
        key = (step, id(node), id(scope))
        if key not in self._seen and (step == "origin" or self.facts.padding):
            self._seen.add(key)
            self._todo.append((step, node, scope))

    def run(self) -> None:
        while self._todo:
            step, node, scope = self._todo.pop()
            self._steps[step](node, scope)

    def _origin(self, node: ast.AST, scope: Scope) -> None:
        kind = type(node)
        if kind is ast.Name:
            for statement, _ in scope.assigned.get(node.id, ()):  # type: ignore[attr-defined]
                value = getattr(statement, "value", None)
                if value is None:
                    continue
                self.push("origin", value, scope)
                # ``_tuple_element_origin``: ``a, loss = model(...)``
                if type(value) is ast.Call and not binds_alone(statement, node.id):  # type: ignore[attr-defined]
                    self.push("model", value.func, scope)
            for value in scope.added.get(node.id, ()):  # type: ignore[attr-defined]
                self.push("origin", value, scope)
        elif kind is ast.Attribute:
            if node.attr == "loss":  # type: ignore[attr-defined]
                self.push("output", node.value, scope)  # type: ignore[attr-defined]
        elif kind is ast.Subscript:
            self.push("output", node.value, scope)  # type: ignore[attr-defined]
            self.push("origin", node.value, scope)  # type: ignore[attr-defined]
        elif kind is ast.Call:
            self._call(node, scope)  # type: ignore[arg-type]
        elif kind is ast.BinOp:
            self.push("origin", node.left, scope)  # type: ignore[attr-defined]
            self.push("origin", node.right, scope)  # type: ignore[attr-defined]
        elif kind is ast.Tuple or kind is ast.List:
            for element in node.elts:  # type: ignore[attr-defined]
                self.push("origin", element, scope)

    def _call(self, call: ast.Call, scope: Scope) -> None:
        """``_call_origin``: a method's receiver (``.mean()``, ``.sum()``), ``_project_origin``'s lookup,
        and what a function of the file returns (``_local_function_origin``: ``f(...)``, ``self.f(...)``)."""
        func = call.func
        path = dotted(func)
        self.add(path)  # (``imported_fact``)
        if type(func) is ast.Attribute:
            self.push("origin", func.value, scope)
            if path == f"self.{func.attr}":  # (``own_method``, else ``_inherited_method``)
                owner = enclosing_class(scope)
                for base in owner.bases if owner is not None else ():
                    self.add(f"{base}.{func.attr}")
            receiver = func.value  # (``constructed_class``: an instance of another file's class)
            for value in [receiver] if type(receiver) is ast.Call else self.facts.values.of(receiver, scope):
                self.add(dotted(value.func))  # type: ignore[attr-defined]
        if path is not None and (
            type(func) is ast.Name or (path.count(".") == 1 and path.startswith("self."))
        ):
            for function in self._functions.get(path.rpartition(".")[2], ()):
                for inner in self._within(function):  # (``walk(definition.body)``: nested returns too)
                    for value in inner.returned:
                        self.push("origin", value, function)

    def _output(self, output: ast.AST, scope: Scope) -> None:
        """``_model_output_origin``: the call the output comes from (itself, or a call assigned to it)."""
        calls = [output] if type(output) is ast.Call else []
        if type(output) is ast.Name:
            calls += [getattr(s, "value", None) for s, _ in scope.assigned.get(output.id, ())]  # type: ignore[attr-defined]
        for call in calls:
            if type(call) is ast.Call:
                self.push("model", call.func, scope)  # type: ignore[union-attr]

    def _model(self, func: ast.AST, scope: Scope) -> None:
        """``_model_kind``: the model built inline, or the calls its name or ``self`` attribute holds."""
        for call in [func] if type(func) is ast.Call else self.facts.values.of(func, scope):
            self.push("class", call, scope)

    def _class(self, call: ast.Call, scope: Scope) -> None:
        """``_class_kind``: an imported builder (its model's kind is the other file's fact), a model class
        of the file (whose calls ``_local_class_is_lm`` traces), and what a wrapper wraps (the builder's
        returned callee, unknown here, may be a wrapper too)."""
        func = call.func
        if type(func) is ast.Attribute and func.attr in _LOADERS:
            func = func.value
        path = dotted(func)
        names = self.facts.qualnames.of(path)
        self.found |= names
        for model_class in self._classes.get((path or ".").partition(".")[0], ()):
            for inner in self._within(model_class):
                for inner_call in inner.calls:
                    self.push("origin", inner_call, inner)
        if names or last_name(func) in MODEL_WRAPPERS:
            if type(call.func) is ast.Attribute:
                self.push("model", call.func.value, scope)
            arguments = positional(call)
            if arguments:
                self.push("model", arguments[0], scope)

    def _within(self, scope: Scope) -> Iterator[Scope]:
        """The scope and every scope inside it."""
        todo = [scope]
        while todo:
            current = todo.pop()
            yield current
            todo += self._inner.get(id(current), ())


def binds_alone(statement: ast.AST, name: str) -> bool:
    """``name = ...`` (not ``a, name = ...``)."""
    targets = statement.targets if type(statement) is ast.Assign else [statement.target]  # type: ignore[attr-defined]
    return any(type(t) is ast.Name and t.id == name for t in targets)
