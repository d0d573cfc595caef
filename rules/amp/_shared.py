"""Helpers shared by the amp rules (private to this family)."""

from __future__ import annotations

import libcst as cst

from trainlint.model import (
    Event,
    FileModel,
    Scope,
    Site,
    dotted,
    first_arg,
    keyword,
    literal_false,
    positional,
)
from trainlint.model.vocab import (
    AUTOCAST_FUNCTIONS,
)


def optimizer_text(step: Event) -> str | None:
    """``opt`` in ``scaler.step(opt)``, when it is a plain name or attribute chain."""
    arg = first_arg(step.call, "optimizer")
    return dotted(arg) if arg is not None else None


def autocast_call(model: FileModel, expr: cst.BaseExpression, scope: Scope) -> cst.Call | None:
    """The autocast constructor call ``expr`` is, directly or through a local name (``ctx =
    nullcontext() if cpu else torch.autocast(...)``: the autocast branch counts)."""
    options: list[cst.BaseExpression] = [expr]
    if isinstance(expr, cst.Name | cst.Attribute) and not isinstance(expr, cst.Call):
        options = list(model.values_of(expr, scope))
    for option in options:
        branches = [option.body, option.orelse] if isinstance(option, cst.IfExp) else [option]
        for branch in branches:
            if isinstance(branch, cst.Call) and model.qualname(branch.func, scope) in AUTOCAST_FUNCTIONS:
                return branch
    return None


def autocast_dtype(model: FileModel, call: cst.Call, scope: Scope) -> str | None:
    """``"fp16"``, ``"bf16"`` or None (unknown) for an autocast constructor call."""
    callee = model.qualname(call.func, scope) or ""
    training = model.training
    args = positional(call)
    dtype_arg = keyword(call, "dtype")
    dtype = dtype_arg.value if dtype_arg is not None else None
    if dtype is None and callee in ("torch.autocast", "torch.amp.autocast") and len(args) > 1:
        dtype = args[1]
    if dtype is not None:
        if not training.is_low_precision_dtype(dtype, scope):
            return None
        texts = [model.qualname(dtype, scope) or ""]
        if isinstance(dtype, cst.Name):
            texts += [model.qualname(v, scope) or "" for v in model.values_of(dtype, scope)]
        kinds = {"bf16" if t.endswith("bfloat16") else "fp16" for t in texts if t}
        return kinds.pop() if len(kinds) == 1 else None
    if callee.startswith("torch.cuda.amp"):
        return "fp16"
    if callee.startswith("torch.cpu.amp"):
        return "bf16"
    device_arg = keyword(call, "device_type")
    device = device_arg.value if device_arg is not None else (args[0] if args else None)
    if isinstance(device, cst.SimpleString):
        text = device.evaluated_value
        if text == "cuda":
            return "fp16"
        if text == "cpu":
            return "bf16"
    return None


def autocast_frames(model: FileModel, site: Site) -> list[tuple[cst.Call, bool]]:
    """The autocast regions around ``site``, outermost first, each with whether it is enabled
    (``enabled=False`` turns a region off), including decorators of the enclosing function."""
    out: list[tuple[cst.Call, bool]] = []
    scope: Scope | None = site.scope
    decorated: list[tuple[cst.Call, bool]] = []
    while scope is not None and scope.kind == "function":
        node = scope.node
        assert isinstance(node, cst.FunctionDef)
        for deco in node.decorators:
            if isinstance(deco.decorator, cst.Call):
                call = autocast_call(model, deco.decorator, scope.parent or scope)
                if call is not None:
                    decorated.insert(0, (call, not literal_false(keyword(call, "enabled"))))
        scope = scope.parent
    out.extend(decorated)
    for frame in site.frames:
        if frame.kind == "with" and isinstance(frame.node, cst.With):
            for item in frame.node.items:
                call = autocast_call(model, item.item, site.scope)
                if call is not None:
                    out.append((call, not literal_false(keyword(call, "enabled"))))
    return out
