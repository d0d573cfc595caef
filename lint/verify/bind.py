"""Binding a snippet's names to small synthetic stand-ins and assembling the probe program.

The program for one variant is plain Python text: the module-level imports and definitions the snippet
needs (carried over from the user's file), stand-in classes for the user's modules (their own methods,
with attributes built from how the methods use them), synthetic inputs, and ``__tl_run__``. Names that
cannot be bound are bound to ``__tl__.Unbound("name")``, which fails loudly the moment the snippet uses
it, so the probe reports ``not-executable`` naming it instead of guessing.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import libcst as cst

from trainlint.model import FileModel, dotted, walk
from trainlint.verify.source import Carry, NotExecutable, analyse_names, code_of, indent, is_literal, parents

NN_PREFIXES = ("torch.nn.", "torch.nn.modules.")
# attributes every nn.Module has: never built as stand-ins
MODULE_ATTRS = frozenset(
    {
        "training",
        "parameters",
        "named_parameters",
        "buffers",
        "named_buffers",
        "modules",
        "named_modules",
        "children",
        "named_children",
        "register_buffer",
        "register_parameter",
        "register_module",
        "add_module",
        "apply",
        "to",
        "cuda",
        "cpu",
        "float",
        "half",
        "bfloat16",
        "double",
        "train",
        "eval",
        "state_dict",
        "load_state_dict",
        "zero_grad",
        "requires_grad_",
        "forward",
        "__class__",
        "__dict__",
        "_modules",
        "_parameters",
        "_buffers",
        "get_submodule",
        "get_parameter",
        "extra_repr",
        "type",
    }
)
IDS_NAMES = re.compile(r"(^|_)(ids|idx|tokens?|token_ids|input_ids|indices|input_tokens)$")
MASK_NAMES = re.compile(r"mask")
LABEL_NAMES = re.compile(r"^(labels?|targets?|y)$")
POSITION_NAMES = re.compile(r"position")
SIZE_NAMES = re.compile(
    r"^(dim|d_model|hidden_size|n_embd|embed_dim|depth|n_layers?|num_layers|n_heads?|num_heads|"
    r"vocab_size|block_size|seq_len|segments|chunks|n_chunks|num_segments)$"
)
CONFIG_NAMES = re.compile(r"^(config|cfg|conf|model_config|hparams)$")
SETTINGS_NAMES = re.compile(r"^(config|cfg|conf|model_config|hparams|args|opt|opts)$")
ITERATING_CALLS = frozenset({"enumerate", "zip", "len", "list", "reversed", "iter", "tuple", "sorted"})


def parent_map(node: cst.CSTNode) -> dict[int, cst.CSTNode]:
    return parents(node)  # syntax nodes only: libcst's ``children`` is slow


LIST_METHODS = frozenset({"append", "extend", "insert", "pop", "remove", "clear", "index", "count"})
DICT_METHODS = frozenset({"update", "setdefault", "items", "keys", "values", "get", "popitem"})
SET_METHODS = frozenset({"add", "discard"})
WEIGHT_NAMES = re.compile(r"^(w|w\d|weight|weights|b|bias|kernel)$")


def usage(expr_nodes: list[cst.CSTNode], parents: dict[int, cst.CSTNode]) -> set[str]:
    """How an expression is used: called, iterated, indexed, attribute, truth, value, and
    list/dict/set when a container method is called on it."""
    kinds: set[str] = set()
    for node in expr_nodes:
        parent = parents.get(id(node))
        if isinstance(parent, cst.Attribute) and parent.value is node:
            method = parent.attr.value
            call = parents.get(id(parent))
            if isinstance(call, cst.Call) and call.func is parent:
                if method in LIST_METHODS:
                    kinds.add("list")
                elif method in DICT_METHODS:
                    kinds.add("dict")
                elif method in SET_METHODS:
                    kinds.add("set")
        if isinstance(parent, cst.Call) and parent.func is node:
            kinds.add("called")
        elif isinstance(parent, cst.For) and parent.iter is node:
            kinds.add("iterated")
        elif isinstance(parent, cst.CompFor) and parent.iter is node:
            kinds.add("iterated")
        elif isinstance(parent, cst.Subscript) and parent.value is node:
            kinds.add("indexed")
        elif isinstance(parent, cst.Attribute) and parent.value is node:
            kinds.add("attribute")
        elif isinstance(parent, cst.Arg):
            call = parents.get(id(parent))
            if isinstance(call, cst.Call):
                fname = dotted(call.func) or ""
                last = fname.split(".")[-1]
                if last in ITERATING_CALLS:
                    kinds.add("iterated")
                elif last in ("checkpoint", "checkpoint_sequential") and call.args and call.args[0] is parent:
                    kinds.add("iterated" if last == "checkpoint_sequential" else "called")
                else:
                    kinds.add("value")
            else:
                kinds.add("value")
        elif isinstance(parent, cst.If | cst.While | cst.IfExp | cst.BooleanOperation | cst.UnaryOperation):
            kinds.add("truth")
        else:
            kinds.add("value")
    return kinds


def truth_atoms(test: cst.BaseExpression, want: bool) -> dict[str, bool]:
    """Simple names and attributes whose values make ``test`` have the truth value ``want``
    (``a and b`` true: both true; ``not a``: a false). Anything else gives no constraint."""
    if isinstance(test, cst.BooleanOperation):
        is_and = isinstance(test.operator, cst.And)
        if is_and == want:  # and→True or or→False: every operand must have the value
            return {**truth_atoms(test.left, want), **truth_atoms(test.right, want)}
        left = truth_atoms(test.left, want)
        return left or truth_atoms(test.right, want)
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        return truth_atoms(test.expression, not want)
    path = dotted(test)
    if path is not None and path not in ("True", "False", "None"):
        return {path: want}
    return {}


@dataclass
class ClassPlan:
    name: str
    code: str  # class definition text
    needs: list[str]  # module-level names its code reads


@dataclass
class Program:
    """Pieces of a probe program; ``render`` joins them in an order that always works."""

    carry: Carry
    classes: list[ClassPlan] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)
    run: str = ""
    unbound: set[str] = field(default_factory=set)

    def render(self) -> str:
        provided = {c.name for c in self.classes}
        self.carry.names.update(provided)
        needed: list[str] = []
        for plan in self.classes:
            needed.extend(plan.needs)
        needed.extend(analyse_names("\n".join(self.setup) + "\n" + self.run).free)
        missing = [n for n in dict.fromkeys(needed) if n not in provided and not n.startswith("__tl")]
        for name in self.carry.need(missing):
            self.unbound.add(name)
        lines = ["import torch as __tl_torch__\n", self.carry.code()]
        lines.extend(f"{name} = __tl__.Unbound({name!r})\n" for name in sorted(self.unbound))
        lines.extend(line + "\n" for line in self.overrides)
        lines.extend(plan.code + "\n" for plan in self.classes)
        lines.append("__tl__.seed(0)\n")
        # always set: the child runs the programs of other files before this one
        lines.append(f"__tl__.config_defaults({config_field_defaults(self.carry.model)!r})\n")
        lines.extend(line + "\n" for line in self.setup)
        lines.append(self.run)
        return "".join(lines)


@functools.lru_cache(maxsize=16)  # one walk per file model, not one per program rendered
def config_field_defaults(model: FileModel) -> dict[str, object]:
    """Settings fields the file reads with a default of its own: ``getattr(config, "field", "absolute")``
    gives ``"absolute"``, a field tested ``config.field is None`` (an optional feature) gives None. A
    settings stand-in answers these by name (and says so) instead of leaving them unbound."""
    out: dict[str, object] = {}
    for node in walk(model.module):
        if isinstance(node, cst.Call) and dotted(node.func) == "getattr" and len(node.args) == 3:
            target, field_, default = (a.value for a in node.args)
            head = (dotted(target) or "").rsplit(".", 1)[-1]
            if SETTINGS_NAMES.search(head) and isinstance(field_, cst.SimpleString) and is_literal(default):
                try:
                    out.setdefault(str(field_.evaluated_value), ast.literal_eval(model.code(default)))
                except (ValueError, SyntaxError):
                    continue
        elif isinstance(node, cst.Comparison) and len(node.comparisons) == 1:
            test = node.comparisons[0]
            path = dotted(node.left) or ""
            head, _, attr = path.rpartition(".")
            if not attr or not SETTINGS_NAMES.search(head.rsplit(".", 1)[-1]):
                continue
            if isinstance(test.operator, cst.Is | cst.IsNot) and dotted(test.comparator) == "None":
                out.setdefault(attr, None)
            elif isinstance(test.comparator, cst.Integer):
                # `config.pretraining_tp > 1`: the bound itself, which leaves the optional branch off
                shift = {cst.GreaterThanEqual: -1, cst.LessThanEqual: 1, cst.GreaterThan: 0, cst.LessThan: 0}
                if type(test.operator) in shift:
                    out.setdefault(attr, int(test.comparator.value) + shift[type(test.operator)])
    # a flag or mode a function of the file takes with a default of the same name
    # (`_expand_mask(..., enable_mmca_attention=False)` for `config.enable_mmca_attention`)
    for node in walk(model.module):
        if isinstance(node, cst.Param) and node.default is not None:
            default = node.default
            if (isinstance(default, cst.Name) and default.value in ("True", "False")) or isinstance(
                default, cst.SimpleString
            ):
                out.setdefault(node.name.value, ast.literal_eval(model.code(default)))
    return out


class Synth:
    """Builds stand-in classes for user modules. The class bodies come from ``model`` (a variant of
    the file); how attributes are built is decided on ``plan_model`` (the file as written), so that
    every variant gets the same stand-ins."""

    def __init__(
        self,
        model: FileModel,
        conditions: dict[str, bool],
        plan_model: FileModel | None = None,
        depth: int = 3,
    ) -> None:
        self.model = model
        self.plan_model = plan_model or model
        self.conditions = conditions
        self.depth = depth
        self.plans: dict[str, ClassPlan] = {}
        self.order: list[str] = []

    @staticmethod
    def module_class_of(model: FileModel, name: str) -> cst.ClassDef | None:
        for stmt in model.module.body:
            if isinstance(stmt, cst.ClassDef) and stmt.name.value == name:
                return stmt
        return None

    def module_class(self, name: str) -> cst.ClassDef | None:
        return self.module_class_of(self.plan_model, name)

    def plans_in_order(self) -> list[ClassPlan]:
        return [self.plans[n] for n in self.order]

    def synth_class(self, name: str, depth: int = 0) -> str:
        """Generate a stand-in class for the user's class ``name``: its body without ``__init__``
        plus an ``__init__`` that builds each ``self.<attr>`` the methods use."""
        if name in self.plans:
            return name
        if depth > self.depth:
            raise NotExecutable(f"`{name}` nests user modules too deeply for the probe")
        body_def = self.module_class_of(self.model, name)
        plan_def = self.module_class(name)
        if body_def is None or plan_def is None:
            raise NotExecutable(f"class `{name}` not found")
        self.plans[name] = ClassPlan(name, "", [])  # placeholder against recursion
        scope = self.plan_model.scope_for(plan_def)
        assert scope is not None
        bases = []
        for base in plan_def.bases:
            base_name = dotted(base.value)
            if base_name and "." not in base_name and self.module_class(base_name) is not None:
                bases.append(self.synth_class(base_name, depth + 1))
        base_text = ", ".join(bases) if bases else "__tl_torch__.nn.Module"
        body_members = {
            b
            for b, bl in scope.bindings.items()
            if any(x.kind in ("def", "class", "assign", "other") for x in bl)
        }
        kept = [
            stmt
            for stmt in body_def.body.body
            if not (isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__")
        ]
        plan_init = next(
            (
                stmt
                for stmt in plan_def.body.body
                if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__"
            ),
            None,
        )
        parents = parent_map(plan_def)
        attr_nodes: dict[str, list[cst.CSTNode]] = {}
        for stmt in plan_def.body.body:
            if stmt is plan_init:
                continue
            for node in walk(stmt):
                if (
                    isinstance(node, cst.Attribute)
                    and isinstance(node.value, cst.Name)
                    and node.value.value == "self"
                ):
                    attr_nodes.setdefault(node.attr.value, []).append(node)
        init_lines: list[str] = ["super().__init__()"]
        registered = self._registered(plan_init)
        for attr, nodes in attr_nodes.items():
            if attr in body_members or attr in MODULE_ATTRS or attr.startswith("__"):
                continue
            if self._inherited(plan_def, attr):
                continue
            if attr in registered:
                init_lines.append(registered[attr])
                continue
            value = self._attr_value(scope, attr, nodes, parents, depth)
            init_lines.append(f"self.{attr} = {value}")
        if "self.training" in self.conditions:
            init_lines.append(f"self.train({self.conditions['self.training']})")
        init_lines.extend(self._freezing(plan_init))
        init_code = "def __init__(self, *args, **kwargs):\n" + indent("\n".join(init_lines) + "\n")
        body_code = code_of(kept) if kept else ""
        code = f"class {name}({base_text}):\n" + indent(init_code) + indent(body_code)
        needs = [n for n in analyse_names(code).free if n != name]
        self.plans[name] = ClassPlan(name, code, needs)
        self.order.append(name)
        return name

    def _registered(self, init_def: cst.FunctionDef | None) -> dict[str, str]:
        """``self.register_buffer("name", value)`` / ``register_parameter`` statements of the user's
        ``__init__`` whose value needs nothing but torch and literals, by attribute name."""
        out: dict[str, str] = {}
        if init_def is None:
            return out
        model = self.plan_model
        for node in walk(init_def):
            if not isinstance(node, cst.Call) or not isinstance(node.func, cst.Attribute):
                continue
            if dotted(node.func.value) != "self" or node.func.attr.value not in (
                "register_buffer",
                "register_parameter",
            ):
                continue
            if not node.args or not isinstance(node.args[0].value, cst.SimpleString):
                continue
            carry = Carry(model)  # only to ask which values are safe: torch factories and literals
            if all(carry.safe_value(a.value) for a in node.args[1:]):
                out[str(node.args[0].value.evaluated_value)] = model.code(node)
        return out

    def _inherited(self, classdef: cst.ClassDef, attr: str) -> bool:
        for base in classdef.bases:
            base_name = dotted(base.value)
            base_def = self.module_class(base_name) if base_name else None
            if base_def is None:
                continue
            scope = self.plan_model.scope_for(base_def)
            if scope is not None and attr in scope.bindings:
                return True
        return False

    def _attr_value(self, scope, attr, nodes, parents, depth) -> str:
        key = f"self.{attr}"
        if key in self.conditions:
            return repr(self.conditions[key])
        values = scope.self_attrs.get(attr, [])
        kinds = usage(nodes, parents)
        for value in values:
            built = self.build_value(value, depth, kinds)
            if built is not None:
                return built
        for container, text in (("list", "[]"), ("dict", "{}"), ("set", "set()")):
            if container in kinds:
                return text
        if "called" in kinds:
            return "__tl__.layer()"
        if "iterated" in kinds or "indexed" in kinds:
            return "__tl__.layers(2)"
        return f"__tl__.Unbound({key!r})"

    def build_value(self, value: cst.BaseExpression, depth: int, kinds: set[str]) -> str | None:
        """Text that builds a stand-in for a value expression from the user's ``__init__``; None
        when it cannot be built (the caller falls back to usage)."""
        model = self.plan_model
        if is_literal(value):
            return model.code(value)
        if isinstance(value, cst.List | cst.Tuple):
            items = [self.build_value(e.value, depth, set()) for e in value.elements]
            if all(i is not None for i in items):
                return "[" + ", ".join(items) + "]"  # type: ignore[arg-type]
            return None
        if isinstance(value, cst.ListComp | cst.GeneratorExp):
            item = self.build_value(value.elt, depth, set())
            return None if item is None else f"[{item} for _ in range(2)]"
        if not isinstance(value, cst.Call):
            return None
        callee = model.qualname(value.func, model.module_scope) or ""
        if callee.startswith("<local>."):
            name = callee.split(".", 1)[1]
            if self.module_class(name) is None:
                return None
            return f"{self.synth_class(name, depth + 1)}()"
        for prefix in NN_PREFIXES:
            if callee.startswith(prefix):
                kind = callee.rsplit(".", 1)[1]
                return self._nn_value(kind, value, depth)
        return None

    def _nn_value(self, kind: str, call: cst.Call, depth: int) -> str | None:
        if kind in ("ModuleList", "Sequential"):
            items: list[str] = []
            for arg in call.args:
                built = self.build_value(arg.value, depth, set())
                if built is None:
                    return None
                items.append(f"*{built}" if arg.star == "*" or kind == "ModuleList" else built)
            inner = ", ".join(items)
            if kind == "ModuleList":
                return f"__tl_torch__.nn.ModuleList([{inner}])"
            return f"__tl_torch__.nn.Sequential({inner})"
        if kind == "ModuleDict":
            return None
        if kind == "Parameter":
            return "__tl_torch__.nn.Parameter(1.0 + 0.1 * __tl_torch__.randn(__tl__.D))"
        options = []
        code = self.plan_model.code
        if kind.startswith("Dropout"):
            for i, arg in enumerate(call.args):
                if (arg.keyword is None and i == 0) or (arg.keyword is not None and arg.keyword.value == "p"):
                    if is_literal(arg.value):
                        options.append(f"p={code(arg.value)}")
        elif kind in ("Linear", "LazyLinear"):
            for arg in call.args:
                if arg.keyword is not None and arg.keyword.value == "bias" and is_literal(arg.value):
                    options.append(f"bias={code(arg.value)}")
        elif kind in ("GELU", "LeakyReLU", "Softmax"):
            for arg in call.args:
                if arg.keyword is not None and is_literal(arg.value):
                    options.append(f"{arg.keyword.value}={code(arg.value)}")
        opts = "".join(", " + o for o in options)
        return f"__tl__.layer({kind!r}{opts})"

    def _freezing(self, init_def: cst.FunctionDef | None) -> list[str]:
        """Statements of the user's ``__init__`` that freeze or switch mode of sub-modules."""
        if init_def is None or not isinstance(init_def.body, cst.IndentedBlock):
            return []
        out = []
        for stmt in init_def.body.body:
            text = code_of([stmt])
            if "requires_grad" in text or ".eval()" in text or ".train(" in text:
                names = analyse_names(text).free
                if set(names) <= {"self", "False", "True"}:
                    out.append(text.rstrip("\n"))
        return out


