"""Whether a file can hold TL204's or TL205's finding, read from CPython's tree before libcst is asked:
a ``preserve_rng_state=`` keyword that may be False (TL204), or, for TL204's cross-file findings, a call
of another file's checkpointing wrapper given something that may draw random numbers; and a Hugging
Face checkpointing switch given without ``gradient_checkpointing_kwargs`` in a file that does not make
the inputs require grad (TL205)."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from trainlint.model.gate_calls import BINDERS, Bindings, binding, last_name, names_bound_to
from trainlint.model.gate_sharding_order import Resolve, resolver
from trainlint.model.pyast import ast_dotted as dotted
from trainlint.model.pyast import import_bindings, of_last_tree
from trainlint.model.vocab import CHECKPOINT_WRAPPERS, INPUT_GRAD_FIXES

_ARGUMENTS_SUFFIX = "TrainingArguments"  # TL205's ``ARGUMENT_CLASS`` (``TrainingArguments$``)
_KWARGS = "gradient_checkpointing_kwargs"


def rng_flag_may_be_off(tree: ast.Module) -> bool:
    """Whether some call is given ``preserve_rng_state=`` a value that TL204 may read as False: the
    literal ``False``, a test of a dropout rate (``cfg.dropout == 0.0 and ...``, ``not cfg.dropout``), or
    a name that the file assigns one of those somewhere, or a parameter whose default is the literal
    False of a def that the file calls by its name. Every finding TL204 makes from the file alone rests
    on such a keyword: ``_in_this_file`` and ``_wrapped_modules`` need ``constant_value`` to be False
    (the literal, or a name whose only value is the literal), ``_off_when_dropout`` needs the keyword's
    expression, or a name's only value, to be that dropout test, and ``_through_wrappers`` on the
    file's own wrapper (``own_function``: a call of a module-level def whose checkpoint call is given
    ``preserve_rng_state=<its parameter>``, that parameter defaulting to False). (On another file's
    wrapper it rests on that file's default: see ``wrapper_may_leave_rng_off``.)"""
    flags = _RngFlags()
    for node in ast.walk(tree):
        kind = type(node)
        if kind is ast.Call:
            if flags.call(node):  # type: ignore[arg-type]
                return True
        elif kind is ast.Assign or kind is ast.AnnAssign or kind is ast.NamedExpr:
            flags.assign(node, kind)
        elif kind is ast.FunctionDef or kind is ast.AsyncFunctionDef:
            flags.define(node)  # type: ignore[arg-type]
    return flags.may_be_off()


@dataclass
class _RngFlags:
    """The ``preserve_rng_state=`` keywords of a tree and the names it assigns a value that may be off."""

    flags: set[str] = field(default_factory=set)  # names given as the keyword
    may_be_off_names: set[str] = field(default_factory=set)  # names assigned False or a dropout test
    keyword: bool = False  # some call is given the keyword
    off_by_default: list[tuple[str, str]] = field(default_factory=list)  # (def, its parameter)
    called: set[str] = field(default_factory=set)  # the plain names called
    # the callees (dotted names) of the calls given a positional argument and ``preserve_rng_state=``
    # the literal False or a name: what ``constant_value`` may read as False
    off_calls: list[str] = field(default_factory=list)

    def call(self, node: ast.Call) -> bool:
        """Notes the call's keyword; True when its value is itself one that may be off."""
        if type(node.func) is ast.Name:
            self.called.add(node.func.id)
        for keyword in node.keywords:
            if keyword.arg != "preserve_rng_state":
                continue
            self.keyword = True
            value = keyword.value
            if node.args and (type(value) is ast.Name or _is_false(value)):
                self.off_calls.append(dotted(node.func) or "")
            if type(value) is ast.Name:
                self.flags.add(value.id)
            elif _false_or_dropout_test(value):
                return True
        return False

    def assign(self, node: ast.AST, kind: type) -> None:
        value = node.value  # type: ignore[attr-defined]
        if value is None or not _false_or_dropout_test(value):
            return
        # (the model binds a value to plain-name targets only, not to a tuple's elements)
        targets = node.targets if kind is ast.Assign else [node.target]  # type: ignore[attr-defined]
        self.may_be_off_names.update(t.id for t in targets if type(t) is ast.Name)

    def define(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        """Notes the parameters defaulting to the literal False (``summary._params``: ``is False``)."""
        args = node.args
        positional = [*args.posonlyargs, *args.args]
        pairs = [
            *zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True),
            *zip(args.kwonlyargs, args.kw_defaults, strict=True),
        ]
        self.off_by_default += [
            (node.name, a.arg) for a, d in pairs if type(d) is ast.Constant and d.value is False
        ]

    def may_be_off(self) -> bool:
        if not self.flags.isdisjoint(self.may_be_off_names):
            return True
        return any(name in self.called and p in self.flags for name, p in self.off_by_default)


# What TL204's ``_randomness`` resolves a callee to (``RANDOM_FUNCTIONS``, ``random.``/``numpy.random.``,
# ``DROPOUT_MODULES``), by the words of their names: each name a qualified name is made of is an
# imported name or an attribute's in this file
_RANDOM_WORDS = ("rand", "bernoulli", "multinomial", "normal", "poisson", "dropout")


def wrapper_may_leave_rng_off(tree: ast.Module) -> bool:
    """Whether TL204, run with the project's facts, may report on the file. Its findings made from the
    file alone need ``rng_flag_may_be_off`` (``_wrapped_modules`` too, when the dropout is in another
    file's class). ``_through_wrappers`` needs a call whose callee is another file's function (its first
    name imported, or assigned a plain or dotted name: how ``FileModel.qualname`` reaches an import)
    or, when the file gives a ``preserve_rng_state=`` keyword, one of its own, with an argument (the
    function it checkpoints) that draws random numbers: in this file's code, whose calls then name a
    word of randomness (``_RANDOM_WORDS``), or as an instance of another file's class with a dropout:
    the argument is then a call whose callee's first name is imported so, or a name or ``self.x`` the
    file assigns such a call (``constructed_class``)."""
    flags, found, settled = _gathered(tree)
    return settled or flags.may_be_off() or found.may_report(flags.keyword)


def rng_wrapper_callees(tree: ast.Module) -> frozenset[str]:
    """The qualified names (``FileModel.qualname``: through the file's imports and aliases) of the
    imported functions and classes a cross-file finding of TL204 may rest on (``Rule.project_callees``):

    - ``_through_wrappers``: at a call that may be another file's wrapper (its callee resolves through
      an import) or, when the file gives a ``preserve_rng_state=`` keyword, the file's own (called by
      its name), given something that may draw random numbers: an instance of an imported class
      (``constructed_class``: a call given, or a call assigned anywhere to a name or ``self.x`` given),
      or, in a file naming a word of randomness, code of the file (``resolve_callable``): the callee,
      and the class of each instance given (``Block.from_pretrained`` names ``Block``'s method,
      reached through ``Block``'s import).
    - ``_wrapped_modules``: torch's ``checkpoint_wrapper``/``CheckpointWrapper`` given a module and
      ``preserve_rng_state=`` False or a name: the module's class may be any class of another file the
      file imports (``candidate_classes`` falls back to them all, and a loop over the model's own
      blocks takes the classes its container is built from), so every import target of the file.

    Empty where no call may reach an imported definition so: no import then takes part in a finding."""
    flags, found, _ = _gathered(tree)
    resolve = resolver(found.imports, found.aliases)
    if any(CHECKPOINT_WRAPPERS & resolve(path) for path in flags.off_calls):
        return frozenset(t for targets in found.imports.values() for t in targets)
    return frozenset(found.callees(resolve, flags.keyword))


def _gather(tree: ast.Module) -> tuple[_RngFlags, _Wrapped, bool]:
    """One walk of the tree into the flags and the calls it holds, and whether a call, with what came
    before it, may hold a finding (the check's answer then, whatever follows)."""
    flags, found, settled = _RngFlags(), _Wrapped(), False
    stack: list[ast.AST] = [tree]
    pop, push, node_type = stack.pop, stack.append, ast.AST
    while stack:
        node = pop()
        kind = type(node)
        if kind is ast.Call:
            off = flags.call(node)  # type: ignore[arg-type]
            settled = found.call(node) or off or settled  # type: ignore[arg-type]
        elif kind is ast.Attribute:
            found.random = found.random or _random_word(node.attr)  # type: ignore[attr-defined]
        elif kind is ast.Assign or kind is ast.AnnAssign or kind is ast.NamedExpr:
            flags.assign(node, kind)
            found.assign(node, kind)
        elif kind is ast.FunctionDef or kind is ast.AsyncFunctionDef:
            flags.define(node)  # type: ignore[arg-type]
            found.callables.add(node.name)  # type: ignore[attr-defined]
        elif kind is ast.Import or kind is ast.ImportFrom:
            found.bind_import(node, kind)
        # the children in reverse, so that they are taken in the order of the source (imports first)
        fields = _REVERSED_FIELDS.get(kind)
        if fields is None:
            fields = _REVERSED_FIELDS[kind] = tuple(reversed(kind._fields))  # type: ignore[attr-defined]
        for name in fields:
            value = getattr(node, name, None)
            if type(value) is list:
                for child in reversed(value):
                    if isinstance(child, node_type):
                        push(child)
            elif isinstance(value, node_type):
                push(value)
    return flags, found, settled


_REVERSED_FIELDS: dict[type, tuple[str, ...]] = {}


_gathered = of_last_tree(_gather)  # (the check, then the callees, of one tree)


@dataclass
class _Wrapped:
    """What ``_through_wrappers`` needs of the file, gathered over its tree. Names are dotted ones
    (``a.b.c``); their first name (``_first``) is what the gate's answer looks at, the whole one what
    the callees are resolved from."""

    imports: dict[str, set[str]] = field(default_factory=dict)  # names bound by an import: its targets
    aliases: dict[str, list[str]] = field(default_factory=dict)  # name: the dotted names assigned to it
    made: list[tuple[str, str]] = field(default_factory=list)  # (name or self.x, the callee of its call)
    # (the callee, the callees of the calls given as arguments, names given, whether a lambda is given)
    calls: list[tuple[str, list[str], list[str], bool]] = field(default_factory=list)
    random: bool = False  # a word of randomness in an imported name or an attribute
    made_here: set[str] = field(default_factory=set)  # those of ``made`` whose call is of an import so far
    # the names a def binds or that are assigned a call or a lambda: those ``resolve_callable`` may
    # follow to a def of the file
    callables: set[str] = field(default_factory=set)

    def call(self, node: ast.Call) -> bool:
        """Notes the call; True when it is, with what came before it, a call of an imported function
        given something that may draw random numbers (the answer is then known)."""
        path = dotted(node.func)
        given = [a for a in node.args if type(a) is not ast.Starred]
        given += [k.value for k in node.keywords if k.arg is not None]
        if path is None or not given:
            return False
        calls = [p for p in (dotted(a.func) for a in given if type(a) is ast.Call) if p is not None]
        names = [n for n in map(_assigned_name, given) if n is not None]
        self.calls.append((path, calls, names, any(type(a) is ast.Lambda for a in given)))
        imported = self.imports
        if _first(path) not in imported:
            return False
        return (
            self.random
            or any(_first(p) in imported for p in calls)
            or any(n in self.made_here for n in names)
        )

    def assign(self, node: ast.AST, kind: type) -> None:
        value = node.value  # type: ignore[attr-defined]
        targets = node.targets if kind is ast.Assign else [node.target]  # type: ignore[attr-defined]
        path = dotted(value) if value is not None else None
        if path is not None:  # ``f = x.name``: ``f`` is ``x``'s when ``x`` is imported
            for target in targets:
                if type(target) is ast.Name:
                    self.aliases.setdefault(target.id, []).append(path)
        if type(value) is ast.Call or type(value) is ast.Lambda:
            self.callables.update(t.id for t in targets if type(t) is ast.Name)
        path = dotted(value.func) if type(value) is ast.Call else None
        if path is not None:
            made = [n for n in map(_assigned_name, targets) if n is not None]
            self.made += [(n, path) for n in made]
            if _first(path) in self.imports:
                self.made_here.update(made)

    def bind_import(self, node: ast.AST, kind: type) -> None:
        """The names an import binds, with their targets as ``FileModel`` spells them."""
        module = node.module if kind is ast.ImportFrom else None  # type: ignore[attr-defined]
        self.random = self.random or (module is not None and _random_word(module))
        for alias in node.names:  # type: ignore[attr-defined]
            self.random = self.random or _random_word(alias.name)
        for bound, target in import_bindings(node):  # type: ignore[arg-type]
            self.imports.setdefault(bound, set()).add(target)

    def may_report(self, own_wrappers: bool) -> bool:
        bindings = [(name, _first(path)) for name, paths in self.aliases.items() for path in paths]
        imported = names_bound_to(frozenset(self.imports), bindings)
        made = {name for name, path in self.made if _first(path) in imported}
        for path, calls, names, _ in self.calls:
            if _first(path) not in imported and not own_wrappers:
                continue
            if self.random or any(_first(p) in imported for p in calls) or any(n in made for n in names):
                return True
        return False

    def callees(self, resolve: Resolve, own_wrappers: bool) -> set[str]:
        """What ``may_report`` asks, call by call, as qualified names: the callee of each call that may
        be a wrapper (none for the file's own) given an instance of an imported class (those classes
        too), or given, in a file naming a word of randomness, something ``resolve_callable`` may
        follow to a def or lambda of the file (``_runs_here``)."""
        classes: dict[str, set[str]] = {}
        for name, path in self.made:
            classes.setdefault(name, set()).update(resolve(path))
        out: set[str] = set()
        for path, calls, names, lambdas in self.calls:
            wrappers = resolve(path)
            if not wrappers and not (own_wrappers and "." not in path):  # (``own_function``: a name)
                continue
            given = set().union(*map(resolve, calls), *(classes.get(n, ()) for n in names))
            if given or (self.random and wrappers and self._runs_here(resolve, calls, names, lambdas)):
                out |= wrappers | given
        return out

    def _runs_here(self, resolve: Resolve, calls: list[str], names: list[str], lambdas: bool) -> bool:
        """Whether an argument may be code of this file (``resolve_callable``): a lambda, ``self.x``
        (a method, or an instance of a class of the file), a name bound by a def or assigned a call or a
        lambda, or a call of a plain name (the file's factory of a nested def) or of ``partial``."""
        if lambdas or any(n.startswith("self.") or n in self.callables for n in names):
            return True
        return any("." not in p or _PARTIAL in resolve(p) for p in calls)


_PARTIAL = "functools.partial"  # (``targets.PARTIAL``)


def _first(path: str) -> str:
    """``a`` of ``a.b.c``."""
    return path.partition(".")[0]


def _is_false(value: ast.expr) -> bool:
    return type(value) is ast.Constant and value.value is False  # type: ignore[attr-defined]


def _assigned_name(node: ast.expr) -> str | None:
    """``x`` of a plain name, ``self.x`` of that attribute: what ``FileModel.values_of`` knows."""
    if type(node) is ast.Name:
        return node.id  # type: ignore[attr-defined]
    value = node.value if type(node) is ast.Attribute else None  # type: ignore[attr-defined]
    if type(value) is ast.Name and value.id == "self":  # type: ignore[attr-defined]
        return "self." + node.attr  # type: ignore[attr-defined]
    return None


def _random_word(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in _RANDOM_WORDS)


def _false_or_dropout_test(expr: ast.expr) -> bool:
    """The literal ``False``, or a ``not``/``and``/``or``/comparison that names a dropout (the only
    expressions ``_dropout_is_zero`` finds a test in: a dotted name mentioning dropout inside one)."""
    if type(expr) is ast.Constant:
        return expr.value is False  # type: ignore[attr-defined]
    if not isinstance(expr, ast.UnaryOp | ast.BoolOp | ast.Compare):
        return False
    for node in ast.walk(expr):
        kind = type(node)
        if kind is ast.Name and "dropout" in node.id.lower():  # type: ignore[attr-defined]
            return True
        if kind is ast.Attribute and "dropout" in node.attr.lower():  # type: ignore[attr-defined]
            return True
    return False


def hf_checkpointing_may_lack_kwargs(tree: ast.Module) -> bool:
    """Whether the file may hold one of TL205's two findings, and names none of the input-grad fixes.

    TL205 reports nothing when the source mentions one of ``INPUT_GRAD_FIXES``: an identifier of the
    tree (a name, attribute, keyword, parameter, definition or import) is spelled in the source, so one
    that contains a fix rules the file out. Otherwise it reports ``x.gradient_checkpointing_enable()``
    called with no argument at all, outside a function of that name and with no ``get_peft_model`` call
    after it in its scope (``_before_peft``: a later start in the source is a later program order), or
    a call with a ``gradient_checkpointing=`` keyword that is not the literal False or None, with no
    ``gradient_checkpointing_kwargs=`` keyword and no ``**`` splat, whose callee's last name ends with
    ``TrainingArguments`` (the model's qualified name, through imports and name assignments: names bound
    to such a name count), unless the file assigns ``x.gradient_checkpointing_kwargs = ...``."""
    found = _Switches()
    # (node, its scope: the node of the def, lambda, class or module whose ``Scope`` holds its calls)
    stack: list[tuple[ast.AST, ast.AST]] = [(tree, tree)]
    while stack:
        node, scope = stack.pop()
        if _names_a_fix(node):
            return False
        kind = type(node)
        if kind is ast.Call:
            found.call(node, scope)  # type: ignore[arg-type]
        elif kind in BINDERS:
            binding(node, found.bindings)
            if kind is ast.Assign:
                found.sets_kwargs = found.sets_kwargs or any(
                    type(t) is ast.Attribute and t.attr == _KWARGS
                    for t in node.targets  # type: ignore[attr-defined]
                )
        elif kind is ast.JoinedStr:
            # (its calls may carry wrong positions: none is taken to follow a switch, none to precede one)
            found.in_fstrings.update(id(n) for n in ast.walk(node) if type(n) is ast.Call)
        # the model pushes a def's, lambda's or class's scope before its decorators, defaults and bases
        inner = node if kind in _SCOPE_NODES else scope
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))
    return found.may_report()


