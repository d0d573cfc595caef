"""Running the function that holds a flagged call: find it (climbing to the ``forward`` that calls it),
build its class or a stand-in ``self``, and call it with the conditions that reach the call."""

from __future__ import annotations

import libcst as cst

from trainlint.model import FileModel, Site, dotted, walk
from trainlint.verify.bind import (
    Program,
    Synth,
    call_entry,
    constructor_call,
    function_params,
    required_conditions,
)
from trainlint.verify.context import ProbeContext, TextEdit
from trainlint.verify.source import (
    Carry,
    NotExecutable,
    is_literal,
)


def entry_path(ctx: ProbeContext, node: cst.CSTNode) -> tuple[str | None, str]:
    """(class name or None, function name) of the outermost def around ``node``; the probe calls it."""
    funcs = [a for a in ctx.tree.ancestors(node) if isinstance(a, cst.FunctionDef)]
    if not funcs:
        raise NotExecutable("the flagged call is at module level; the probe runs calls inside functions")
    outer = funcs[-1]
    owner = ctx.tree.enclosing_class(outer)
    if owner is None:
        if ctx.tree.parent.get(id(outer)) is not ctx.model.module:
            raise NotExecutable(f"`{outer.name.value}` is not a module-level function or method")
        return None, outer.name.value
    if ctx.tree.parent.get(id(owner)) is not ctx.model.module:
        raise NotExecutable(f"class `{owner.name.value}` is nested; the probe runs module-level classes")
    return owner.name.value, outer.name.value


def find_entry(model: FileModel, path: tuple[str | None, str]) -> tuple[cst.ClassDef | None, cst.FunctionDef]:
    cls_name, func_name = path
    body = model.module.body
    if cls_name is not None:
        for stmt in body:
            if isinstance(stmt, cst.ClassDef) and stmt.name.value == cls_name:
                for inner in stmt.body.body:
                    if isinstance(inner, cst.FunctionDef) and inner.name.value == func_name:
                        return stmt, inner
        raise NotExecutable(f"method `{cls_name}.{func_name}` not found")
    for stmt in body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == func_name:
            return None, stmt
    raise NotExecutable(f"function `{func_name}` not found")


def entry_programs(
    ctx: ProbeContext, site: Site, variants: dict[str, list[TextEdit]]
) -> tuple[dict[str, list[str]], list[str], list[str]]:
    """Programs per variant that call the function holding ``site``. The entry is the outermost
    caller the climb reaches; when it cannot be run (its own inputs, a loss with labels the probe
    cannot build) each caller below it is tried in turn, down to the flagged function. For a method
    there are two ways to build it: the user's class by its own ``__init__`` with small sizes, and a
    stand-in ``self`` built from how the methods use their attributes. The runtime uses the first
    program whose reference runs; each program records its own entry and settings for the detail."""
    first = entry_path(ctx, site.node)
    _, entry = find_entry(ctx.model, first)
    steps = _climb(ctx.model, first, _site_conditions(site, entry))
    programs: dict[str, list[str]] = {}
    roots: list[str] = []
    for name, edits in variants.items():
        vmodel = ctx.variant(edits)
        alternatives, failures = [], []
        for depth, (path, conditions, below) in enumerate(reversed(steps)):
            classdef, _ = find_entry(vmodel, path)
            notes = [f"`{k}` set to {v}" for k, v in conditions.items()]
            notes.extend(f"`{cls}.{attr}` set to {value}" for cls, attr, value in below)
            if path != first or depth:
                notes.insert(0, f"run through `{'.'.join(p for p in path if p)}`")
            if depth:
                notes.insert(0, f"`{'.'.join(p for p in steps[-1][0] if p)}` did not run")
            for how in ("own", "synth") if classdef is not None else ("plain",):
                try:
                    program_text, more = _entry_program(ctx, vmodel, how, path, conditions, below)
                except NotExecutable as exc:  # this way of building the entry does not apply
                    failures.append(str(exc))
                    continue
                alternatives.append(f"__tl__.entry_notes({notes!r})\n" + program_text)
                roots.extend(r for r in more if r not in roots)
        if not alternatives:
            raise NotExecutable(failures[0])
        programs[name] = alternatives
    return programs, roots, []


def _entry_program(
    ctx: ProbeContext,
    vmodel: FileModel,
    how: str,
    path: tuple[str | None, str],
    conditions: dict[str, bool],
    below: list[tuple[str, str, bool]],
) -> tuple[str, list[str]]:
    """One program calling the entry: ``own`` builds the user's class with its ``__init__``,
    ``synth`` builds a stand-in ``self``, ``plain`` calls a module-level function."""
    classdef, func = find_entry(vmodel, path)
    program = Program(Carry(vmodel))
    receiver = None
    if how == "own":
        assert classdef is not None
        program.carry.carry(classdef.name.value)
        construct = constructor_call(vmodel, classdef.name.value, program.carry)
        program.setup.append(f"self = __tl__.place({construct})")
        receiver = "self"
    elif how == "synth":
        assert classdef is not None
        synth = Synth(vmodel, conditions, plan_model=ctx.model)
        synth.synth_class(classdef.name.value)
        program.classes = synth.plans_in_order()
        program.setup.append(f"self = __tl__.place({classdef.name.value}())")
        receiver = "self"
    else:
        program.carry.carry(func.name.value)
    for cls_name, attr, value in below:
        program.setup.append(f"__tl__.set_on(self, {cls_name!r}, {attr!r}, {value!r})")
    for key, value in conditions.items():
        if key == "self.training" and receiver:
            program.setup.append(f"self.train({value!r})")
        elif key.startswith("self.") and receiver:
            program.setup.append(f"{key} = {value!r}")
        elif "." not in key and key in vmodel.module_scope.bindings:
            program.overrides.append(f"{key} = {value!r}")
    _, plan_func = find_entry(ctx.model, path)
    module_args = call_entry(vmodel, func, receiver, conditions, program, plan_func=plan_func)
    return program.render(), (["self"] if receiver else []) + module_args