def checked_class(model: FileModel, name: str) -> str | None:
    """The class of the file that the code requires ``name`` to be (``isinstance(config,
    BertConfig)``, raising otherwise, as model base classes do), or None."""
    for node in walk(model.module):
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "isinstance":
            args = [a.value for a in node.args]
            if len(args) == 2 and isinstance(args[0], cst.Name) and args[0].value == name:
                if isinstance(args[1], cst.Name) and Synth.module_class_of(model, args[1].value) is not None:
                    return args[1].value
    return None


def constructor_call(model: FileModel, class_name: str, carry: Carry | None = None) -> str:
    """``Name(arg=__tl__.arg("arg"), ...)``: the user's own class built with small sizes chosen
    from the parameter names of its ``__init__`` (parameters with defaults keep them). A settings
    argument the code checks against a class of the file is a settings stand-in of that class
    (carried with ``carry``)."""
    classdef = Synth.module_class_of(model, class_name)
    init = None
    if classdef is not None:
        for stmt in classdef.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
                init = stmt
    if init is None:
        return f"{class_name}()"
    written = _construction_literals(model, class_name, init)
    args = []
    for name, param, _how in function_params(init)[1:]:
        if param.default is not None:
            # ``args=None``: a settings object the code reads fields of: a settings stand-in
            if (
                isinstance(param.default, cst.Name)
                and param.default.value == "None"
                and SETTINGS_NAMES.search(name)
            ):
                args.append(f"{name}=__tl__.arg({name!r})")
            continue
        literal = written.get(name)
        if literal is not None:
            # the file's own flag or small value; sizes still come from the name when known
            args.append(f"{name}=__tl__.arg({name!r}, written={literal})")
        elif carry is not None and (checked := checked_class(model, name)) and carry.carry(checked):
            args.append(f"{name}=__tl__.config_as({checked}, {name!r})")
        else:
            args.append(f"{name}=__tl__.arg({name!r})")
    return f"{class_name}({', '.join(args)})"


