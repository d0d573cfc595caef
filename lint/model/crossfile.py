"""What names defined in other files of the project do, asked from one file's model.

The file model resolves a name to its import target; the project index (``project``) answers with the
facts the other file's summary holds (``summary``). These helpers combine the two for rules: the
class of a module built from an imported class, that class's side effects under checkpoint, the
arguments an imported helper converts to 16-bit, what an imported factory returns. Locations in the
other file come back as ``Elsewhere``, ready to become a finding's related location.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import libcst as cst

from trainlint.model.filemodel import FileModel, Scope, Site
from trainlint.model.project import Fact
from trainlint.model.syntax import dotted, positional, walk
from trainlint.model.vocab import BATCHNORM_CLASSES, DROPOUT_CALLS, OPTIMIZER_WORDS


@dataclass(frozen=True)
class Elsewhere:
    """A place in another file: the path as the user sees it (relative to the working folder when
    inside it), 1-based line and column, and what happens there."""

    path: str
    line: int
    column: int
    what: str

    def related(self, label: str | None = None) -> tuple[str, int, int, str, str | None]:
        """As a ``Diagnostic.elsewhere`` entry."""
        return (self.path, self.line, self.column, self.what, label)


def related_elsewhere(
    where: Elsewhere | None, label: str | None = None
) -> tuple[tuple[str, int, int, str, str | None], ...]:
    """A ``Diagnostic.elsewhere`` value: the one place, or none."""
    return (where.related(label),) if where is not None else ()


def shown_path(path: str) -> str:
    relative = os.path.relpath(path)
    return Path(relative if not relative.startswith("..") else path).as_posix()


def _at(fact: Fact, line: int, column: int, what: str) -> Elsewhere:
    return Elsewhere(shown_path(fact.path), line, column, what)


def imported_fact(model: FileModel, func: cst.BaseExpression, scope: Scope) -> Fact | None:
    """The facts of what a called expression names, when another project file defines it."""
    return model.elsewhere(model.qualname(func, scope))


def own_method(model: FileModel, func: cst.BaseExpression, scope: Scope) -> Fact | None:
    """The facts of ``self.method`` called inside a method of the class that defines it, from the
    linted file's own summary (a trainer's ``self.train_one_batch(...)``)."""
    name = dotted(func)
    cls = scope.enclosing_class
    project = model.project
    if name is None or not name.startswith("self.") or name.count(".") != 1 or cls is None:
        return None
    if project is None or not isinstance(cls.node, cst.ClassDef):
        return None
    own = project.own if project.own is not None else project.index.summary(project.path)
    qualified = f"{cls.node.name.value}.{name[5:]}"
    facts = own["functions"].get(qualified) if own is not None else None
    if facts is None and own is not None:
        return _inherited_method(model, own, cls.node.name.value, name[5:])
    return Fact(str(project.path), qualified, "function", facts) if facts is not None else None


def project_method(model: FileModel, func: cst.BaseExpression, scope: Scope) -> Fact | None:
    """The facts of a function of another project file that ``func`` calls: an imported function, a
    method of this class or of its base class there (``self.step``), or a method of an instance of a
    project class (``self.stepper.step`` with ``self.stepper = Stepper()``)."""
    fact = imported_fact(model, func, scope) or own_method(model, func, scope)
    if fact is not None or not isinstance(func, cst.Attribute) or model.project is None:
        return fact
    owner = constructed_class(model, func.value, scope)
    summary = model.project.index.summary(Path(owner.path)) if owner is not None else None
    if owner is None or summary is None:
        return None
    name = f"{owner.name}.{func.attr.value}"
    facts = summary["functions"].get(name)
    return Fact(owner.path, name, "function", facts) if facts is not None else None


def own_function(model: FileModel, func: cst.BaseExpression, scope: Scope) -> Fact | None:
    """The facts of a module-level function of the linted file itself, from its own summary."""
    project = model.project
    if project is None or not isinstance(func, cst.Name):
        return None
    if model.qualname(func, scope) != f"<local>.{func.value}":
        return None
    own = project.own if project.own is not None else project.index.summary(project.path)
    facts = own["functions"].get(func.value) if own is not None else None
    return Fact(str(project.path), func.value, "function", facts) if facts is not None else None


def _inherited_method(model: FileModel, own: dict[str, Any], cls: str, method: str) -> Fact | None:
    """``self.method`` defined by a base class of another project file (``class Trainer(BaseTrainer)``
    with ``BaseTrainer`` imported): the nearest base's facts, one level up."""
    for base in own["classes"].get(cls, {}).get("bases", ()):
        head, _, rest = base.partition(".")
        target = own["imports"].get(head)
        if target is not None:
            fact = model.elsewhere(f"{target}.{rest}.{method}" if rest else f"{target}.{method}")
            if fact is not None and fact.kind == "function":
                return fact
    return None


