"""Reading the user's file for a probe: find the flagged nodes, cut out statements, carry definitions.

Everything here works on the CST of the user's file (through ``FileModel``); nothing is imported or
executed. A name that a snippet needs and that cannot be carried over raises ``NotExecutable``.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst
from libcst.metadata import ExpressionContext, ExpressionContextProvider, MetadataWrapper, ScopeProvider

from trainlint.model import FileModel, Site, children, dotted, walk
from trainlint.rule import Finding
from trainlint.verify import free_names
from trainlint.verify.free_names import Names


class NotExecutable(Exception):
    """The snippet cannot be built: ``str(exc)`` says which name or construct, for ``detail``."""


# --------------------------------------------------------------------------------------------------
# locating nodes


def node_span(model: FileModel, node: cst.CSTNode) -> tuple[int, int, int, int]:
    """(line, column, end_line, end_column), 1-based columns as in findings."""
    pos = model.position(node)
    return pos.start.line, pos.start.column + 1, pos.end.line, pos.end.column + 1


def finding_span(finding: Finding) -> tuple[int, int, int, int]:
    return finding.line, finding.column, finding.end_line, finding.end_column


def _contains(outer: tuple[int, int, int, int], inner: tuple[int, int, int, int]) -> bool:
    return (outer[0], outer[1]) <= (inner[0], inner[1]) and (inner[2], inner[3]) <= (outer[2], outer[3])


def call_site_at(model: FileModel, finding: Finding, accept=lambda site: True) -> Site:
    """The call site the finding points at: an exact match, else the smallest accepted call around it."""
    span = finding_span(finding)
    best: tuple[int, Site] | None = None
    for site in model.calls:
        if not accept(site):
            continue
        where = node_span(model, site.node)
        if where == span:
            return site
        if _contains(where, span):
            size = (where[2] - where[0]) * 10_000 + (where[3] - where[1])
            if best is None or size < best[0]:
                best = (size, site)
    if best is None:
        raise NotExecutable(_why_no_call_site(model, span, finding.line))
    return best[1]


def _why_no_call_site(model: FileModel, span: tuple[int, int, int, int], line: int) -> str:
    """Names the call the finding points at when the probe does not run that kind of call."""
    for site in model.calls:
        if node_span(model, site.node) == span and isinstance(site.node, cst.Call):
            name = dotted(site.node.func) or "the call"
            return f"the flagged call `{name}(...)` at line {line} is not a call this probe runs"
    return f"the flagged call at line {line} was not found in the file"


# --------------------------------------------------------------------------------------------------
# scopes, blocks and statements


def parents(root: cst.CSTNode) -> dict[int, cst.CSTNode]:
    """The parent of every syntax node below ``root`` (by id). Whitespace, comment and punctuation
    nodes are left out: libcst's ``children`` rebuilds them all and cost a sixth of building probes."""
    out: dict[int, cst.CSTNode] = {}
    stack: list[cst.CSTNode] = [root]
    while stack:
        node = stack.pop()
        for child in children(node):
            out[id(child)] = node
            stack.append(child)
    return out