def _construction_literals(
    model: FileModel, class_name: str, init: cst.FunctionDef, depth: int = 0
) -> dict[str, str]:
    """Literal arguments of the first ``ClassName(...)`` call in the file, by parameter name. An
    argument that is a parameter of the ``__init__`` building it (``growth_rate=growth_rate`` in
    ``_DenseBlock``) takes that parameter's default, or what that class's own construction passes."""
    params = [name for name, _, _ in function_params(init)[1:]]
    for site in model.calls:
        call = site.node
        assert isinstance(call, cst.Call)
        if model.callee(site) != f"<local>.{class_name}":
            continue
        out: dict[str, str] = {}
        position = 0
        for arg in call.args:
            if arg.star:
                break
            if arg.keyword is None:
                name = params[position] if position < len(params) else None
                position += 1
            else:
                name = arg.keyword.value
            if name is not None and is_literal(arg.value):
                out[name] = model.code(arg.value)
            elif name is not None and isinstance(arg.value, cst.Name) and depth < 4:
                passed = _outer_value(model, site.scope, arg.value.value, depth)
                if passed is not None:
                    out[name] = passed
        return out
    return {}


def _outer_value(model: FileModel, scope, name: str, depth: int) -> str | None:
    """The literal a parameter of the enclosing ``__init__`` holds: its default, else the literal its
    class's own construction passes (climbing at most four classes)."""
    binding = model.lookup(name, scope)
    func = scope.node
    if binding is None or binding.kind != "param" or not isinstance(func, cst.FunctionDef):
        return None
    if isinstance(binding.node, cst.Param) and binding.node.default is not None:
        return model.code(binding.node.default) if is_literal(binding.node.default) else None
    owner = scope.enclosing_class
    if func.name.value != "__init__" or owner is None or not isinstance(owner.node, cst.ClassDef):
        return None
    return _construction_literals(model, owner.node.name.value, func, depth + 1).get(name)


