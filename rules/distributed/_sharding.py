"""Helpers shared by the wrapping rules of this family (TL503, TL504, TL506, TL507): which names a
wrapper's result is bound to, and what it wrapped."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import libcst as cst

from trainlint.model import FileModel, Frame, Scope, Site, dotted, exclusive, first_arg, int_value, keyword


@dataclass(frozen=True)
class Wrap:
    """``outer = Wrapper(inner, ...)``: the call site, the bound name and the wrapped module's name."""

    site: Site
    outer: str
    inner: str | None


def _assigned_targets(site: Site) -> list[cst.BaseExpression]:
    """The targets a call's value is assigned to directly (``a = b = call(...)``, ``a: T = call(...)``)."""
    statement = site.statement
    if not isinstance(statement, cst.SimpleStatementLine):
        return []
    for small in statement.body:
        if isinstance(small, cst.Assign) and small.value is site.node:
            return [t.target for t in small.targets]
        if isinstance(small, cst.AnnAssign) and small.value is site.node:
            return [small.target]
    return []


def assigned_names(site: Site) -> list[str]:
    """The dotted names a call's value is assigned to directly."""
    return [n for n in (dotted(t) for t in _assigned_targets(site)) if n]


def wraps(model: FileModel, classes: frozenset[str]) -> list[Wrap]:
    """Every ``x = Wrapper(module, ...)`` of one of ``classes`` in the file."""
    out = []
    for site in model.calls_to(*classes):
        assert isinstance(site.node, cst.Call)
        inner = dotted(first_arg(site.node, "module"))
        for target in _assigned_targets(site):
            outer = dotted(target)
            if outer:
                out.append(Wrap(site, outer, inner))
    return out


def sharded_in_place(model: FileModel, functions: frozenset[str]) -> Iterator[tuple[Site, str]]:
    """``fully_shard(module)`` calls (FSDP2 shards in place) with the module's dotted name."""
    for site in model.calls_to(*functions):
        assert isinstance(site.node, cst.Call)
        inner = dotted(first_arg(site.node, "module"))
        if inner:
            yield site, inner


def deepspeed_engines(model: FileModel, initialize: frozenset[str]) -> set[str]:
    """Names bound to the engine ``deepspeed.initialize`` returns first: ``engine, opt, _, _ = ...``
    or ``engine = deepspeed.initialize(...)[0]``."""
    out: set[str] = set()
    for site in model.calls_to(*initialize):
        statement = site.statement
        if not isinstance(statement, cst.SimpleStatementLine):
            continue
        for small in statement.body:
            if not isinstance(small, cst.Assign):
                continue
            value = small.value
            for target in (t.target for t in small.targets):
                if value is site.node and isinstance(target, cst.Tuple | cst.List) and target.elements:
                    name = dotted(target.elements[0].value)
                elif (
                    isinstance(value, cst.Subscript)
                    and value.value is site.node
                    and len(value.slice) == 1
                    and isinstance(value.slice[0].slice, cst.Index)
                    and int_value(value.slice[0].slice.value) == 0
                ):
                    name = dotted(target)
                else:
                    name = None
                if name:
                    out.add(name)
    return out


def same_owner(scope: Scope, wrap: Wrap) -> bool:
    """Code in ``scope`` sees the wrap's names: the wrap's own scope, or a method of its class for
    ``self.`` attributes."""
    if scope is wrap.site.scope:
        return True
    if wrap.outer.startswith("self."):
        return scope.enclosing_class is not None and scope.enclosing_class is wrap.site.scope.enclosing_class
    return False


def keyword_is(call: cst.CSTNode, name: str, *values: str) -> bool:
    """``call`` passes ``name=`` one of ``values`` (the last part of a dotted value: ``True``,
    ``ShardingStrategy.NO_SHARD``)."""
    if not isinstance(call, cst.Call):
        return False
    arg = keyword(call, name)
    return arg is not None and (dotted(arg.value) or "").rsplit(".", 1)[-1] in values


def _branch_body(frame: Frame) -> Sequence[cst.BaseStatement] | None:
    """The statements of the ``if`` branch a frame names (``elif`` is a nested ``if``: not followed)."""
    node = frame.node
    if not isinstance(node, cst.If):
        return None
    block = node.body if frame.branch == "body" else node.orelse
    if isinstance(block, cst.Else):
        block = block.body
    return block.body if isinstance(block, cst.IndentedBlock) else None


def _leaves(statements: Sequence[cst.BaseStatement] | None) -> bool:
    """The block ends by leaving the function or the loop (``return``, ``raise``, ``continue``)."""
    if not statements or not isinstance(statements[-1], cst.SimpleStatementLine):
        return False
    return isinstance(statements[-1].body[-1], cst.Return | cst.Raise | cst.Continue | cst.Break)


def on_other_path(model: FileModel, site: Site, calls: Callable[[cst.Call], bool]) -> bool:
    """``site`` never runs after a call its function makes that ``calls`` accepts: the two sit in
    different branches of one ``if``, or the call sits in an ``if`` branch that ends by leaving
    (``if fsdp: return model.clip_grad_norm_(...)``), which ``site`` follows from outside."""
    own = {(id(f.node), f.branch) for f in site.frames}
    for other in model.calls_in(site.scope):
        node = other.node
        if other is site or not isinstance(node, cst.Call) or not calls(node):
            continue
        if exclusive(other.frames, site.frames):
            return True
        if other.order < site.order and any(
            f.kind == "if" and (id(f.node), f.branch) not in own and _leaves(_branch_body(f))
            for f in other.frames
        ):
            return True
    return False
