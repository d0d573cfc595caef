"""Which module classes an expression may hold: the project classes a module handed to a wrapper
(``checkpoint_wrapper(block, ...)``) can be an instance of, the classes an ``isinstance`` test that
raises rules out before a site, and the modules a container (``nn.Sequential(*layers)``) is built from.

Facts only: a rule decides what a candidate class means (a dropout in it, say).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import libcst as cst

from trainlint.model.crossfile import Fact, constructed_class, imported_fact
from trainlint.model.filemodel import FileModel, Scope, Site
from trainlint.model.syntax import attr_name, dotted, positional, receiver, walk

# a loop over these walks the container's modules: ``enumerate(self.blocks.values())``
ELEMENT_METHODS = frozenset({"values", "children", "items"})
PASS_THROUGH = frozenset({"builtins.enumerate", "builtins.list", "builtins.reversed", "builtins.tuple"})
# containers whose parts are given to their call (``nn.Sequential(*layers)``, ``nn.ModuleList([...])``)
MODULE_CONTAINERS = frozenset({"torch.nn.Sequential", "torch.nn.ModuleList"})


def candidate_classes(model: FileModel, passed: cst.BaseExpression, site: Site) -> Iterator[Fact]:
    """The project classes ``passed`` (an argument of the call at ``site``) may be an instance of, in
    this order: the class it is constructed from; else, for a loop variable, the classes its container
    is built from; else (not known) the classes of other project files that the file imports. Less the
    classes an ``if isinstance(passed, C): raise ...`` before the call rules out."""
    fact = constructed_class(model, passed, site.scope)
    facts = [fact] if fact is not None else walked_classes(model, passed, site.scope)
    ruled_out = ruled_out_classes(model, passed, site)
    for candidate in facts or imported_classes(model):
        if not is_ruled_out(model, candidate, ruled_out):
            yield candidate


def walked_classes(model: FileModel, expr: cst.BaseExpression, scope: Scope) -> list[Fact]:
    """For a loop variable (``for i, block in enumerate(self.blocks.values())``), the classes of other
    project files that the walked container is built from (``nn.ModuleDict({...: Block()})``), where
    its values show them; empty when they do not."""
    loops = [
        b.node
        for b in (scope.bindings.get(expr.value, ()) if isinstance(expr, cst.Name) else ())
        if isinstance(b.node, cst.For)
    ]
    out: dict[tuple[str, str], Fact] = {}
    for loop in loops:
        source = loop.iter
        while isinstance(source, cst.Call):
            if model.qualname(source.func, scope) in PASS_THROUGH and source.args:
                source = source.args[0].value
            elif isinstance(source.func, cst.Attribute) and source.func.attr.value in ELEMENT_METHODS:
                source = source.func.value
            else:
                break
        for value in model.values_of(source, scope):
            for node in walk(value):
                if isinstance(node, cst.Call) and (fact := constructed_class(model, node, scope)) is not None:
                    out.setdefault((fact.path, fact.name), fact)
    return list(out.values())


def ruled_out_classes(model: FileModel, passed: cst.BaseExpression, site: Site) -> list[Fact]:
    """The project classes that ``if isinstance(<passed>, C): raise ...`` before the call at ``site``,
    in a block around it, rules out (OLMo-core refuses to wrap its MoE blocks that way)."""
    if not isinstance(passed, cst.Name):
        return []
    chain = {id(site.statement), *(id(f.node) for f in site.frames)}
    out: list[Fact] = []
    for holder in (site.scope.node, *(f.node for f in site.frames)):
        for block in _blocks(holder):
            statements = list(block.body)
            end = next((i for i, s in enumerate(statements) if id(s) in chain), None)
            for statement in statements[:end] if end is not None else ():
                out += _raised_for(model, statement, passed.value, site.scope)
    return out


def _blocks(node: cst.CSTNode) -> Iterator[cst.IndentedBlock]:
    """The indented blocks of a compound statement (or a def), its ``else``/``except``/``finally`` too."""
    for child in node.children:
        if isinstance(child, cst.IndentedBlock):
            yield child
        elif isinstance(child, cst.Else | cst.ExceptHandler | cst.Finally):
            yield from _blocks(child)


def _raised_for(model: FileModel, statement: cst.CSTNode, name: str, scope: Scope) -> list[Fact]:
    """The project classes of ``if isinstance(name, C)`` / ``(C, D)`` whose body ends in ``raise``."""
    if not isinstance(statement, cst.If) or not isinstance(statement.body, cst.IndentedBlock):
        return []
    last = statement.body.body[-1] if statement.body.body else None
    if not isinstance(last, cst.SimpleStatementLine) or not isinstance(last.body[-1], cst.Raise):
        return []
    test = statement.test
    if not isinstance(test, cst.Call) or model.qualname(test.func, scope) != "builtins.isinstance":
        return []
    args = positional(test)
    if len(args) != 2 or not isinstance(args[0], cst.Name) or args[0].value != name:
        return []
    kinds = [e.value for e in args[1].elements] if isinstance(args[1], cst.Tuple) else [args[1]]
    facts = [imported_fact(model, kind, scope) for kind in kinds]
    return [f for f in facts if f is not None and f.kind == "class"]


def is_ruled_out(model: FileModel, fact: Fact, ruled_out: list[Fact]) -> bool:
    """The class, or a base of it (one level), is one of ``ruled_out``."""
    keys = {(f.path, f.name) for f in ruled_out}
    if not keys or (fact.path, fact.name) in keys:
        return bool(keys)
    bases = (project_class(model, fact, base) for base in fact.facts.get("bases", ()))
    return any(b is not None and (b.path, b.name) in keys for b in bases)


def project_class(model: FileModel, fact: Fact, name: str) -> Fact | None:
    """The project class a name written in ``fact``'s file refers to: imported there, or defined there."""
    project = model.project
    if project is None:
        return None
    target = project.resolve_in(fact, name)
    if target is not None:
        found = project.lookup(target, importer=Path(fact.path))
        return found if found is not None and found.kind == "class" else None
    summary = project.index.summary(Path(fact.path))
    facts = summary["classes"].get(name) if summary is not None else None
    return Fact(fact.path, name, "class", facts) if facts is not None else None