def param_value(
    name: str, param: cst.Param, kinds: set[str], conditions: dict[str, bool], model: FileModel
) -> str:
    """A synthetic argument for a parameter of the entry function."""
    if name in conditions:
        return repr(conditions[name])
    if param.default is not None:
        if is_literal(param.default):
            return model.code(param.default)
        return f"__tl__.Unbound({name!r})"
    for container, text in (("list", "[]"), ("dict", "{}"), ("set", "set()")):
        if container in kinds:
            return text
    if "called" in kinds:
        return "__tl__.layer()"
    if WEIGHT_NAMES.search(name):
        return f"__tl__.param({name!r})"
    if "iterated" in kinds or ("indexed" in kinds and not IDS_NAMES.search(name)):
        return "__tl__.layers(2)"
    if CONFIG_NAMES.search(name) or (SIZE_NAMES.search(name) and "attribute" not in kinds):
        return f"__tl__.arg({name!r})"
    if "count" in kinds:
        # a whole number the code compares or counts with (`blocks_per_ckpt < 1`, `range(0, n, k)`):
        # 1 fits any such use (a chunk of one, one step); named in the detail
        return f"__tl__.chosen({name!r}, 1)"
    if IDS_NAMES.search(name):
        return '__tl__.data("ids")'
    if POSITION_NAMES.search(name):
        return '__tl__.data("positions")'
    if MASK_NAMES.search(name):
        return '__tl__.data("mask")'
    if LABEL_NAMES.search(name):
        return '__tl__.data("labels")'
    return '__tl__.data("float")'