def constructed_class(model: FileModel, expr: cst.BaseExpression, scope: Scope) -> Fact | None:
    """The class, defined in another project file, whose instance ``expr`` holds: ``Block(...)``
    itself, a name or ``self.attr`` assigned ``Block(...)``, or ``Block.from_pretrained(...)`` when that
    classmethod (of the class or of a base in its file) returns ``cls(...)``."""
    values = [expr] if isinstance(expr, cst.Call) else model.values_of(expr, scope)
    for value in values:
        if not isinstance(value, cst.Call):
            continue
        fact = imported_fact(model, value.func, scope)
        if fact is not None and fact.kind == "class":
            return fact
        func = value.func
        if isinstance(func, cst.Attribute):
            owner = imported_fact(model, func.value, scope)
            if owner is not None and owner.kind == "class" and _makes_cls(model, owner, func.attr.value):
                return owner
    return None


def _makes_cls(model: FileModel, fact: Fact, method: str) -> bool:
    """Whether ``Class.method`` (found on the class or a base class defined in the same file) returns
    ``cls(...)``: an alternative constructor."""
    assert model.project is not None
    summary = model.project.index.summary(Path(fact.path))
    classes = [fact.name]
    while classes and summary is not None and len(classes) < 8:
        name = classes.pop(0)
        facts = summary["functions"].get(f"{name}.{method}")
        if facts is not None:
            return bool(facts.get("returns_cls"))
        classes += [b for b in summary["classes"].get(name, {}).get("bases", ()) if b in summary["classes"]]
    return False


# the base classes that make a project's own class an optimizer; the name test spares a lookup per call
_OPTIMIZER_BASES = frozenset({"torch.optim.Optimizer", "torch.optim.optimizer.Optimizer"})


def project_optimizer_class(model: FileModel, qualname: str | None) -> bool:
    """A class of another project file that subclasses ``torch.optim.Optimizer`` (BERT's ``BertAdam``)."""
    if not qualname or not OPTIMIZER_WORDS.search(qualname.rsplit(".", 1)[-1]):
        return False
    fact = model.elsewhere(qualname)
    if fact is None or fact.kind != "class":
        return False
    return any(_resolved(model, fact, base) in _OPTIMIZER_BASES for base in fact.facts["bases"])


def converted_when_built(model: FileModel, fact: Fact) -> Elsewhere | None:
    """Where building an instance of the class converts (part of) it to 16-bit: its ``__init__``
    converts ``self``/``self.x`` itself, or hands ``self.x`` to a project function that converts that
    argument (CLIP's ``convert_weights(self.clip)``)."""
    assert model.project is not None
    head = fact.name if "." not in fact.name else None  # (its entries alone: ``ProjectIndex.summary``)
    summary = model.project.index.summary(Path(fact.path), head=head)
    init = summary["functions"].get(f"{fact.name}.__init__") if summary is not None else None
    if init is None:
        return None
    if "self" in init["half"]:
        line, column = init["half"]["self"]
        return _at(fact, line, column, f"`{fact.name}.__init__` converts the module to 16-bit here")
    for call in init["calls"]:
        target = model.project.resolve_in(fact, call["callee"])
        helper = model.project.lookup(target, importer=Path(fact.path)) if target else None
        if helper is None or helper.kind != "function" or not helper.facts["half"]:
            continue
        names = [p[0] for p in helper.facts["params"]]
        passed = {**dict(zip(names, call["args"], strict=False)), **call["keywords"]}
        for param in helper.facts["half"]:
            if (passed.get(param) or "").startswith("self."):
                what = f"`{call['callee']}({passed[param]})` in `{fact.name}.__init__` converts it to 16-bit"
                return _at(fact, call["at"][0], call["at"][1], what)
    return None