@dataclass
class Tree:
    """Parent links for one module, computed once per file."""

    model: FileModel
    parent: dict[int, cst.CSTNode] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.parent = parents(self.model.module)

    def ancestors(self, node: cst.CSTNode) -> Iterator[cst.CSTNode]:
        current = self.parent.get(id(node))
        while current is not None:
            yield current
            current = self.parent.get(id(current))

    def enclosing_class(self, func: cst.FunctionDef) -> cst.ClassDef | None:
        """The class whose body holds ``func`` directly (a method), else None."""
        body = self.parent.get(id(func))
        owner = self.parent.get(id(body)) if body is not None else None
        if isinstance(owner, cst.ClassDef):
            return owner
        return None

    def statement_of(self, node: cst.CSTNode) -> cst.CSTNode:
        """The innermost statement (simple line or compound statement) holding ``node``."""
        if isinstance(node, cst.SimpleStatementLine | cst.BaseCompoundStatement):
            return node
        for anc in self.ancestors(node):
            if isinstance(anc, cst.SimpleStatementLine | cst.BaseCompoundStatement):
                return anc
        raise NotExecutable("the flagged code is not inside a statement")

    def block_of(self, statement: cst.CSTNode) -> tuple[cst.CSTNode, list[cst.CSTNode]]:
        """The statement list (module body or indented block) that holds ``statement``."""
        owner = self.parent.get(id(statement))
        if isinstance(owner, cst.Module):
            return owner, list(owner.body)
        if isinstance(owner, cst.IndentedBlock):
            return owner, list(owner.body)
        raise NotExecutable("the flagged statement sits in a one-line block")

    def common_block(self, a: cst.CSTNode, b: cst.CSTNode) -> tuple[list[cst.CSTNode], int, int]:
        """The innermost statement list holding both nodes and the indexes of the statements there
        that contain ``a`` and ``b``."""
        chain_a = [self.statement_of(a), *self.ancestors(self.statement_of(a))]
        for stmt in chain_a:
            if not isinstance(stmt, cst.SimpleStatementLine | cst.BaseCompoundStatement):
                continue
            try:
                _, body = self.block_of(stmt)
            except NotExecutable:
                continue
            ids = [id(s) for s in body]
            if id(stmt) not in ids:
                continue
            for stmt_b in [self.statement_of(b), *self.ancestors(self.statement_of(b))]:
                if id(stmt_b) in ids:
                    return body, ids.index(id(stmt)), ids.index(id(stmt_b))
        raise NotExecutable("the statements of the step window are not in one block")


def code_of(nodes: Sequence[cst.CSTNode]) -> str:
    """Source of statements, re-indented to column 0 (libcst keeps indentation relative)."""
    empty = cst.Module(body=[])
    return "".join(empty.code_for_node(n) for n in nodes)


def indent(code: str, prefix: str = "    ") -> str:
    return "".join(prefix + line if line.strip() else line for line in code.splitlines(keepends=True))


# --------------------------------------------------------------------------------------------------
# free names


@functools.lru_cache(maxsize=4096)
def analyse_names(code: str) -> Names:
    """Which names a snippet of statements reads without binding them first (order-aware for the
    top level: ``loss = loss / n`` needs ``loss`` from outside). Cached: treat the result as
    read-only. Answered on CPython's ``ast`` (``free_names``), and by libcst's scope analysis where
    that module cannot be sure to answer the same."""
    return free_names.analyse(code) or analyse_names_cst(code)


def analyse_names_cst(code: str) -> Names:
    """``analyse_names`` on libcst's scope and expression-context metadata: the reference the ``ast``
    version follows, and its fallback."""
    module = cst.parse_module(code)
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    scopes = wrapper.resolve(ScopeProvider)
    contexts = wrapper.resolve(ExpressionContextProvider)
    from libcst.metadata import PositionProvider

    positions = wrapper.resolve(PositionProvider)
    parent = parents(module)
    free: list[str] = []
    assigned: set[str] = set()
    first_store: dict[str, tuple[int, int]] = {}
    loads: list[tuple[tuple[int, int], str, cst.Name]] = []
    for node in walk(module):
        if not isinstance(node, cst.Name):
            continue
        ctx = contexts.get(node)
        scope = scopes.get(node)
        if scope is None:
            continue
        where = (positions[node].start.line, positions[node].start.column)
        up = parent.get(id(node))
        if isinstance(up, cst.AugAssign) and up.target is node:
            loads.append((where, node.value, node))  # ``n += 1`` reads ``n`` first
        if ctx is ExpressionContext.STORE or ctx is ExpressionContext.DEL:
            where = _store_point(node, parent, positions)
            if scope is scopes[module]:
                assigned.add(node.value)
                first_store[node.value] = min(first_store.get(node.value, where), where)
            continue
        if ctx is ExpressionContext.LOAD:
            loads.append((where, node.value, node))
    # defs, classes and imports at the top level bind names too
    for stmt in module.body:
        for name, where in _defined_names(stmt, positions):
            assigned.add(name)
            first_store[name] = min(first_store.get(name, where), where)
    import builtins

    builtin_names = set(dir(builtins))
    attrs: list[str] = []
    for where, name, node in sorted(loads, key=lambda item: item[0]):
        scope = scopes[node]
        if scope is not scopes[module]:
            # inside a nested def/lambda/comprehension: free when no scope on the way binds it
            if _bound_on_the_way(name, scope, scopes[module]):
                continue
            if name in first_store:
                continue  # a top-level name the nested code sees when it runs
        elif name in first_store and first_store[name] < where:
            continue
        if name in builtin_names or name in free:
            continue
        free.append(name)
    for node in walk(module):
        if isinstance(node, cst.Attribute) and contexts.get(node) is ExpressionContext.LOAD:
            path = dotted(node)
            if path and path.split(".")[0] in free and path not in attrs:
                attrs.append(path)
    return Names(free, assigned, attrs)


