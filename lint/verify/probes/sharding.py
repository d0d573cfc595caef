"""Probes of the sampling and sharding rules: TL505 on CPU without a process group; TL503, TL506 and
TL110 run the user's statements on a real two-process gloo group with FSDP on the CPU (the child's
``fsdp`` jobs). TL507's probe is in ``wrapping.py``, TL504's in ``engines.py``."""

from __future__ import annotations

from typing import Any

import libcst as cst

from trainlint.model import FileModel, Scope, attr_name, keyword, positional
from trainlint.rules.distributed.tl503_optimizer_before_sharding import OptimizerBeforeSharding
from trainlint.rules.distributed.tl506_sharded_clip_local_norm import ShardedClipLocalNorm
from trainlint.verify.context import ProbeContext, replace_node
from trainlint.verify.probes._common import assigned_name, wrap_names
from trainlint.verify.source import NotExecutable, analyse_names, call_site_at, indent
from trainlint.verify.window import Binder, region_text, statements_region

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


TINY = "__tl__.tiny_model()"
# A tiny model whose blocks are reachable as `.blocks` and `.layers` (code that shards each block
# before the whole model walks one of them); its input width is the stand-ins' D = 8.
BLOCKS_MODEL = (
    "import torch as __tl_torch__\n"
    "class __TlBlocks__(__tl_torch__.nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.blocks = __tl_torch__.nn.ModuleList(__tl_torch__.nn.Linear(8, 8) for _ in range(2))\n"
    "        self.layers = self.blocks\n"
    "    def forward(self, x):\n"
    "        for block in self.blocks:\n"
    "            x = __tl_torch__.tanh(block(x))\n"
    "        return x\n"
)


def _bound_program(model: FileModel, scope: Scope, code: str, roles: dict[str, str], notes: list[str]) -> str:
    """``code`` (the user's statements) after the lines that bind its free names: ``roles`` first,
    then the file's own values; a name that cannot be bound fails the run, naming it."""
    names = analyse_names(code)
    binder = Binder(model, scope, roles=dict(roles))
    binder.bind([n for n in names.free if not n.startswith("__tl")], names.attrs)
    assert binder.carry is not None
    for note in binder.notes:
        if note not in notes:
            notes.append(note)
    return binder.carry.code() + "".join(line + "\n" for line in binder.lines) + code


def _argument(call: cst.Call, name: str, index: int) -> cst.BaseExpression | None:
    args = positional(call)
    if len(args) > index:
        return args[index]
    arg = keyword(call, name)
    return arg.value if arg is not None else None


def _statement_text(ctx: ProbeContext, statement: cst.CSTNode, edits=()) -> str:
    if not isinstance(statement, cst.SimpleStatementLine):
        line = ctx.model.position(statement).start.line
        raise NotExecutable(f"the statement on line {line} is not a simple statement of its own")
    return region_text(ctx.model.source, statements_region(ctx.model, statement, statement), list(edits))


def tl503(ctx: ProbeContext) -> dict[str, Any]:
    """The user's statements from the optimizer through the wrap on a tiny model, one forward,
    backward and ``optimizer.step()`` on each of two ranks: do the wrapped model's parameters move?
    The fix builds the optimizer (the same statement) right after the wrap."""
    model = ctx.model
    optimizer = call_site_at(model, ctx.finding)
    shard = ctx.related(OptimizerBeforeSharding.SHARD)
    call = shard.node
    assert isinstance(call, cst.Call)
    if attr_name(call) == "prepare":
        raise NotExecutable(
            "accelerate's `prepare` shards only under an accelerate launch with an FSDP configuration"
        )
    inner = wrap_names(ctx, call)[0]
    body, first, last = ctx.tree.common_block(optimizer.node, call)
    opt_name = assigned_name(ctx.tree.statement_of(optimizer.node), optimizer.node)
    if inner is None or opt_name is None:
        raise NotExecutable("the optimizer or the sharded model is not bound to a name of its own")
    # (the wrap's own statement at the level of the optimizer's: a wrap under an `if` is refused)
    wrapped = assigned_name(body[last], call) if "fully_shard" not in (model.callee(shard) or "") else inner
    if wrapped is None:
        raise NotExecutable("the wrapped model is not bound to a name")
    source = model.source
    written = region_text(source, statements_region(model, body[first], body[last]))
    rest = region_text(source, statements_region(model, body[first + 1], body[last]))
    moved = rest + region_text(source, statements_region(model, body[first], body[first]))
    notes = [
        f"`{inner}` is a tiny model of two linear blocks; the harness runs one forward, backward and step"
    ]
    roles = {inner: "__TlBlocks__()"}
    programs = {
        "as_written": BLOCKS_MODEL + _bound_program(model, optimizer.scope, written, roles, notes),
        "fixed": BLOCKS_MODEL + _bound_program(model, optimizer.scope, moved, roles, notes),
    }
    return {
        "driver": "fsdp_order",
        "programs": programs,
        "model": wrapped,
        "optimizer": opt_name,
        "notes": notes,
    }