def classes_built_by_name(model: FileModel) -> list[Fact]:
    """Classes of other project files that the file may build from a name looked up at run time. A
    model builder that turns a config's layer names into classes with ``globals()[name]`` can build
    any class it names, so every project class the builder function mentions is a candidate for a
    layer it made (YOLO's ``parse_model``)."""
    out: list[Fact] = []
    seen: set[str] = set()
    for site in model.calls:
        call = site.node
        if not isinstance(call, cst.Call) or call.args or not isinstance(site.parent, cst.Subscript):
            continue
        if not (isinstance(call.func, cst.Name) and call.func.value == "globals"):
            continue
        attributes: set[int] = set()  # the ``Conv`` of ``nn.Conv`` is not the name ``Conv``
        for node in walk(site.scope.node):
            if isinstance(node, cst.Attribute):
                attributes.add(id(node.attr))
            elif isinstance(node, cst.Name) and node.value not in seen and id(node) not in attributes:
                seen.add(node.value)
                fact = model.elsewhere(model.qualname(node, site.scope))
                if fact is not None and fact.kind == "class":
                    out.append(fact)
    return out


def _resolved(model: FileModel, fact: Fact, name: str) -> str:
    assert model.project is not None
    return model.project.resolve_in(fact, name) or name


def class_side_effects(model: FileModel, fact: Fact) -> list[Elsewhere]:
    """What running the forward of a module of this class does besides computing: BatchNorm running
    statistics of its submodules (``self.bn = nn.BatchNorm2d(...)``, ``add_module``), global and
    registry writes and collectives in ``forward``."""
    out = []
    for label, (callee, line, column, tracks) in fact.facts["submodules"].items():
        if tracks and _resolved(model, fact, callee) in BATCHNORM_CLASSES:
            out.append(_at(fact, line, column, f"BatchNorm `{label}` updates its running statistics"))
    out.extend(_at(fact, line, column, what) for what, line, column in fact.facts["forward_effects"])
    return out


def class_randomness(model: FileModel, fact: Fact) -> Elsewhere | None:
    """A dropout submodule of the class, or a dropout call in its ``forward``."""
    for label, (callee, line, column, _tracks) in fact.facts["submodules"].items():
        if _resolved(model, fact, callee) in DROPOUT_CALLS:
            return _at(fact, line, column, f"dropout `{label}` draws random numbers")
    for callee, line, column in fact.facts.get("forward_calls", ()):
        if _resolved(model, fact, callee) in DROPOUT_CALLS:
            return _at(fact, line, column, f"`{callee}` draws random numbers")
    return None


def converted_arguments(model: FileModel, site: Site) -> list[tuple[cst.BaseExpression, Elsewhere]]:
    """The arguments a call of another file's function converts to 16-bit in place (``x.half()``,
    ``x.to(torch.float16)``, ``x.apply(fn)`` with a converting ``fn``), with where it does so."""
    call = site.node
    assert isinstance(call, cst.Call)
    fact = imported_fact(model, call.func, site.scope)
    if fact is None or fact.kind != "function" or not fact.facts["half"]:
        return []
    names = [p[0] for p in fact.facts["params"]]
    if names and names[0] in ("self", "cls") and "." in fact.name:
        names = names[1:]
    out = []
    args = positional(call)
    for param, (line, column) in fact.facts["half"].items():
        value = _argument(call, args, names, param)
        if value is not None:
            out.append((value, _at(fact, line, column, f"`{fact.name}` converts `{param}` to 16-bit here")))
    return out


