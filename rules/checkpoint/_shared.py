"""Helpers shared by the checkpoint rules (private to this family)."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from trainlint.model import (
    FileModel,
    Scope,
    Site,
    dotted,
    positional,
    walk_scope,
)
from trainlint.model.targets import Target, resolve_checkpoint_target
from trainlint.model.vocab import CHECKPOINT_FUNCTIONS

PARTIALS = ("functools.partial",)


def checkpoint_calls(model: FileModel) -> Iterator[tuple[Site, cst.Call]]:
    """Direct calls of torch's checkpoint functions, and ``functools.partial(checkpoint, ...)``.

    For a partial, the keywords bound at the partial count: its later calls are not reported again.
    """
    for site in model.calls_to(*CHECKPOINT_FUNCTIONS):
        assert isinstance(site.node, cst.Call)
        yield site, site.node
    for site in model.calls_to(*PARTIALS):
        call = site.node
        assert isinstance(call, cst.Call)
        args = positional(call)
        if args and model.resolves_to(args[0], site.scope, *CHECKPOINT_FUNCTIONS):
            yield site, call


def factory_checkpoint_calls(model: FileModel) -> Iterator[tuple[Site, cst.Call, cst.Return]]:
    """Calls of a name bound to the result of the file's own factory that can return torch's
    checkpoint (``checkpoint = get_checkpoint_fn()`` where the factory returns either DeepSpeed's
    or ``torch.utils.checkpoint.checkpoint``), with the factory's return statement."""
    for site in model.calls:
        call = site.node
        if not isinstance(call, cst.Call) or not isinstance(call.func, cst.Name) or model.callee(site):
            continue
        binding = model.lookup(call.func.value, site.scope)
        value = binding.value if binding is not None and binding.kind == "assign" else None
        if not isinstance(value, cst.Call) or value.args:
            continue
        factory = model.local_function(value, site.scope, methods=False)
        inner = model.scope_for(factory) if factory is not None else None
        if factory is None or inner is None:
            continue
        for node in walk_scope(factory.body):
            if isinstance(node, cst.Return) and node.value is not None:
                if _may_be_checkpoint(model, node.value, inner):
                    yield site, call, node
                    break


def _may_be_checkpoint(model: FileModel, value: cst.BaseExpression, scope: Scope) -> bool:
    """Whether a returned name is, on some path, torch's checkpoint function (any of its values)."""
    if model.resolves_to(value, scope, *CHECKPOINT_FUNCTIONS):
        return True
    return any(model.resolves_to(v, scope, *CHECKPOINT_FUNCTIONS) for v in model.values_of(value, scope))


def constant_value(model: FileModel, expr: cst.BaseExpression, site: Site) -> bool | None:
    """``True``/``False`` for a literal or a name bound once to one; None when unknown."""
    if isinstance(expr, cst.Name) and expr.value in ("True", "False"):
        return expr.value == "True"
    if isinstance(expr, cst.Name):
        values = model.values_of(expr, site.scope)
        if len(values) == 1:
            value = values[0]
            if isinstance(value, cst.Name) and value.value in ("True", "False"):
                return value.value == "True"
    return None


def self_attr_callee(model: FileModel, call: cst.Call, scope: Scope) -> list[str | None]:
    """For ``self.bn(x)``, the resolved constructors assigned to ``self.bn`` in the class."""
    path = dotted(call.func)
    if path is None or not path.startswith("self.") or path.count(".") != 1:
        return []
    return [callee for _, callee in model.call_values(call.func, scope)]


def checkpoint_sites(model: FileModel) -> Iterator[tuple[Site, cst.Call, Target]]:
    for site, call in checkpoint_calls(model):
        target = resolve_checkpoint_target(model, site)
        if target is not None:
            yield site, call, target