_SCOPE_NODES = frozenset({ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef})
_Position = tuple[int, int]
_LAST: _Position = (1 << 62, 0)


@dataclass
class _Switches:
    """What TL205's findings need, gathered over the tree."""

    enables: list[tuple[ast.AST, _Position]] = field(default_factory=list)  # bare enable calls
    peft: dict[int, list[_Position]] = field(default_factory=dict)  # get_peft_model calls by scope
    arguments: list[str] = field(default_factory=list)  # callees of calls switching checkpointing on
    bindings: Bindings = field(default_factory=list)
    in_fstrings: set[int] = field(default_factory=set)
    sets_kwargs: bool = False

    def call(self, call: ast.Call, scope: ast.AST) -> None:
        callee = last_name(call.func)
        # (an f-string's calls may carry wrong positions: put them after everything)
        where = (call.lineno, call.col_offset) if id(call) not in self.in_fstrings else _LAST
        if callee == "gradient_checkpointing_enable":
            # (``_inside_override``: a method of that name forwarding its argument)
            override = type(scope) in (ast.FunctionDef, ast.AsyncFunctionDef) and scope.name == callee  # type: ignore[attr-defined]
            if not (call.args or call.keywords or override):
                self.enables.append((scope, where))
        elif callee == "get_peft_model" and id(call) not in self.in_fstrings:
            self.peft.setdefault(id(scope), []).append(where)
        elif callee is not None and _switches_on(call):
            self.arguments.append(callee)

    def may_report(self) -> bool:
        for scope, where in self.enables:
            if not any(later > where for later in self.peft.get(id(scope), ())):
                return True
        if self.sets_kwargs or not self.arguments:
            return False
        wanted = frozenset(value for _, value in self.bindings if value.endswith(_ARGUMENTS_SUFFIX))
        names = names_bound_to(wanted, self.bindings)
        return any(name.endswith(_ARGUMENTS_SUFFIX) or name in names for name in self.arguments)


