"""Members of the class a flagged method belongs to, for the token probes (TL301, TL502): the class's
own helper methods the loop calls (``self._loss_step(batch)``), run as written, and the ``self.``
attributes they read, built as the class builds them or stood in and named (a loss from a config, a
context manager, a cached tensor, the device)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import libcst as cst

from trainlint.model import FileModel, Scope, dotted, walk
from trainlint.verify.source import analyse_names, code_of, is_literal

# an attribute that holds the loss function (``self._loss_fn``, ``self.criterion``)
LOSS_MEMBER = re.compile(r"loss|criterion", re.IGNORECASE)
TENSOR_FACTORIES = frozenset(
    {"full", "zeros", "ones", "empty", "arange", "tensor", "full_like", "zeros_like"}
)
# settings a cached tensor is sized by: large enough for every batch a probe runs (K microbatches in one)
BATCH_SETTING = re.compile(r"batch_size|micro_batch|bsz")
CACHE_ROWS = 64


@dataclass
class Helper:
    """A method of the class called from the window with token data: it runs as written."""

    name: str  # ``self._loss_step``
    function: str  # the program's name for it
    code: str  # its definition, renamed, without annotations or decorators
    body: cst.Module  # its statements, where the model calls are looked for


@dataclass
class Members:
    """What the programs need for the class's members: definitions to put before the set-up lines,
    roles for the ``self.`` names, and notes naming what was stood in."""

    definitions: list[str] = field(default_factory=list)
    roles: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def code(self) -> str:
        return "".join(d if d.endswith("\n") else d + "\n" for d in self.definitions)


class _Plain(cst.CSTTransformer):
    def leave_Param(self, original_node: cst.Param, updated_node: cst.Param) -> cst.Param:
        return updated_node.with_changes(annotation=None)


def class_method(model: FileModel, scope: Scope, name: str) -> cst.FunctionDef | None:
    """The plain method ``self.<m>`` of the class that holds ``scope`` (not a property)."""
    if not name.startswith("self.") or name.count(".") != 1:
        return None
    cls = scope.enclosing_class
    if cls is None or not isinstance(cls.node, cst.ClassDef):
        return None
    for stmt in cls.node.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == name[5:] and not stmt.decorators:
            return stmt
    return None


def helper(func: cst.FunctionDef, name: str) -> Helper:
    function = f"__tl_helper_{func.name.value.strip('_')}"
    plain = func.visit(_Plain())
    assert isinstance(plain, cst.FunctionDef)
    plain = plain.with_changes(name=cst.Name(function), returns=None, decorators=[], leading_lines=[])
    body = cst.parse_module(code_of(list(func.body.body)))  # type: ignore[attr-defined]
    return Helper(name, function, cst.Module(body=[plain]).code, body)


def _flat(model: FileModel, node: cst.CSTNode) -> str:
    """An expression's code on one line (for a note)."""
    return re.sub(r"([(\[])\s+|\s+(?=[)\]])", r"\1", " ".join(model.code(node).split()))


def helper_role(h: Helper) -> str:
    return f"(lambda *__tl_a__, **__tl_k__: {h.function}(self, *__tl_a__, **__tl_k__))"


def _only_entered(codes: list[str], attr: str) -> bool:
    """``self.<attr>`` appears only as the context of a ``with``."""
    entered = used = 0
    for code in codes:
        module = cst.parse_module(code)
        items = {id(n.item) for n in walk(module) if isinstance(n, cst.WithItem)}
        for node in walk(module):
            if isinstance(node, cst.Attribute) and dotted(node) == attr:
                used += 1
                entered += id(node) in items
    return used > 0 and entered == used


def _assignment(cls: cst.ClassDef, attr: str) -> tuple[cst.FunctionDef, cst.BaseExpression] | None:
    """The method of the class that sets ``self.<attr>`` to a tensor factory, and that value."""
    for stmt in cls.body.body:
        if not isinstance(stmt, cst.FunctionDef):
            continue
        for node in walk(stmt):
            if not isinstance(node, cst.Assign) or len(node.targets) != 1:
                continue
            if dotted(node.targets[0].target) == f"self.{attr}" and isinstance(node.value, cst.Call):
                name = dotted(node.value.func) or ""
                if name.startswith("torch.") and name.rsplit(".", 1)[-1] in TENSOR_FACTORIES:
                    return stmt, node.value
    return None