def returned_half_modules(model: FileModel, site: Site) -> list[tuple[str, Elsewhere]]:
    """The names a call of another file's loader binds to a module it converted to 16-bit before
    returning it (``model, diffusion = load_model(..., use_fp16=flag)`` with ``if use_fp16:
    model.convert_to_fp16()`` there). Not when the call leaves the guarding flag False."""
    call = site.node
    statement = site.statement
    if not isinstance(call, cst.Call) or not isinstance(statement, cst.SimpleStatementLine):
        return []
    assign = statement.body[0]
    if not isinstance(assign, cst.Assign) or assign.value is not call or len(assign.targets) != 1:
        return []
    fact = imported_fact(model, call.func, site.scope)
    if fact is None or fact.kind != "function" or not fact.facts.get("returns_half"):
        return []
    defaults = {p[0]: p[1] for p in fact.facts["params"]}
    names = [p[0] for p in fact.facts["params"]]
    target = assign.targets[0].target
    out = []
    for position, length, line, column, guard in fact.facts["returns_half"]:
        if guard is not None:
            passed = _argument(call, positional(call), names, guard)
            if passed is None and defaults.get(guard) in (False, None, 0):
                continue
            if isinstance(passed, cst.Name) and passed.value in ("False", "None"):
                continue
        if position < 0:
            key = dotted(target)
        elif isinstance(target, cst.Tuple) and len(target.elements) == length:
            key = dotted(target.elements[position].value)
        else:
            key = None
        if key is not None:
            out.append(
                (key, _at(fact, line, column, f"`{fact.name}` converts the module it returns to 16-bit"))
            )
    return out


def _argument(
    call: cst.Call, args: list[cst.BaseExpression], names: list[str], param: str
) -> cst.BaseExpression | None:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == param:
            return arg.value
    if param in names and names.index(param) < len(args):
        return args[names.index(param)]
    return None


def returned_callee(model: FileModel, fact: Fact) -> tuple[str, Elsewhere] | None:
    """For a factory defined in another file, the resolved callee of what it returns
    (``return GradScaler()``, ``scaler = GradScaler(); return scaler``) and where."""
    returned: list[Any] | None = fact.facts.get("returns")
    if fact.kind != "function" or not returned:
        return None
    callee, line, column = returned
    return _resolved(model, fact, callee), _at(fact, line, column, f"`{fact.name}` returns `{callee}(...)`")


def backward_returned(model: FileModel, site: Site) -> Elsewhere | None:
    """For a call of another file's function that runs a backward on the loss it returns (a
    ``train_step`` helper), where that backward is."""
    call = site.node
    if not isinstance(call, cst.Call):
        return None
    fact = project_method(model, call.func, site.scope)
    if fact is None or fact.kind != "function" or "returns_loss" not in fact.facts:
        return None
    line, column = fact.facts["returns_loss"]
    return _at(fact, line, column, f"`{fact.name}` runs the backward of the loss it returns here")


def assigned_name(site: Site) -> str | None:
    """``loss`` in ``loss = step(batch)``: the one dotted name a call's result is bound to."""
    statement = site.statement
    if not isinstance(statement, cst.SimpleStatementLine) or not isinstance(statement.body[0], cst.Assign):
        return None
    assign = statement.body[0]
    if assign.value is not site.node or len(assign.targets) != 1:
        return None
    return dotted(assign.targets[0].target)


def checkpoint_wrapper(
    model: FileModel, site: Site, checkpoints: frozenset[str]
) -> tuple[cst.BaseExpression, Elsewhere, str] | None:
    """A call of another file's wrapper that checkpoints the function it receives with
    ``preserve_rng_state=<its parameter>`` whose default is False, the call leaving it at the default:
    the function passed, the wrapper's checkpoint call and the parameter's name."""
    call = site.node
    assert isinstance(call, cst.Call)
    fact = imported_fact(model, call.func, site.scope) or own_function(model, call.func, site.scope)
    if fact is None or fact.kind != "function":
        return None
    params = {p[0]: p[1] for p in fact.facts["params"]}
    keyword_only = fact.facts.get("keyword_only", ())
    names = [p[0] for p in fact.facts["params"] if p[0] not in keyword_only]
    if names and names[0] == "self" and "." in fact.name:
        names = names[1:]
    for inner in fact.facts["calls"]:
        rng = inner["keywords"].get("preserve_rng_state")
        runs = inner["args"][0] if inner["args"] else None
        if (
            _resolved(model, fact, inner["callee"]) not in checkpoints
            or rng not in params
            or runs not in params
        ):
            continue
        if params[rng] is not False or _argument(call, positional(call), names, rng) is not None:
            continue  # the default is not False, or the caller passes its own value
        passed = _argument(call, positional(call), names, runs)
        if passed is not None:
            line, column = inner["at"]
            where = _at(fact, line, column, f"checkpoint with `preserve_rng_state={rng}` (False)")
            return passed, where, rng
    return None