INT_ANNOTATIONS = re.compile(r"^(int|Optional\[int\]|int \| None|None \| int)$")


def _code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def counted(func: cst.FunctionDef, name: str, param: cst.Param, parents: dict[int, cst.CSTNode]) -> bool:
    """Whether a parameter is a whole number by its annotation (``int``, ``Optional[int]``) or by its
    uses: compared with an integer literal, or a bound or step of ``range``."""
    if param.annotation is not None and INT_ANNOTATIONS.match(_code(param.annotation.annotation)):
        return True
    if any(p.search(name) for p in (IDS_NAMES, MASK_NAMES, LABEL_NAMES, POSITION_NAMES)):
        return False  # data by its name (`mask == 0` is a tensor's test)
    ordering = cst.LessThan | cst.GreaterThan | cst.LessThanEqual | cst.GreaterThanEqual
    for node in names_used(func, name):
        parent = parents.get(id(node))
        if isinstance(parent, cst.Comparison) and any(
            isinstance(c.comparator, cst.Integer) and isinstance(c.operator, ordering)
            for c in parent.comparisons
        ):
            return True
        if isinstance(parent, cst.Arg):
            call = parents.get(id(parent))
            if isinstance(call, cst.Call) and dotted(call.func) == "range":
                return True
    return False


