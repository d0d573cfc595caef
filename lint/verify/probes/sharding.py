"""Probes of the sampling rules: TL505 on CPU without a process group. (TL507 has none: a probe could
only show DDP's mechanism on a stand-in module, whatever the user's code does.)"""

from __future__ import annotations

from typing import Any

import libcst as cst

from trainlint.model import keyword
from trainlint.verify.context import ProbeContext
from trainlint.verify.source import NotExecutable, call_site_at

# Keywords of DistributedSampler that decide the order; the rest (dataset, num_replicas, rank) the
# probe sets itself, so that no process group is needed.
ORDER_KEYWORDS = ("shuffle", "seed", "drop_last")
DATASET_SIZE = 16


def tl505(ctx: ProbeContext) -> dict[str, Any]:
    """The flagged sampler's order over two epochs as written (no ``set_epoch``) vs with
    ``set_epoch(epoch)`` before each, on a 16-item dataset split over 2 replicas (rank 0)."""
    site = call_site_at(ctx.model, ctx.finding)
    call = site.node
    assert isinstance(call, cst.Call)
    kwargs: list[str] = []
    notes: list[str] = [f"a {DATASET_SIZE}-item dataset over 2 replicas, rank 0"]
    for name in ORDER_KEYWORDS:
        arg = keyword(call, name)
        if arg is None:
            continue
        value = ctx.model.code(arg.value)
        # a name bound once to a literal (`SHUFFLE = False`) counts as that literal
        bound = ctx.model.values_of(arg.value, site.scope) if isinstance(arg.value, cst.Name) else []
        literal = bound[0] if len(bound) == 1 else arg.value
        if _literal(literal):
            kwargs.append(f"{name}={ctx.model.code(literal)}")
        else:
            notes.append(f"`{name}={value}` is only known at run time: its default is used")
    if any(a.star for a in call.args):
        raise NotExecutable("the sampler's arguments come from a `*`/`**` splat")
    build = (
        "import torch.utils.data as __tl_data__\n"
        "__tl_sampler__ = __tl_data__.DistributedSampler("
        f"list(range({DATASET_SIZE})), num_replicas=2, rank=0{''.join(', ' + k for k in kwargs)})\n"
    )
    as_written = build + "__tl_orders__ = [list(__tl_sampler__) for __tl_epoch__ in range(2)]\n"
    fixed = build + (
        "__tl_orders__ = []\nfor __tl_epoch__ in range(2):\n"
        "    __tl_sampler__.set_epoch(__tl_epoch__)\n    __tl_orders__.append(list(__tl_sampler__))\n"
    )
    return {"driver": "sampler_order", "programs": {"as_written": as_written, "fixed": fixed}, "notes": notes}


def _literal(expr: cst.BaseExpression) -> bool:
    if isinstance(expr, cst.Integer):
        return True
    return isinstance(expr, cst.Name) and expr.value in ("True", "False")
