"""Step windows: runs of the user's statements cut out of a function body, and how their free names
are bound (roles, local constants, module-level definitions, argparse defaults, or unbound)."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import libcst as cst

from trainlint.model import (
    FileModel,
    Scope,
    attr_name,
    dotted,
    int_value,
    positional,
    receiver,
    split_lines,
    walk,
)
from trainlint.verify.context import TextEdit
from trainlint.verify.source import Carry, NotExecutable, Tree, analyse_names, is_literal, own_module
from trainlint.verify.values import argparse_defaults, file_value, runtime_read


@dataclass(frozen=True)
class Region:
    """Whole source lines ``start``..``end`` (1-based, inclusive) holding consecutive statements."""

    start: int
    end: int


def statements_region(model: FileModel, first: cst.CSTNode, last: cst.CSTNode) -> Region:
    return Region(model.position(first).start.line, model.position(last).end.line)


def region_text(source: str, region: Region, edits: list[TextEdit] = ()) -> str:  # type: ignore[assignment]
    """The region's lines with the edits that fall inside it applied, dedented."""
    from trainlint.verify.context import apply_text_edits

    lines = split_lines(source, keepends=True)[region.start - 1 : region.end]
    text = "".join(lines)
    if not text.endswith("\n"):
        text += "\n"
    inside = [
        TextEdit(e.line - region.start + 1, e.column, e.end_line - region.start + 1, e.end_column, e.content)
        for e in edits
        if region.start <= e.line and e.end_line <= region.end
    ]
    if inside:
        text = apply_text_edits(text, inside)
    return textwrap.dedent(text)


def window_code(source: str, regions: list[Region], edits: list[TextEdit] = ()) -> str:  # type: ignore[assignment]
    code = "".join(region_text(source, r, list(edits)) for r in regions)
    try:
        cst.parse_module(code)
    except cst.ParserSyntaxError as exc:
        raise NotExecutable(f"the step window cannot be cut out of the function: {exc.message}") from exc
    return code


def step_window(tree: Tree, start: cst.CSTNode, clip_like: cst.CSTNode, end: cst.CSTNode) -> list[Region]:
    """Regions for: the statement holding ``start`` (a backward), then the statements of the block
    that holds ``clip_like`` from it through the statement holding ``end`` (and a directly following
    ``*.update()`` statement). When ``start`` is in that same block, one region from it."""
    model = tree.model
    body, i_clip, i_end = tree.common_block(clip_like, end)
    last = i_end
    if last + 1 < len(body) and _is_update_statement(body[last + 1]):
        last += 1
    start_stmt = tree.statement_of(start)
    ids = [id(s) for s in body]
    if id(start_stmt) in ids and ids.index(id(start_stmt)) <= i_clip:
        return [statements_region(model, start_stmt, body[last])]
    # the backward sits in an inner loop or branch (micro-steps): its statement alone, once per step
    return [
        statements_region(model, start_stmt, start_stmt),
        statements_region(model, body[i_clip], body[last]),
    ]


def _is_update_statement(stmt: cst.CSTNode) -> bool:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        expr = stmt.body[0]
        if isinstance(expr, cst.Expr) and isinstance(expr.value, cst.Call):
            return attr_name(expr.value) == "update"
    return False


# --------------------------------------------------------------------------------------------------
# binding free names


# the names an argparse namespace goes by
ARGS_NAMES = frozenset({"args", "opt", "opts", "cfg", "config", "hparams"})