def _store_point(node: cst.CSTNode, parent: dict[int, cst.CSTNode], positions) -> tuple[int, int]:
    """Where a stored name becomes bound: once its statement's right-hand side has run (``loss = loss
    / n`` reads first), after a ``for``'s iterable."""
    current = node
    while id(current) in parent:
        up = parent[id(current)]
        if isinstance(up, cst.For) and current is up.target:
            end = positions[up.iter].end
            return (end.line, end.column)
        if isinstance(up, cst.BaseSmallStatement | cst.WithItem | cst.NamedExpr):
            end = positions[up].end
            return (end.line, end.column)
        current = up
    start = positions[node].start
    return (start.line, start.column)


def _bound_on_the_way(name: str, scope, top) -> bool:
    """Whether a scope between ``scope`` (a nested def, lambda or comprehension) and ``top`` binds
    ``name``."""
    s = scope
    while s is not None and s is not top:
        if name in s and any(a.scope is s for a in s.assignments[name]):
            return True
        s = s.parent if s.parent is not s else None
    return False


def _defined_names(stmt: cst.CSTNode, positions) -> Iterator[tuple[str, tuple[int, int]]]:
    where = (positions[stmt].start.line, positions[stmt].start.column)
    if isinstance(stmt, cst.FunctionDef | cst.ClassDef):
        yield stmt.name.value, where
    elif isinstance(stmt, cst.SimpleStatementLine):
        for small in stmt.body:
            if isinstance(small, cst.Import):
                for alias in small.names:
                    if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                        yield alias.asname.name.value, where
                    else:
                        yield (dotted(alias.name) or "").split(".")[0], where
            elif isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
                for alias in small.names:
                    if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                        yield alias.asname.name.value, where
                    else:
                        yield dotted(alias.name) or "", where


# --------------------------------------------------------------------------------------------------
# carrying module-level definitions

# a logger is made at module level in most training files; building one has no side effect
SAFE_CALL_PREFIXES = ("torch.", "math.", "builtins.", "functools.partial", "logging.getLogger")
UNSAFE_CALL_PREFIXES = (
    "torch.load",
    "torch.save",
    "torch.hub",
    "torch.distributed",
    "torch.compile",
    "torch.jit",
    "torch.utils.data",
    "torch.cuda",
    "builtins.open",
    "builtins.input",
    "builtins.exec",
    "builtins.eval",
    "builtins.print",
    "builtins.exit",
    "builtins.quit",
    "builtins.__import__",
)
PURE_BUILTINS = {
    "int",
    "float",
    "bool",
    "str",
    "len",
    "range",
    "min",
    "max",
    "abs",
    "round",
    "tuple",
    "list",
    "dict",
    "set",
    "sum",
    "pow",
    "isinstance",
    "getattr",
    "hasattr",
    "zip",
    "enumerate",
    "sorted",
    "reversed",
    "any",
    "all",
    "map",
    "filter",
    "slice",
    "object",
    "super",
    "property",
    "staticmethod",
    "classmethod",
    "type",
    "iter",
    "next",
    "divmod",
}


def is_literal(expr: cst.BaseExpression) -> bool:
    """Numbers, strings, True/False/None and containers or arithmetic of them."""
    if isinstance(expr, cst.Integer | cst.Float | cst.Imaginary | cst.SimpleString | cst.ConcatenatedString):
        return True
    if isinstance(expr, cst.Name):
        return expr.value in ("True", "False", "None")
    if isinstance(expr, cst.UnaryOperation):
        return is_literal(expr.expression)
    if isinstance(expr, cst.BinaryOperation):
        return is_literal(expr.left) and is_literal(expr.right)
    if isinstance(expr, cst.Tuple | cst.List | cst.Set):
        return all(is_literal(e.value) for e in expr.elements if isinstance(e, cst.Element))
    return False


