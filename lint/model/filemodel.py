"""The file model: what rules need to know about one file, computed in one pass over the CST.

It owns name resolution (imports, aliases, attribute chains, shadowing by local definitions, without
libcst's scope providers), the scopes and their bindings, every call site with its enclosing
control-flow frames in program order, and the role queries (scaler, optimizer, checkpoint target)
built on them. Rules ask the model; they never walk imports themselves.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import libcst as cst
from libcst._nodes.internal import CodegenState
from libcst.metadata import CodePosition, CodeRange

from trainlint.model.syntax import children, dotted
from trainlint.model.text import LINE_BREAK, line_starts, split_lines

if TYPE_CHECKING:
    from trainlint.model.project import Fact, Project
    from trainlint.model.training import Training

BUILTIN_NAMES = frozenset(dir(builtins))

Span = tuple[tuple[int, int], tuple[int, int]]


@dataclass(frozen=True, eq=False)
class Frame:
    """One enclosing control-flow construct: ``kind`` is if/loop/with/try; ``branch`` names the part."""

    kind: str
    node: cst.CSTNode
    branch: str


@dataclass(eq=False)
class Binding:
    """A name bound in a scope. ``target`` is the imported dotted path for imports."""

    name: str
    kind: str  # import | def | class | assign | param | other
    node: cst.CSTNode
    value: cst.BaseExpression | None = None
    target: str | None = None
    order: int = 0


@dataclass(eq=False)
class Scope:
    kind: str  # module | class | function | lambda
    node: cst.CSTNode
    parent: Scope | None
    name: str
    bindings: dict[str, list[Binding]] = field(default_factory=dict)
    global_names: set[str] = field(default_factory=set)
    nonlocal_names: set[str] = field(default_factory=set)
    self_attrs: dict[str, list[cst.BaseExpression]] = field(default_factory=dict)  # class scopes

    def bind(self, binding: Binding) -> None:
        self.bindings.setdefault(binding.name, []).append(binding)

    @property
    def enclosing_class(self) -> Scope | None:
        """For a method (or a function nested in one), the class whose ``self`` it sees."""
        scope: Scope | None = self
        while scope is not None and scope.kind in ("function", "lambda"):
            if scope.parent is not None and scope.parent.kind == "class":
                return scope.parent
            scope = scope.parent
        return None


@dataclass(eq=False)
class Site:
    """A node of interest with where it sits: scope, program order, control frames, statement."""

    node: cst.CSTNode
    scope: Scope
    order: int
    frames: tuple[Frame, ...]
    statement: cst.CSTNode
    parent: cst.CSTNode | None

    def inside(self, kind: str) -> list[Frame]:
        return [f for f in self.frames if f.kind == kind]


def exclusive(a: Iterable[Frame], b: Iterable[Frame]) -> bool:
    """True when two sites sit in different branches of the same ``if``: they never both run."""
    branches = {id(f.node): f.branch for f in a if f.kind == "if"}
    return any(f.kind == "if" and branches.get(id(f.node), f.branch) != f.branch for f in b)


_STATEMENT_TYPES = (cst.SimpleStatementLine, cst.BaseCompoundStatement)
_OPERATORS = (cst.BaseBinaryOp, cst.BaseBooleanOp, cst.BaseUnaryOp, cst.BaseCompOp, cst.BaseAugOp)
# Nodes that never have syntax children and that the builder has nothing to do for: it skips them
# (``walk`` still yields them). About a third of all nodes are names.
_BUILDER_SKIPS = frozenset(
    {cst.Name, cst.SimpleString, cst.Integer, cst.Float, cst.Imaginary, cst.Ellipsis}
    | {
        cls
        for cls in vars(cst).values()
        # the MRO, not ``issubclass``: libcst's bases are ABCs, and their subclass checks of every
        # libcst name cost pre-commit's one-file run 15 ms
        if isinstance(cls, type) and any(base in cls.__mro__ for base in _OPERATORS)
    }
)


class _Builder:
    """The single pass that fills a FileModel: ``run`` calls the ``visit_X``/``leave_X`` methods in
    source order, as a libcst visitor would, for the syntax nodes (see ``walk``)."""

    # per node class: (visit_X, leave_X, is a statement)
    _handlers: ClassVar[dict[type, tuple[Any, Any, bool]]] = {}

    def __init__(self, model: FileModel) -> None:
        self.model = model
        self.scopes: list[Scope] = [model.module_scope]
        self.frames: list[Frame] = []
        self.branch_of: dict[int, Frame] = {}
        self.pushed: dict[int, int] = {}
        self.statements: list[cst.CSTNode] = []
        self.nodes: list[cst.CSTNode] = []
        self.order = 0

    def run(self, root: cst.CSTNode) -> None:
        """Iterative: no recursion, however deeply the file nests."""
        handlers = self._handlers
        branch_of, pushed, frames = self.branch_of, self.pushed, self.frames
        statements, nodes = self.statements, self.nodes
        stack: list[tuple[cst.CSTNode, bool]] = [(root, False)]
        while stack:
            node, leaving = stack.pop()
            cls = type(node)
            handler = handlers.get(cls)
            if handler is None:
                handler = handlers[cls] = (
                    getattr(_Builder, f"visit_{cls.__name__}", None),
                    getattr(_Builder, f"leave_{cls.__name__}", None),
                    issubclass(cls, _STATEMENT_TYPES),
                )
            visit, leave, is_statement = handler
            if leaving:
                if leave is not None:
                    leave(self, node)
                nodes.pop()
                if is_statement:
                    statements.pop()
                if pushed:
                    for _ in range(pushed.pop(id(node), 0)):
                        frames.pop()
                continue
            if branch_of:
                frame = branch_of.pop(id(node), None)
                if frame is not None:
                    frames.append(frame)
                    pushed[id(node)] = pushed.get(id(node), 0) + 1
            if is_statement:
                statements.append(node)
            nodes.append(node)
            self.order += 1
            stack.append((node, True))
            if visit is not None and visit(self, node) is False:
                continue  # as in libcst: a visit_X returning False skips the children, not the leave
            kids = children(node)
            if kids:
                kids.reverse()
                stack.extend((k, False) for k in kids if type(k) not in _BUILDER_SKIPS)

    def _site(self, node: cst.CSTNode) -> Site:
        return Site(
            node=node,
            scope=self.scopes[-1],
            order=self.order,
            frames=tuple(self.frames),
            statement=self.statements[-1] if self.statements else self.model.module,
            parent=self.nodes[-2] if len(self.nodes) > 1 else None,
        )

    def _mark(self, child: cst.CSTNode | None, kind: str, owner: cst.CSTNode, branch: str) -> None:
        if child is not None:
            self.branch_of[id(child)] = Frame(kind, owner, branch)

    # -- control flow ------------------------------------------------------------------------------
    def visit_If(self, node: cst.If) -> None:
        self._mark(node.body, "if", node, "body")
        self._mark(node.orelse, "if", node, "orelse")

    def visit_For(self, node: cst.For) -> None:
        self._mark(node.body, "loop", node, "body")
        self._mark(node.orelse, "loop", node, "orelse")
        self._bind_target(node.target, node)

    def visit_While(self, node: cst.While) -> None:
        self._mark(node.body, "loop", node, "body")
        self._mark(node.orelse, "loop", node, "orelse")

    def visit_With(self, node: cst.With) -> None:
        self._mark(node.body, "with", node, "body")
        for item in node.items:
            if item.asname is not None:
                self._bind_target(item.asname.name, node)

    def visit_Try(self, node: cst.Try) -> None:
        self._mark(node.body, "try", node, "body")
        for handler in node.handlers:
            self._mark(handler, "try", node, "handler")
        self._mark(node.orelse, "try", node, "else")
        self._mark(node.finalbody, "try", node, "finally")

    # -- scopes and bindings -----------------------------------------------------------------------
    def _push_scope(self, kind: str, node: cst.CSTNode, name: str) -> Scope:
        scope = Scope(kind=kind, node=node, parent=self.scopes[-1], name=name)
        self.scopes.append(scope)
        self.model.scopes.append(scope)
        self.model.scope_of_node[id(node)] = scope
        return scope

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.scopes[-1].bind(Binding(node.name.value, "def", node, order=self.order))
        scope = self._push_scope("function", node, node.name.value)
        params = node.params
        for param in (*params.posonly_params, *params.params, *params.kwonly_params):
            scope.bind(Binding(param.name.value, "param", param, order=self.order))
        for star in (params.star_arg, params.star_kwarg):
            if isinstance(star, cst.Param):
                scope.bind(Binding(star.name.value, "param", star, order=self.order))

    def leave_FunctionDef(self, _node: cst.FunctionDef) -> None:
        self.scopes.pop()

    def visit_Lambda(self, node: cst.Lambda) -> None:
        scope = self._push_scope("lambda", node, "<lambda>")
        for param in (*node.params.posonly_params, *node.params.params, *node.params.kwonly_params):
            scope.bind(Binding(param.name.value, "param", param, order=self.order))

    def leave_Lambda(self, _node: cst.Lambda) -> None:
        self.scopes.pop()

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.scopes[-1].bind(Binding(node.name.value, "class", node, order=self.order))
        self._push_scope("class", node, node.name.value)

    def leave_ClassDef(self, _node: cst.ClassDef) -> None:
        self.scopes.pop()

    def visit_Global(self, node: cst.Global) -> None:
        self.scopes[-1].global_names.update(n.name.value for n in node.names)

    def visit_Nonlocal(self, node: cst.Nonlocal) -> None:
        self.scopes[-1].nonlocal_names.update(n.name.value for n in node.names)

    def visit_Import(self, node: cst.Import) -> None:
        for alias in node.names:
            full = dotted(alias.name)
            if full is None:
                continue
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                name, target = alias.asname.name.value, full
            else:
                name = target = full.split(".")[0]
            self.scopes[-1].bind(Binding(name, "import", node, target=target, order=self.order))

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if node.relative:
            base = "." * len(node.relative) + (dotted(node.module) or "")
        else:
            base = dotted(node.module) or ""
        if isinstance(node.names, cst.ImportStar):
            return
        for alias in node.names:
            name = dotted(alias.name)
            if name is None:
                continue
            local = name
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                local = alias.asname.name.value
            target = f"{base}.{name}" if base else name
            self.scopes[-1].bind(Binding(local, "import", node, target=target, order=self.order))

    def _bind_target(self, target: cst.BaseExpression, node: cst.CSTNode, value=None) -> None:
        scope = self.scopes[-1]
        if isinstance(target, cst.Name):
            scope.bind(
                Binding(
                    target.value, "assign" if value is not None else "other", node, value, order=self.order
                )
            )
        elif isinstance(target, cst.Tuple | cst.List):
            for element in target.elements:
                inner = element.value
                if isinstance(inner, cst.StarredElement):
                    inner = inner.value
                self._bind_target(inner, node)
        elif isinstance(target, cst.Attribute) and isinstance(target.value, cst.Name):
            if target.value.value == "self" and value is not None:
                cls = scope.enclosing_class
                if cls is not None:
                    cls.self_attrs.setdefault(target.attr.value, []).append(value)

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            self._bind_target(t.target, node, node.value)
        self.model.assigns.append(self._site(node))

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._bind_target(node.target, node, node.value)
        if node.value is not None:
            self.model.assigns.append(self._site(node))

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self.model.augassigns.append(self._site(node))

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self._bind_target(node.target, node, node.value)

    def visit_CompFor(self, node: cst.CompFor) -> None:
        # Comprehension variables live in their own scope; binding them in the enclosing scope as
        # "other" only hides outer names of the same spelling, which errs towards not reporting.
        self._bind_target(node.target, node)

    # -- sites ---------------------------------------------------------------------------------------
    def visit_Call(self, node: cst.Call) -> None:
        self.model.calls.append(self._site(node))

    def visit_BinaryOperation(self, node: cst.BinaryOperation) -> None:
        if isinstance(node.operator, cst.Divide | cst.Multiply):
            self.model.binops.append(self._site(node))


@dataclass
class _PositionState(CodegenState):
    """libcst's ``PositionProvider`` without the metadata machinery: the same code generation pass and
    the same rules (a node's syntactic range when it records one, else its whitespace-inclusive range),
    with plain tuples instead of a ``CodeRange`` per node. About 4x faster; tests/test_performance.py
    checks it against ``PositionProvider`` node for node."""

    computed: dict[cst.CSTNode, tuple[tuple[int, int], tuple[int, int]]] = field(default_factory=dict)
    line: int = 1
    column: int = 0
    stack: list[tuple[int, int]] = field(default_factory=list)

    def add_indent_tokens(self) -> None:
        self.tokens.extend(self.indent_tokens)
        for token in self.indent_tokens:
            self._advance(token)

    def add_token(self, value: str) -> None:
        self.tokens.append(value)
        self._advance(value)

    def _advance(self, value: str) -> None:
        if "\n" not in value and "\r" not in value:
            self.column += len(value)
            return
        segments = LINE_BREAK.split(value)
        self.line += len(segments) - 1
        self.column = len(segments[-1])

    def before_codegen(self, _node: cst.CSTNode) -> None:
        self.stack.append((self.line, self.column))

    def after_codegen(self, node: cst.CSTNode) -> None:
        start = self.stack.pop()
        if node not in self.computed:  # a syntactic position recorded inside wins
            self.computed[node] = (start, (self.line, self.column))

    @contextlib.contextmanager
    def record_syntactic_position(
        self, node: cst.CSTNode, *, start_node: cst.CSTNode | None = None, end_node: cst.CSTNode | None = None
    ) -> Iterator[None]:
        start = (self.line, self.column)
        try:
            yield
        finally:
            end = (self.line, self.column)
            if start_node is not None:
                start = self.computed[start_node][0]
            if end_node is not None:
                end = self.computed[end_node][1]
            self.computed[node] = (start, end)


class FileModel:
    """Everything rules know about one parsed file."""

    def __init__(
        self,
        module: cst.Module,
        path: str = "<string>",
        source: str | None = None,
        positions: Mapping[cst.CSTNode, Span] | None = None,
    ) -> None:
        """``positions``: every node's span when the caller already knows them (an editor that re-parsed
        only the statements an edit touched shifts the others' instead of generating the whole code)."""
        self.module = module
        self.path = path
        self.source = source if source is not None else module.code
        self.module_scope = Scope(kind="module", node=module, parent=None, name="<module>")
        self.scopes: list[Scope] = [self.module_scope]
        self.scope_of_node: dict[int, Scope] = {id(module): self.module_scope}
        self.calls: list[Site] = []
        self.binops: list[Site] = []
        self.assigns: list[Site] = []
        self.augassigns: list[Site] = []
        self._positions: Mapping[cst.CSTNode, Span] | None = positions
        self._callee: dict[int, str | None] = {}
        # the rest of the project, when the file is part of one on disk (set by the engine)
        self.project: Project | None = None
        _Builder(self).run(module)

    @classmethod
    def from_source(cls, source: str, path: str = "<string>") -> FileModel:
        return cls(cst.parse_module(source), path, source)

    # -- positions -----------------------------------------------------------------------------------
    def position(self, node: cst.CSTNode) -> CodeRange:
        """Start/end of a node (lines 1-based, columns 0-based), computed on first use only."""
        if self._positions is None:
            state = _PositionState(self.module.default_indent, self.module.default_newline)
            self.module._codegen(state)
            self._positions = state.computed
        (start_line, start_column), (end_line, end_column) = self._positions[node]
        return CodeRange(CodePosition(start_line, start_column), CodePosition(end_line, end_column))

    @functools.cached_property
    def lines(self) -> list[str]:
        """The file's physical lines as the parser numbers them, without their line breaks."""
        return split_lines(self.source)

    @functools.cached_property
    def line_starts(self) -> list[int]:
        """The offset in ``source`` at which each line starts (line ``n`` at ``[n - 1]``)."""
        return line_starts(self.source)

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)

    # -- name resolution ---------------------------------------------------------------------------
    def lookup(self, name: str, scope: Scope) -> Binding | None:
        """The binding ``name`` refers to from ``scope`` (class scopes are skipped, as Python does)."""
        current: Scope | None = scope
        first = True
        while current is not None:
            if current.kind != "class" or first:
                if name in current.global_names and current is not self.module_scope:
                    # (``global x`` at module level is legal and means nothing: no jump, no loop)
                    current, first = self.module_scope, False
                    continue
                found = current.bindings.get(name)
                if found:
                    return self._pick(found)
            first = False
            current = current.parent
        return None

    @staticmethod
    def _pick(bindings: list[Binding]) -> Binding:
        # A def or class of that name anywhere in the scope shadows imports (the user's own function
        # called ``checkpoint`` is never torch's); otherwise the last binding in program order wins.
        for b in bindings:
            if b.kind in ("def", "class"):
                return b
        return bindings[-1]

    def qualname(self, expr: cst.CSTNode | None, scope: Scope, _depth: int = 0) -> str | None:
        """What a Name/Attribute chain refers to: ``torch.utils.checkpoint.checkpoint``, a local
        ``<local>.name`` for the file's own defs, or None when it cannot be known."""
        path = dotted(expr)
        if path is None or _depth > 8:
            return None
        head, _, rest = path.partition(".")
        binding = self.lookup(head, scope)
        if binding is None:
            if head in BUILTIN_NAMES:
                return f"builtins.{path}"
            return None
        if binding.kind == "import":
            base = binding.target
        elif binding.kind in ("def", "class"):
            base = f"<local>.{head}"
        elif binding.kind == "assign" and isinstance(binding.value, cst.Name | cst.Attribute):
            base = self.qualname(binding.value, scope, _depth + 1)
        else:
            return None
        if base is None:
            return None
        return f"{base}.{rest}" if rest else base

    def callee(self, site: Site) -> str | None:
        """Qualified name of what a call site calls (cached)."""
        key = id(site.node)
        if key not in self._callee:
            assert isinstance(site.node, cst.Call)
            self._callee[key] = self.qualname(site.node.func, site.scope)
        return self._callee[key]

    def calls_to(self, *names: str) -> list[Site]:
        wanted = set(names)
        return [s for s in self.calls if self.callee(s) in wanted]

    def resolves_to(self, expr: cst.CSTNode, scope: Scope, *names: str) -> bool:
        return self.qualname(expr, scope) in set(names)

    def elsewhere(self, qualname: str | None) -> Fact | None:
        """The facts of the function or class an imported name refers to, when another file of the
        project defines it (None for third-party names, or when the file is not in a project)."""
        if qualname is None or self.project is None or qualname.startswith(("<local>.", "builtins.")):
            return None
        return self.project.lookup(qualname)

    # -- definitions and values ----------------------------------------------------------------------
    def scope_for(self, node: cst.CSTNode) -> Scope | None:
        return self.scope_of_node.get(id(node))

    def definition(self, name: str, scope: Scope) -> cst.FunctionDef | cst.ClassDef | None:
        binding = self.lookup(name, scope)
        if binding is not None and isinstance(binding.node, cst.FunctionDef | cst.ClassDef):
            return binding.node
        return None

    def method(self, cls: Scope, name: str) -> cst.FunctionDef | None:
        found = cls.bindings.get(name)
        if found and isinstance(found[-1].node, cst.FunctionDef):
            return found[-1].node
        return None

    def local_function(self, call: cst.Call, scope: Scope, *, methods: bool = True) -> cst.FunctionDef | None:
        """The file's own function that ``call`` runs: ``helper(...)`` (a def visible from ``scope``)
        or, with ``methods``, ``self.helper(...)`` (a method of the enclosing class)."""
        func = call.func
        if isinstance(func, cst.Name):
            found = self.definition(func.value, scope)
            return found if isinstance(found, cst.FunctionDef) else None
        if methods and isinstance(func, cst.Attribute) and dotted(func.value) == "self":
            cls = scope.enclosing_class
            return self.method(cls, func.attr.value) if cls is not None else None
        return None

    def local_callee(self, site: Site, *, methods: bool = True) -> cst.FunctionDef | None:
        """``local_function`` for a call site."""
        assert isinstance(site.node, cst.Call)
        return self.local_function(site.node, site.scope, methods=methods)

    def values_of(self, expr: cst.CSTNode, scope: Scope) -> list[cst.BaseExpression]:
        """Every value assigned to a local name or to ``self.attr`` (anywhere in the class)."""
        path = dotted(expr)
        if path is None:
            return []
        if path.startswith("self.") and path.count(".") == 1:
            cls = scope.enclosing_class
            return list(cls.self_attrs.get(path[5:], ())) if cls else []
        if "." in path:
            return []
        binding_scope: Scope | None = scope
        while binding_scope is not None:
            if binding_scope.kind != "class" or binding_scope is scope:
                found = binding_scope.bindings.get(path)
                if found:
                    return [b.value for b in found if b.value is not None]
            binding_scope = binding_scope.parent
        return []

    def call_values(self, expr: cst.CSTNode, scope: Scope) -> list[tuple[cst.Call, str | None]]:
        """Calls whose result is assigned to ``expr``, with their resolved callee."""
        out = []
        for value in self.values_of(expr, scope):
            if isinstance(value, cst.Call):
                value_scope = scope
                out.append((value, self.qualname(value.func, value_scope)))
        return out

    @functools.cached_property
    def sites_by_scope(self) -> dict[int, list[Site]]:
        out: dict[int, list[Site]] = {}
        for site in self.calls:
            out.setdefault(id(site.scope), []).append(site)
        return out

    def calls_in(self, scope: Scope) -> list[Site]:
        return self.sites_by_scope.get(id(scope), [])

    def text_mentions(self, *tokens: str) -> bool:
        return any(t in self.source for t in tokens)

    def release(self) -> None:
        """Drop the cached views that refer back to the model (``training``, token evidence), so that
        the model and its syntax tree are freed as soon as the last reference goes, without waiting
        for the cyclic garbage collector."""
        for name, value in list(self.__dict__.items()):
            if getattr(value, "model", None) is self:
                del self.__dict__[name]

    @functools.cached_property
    def training(self) -> Training:
        """Roles and training events of this file (see ``trainlint.model.training``)."""
        from trainlint.model.training import Training  # builds on this module

        return Training(self)