@dataclass
class Binder:
    """Chooses a binding for each free name of a window, in order: roles given by the probe, a
    single safe local value in the function, a module-level definition, an argparse-backed
    ``args`` object; anything else stays unbound (and is reported if the window uses it)."""

    model: FileModel
    scope: Scope
    roles: dict[str, str] = field(default_factory=dict)  # dotted name -> expression text
    carry: Carry | None = None
    lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unbound: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.carry is None:
            self.carry = Carry(self.model)

    @property
    def lines_for(self) -> set[str]:
        """Names the set-up lines bind already."""
        return {line.split(" = ", 1)[0] for line in self.lines if " = " in line}

    def local_value(self, name: str) -> str | None:
        values = self.model.values_of(cst.Name(name), self.scope) if self.scope.kind != "module" else []
        binding = self.model.lookup(name, self.scope)
        if binding is not None and binding.kind == "param" and isinstance(binding.node, cst.Param):
            default = binding.node.default
            if default is not None and is_literal(default):
                return self.model.code(default)
        if len(values) == 1 and self.carry is not None and self.carry.safe_value(values[0]):
            if all(self._bindable(n) for n in analyse_names(f"_ = {self.model.code(values[0])}\n").free):
                return self.model.code(values[0])
        return None

    def runtime_value(self, name: str) -> str | None:
        """How the function reads ``name`` from a config at run time (``conf["trainer"]["clip"]``),
        when that is its only value."""
        if self.scope.kind == "module":
            return None
        values = self.model.values_of(cst.Name(name), self.scope)
        return runtime_read(self.model, values[0]) if len(values) == 1 else None

    def _bindable(self, name: str) -> bool:
        """A name a local value may read: a role, a module-level name, or the argparse namespace when
        the file holds its defaults (``use_fp16 = args.precision == "fp16"``)."""
        if name in self.roles or self.model.module_scope.bindings.get(name) is not None:
            return True
        return name in ARGS_NAMES and bool(argparse_defaults(self.model))

    def bind(self, names: list[str], attrs: list[str]) -> None:
        """Append set-up lines binding ``names`` (attribute chains in ``attrs`` refine objects)."""
        heads: dict[str, list[str]] = {}
        for role in self.roles:
            head = role.split(".")[0]
            heads.setdefault(head, []).append(role)
        defaults = argparse_defaults(self.model)
        for name in names:
            if name in self.roles:
                self.lines.append(f"{name} = {self.roles[name]}")
                continue
            if name in heads:
                self.lines.append(f"{name} = __tl__.Config({name!r})")
                for role in heads[name]:
                    self.lines.append(f"{role} = {self.roles[role]}")
                self._args_fields(name, attrs, defaults)
                continue
            value = self.local_value(name)
            if value is not None:
                read = analyse_names(f"_ = {value}\n")
                for inner in read.free:
                    assert self.carry is not None
                    if (
                        inner not in self.roles
                        and not self.carry.carry(inner)
                        and inner not in self.lines_for
                    ):
                        self.bind([inner], read.attrs)  # the argparse namespace, with its defaults
                self.lines.append(f"{name} = {value}")
                continue
            assert self.carry is not None
            if self.carry.carry(name):
                continue
            read = self.runtime_value(name)
            if read is not None:
                # a setting read from a config at run time: a small value chosen by its name
                self.lines.append(f"{name} = __tl__.arg({name!r})")
                self.notes.append(f"`{name}` is read at run time (`{read}`): its value is chosen by name")
                continue
            fields = [a for a in attrs if a.startswith(name + ".")]
            if fields and (
                defaults
                or name in ("args", "cfg", "config", "opt", "self")
                or any(file_value(self.model, self.scope, a) is not None for a in fields)
            ):
                self.lines.append(f"{name} = __tl__.Config({name!r})")
                self._args_fields(name, attrs, defaults)
                continue
            self.unbound.append(name)
            self.lines.append(f"{name} = __tl__.Unbound({name!r})")

    def _args_fields(self, name: str, attrs: list[str], defaults: dict[str, str]) -> None:
        """Fields of a settings object (``args.max_norm``, ``self.clip_at``, ``self.config.clip``) set
        to the file's own values; the objects in between are built as settings objects."""
        for attr in attrs:
            head, _, rest = attr.partition(".")
            if head != name or not rest or any(attr.startswith(r + ".") or attr == r for r in self.roles):
                continue
            found = file_value(self.model, self.scope, attr)
            if found is None:
                continue
            if "." in rest:
                self.lines.append(f"__tl__.set_path({head}, {rest!r}, {found.code})")
            else:
                self.lines.append(f"{attr} = {found.code}")
            self.notes.append(found.note(attr))


