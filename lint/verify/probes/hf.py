"""Probe of TL205: the user's own model construction (a transformers model built from a configuration
in the file), run by the child's ``hf_checkpointing`` driver with transformers itself. A model loaded
with ``from_pretrained`` is not run (the probe fetches no weights); PEFT's ``get_peft_model`` is
followed to the model it wraps, and its adapters are stood in for by a frozen input embedding."""

from __future__ import annotations

from typing import Any

import libcst as cst

from trainlint.model import attr_name, dotted, first_arg, receiver
from trainlint.verify.context import ProbeContext
from trainlint.verify.source import NotExecutable, analyse_names, call_site_at
from trainlint.verify.window import Binder

PEFT_WRAPPERS = ("get_peft_model", "prepare_model_for_kbit_training")


def tl205(ctx: ProbeContext) -> dict[str, Any]:
    """Build the receiver of the flagged ``gradient_checkpointing_enable()`` as the file builds it,
    then enable checkpointing as written and with ``use_reentrant=False``."""
    model = ctx.model
    site = call_site_at(model, ctx.finding)
    call = site.node
    if not isinstance(call, cst.Call) or attr_name(call) != "gradient_checkpointing_enable":
        raise NotExecutable(
            "the finding is a training-arguments keyword: the Trainer enables checkpointing, and the probe "
            "runs only a model's own gradient_checkpointing_enable() call"
        )
    target = receiver(call)
    notes = [
        "the input embedding is frozen, standing in for adapters (only the layers' own parameters train)"
    ]
    value = _construction(ctx, target, site.scope, notes)
    code = f"__tl_model__ = {model.code(value)}\n"
    names = analyse_names(code)
    roles = _configurations(ctx, names.free, site.scope, ctx.model.position(value).start.line)
    role_names = [n for r in roles.values() for n in analyse_names(f"_ = {r}\n").free]
    binder = Binder(model, site.scope, roles=roles)
    binder.bind([n for n in [*role_names, *names.free] if not n.startswith("__tl")], names.attrs)
    assert binder.carry is not None
    notes.extend(binder.notes)
    program = binder.carry.code() + "".join(line + "\n" for line in binder.lines) + code
    return {"driver": "hf_checkpointing", "programs": {"as_written": program}, "notes": notes}


def _configurations(ctx: ProbeContext, names: list[str], scope, line: int) -> dict[str, str]:
    """The names the construction reads that the file last set, before ``line``, to a call of a
    transformers class (``config = LlamaConfig(num_hidden_layers=2)``): that call is the value."""
    out = {}
    for name in names:
        values = [
            v for v in ctx.model.values_of(cst.Name(name), scope) if ctx.model.position(v).start.line < line
        ]
        if not values:
            continue
        value = max(values, key=lambda v: ctx.model.position(v).start.line)
        if isinstance(value, cst.Call) and (ctx.model.qualname(value.func, scope) or "").startswith(
            "transformers."
        ):
            out[name] = ctx.model.code(value)
    return out


def _construction(
    ctx: ProbeContext, expr: cst.BaseExpression | None, scope, notes: list[str]
) -> cst.BaseExpression:
    """The value the file last assigns to ``expr`` before it is used (``model = get_peft_model(model,
    cfg)`` rebinds the name), followed through PEFT's wrappers to the model they wrap."""
    used_at = ctx.model.position(expr).start.line if expr is not None else 0
    for _ in range(4):
        name = dotted(expr)
        values = ctx.model.values_of(expr, scope) if expr is not None and name else []
        before = [v for v in values if ctx.model.position(v).start.line < used_at]
        if not before:
            raise NotExecutable(f"`{name or 'the model'}` is not assigned before it is used in its scope")
        value = max(before, key=lambda v: ctx.model.position(v).start.line)
        if not isinstance(value, cst.Call):
            raise NotExecutable(f"`{name}` is not built by a call in the file")
        callee = dotted(value.func) or ""
        last = callee.rsplit(".", 1)[-1]
        if last in PEFT_WRAPPERS:
            notes.append(f"`{callee}` is not run: the model it wraps is")
            expr = first_arg(value, "model")
            used_at = ctx.model.position(value).start.line
            continue
        if last == "from_pretrained":
            raise NotExecutable(
                f"`{name}` is loaded by `{callee}`: the probe fetches no weights (no network, no user files)"
            )
        return value
    raise NotExecutable("the model's construction is wrapped too many times to follow")