def tl506(ctx: ProbeContext) -> dict[str, Any]:
    """The user's wrap on a tiny model, a backward with large gradients, then the user's clip
    statement vs the same bound through FSDP's own ``clip_grad_norm_``, on each of two ranks."""
    model = ctx.model
    clip = call_site_at(model, ctx.finding)
    wrap = ctx.related(ShardedClipLocalNorm.WRAP)
    call, clip_call = wrap.node, clip.node
    assert isinstance(call, cst.Call) and isinstance(clip_call, cst.Call)
    inner, outer = wrap_names(ctx, call)
    max_norm = _argument(clip_call, "max_norm", 1)
    if inner is None or outer is None or max_norm is None:
        raise NotExecutable("the wrapped model or the clipping bound is not a name or value of its own")
    norm_type = _argument(clip_call, "norm_type", 2)
    method = f"{outer}.clip_grad_norm_({model.code(max_norm)}"
    method += f", norm_type={model.code(norm_type)})" if norm_type is not None else ")"
    clip_statement = ctx.tree.statement_of(clip_call)
    wrap_code = _statement_text(ctx, ctx.tree.statement_of(call))
    notes = [f"`{inner}` is a tiny two-layer model; its loss is scaled so that both clips act"]
    programs = {}
    for name, edits in (("as_written", []), ("reference", [replace_node(model, clip_call, method)])):
        after = "def __tl_after_backward__():\n" + indent(_statement_text(ctx, clip_statement, edits))
        programs[name] = _bound_program(model, clip.scope, wrap_code + after, {inner: TINY}, notes)
    return {"driver": "fsdp_clip", "programs": programs, "model": outer, "notes": notes}


def tl110(ctx: ProbeContext) -> dict[str, Any]:
    """The user's mixed-precision policy on an FSDP-wrapped tiny model (FSDP1's class or FSDP2's
    ``fully_shard``, whichever the policy belongs to) on two ranks: the dtype of the gradient
    reduce-scatter as written vs with ``reduce_dtype=torch.float32``."""
    model = ctx.model
    site = call_site_at(model, ctx.finding)
    call = site.node
    assert isinstance(call, cst.Call)
    kept = [a for a in call.args if not (a.keyword is not None and a.keyword.value == "reduce_dtype")]
    fp32 = cst.Arg(
        keyword=cst.Name("reduce_dtype"),
        value=cst.parse_expression("__tl_torch__.float32"),
        equal=cst.AssignEqual(),
    )
    if kept:
        kept[-1] = kept[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    reference = cst.Module(body=[]).code_for_node(call.with_changes(args=[*kept, fp32]))
    if (model.callee(site) or "").endswith("MixedPrecisionPolicy"):
        wrap = "__tl_wrapped__ = __tl__.tiny_model()\n__tl_fsdp__.fully_shard(__tl_wrapped__, mp_policy=__tl_policy__)\n"
        kind = "FSDP2's fully_shard"
    else:
        wrap = "__tl_wrapped__ = __tl_fsdp__.FullyShardedDataParallel(__tl__.tiny_model(), mixed_precision=__tl_policy__)\n"
        kind = "FSDP1's FullyShardedDataParallel"
    head = "import torch as __tl_torch__\nimport torch.distributed.fsdp as __tl_fsdp__\n"
    notes = [f"the policy wraps a tiny two-layer model in {kind}"]
    programs = {
        name: _bound_program(model, site.scope, f"{head}__tl_policy__ = {text}\n{wrap}", {}, notes)
        for name, text in (("as_written", model.code(call)), ("reference", reference))
    }
    return {"driver": "fsdp_reduce_dtype", "programs": programs, "notes": notes}