def optimizer_construction(
    model: FileModel, call: cst.Call, scope: Scope, params: str, strict: bool = False
) -> tuple[str, str]:
    """The user's optimizer class with its keyword hyper-parameters, over ``params``. Literal values
    are kept; other values are kept as written when ``strict`` (their names are then bound or
    reported), else dropped for the class default. Returns (code, description)."""
    callee = model.qualname(call.func, scope)
    if callee is None:
        raise NotExecutable(f"the optimizer class `{model.code(call.func)}` cannot be resolved")
    sharded = callee.endswith(".ZeroRedundancyOptimizer")
    if sharded:
        # on one rank ZeRO is its inner optimizer over all the parameters
        callee = _zero_inner_class(model, call, scope)
    module, _, cls = callee.rpartition(".")
    kwargs = []
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value not in ("params", *ZERO_OPTIONS):
            if is_literal(arg.value) or strict:
                kwargs.append(f"{arg.keyword.value}={model.code(arg.value)}")
    pos = positional(call)
    if len(pos) > 1 and (is_literal(pos[1]) or strict) and not any(k.startswith("lr=") for k in kwargs):
        kwargs.append(f"lr={model.code(pos[1])}")
    if not any(k.startswith("lr=") for k in kwargs) and cls in ("SGD",):
        kwargs.append("lr=0.01")
    code = f"__import__({module!r}, fromlist=[{cls!r}]).{cls}({params}{''.join(', ' + k for k in kwargs)})"
    own = (
        own_module(model.path, cst.parse_statement(f"from {module} import {cls}").body[0], module)
        if module
        else None
    )
    if own is not None:  # the user's own optimizer class, imported from the project's folder
        code = f"(__tl__.on_path({own[0]!r}), {code})[1]"
    described = f"{cls}({', '.join(kwargs)})"
    if sharded:
        described = f"ZeroRedundancyOptimizer on one rank, that is {described}"
    return code, described


# ZeroRedundancyOptimizer's own options; the rest are its inner optimizer's
ZERO_OPTIONS = ("optimizer_class", "process_group", "parameters_as_bucket_view", "overlap_with_ddp")


def _zero_inner_class(model: FileModel, call: cst.Call, scope: Scope) -> str:
    """The torch optimizer class a ``ZeroRedundancyOptimizer`` wraps (``optimizer_class=``, or a
    name bound to torch optimizer classes: the last one the file assigns); AdamW when not known."""
    from trainlint.model import keyword

    kw = keyword(call, "optimizer_class")
    if kw is not None:
        candidates = [kw.value, *model.values_of(kw.value, scope)]
        names = [model.qualname(c, scope) for c in candidates if isinstance(c, cst.Name | cst.Attribute)]
        torch_classes = [n for n in names if n and n.startswith("torch.optim.")]
        if torch_classes:
            return torch_classes[-1]
    return "torch.optim.AdamW"


def parameters_receivers(expr: cst.CSTNode) -> list[str]:
    """Dotted receivers of ``.parameters()`` / ``.named_parameters()`` calls inside ``expr``."""
    out = []
    for node in walk(expr):
        if isinstance(node, cst.Call) and attr_name(node) in ("parameters", "named_parameters"):
            key = dotted(receiver(node))
            if key and key not in out:
                out.append(key)
    return out