def member_roles(model: FileModel, scope: Scope, codes: list[str], roles: dict[str, str]) -> Members:
    """Roles for the ``self.<attr>`` members the code reads that the probe does not build already."""
    out = Members()
    cls = scope.enclosing_class
    if cls is None or not isinstance(cls.node, cst.ClassDef):
        return out
    wanted: list[str] = []
    for code in codes:
        for attr in analyse_names(code).attrs:
            parts = attr.split(".")
            if parts[0] == "self" and len(parts) > 1 and parts[1] not in wanted:
                wanted.append(parts[1])
    for attr in wanted:
        _member(model, cls, attr, codes, roles, out, depth=0)
    return out


def _member(model, cls: Scope, attr: str, codes: list[str], roles: dict, out: Members, depth: int) -> None:
    key = f"self.{attr}"
    if key in roles or key in out.roles or any(r.startswith(key + ".") for r in [*roles, *out.roles]):
        return
    values = cls.self_attrs.get(attr, [])
    written = ", ".join(f"`{_flat(model, v)}`" for v in values[:2]) or "nothing in this file"
    if _only_entered(codes, key):
        out.roles[key] = f"__tl__.NullContext({key!r})"
        out.notes.append(f"`{key}` (set to {written}) entered as a no-op context")
    elif LOSS_MEMBER.search(attr) and _torch_loss(model, cls, values) is not None:
        out.roles[key] = _torch_loss(model, cls, values)  # type: ignore[assignment]
        out.notes.append(f"`{key}` built as the class builds it ({written})")
    elif LOSS_MEMBER.search(attr) and not any(is_literal(v) for v in values):
        out.roles[key] = "__tl_torch__.nn.CrossEntropyLoss()"
        out.notes.append(
            f"`{key}` (set to {written}) stood in by CrossEntropyLoss(): a token mean over labels that are not -100"
        )
    elif attr.endswith("device"):
        out.roles[key] = "__tl__.DEVICE"
        out.notes.append(f"`{key}` is the probe's device")
    elif depth < 2:
        found = _assignment(cls.node, attr)  # type: ignore[arg-type]
        if found is not None:
            _cached_tensor(model, cls, attr, found, roles, out, depth)


def _torch_loss(model: FileModel, cls: Scope, values: list) -> str | None:
    """The class's only value of a loss member when it is a torch loss built from literals
    (``nn.CrossEntropyLoss(ignore_index=-100)``), as the program writes it."""
    if len(values) != 1 or not isinstance(values[0], cst.Call):
        return None
    call = values[0]
    callee = model.qualname(call.func, cls) or ""
    if not (callee.startswith("torch.nn.") and callee.endswith("Loss")):
        return None
    if not all(is_literal(a.value) for a in call.args):
        return None
    args = ", ".join(model.code(a).rstrip(", ") for a in call.args)
    return f"__tl_torch__.{callee[len('torch.') :]}({args})"


def _cached_tensor(model, cls: Scope, attr: str, found, roles: dict, out: Members, depth: int) -> None:
    """A tensor the class builds once (``self.ignore_labels_cache = torch.full(...)``), built the same
    way: the method's parameters are settings objects, batch sizes large enough for every batch."""
    method, value = found
    value_code = _flat(model, value)
    names = analyse_names(f"_ = {value_code}\n")
    params = {p.name.value for p in method.params.params} - {"self"}
    lines = []
    settings = []
    for name in names.free:
        if name not in params:
            continue
        lines.append(f"{name} = __tl__.Config({name!r})")
        for path in names.attrs:
            head, _, rest = path.partition(".")
            if head == name and rest and "." not in rest and BATCH_SETTING.search(rest):
                lines.append(f"{path} = {CACHE_ROWS}")
                settings.append(f"`{path}` = {CACHE_ROWS}")
    for path in names.attrs:  # members it reads first (``self._loss_fn.ignore_index``)
        parts = path.split(".")
        if parts[0] == "self" and len(parts) > 1:
            _member(model, cls, parts[1], [f"_ = {value_code}\n"], roles, out, depth + 1)
    function = f"__tl_member_{attr.strip('_')}"
    body = "".join(f"    {line}\n" for line in [*lines, f"return {value_code}"])
    out.definitions.append(f"def {function}(self):\n{body}")
    out.roles[f"self.{attr}"] = f"{function}(self)"
    room = f", with {', '.join(settings)} (room for every batch of the probe)" if settings else ""
    out.notes.append(f"`self.{attr}` built as the class builds it (`{value_code}`){room}")