def _site_conditions(site: Site, func: cst.FunctionDef) -> dict[str, bool]:
    inside = {id(n) for n in walk(func)}
    return required_conditions([f for f in site.frames if id(f.node) in inside], func)


def _self_calls(model: FileModel, func: cst.FunctionDef, attr: str) -> list[Site]:
    """Calls in ``func`` of ``self.<attr>(...)``, or of a loop variable over ``self.<attr>``."""
    scope = model.scope_for(func)
    loop_vars = set()
    for node in walk(func):
        if isinstance(node, cst.For):
            it = node.iter
            if isinstance(it, cst.Call) and dotted(it.func) == "enumerate" and it.args:
                it = it.args[0].value
                target = node.target
                if isinstance(target, cst.Tuple) and len(target.elements) == 2:
                    target = target.elements[1].value
            else:
                target = node.target
            if dotted(it) == f"self.{attr}" and isinstance(target, cst.Name):
                loop_vars.add(target.value)
    out = []
    for site in model.calls_in(scope) if scope is not None else []:
        name = dotted(site.node.func)  # type: ignore[attr-defined]
        if name == f"self.{attr}" or name in loop_vars:
            out.append(site)
    return out


def _map_conditions(
    model: FileModel, callee: cst.FunctionDef, call: cst.Call, conditions: dict[str, bool]
) -> tuple[dict[str, bool], list[tuple[str, bool]]] | None:
    """Translate conditions on the callee's parameters into the caller's terms (through the call's
    arguments); attribute conditions (``self.x``) are returned apart. None when the call passes a
    literal that makes the flagged call unreachable."""
    params = [(n, p) for n, p, _ in function_params(callee)][1:]
    passed: dict[str, cst.BaseExpression] = {}
    pos = 0
    for arg in call.args:
        if arg.star:
            return None
        if arg.keyword is None:
            if pos < len(params):
                passed[params[pos][0]] = arg.value
            pos += 1
        else:
            passed[arg.keyword.value] = arg.value
    out: dict[str, bool] = {}
    attrs: list[tuple[str, bool]] = []
    for key, want in conditions.items():
        if key.startswith("self."):
            if key != "self.training":
                attrs.append((key[5:], want))
            continue
        param = next((p for n, p in params if n == key), None)
        if param is None:
            out[key] = want  # a module-level flag
            continue
        value = passed.get(key, param.default)
        if value is None:
            return None
        if is_literal(value):
            if model.code(value) not in ("True", "False") or (model.code(value) == "True") != want:
                return None
            continue
        path = dotted(value)
        if path is None:
            return None
        out[path] = want
    return out, attrs


Step = tuple[tuple[str | None, str], dict[str, bool], list[tuple[str, str, bool]]]


def _climb(model: FileModel, path: tuple[str | None, str], conditions: dict[str, bool]) -> list[Step]:
    """Run the flagged code through the code that calls it in this file: a helper method through
    its class's ``forward``, a module's ``forward`` through the model that holds it. That way the
    inputs are what they are in the file (an encoder's input comes from a trainable embedding),
    not data tensors. Returns every entry on the way, the flagged function first: the entry, its
    conditions and attribute settings for classes below it."""
    below: list[tuple[str, str, bool]] = []
    steps: list[Step] = [(path, conditions, [])]
    for _ in range(4):
        cls_name, func_name = path
        if cls_name is None:
            break
        classdef, func = find_entry(model, path)
        scope = model.scope_for(classdef)
        assert scope is not None
        if func_name != "forward":
            forward = model.method(scope, "forward")
            calls = _self_calls(model, forward, func_name) if forward is not None else []
            if forward is None or len(calls) != 1:
                break
            mapped = _map_conditions(model, func, calls[0].node, conditions)  # type: ignore[arg-type]
            if mapped is None:
                break
            new, attrs = mapped
            new.update({f"self.{a}": v for a, v in attrs})
            new.update(_site_conditions(calls[0], forward))
            path, conditions = (cls_name, "forward"), new
            steps.append((path, conditions, list(below)))
            continue
        holder = None
        for stmt in model.module.body:
            if not isinstance(stmt, cst.ClassDef) or stmt.name.value == cls_name:
                continue
            holder_scope = model.scope_for(stmt)
            if holder_scope is None:
                continue
            for attr, values in holder_scope.self_attrs.items():
                if any(
                    isinstance(n, cst.Call)
                    and model.qualname(n.func, model.module_scope) == f"<local>.{cls_name}"
                    for v in values
                    for n in walk(v)
                ):
                    forward = model.method(holder_scope, "forward")
                    calls = _self_calls(model, forward, attr) if forward is not None else []
                    if forward is not None and len(calls) == 1:
                        holder = (stmt, forward, calls[0])
                        break
            if holder is not None:
                break
        if holder is None:
            break
        parent, forward, call_site = holder
        mapped = _map_conditions(model, func, call_site.node, conditions)  # type: ignore[arg-type]
        if mapped is None or Synth.module_class_of(model, parent.name.value) is None:
            break
        new, attrs = mapped
        below.extend((cls_name, a, v) for a, v in attrs)
        if "self.training" in conditions:
            new["self.training"] = conditions["self.training"]
        new.update(_site_conditions(call_site, forward))
        path, conditions = (parent.name.value, "forward"), new
        steps.append((path, conditions, list(below)))
    return steps