def _switches_on(call: ast.Call) -> bool:
    """``gradient_checkpointing=<not False, not None>`` without the kwargs keyword or a ``**`` splat."""
    keywords = {k.arg: k.value for k in call.keywords}
    value = keywords.get("gradient_checkpointing")
    if value is None or None in keywords or _KWARGS in keywords:
        return False
    return not (type(value) is ast.Constant and (value.value is False or value.value is None))


def _names_a_fix(node: ast.AST) -> bool:
    """An identifier of ``node`` (as the source spells it) contains one of the input-grad fixes."""
    kind = type(node)
    if kind is ast.Name:
        names: tuple[str | None, ...] = (node.id,)  # type: ignore[attr-defined]
    elif kind is ast.Attribute:
        names = (node.attr,)  # type: ignore[attr-defined]
    elif kind is ast.FunctionDef or kind is ast.AsyncFunctionDef or kind is ast.ClassDef:
        names = (node.name,)  # type: ignore[attr-defined]
    elif kind is ast.keyword:
        names = (node.arg,)  # type: ignore[attr-defined]
    elif kind is ast.arg:
        names = (node.arg,)  # type: ignore[attr-defined]
    elif kind is ast.alias:
        names = (node.name, node.asname)  # type: ignore[attr-defined]
    elif kind is ast.ImportFrom:
        names = (node.module,)  # type: ignore[attr-defined]
    else:
        return False
    return any(name is not None and any(fix in name for fix in INPUT_GRAD_FIXES) for name in names)