def submodule_classes(model: FileModel, fact: Fact) -> Iterator[tuple[str, Fact]]:
    """The submodules of class ``fact`` that are instances of another project class: (attribute, its
    class), such as a residual stream built in ``__init__`` (``self.stream = Residual(p)``)."""
    for label, (callee, *_where) in fact.facts["submodules"].items():
        inner = project_class(model, fact, callee)
        if inner is not None:
            yield label, inner


def imported_classes(model: FileModel) -> Iterator[Fact]:
    """The classes of other project files that the module imports by name."""
    scope = model.module_scope
    for name, bindings in scope.bindings.items():
        if any(b.kind == "import" for b in bindings):
            fact = imported_fact(model, cst.Name(name), scope)
            if fact is not None and fact.kind == "class":
                yield fact


def container_modules(
    model: FileModel, expr: cst.BaseExpression, scope: Scope, containers: frozenset[str] = MODULE_CONTAINERS
) -> Iterator[str | None]:
    """For ``self.layers`` built as a call of one of ``containers`` (``nn.Sequential(...)``), the
    qualified names of the classes its call-made parts are constructed from (None where unknown)."""
    path = dotted(expr)
    if path is None or not path.startswith("self.") or path.count(".") != 1:
        return
    sites = {id(s.node): s for s in model.calls}
    for value, callee in model.call_values(expr, scope):
        site = sites.get(id(value))
        if callee not in containers or site is None:
            continue
        for part in container_parts(model, value, site):
            if isinstance(part, cst.Call):
                yield model.qualname(part.func, site.scope)


def container_parts(model: FileModel, container: cst.Call, site: Site) -> Iterator[cst.BaseExpression]:
    """The modules a container call is given: its arguments, the elements of a list literal among them,
    and for ``*layers`` the elements the list held at that point (see ``list_elements``)."""
    for arg in container.args:
        value = arg.value
        if isinstance(value, cst.List | cst.Tuple):
            yield from (e.value for e in value.elements)
        elif arg.star == "*" and isinstance(value, cst.Name):
            yield from list_elements(model, value.value, site)
        else:
            yield value


def list_elements(model: FileModel, name: str, site: Site) -> Iterator[cst.BaseExpression]:
    """The elements the list ``name`` holds at ``site``: its last assignment before it, and what
    ``name += [...]``/``name.append(...)``/``name.extend([...])`` in the same scope added after that."""
    bindings = [b for b in site.scope.bindings.get(name, ()) if b.order < site.order]
    if not bindings or not isinstance(bindings[-1].value, cst.List | cst.Tuple):
        return
    start = bindings[-1].order
    added: list[cst.BaseExpression] = [bindings[-1].value]
    for aug in model.augassigns:
        node = aug.node
        if aug.scope is site.scope and start < aug.order < site.order and isinstance(node, cst.AugAssign):
            if dotted(node.target) == name:
                added.append(node.value)
    for call_site in model.calls_in(site.scope):
        call = call_site.node
        if start < call_site.order < site.order and isinstance(call, cst.Call) and call.args:
            if dotted(receiver(call)) == name and attr_name(call) in ("append", "extend"):
                added.append(call.args[0].value)
    for value in added:
        if isinstance(value, cst.List | cst.Tuple):
            yield from (e.value for e in value.elements)
        else:
            yield value