@dataclass
class Carry:
    """Module-level statements a snippet needs, in file order, and what was bound how."""

    model: FileModel
    chunks: dict[object, tuple[int, str]] = field(default_factory=dict)  # id(stmt) -> (order, code)
    names: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)

    def code(self) -> str:
        return "".join(code for _, code in sorted(self.chunks.values()))

    @functools.cached_property
    def _order(self) -> dict[int, int]:
        """File order of module-level statements (and the imports inside them)."""
        out: dict[int, int] = {}
        for index, stmt in enumerate(self.model.module.body):
            out[id(stmt)] = index
            if isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    out[id(small)] = index
        return out

    def _add(self, node: cst.CSTNode, code: str, part: object = None) -> None:
        """Carry ``code`` at the place of ``node``; ``part`` tells apart several names carried from
        one statement (``VOCAB, SEQ = 32, 24``)."""
        key = id(node) if part is None else (id(node), part)
        if key not in self.chunks:
            self.chunks[key] = (self._order.get(id(node), len(self._order)), code)

    def carry(self, name: str, *, allow_values: bool = True) -> bool:
        """Carry the module-level binding of ``name`` (import, def, class, constant). False when the
        module does not bind it in a way that can be carried over."""
        if name in self.names:
            return True
        bindings = self.model.module_scope.bindings.get(name)
        if not bindings:
            return False
        binding = self.model._pick(bindings)
        if binding.kind == "import":
            stmt = binding.node
            self.names.add(name)
            # several names of one import are carried one by one
            line = _import_line(stmt, name)
            own = own_module(self.model.path, stmt, binding.target or name)
            if own is not None:  # the user's own package, imported from the project's folder
                line = re.sub(r"^from \S+ import", f"from {own[1]} import", line)
            self._add(stmt, guarded_import(line, name, binding.target or name, own and own[0]), part=name)
            return True
        if binding.kind in ("def", "class"):
            node = binding.node
            if not isinstance(node, cst.FunctionDef | cst.ClassDef):
                return False
            self.names.add(name)
            code = code_of([node])
            self._add(node, code)
            self.need(analyse_names(code).free, allow_values=allow_values)
            return True
        if binding.kind == "other" and allow_values and len(bindings) == 1:
            value = unpacked_value(binding.node, name)  # VOCAB, SEQ = 32, 12
            if value is None or not self.safe_value(value):
                return False
            self.names.add(name)
            code = f"{name} = {self.model.code(value)}\n"
            self._add(binding.node, code, part=name)
            self.need(analyse_names(code).free, allow_values=allow_values)
            return True
        if binding.kind == "assign" and allow_values:
            assigned = [b for b in bindings if b.kind == "assign"]
            if len(assigned) != 1 or binding.value is None:
                return False
            value = binding.value
            if not self.safe_value(value):
                return False
            self.names.add(name)
            code = f"{name} = {self.model.code(value)}\n"
            self._add(binding.node, code)
            self.need(analyse_names(code).free, allow_values=allow_values)
            return True
        return False

    def need(self, names: Iterable[str], *, allow_values: bool = True) -> list[str]:
        """Carry each name; returns those that could not be carried."""
        missing = []
        for name in names:
            if not self.carry(name, allow_values=allow_values):
                missing.append(name)
        return missing

    def safe_value(self, value: cst.BaseExpression) -> bool:
        """A module-level value that can be evaluated without side effects: literals, arithmetic,
        and calls of torch factories and constructors (never user code, I/O or data loading)."""
        if is_literal(value):
            return True
        for node in walk(value):
            if isinstance(node, cst.Call):
                callee = self.model.qualname(node.func, self.model.module_scope)
                if callee is None:
                    return False
                if callee.startswith(UNSAFE_CALL_PREFIXES):
                    return False
                if callee == "importlib.util.find_spec" and _top_level_spec(node):
                    continue  # `HAS_DEEPSPEED = find_spec("deepspeed") is not None`: imports nothing
                if callee.startswith("builtins."):
                    if callee[len("builtins.") :] not in PURE_BUILTINS:
                        return False
                    continue
                if not callee.startswith(SAFE_CALL_PREFIXES):
                    return False
            if isinstance(node, cst.Lambda | cst.Await | cst.Yield):
                return False
        return True


