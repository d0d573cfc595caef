"""How the names a running loss total is built from are used after the loop: read as numbers, kept
as tensors, logged or reduced (TL302 asks this before calling a total a leak)."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from trainlint.model import (
    FileModel,
    Scope,
    attr_name,
    children,
    dotted,
    is_number,
)
from trainlint.model.vocab import LOGGING_METHODS

# How the running total is used elsewhere in its scope decides between `.item()` and `.detach()`.
LIST_METHODS = frozenset({"append", "extend", "insert", "clear", "copy", "pop", "remove", "reverse", "count"})


NUMBER_FUNCTIONS = frozenset(
    {
        "builtins.print", "builtins.float", "builtins.int", "builtins.round", "builtins.str",
        "builtins.len", "builtins.format", "builtins.repr", "builtins.bool",
    }
)  # fmt: skip


PASS_THROUGH_FUNCTIONS = frozenset(
    {"builtins.sum", "builtins.min", "builtins.max", "builtins.abs", "builtins.sorted"}
)


NUMBER_MODULES = ("math.", "numpy.", "statistics.")


# Method calls that accept a Python number as well as a tensor (loggers, progress bars, formatting).
TENSOR_WORDS = ("reduce", "gather", "broadcast", "tensor", "stack", "sync")


NOT_REFERENCES = (cst.Param, cst.FunctionDef, cst.ClassDef, cst.ImportAlias, cst.AsName, cst.NameItem)


def parent_map(root: cst.CSTNode) -> dict[int, cst.CSTNode]:
    """Parent of every syntax node of ``root``'s own scope (nested defs, classes, lambdas are not
    entered), keyed by ``id``."""
    out: dict[int, cst.CSTNode] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        for child in children(node):
            out[id(child)] = node
            if not isinstance(child, cst.FunctionDef | cst.ClassDef | cst.Lambda):
                stack.append(child)
    return out


def name_references(parents: dict[int, cst.CSTNode], root: cst.CSTNode) -> dict[str, list[cst.Name]]:
    out: dict[str, list[cst.Name]] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        for child in children(node):
            if isinstance(child, cst.FunctionDef | cst.ClassDef | cst.Lambda):
                continue
            if isinstance(child, cst.Name):
                parent = parents.get(id(child))
                if isinstance(parent, NOT_REFERENCES) or (
                    isinstance(parent, cst.Attribute) and parent.attr is child
                ):
                    continue
                if isinstance(parent, cst.Arg) and parent.keyword is child:
                    continue
                out.setdefault(child.value, []).append(child)
            stack.append(child)
    return out


@dataclass
class Uses:
    """What the uses of a running total in its scope allow: ``kinds`` holds ``number`` (works with a
    Python float), ``tensor`` (needs a tensor), ``escape`` (leaves the scope: returned, stored on an
    object or in a container) and ``unknown``."""

    model: FileModel
    scope: Scope
    parents: dict[int, cst.CSTNode]
    names: dict[str, list[cst.Name]]

    def of_total(self, target: str, is_list: bool) -> set[str]:
        scope = self.scope
        if "." in target or "[" in target:
            return {"escape"}  # self.total, stats["loss"]: visible beyond the scope
        bindings = scope.bindings.get(target)
        if not bindings or target in scope.global_names or target in scope.nonlocal_names:
            return {"escape"}
        kinds: set[str] = set()
        for binding in bindings:
            if binding.kind == "param":
                kinds.add("escape")
            elif binding.kind != "assign":
                kinds.add("unknown")
            elif not self._self_update(binding.value, target):
                kinds.add(self._initial(binding.value, is_list))
        for name in self.names.get(target, ()):
            kinds.add(self._use(name, target, is_list, 0))
        kinds.discard("write")
        return kinds

    def _initial(self, value: cst.BaseExpression | None, is_list: bool) -> str:
        if is_list:
            return "number" if isinstance(value, cst.List) and not value.elements else "unknown"
        if is_number(value):
            return "number"
        if isinstance(value, cst.Call) and (self.model.qualname(value.func, self.scope) or "").startswith(
            "torch."
        ):
            return "tensor"
        return "unknown"

    @staticmethod
    def _self_update(value: cst.BaseExpression | None, target: str) -> bool:
        return isinstance(value, cst.BinaryOperation) and target in (dotted(value.left), dotted(value.right))

    def _use(self, node: cst.CSTNode, target: str, is_list: bool, depth: int) -> str:
        parents = self.parents
        current = node
        element = not is_list  # the value in hand is a number or a tensor, not the list holding them
        for _ in range(64):
            parent = parents.get(id(current))
            if parent is None:
                return "unknown"
            if isinstance(parent, cst.Attribute):
                return "number" if not element and parent.attr.value in LIST_METHODS else "tensor"
            if isinstance(parent, cst.Subscript) and parent.value is current:
                if element:
                    return "tensor"
                element = True
            elif isinstance(parent, cst.BinaryOperation | cst.UnaryOperation) and element:
                pass
            elif isinstance(parent, cst.IfExp) and parent.test is not current:
                pass
            elif isinstance(
                parent, cst.Element | cst.DictElement | cst.List | cst.Tuple | cst.Dict | cst.Set
            ):
                pass  # a display holding the value: what happens to the display decides
            elif isinstance(parent, cst.Arg):
                call = parents.get(id(parent))
                if not isinstance(call, cst.Call):
                    return "unknown"
                kind = self._call(call)
                if kind != "through":
                    return kind
                parent, element = call, True
            elif isinstance(parent, cst.AugAssign | cst.AssignTarget):
                return "write" if getattr(parent, "target", None) is current else "unknown"
            elif isinstance(parent, cst.Assign):
                return self._assigned(parent, target, not element, depth)
            elif isinstance(parent, cst.Return | cst.Yield):
                return "escape"
            elif isinstance(
                parent, cst.Comparison | cst.ComparisonTarget | cst.FormattedStringExpression | cst.Expr
            ):
                return "number"
            elif isinstance(parent, cst.If | cst.While | cst.IfExp | cst.Assert):
                return "number"  # as a condition
            else:
                return "unknown"
            current = parent
        return "unknown"

    def _assigned(self, assign: cst.Assign, target: str, is_list: bool, depth: int) -> str:
        targets = [t.target for t in assign.targets]
        if not all(isinstance(t, cst.Name) for t in targets):
            return "escape"  # self.loss = total, metrics["loss"] = total
        if any(t.value == target for t in targets):  # type: ignore[union-attr]
            return "write"  # total = total + ...
        if depth >= 2:
            return "unknown"
        kinds = {
            self._use(ref, t.value, is_list, depth + 1)  # type: ignore[union-attr]
            for t in targets
            for ref in self.names.get(t.value, ())  # type: ignore[union-attr]
        } - {"write"}
        for worst in ("escape", "tensor", "unknown"):
            if worst in kinds:
                return worst
        return "number"

    def _call(self, call: cst.Call) -> str:
        callee = self.model.qualname(call.func, self.scope) or ""
        name = (attr_name(call) or "").lower()
        if callee.startswith("torch.") or any(word in name for word in TENSOR_WORDS):
            return "tensor"
        if callee in PASS_THROUGH_FUNCTIONS:
            return "through"
        if callee in NUMBER_FUNCTIONS or callee.startswith(NUMBER_MODULES):
            return "number"
        if isinstance(call.func, cst.Attribute) and name in LOGGING_METHODS:
            return "number"
        return "unknown"