def function_params(func: cst.FunctionDef) -> list[tuple[str, cst.Param, str]]:
    """(name, param, how it is passed: pos/kw) for the parameters a caller must supply."""
    p = func.params
    out = [(x.name.value, x, "pos") for x in (*p.posonly_params, *p.params)]
    out.extend((x.name.value, x, "kw") for x in p.kwonly_params)
    return out


def names_used(func: cst.FunctionDef, name: str) -> list[cst.CSTNode]:
    return [n for n in walk(func.body) if isinstance(n, cst.Name) and n.value == name]


def call_entry(
    model: FileModel,
    func: cst.FunctionDef,
    receiver: str | None,
    conditions: dict[str, bool],
    program: Program,
    plan_func: cst.FunctionDef | None = None,
) -> list[str]:
    """Set-up lines that build the entry function's arguments and ``__tl_run__`` calling it; returns
    the names of the arguments that are modules (their parameters are compared too). How each
    argument is built is decided on ``plan_func`` (the function as written)."""
    plan_func = plan_func or func
    parents = parent_map(plan_func)
    params = function_params(plan_func)
    if receiver is not None:
        params = params[1:]  # self
    args, module_args, inputs = [], [], []
    # `forward(self, input_ids=None, attention_mask=None, ...)`: every input optional; the first one
    # (by its name: token ids, pixels, hidden states) is given, as a caller would
    first_input = next((n for n, p, _ in params if _optional_input(n, p)), None)
    if any(p.default is None for _, p, _ in params):
        first_input = None
    for name, param, how in params:
        kinds = usage(names_used(plan_func, name), parents)
        if counted(plan_func, name, param, parents):
            kinds.add("count")
        value = param_value(name, param, kinds, conditions, model)
        if name == first_input:
            value = element_data(name)
        if "indexed" in kinds and param.default is None and name not in conditions:
            value = unpacked_batch(plan_func, name) or value
        var = f"__tl_arg_{name}"
        program.setup.append(f"{var} = {value}")
        if "layer" in value:
            module_args.append(var)
        elif "param(" in value:
            inputs.append(name)
        elif "data(" in value:
            inputs.append(name)
        args.append(f"{name}={var}" if how == "kw" or param.default is not None else var)
    star = plan_func.params.star_arg
    if isinstance(star, cst.Param):
        # `forward(self, *prev_features)`: one synthetic tensor (DenseNet's layers take a list of them)
        name = star.name.value
        program.setup.append(f'__tl_arg_{name} = __tl__.data("float")')
        inputs.append(name)
        args.append(f"*(__tl_arg_{name},)")
        args.sort(key=lambda a: "=" in a)  # keywords after the unpacked positionals
    program.setup.append("__tl_inputs__ = {" + ", ".join(f"{n!r}: __tl_arg_{n}" for n in inputs) + "}")
    target = f"{receiver}.{func.name.value}" if receiver else func.name.value
    program.run = f"def __tl_run__():\n    return {target}({', '.join(args)})\n"
    return module_args