def accumulation_count(model: FileModel, scope, divisor: cst.BaseExpression) -> tuple[int, list[str]]:
    """K as the file defines it (a literal, a local constant or parameter default, an argparse
    default), else 4, with a note saying where it came from."""
    text = model.code(divisor)
    if isinstance(divisor, cst.Integer):
        return int(divisor.value), []
    candidates = []
    if isinstance(divisor, cst.Name):
        value = Binder(model, scope).local_value(divisor.value)
        if value is not None and value.isdigit():
            return int(value), []
        values = model.values_of(divisor, scope)
        if len(values) == 1 and int_value(values[0], arithmetic=True) is not None:
            return int(int_value(values[0], arithmetic=True)), []  # type: ignore[arg-type]
        if len(values) == 1 and dotted(values[0]):
            candidates.append(dotted(values[0]) or "")
        candidates.append(text)  # a module constant unpacked from a tuple (ACCUM, SEQ = 4, 12)
    elif dotted(divisor):
        candidates.append(text)
    for candidate in candidates:
        found = file_value(model, scope, candidate)
        if found is not None and found.code.isdigit():
            return int(found.code), [found.note(candidate)]
    return 4, [f"`{text}` taken as 4 (its value is not in the file)"]


# --------------------------------------------------------------------------------------------------
# names a window uses in one way only


def context_only_names(code: str) -> set[str]:
    """Names the code uses only as the context expression of a ``with`` (``with ctx:``)."""
    module = cst.parse_module(code)
    as_context: set[int] = set()
    for node in walk(module):
        if isinstance(node, cst.WithItem) and isinstance(node.item, cst.Name):
            as_context.add(id(node.item))
    names = {n.value for n in walk(module) if isinstance(n, cst.Name) and id(n) in as_context}
    for node in walk(module):
        if isinstance(node, cst.Name) and node.value in names and id(node) not in as_context:
            names.discard(node.value)
    return names


def clip_threshold_names(code: str) -> set[str]:
    """Names passed as the threshold of ``clip_grad_norm_``/``clip_grad_value_`` (second argument or
    ``max_norm=``/``clip_value=``)."""
    out: set[str] = set()
    for node in walk(cst.parse_module(code)):
        if not isinstance(node, cst.Call) or attr_name(node) not in ("clip_grad_norm_", "clip_grad_value_"):
            continue
        for position, arg in enumerate(node.args):
            keyword = arg.keyword.value if arg.keyword is not None else None
            if (keyword in ("max_norm", "clip_value") or (keyword is None and position == 1)) and isinstance(
                arg.value, cst.Name
            ):
                out.add(arg.value.value)
    return out


def unpacked_only_names(code: str) -> set[str]:
    """Names the code uses only as ``**name`` in a call."""
    module = cst.parse_module(code)
    unpacked = {id(a.value) for a in walk(module) if isinstance(a, cst.Arg) and a.star == "**"}
    names = {n.value for n in walk(module) if isinstance(n, cst.Name) and id(n) in unpacked}
    for node in walk(module):
        if isinstance(node, cst.Name) and node.value in names and id(node) not in unpacked:
            names.discard(node.value)
    return names


# containers a running total starts as (``totals = defaultdict(float)``)
CONTAINERS = frozenset({"dict", "list", "defaultdict", "collections.defaultdict", "OrderedDict"})


def start_value(value: cst.BaseExpression) -> bool:
    """A literal, or an empty container whose default is a builtin (``defaultdict(float)``)."""
    if is_literal(value):
        return True
    if not isinstance(value, cst.Call) or dotted(value.func) not in CONTAINERS:
        return False
    return all(
        is_literal(a.value)
        or (isinstance(a.value, cst.Name) and a.value.value in ("float", "int", "list", "dict"))
        for a in value.args
    )


def output_key(expr: cst.BaseExpression, root: cst.CSTNode) -> str | None:
    """The string key the loss is read by from the value ``root`` names (``output["loss"]``)."""
    for node in walk(expr):
        if isinstance(node, cst.Subscript) and node.value is root and len(node.slice) == 1:
            index = node.slice[0].slice
            if isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString):
                value = index.value.evaluated_value
                return value if isinstance(value, str) else None
    return None