def _top_level_spec(call: cst.Call) -> bool:
    """``find_spec("name")`` of a top-level module: it searches the path without importing."""
    if len(call.args) != 1 or not isinstance(call.args[0].value, cst.SimpleString):
        return False
    name = call.args[0].value.evaluated_value
    return isinstance(name, str) and name.isidentifier()


def unpacked_value(node: cst.CSTNode, name: str) -> cst.BaseExpression | None:
    """The element bound to ``name`` by ``a, b = x, y`` (same length, no starred parts)."""
    if not isinstance(node, cst.Assign) or len(node.targets) != 1:
        return None
    target, value = node.targets[0].target, node.value
    if not isinstance(target, cst.Tuple | cst.List) or not isinstance(value, cst.Tuple | cst.List):
        return None
    if len(target.elements) != len(value.elements):
        return None
    for t, v in zip(target.elements, value.elements, strict=True):
        if isinstance(t.value, cst.Name) and t.value.value == name and isinstance(v, cst.Element):
            return v.value
    return None


def guarded_import(line: str, name: str, target: str, project: str | None = None) -> str:
    """The import, or a stand-in named after it when the module cannot be imported in the child (a
    library that is not installed; the user's own package when it does not import from the project's
    folder ``project``). How the stand-in acts comes from how the code uses it (see
    ``standins.Missing``); its use is named in the detail."""
    stand_in = f"{name} = __tl__.missing({name!r}, {target!r})\n"
    if project is not None:
        stand_in = f"{name} = __tl__.missing({name!r}, {target!r}, own=True)\n"
        # the project's own modules may fail on import in any way (a dependency, a version)
        return f"try:\n    __tl__.on_path({project!r})\n    {line.strip()}\nexcept Exception:\n    {stand_in}"
    if target.startswith("."):
        return stand_in
    root = target.split(".")[0]
    if root in ("torch", "__future__") or root in sys.stdlib_module_names:
        return line  # always there: a failure would be the snippet's own
    return f"try:\n    {line.strip()}\nexcept ImportError:\n    {stand_in}"


def own_module(path: str, stmt: cst.CSTNode, target: str) -> tuple[str, str] | None:
    """(the folder to import from, the absolute module) when the import names a module of the
    user's own project: a relative import inside a package, or a package that sits in a folder above
    the file (``from timm.layers import ...`` in ``timm/models/x.py``, ``from turing.file_utils``
    next to ``turing/``)."""
    file = Path(path).resolve()
    if not file.is_file() or not isinstance(stmt, cst.ImportFrom | cst.Import):
        return None
    if isinstance(stmt, cst.ImportFrom) and stmt.relative:
        package = [file.parent]
        while (package[-1] / "__init__.py").is_file() and package[-1].parent != package[-1]:
            package.append(package[-1].parent)
        names = [p.name for p in reversed(package[:-1])]  # top package first
        level = len(stmt.relative)
        if not names or level > len(names):
            return None
        base = ".".join(names[: len(names) - level + 1])
        module = dotted(stmt.module) if stmt.module is not None else ""
        return str(package[-1]), base + (f".{module}" if module else "")
    top = target.lstrip(".").split(".")[0]
    folder = file.parent
    for _ in range(8):
        if (folder / top).is_dir() or (folder / f"{top}.py").is_file():
            module = (
                dotted(stmt.module) if isinstance(stmt, cst.ImportFrom) and stmt.module is not None else ""
            )
            return str(folder), module
        if folder.parent == folder:
            break
        folder = folder.parent
    return None


def _import_line(stmt: cst.CSTNode, name: str) -> str:
    """An import statement that binds only ``name`` the way ``stmt`` does."""
    if isinstance(stmt, cst.Import):
        for alias in stmt.names:
            full = dotted(alias.name) or ""
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                if alias.asname.name.value == name:
                    return f"import {full} as {name}\n"
            elif full.split(".")[0] == name:
                return f"import {full}\n"
    if isinstance(stmt, cst.ImportFrom) and not isinstance(stmt.names, cst.ImportStar):
        module = dotted(stmt.module) if stmt.module is not None else ""
        for alias in stmt.names:
            imported = dotted(alias.name) or ""
            local = imported
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                local = alias.asname.name.value
            if local == name:
                suffix = f" as {local}" if local != imported else ""
                return f"from {module} import {imported}{suffix}\n"
    return cst.Module(body=[]).code_for_node(stmt) if isinstance(stmt, cst.BaseStatement) else ""