INPUT_NAMES = re.compile(
    r"^(input_ids|x|inputs?|hidden_states|pixel_values|input_values|features|tokens|idx)$"
)


def _optional_input(name: str, param: cst.Param) -> bool:
    default = param.default
    return isinstance(default, cst.Name) and default.value == "None" and bool(INPUT_NAMES.match(name))


ELEMENT_LABELS = re.compile(r"(^|_)(labels?|targets?)$")


def element_data(name: str) -> str:
    """Synthetic data for a batch element by the name the code gives it."""
    if LABEL_NAMES.search(name) or ELEMENT_LABELS.search(name):  # before masks: `masked_lm_labels`
        return '__tl__.data("labels")'
    for pattern, kind in ((IDS_NAMES, "ids"), (POSITION_NAMES, "positions"), (MASK_NAMES, "mask")):
        if pattern.search(name):
            return f'__tl__.data("{kind}")'
    return '__tl__.data("float")'


def unpacked_batch(func: cst.FunctionDef, name: str) -> str | None:
    """A batch the function takes apart by position or key (``input_ids = batch[1]``,
    ``mask = batch["attention_mask"]``): a tuple or dict whose elements are built by the names they
    are given. None unless every subscript of ``name`` is one literal index or key."""
    fields: dict[int | str, str] = {}
    for node in walk(func.body):
        if isinstance(node, cst.Subscript) and isinstance(node.value, cst.Name) and node.value.value == name:
            if len(node.slice) != 1 or not isinstance(node.slice[0].slice, cst.Index):
                return None
            key = node.slice[0].slice.value
            if isinstance(key, cst.Integer):
                fields.setdefault(int(key.value), "")
            elif isinstance(key, cst.SimpleString):
                fields.setdefault(key.evaluated_value, key.evaluated_value)  # type: ignore[arg-type]
            else:
                return None
    for node in walk(func.body):  # the names elements are bound to: ``input_ids = batch[1]``
        if (
            isinstance(node, cst.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0].target, cst.Name)
        ):
            value = node.value
            if (
                isinstance(value, cst.Subscript)
                and isinstance(value.value, cst.Name)
                and value.value.value == name
            ):
                key = value.slice[0].slice.value if isinstance(value.slice[0].slice, cst.Index) else None
                if isinstance(key, cst.Integer):
                    fields[int(key.value)] = node.targets[0].target.value
    if not fields or (
        not all(isinstance(k, int) for k in fields) and not all(isinstance(k, str) for k in fields)
    ):
        return None
    if all(isinstance(k, str) for k in fields):
        return "{" + ", ".join(f"{k!r}: {element_data(str(k))}" for k in fields) + "}"
    size = max(int(k) for k in fields) + 1
    return "(" + "".join(f"{element_data(fields.get(i, ''))}, " for i in range(size)) + ")"


def required_conditions(frames: Iterable, entry: cst.FunctionDef | None) -> dict[str, bool]:
    """Values for simple flags that guard the flagged call (``if self.gradient_checkpointing``)."""
    out: dict[str, bool] = {}
    for frame in frames:
        if frame.kind != "if" or not isinstance(frame.node, cst.If):
            continue
        want = frame.branch == "body"
        out.update(truth_atoms(frame.node.test, want))
    return out
