"""Roles and training events: the file model's view of a training step.

From the call sites of a ``FileModel`` this derives, once per file, which values are GradScalers and
optimizers, and an ordered list of classified events per scope (scaled backward, unscale, clip, step,
update, zero_grad, dtype conversion, checkpoint call, optimizer construction) that rules query.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import libcst as cst

from trainlint.model import FileModel, Scope, Site, attr_name, dotted, keyword, positional, receiver, walk

GRAD_SCALERS = frozenset(
    {
        "torch.amp.GradScaler",
        "torch.amp.grad_scaler.GradScaler",
        "torch.cuda.amp.GradScaler",
        "torch.cuda.amp.grad_scaler.GradScaler",
        "torch.GradScaler",
        "torch.cpu.amp.GradScaler",
    }
)
CLIP_FUNCTIONS = frozenset(
    f"{prefix}.{name}"
    for prefix in ("torch.nn.utils", "torch.nn.utils.clip_grad")
    for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "clip_grad_norm")
)
CHECKPOINT_FUNCTIONS = frozenset(
    {
        "torch.utils.checkpoint.checkpoint",
        "torch.utils.checkpoint.checkpoint_sequential",
    }
)
LOW_PRECISION_DTYPES = frozenset(
    {"torch.float16", "torch.half", "torch.bfloat16"},
)
OPTIMIZER_PREFIXES = (
    "torch.optim.",
    "bitsandbytes.optim.",
    "bnb.optim.",
    "apex.optimizers.",
    "timm.optim.",
    "torch.distributed.optim.",
    "deepspeed.ops.adam.",
    "deepspeed.ops.lamb.",
    "transformers.AdamW",
    "transformers.Adafactor",
    "transformers.optimization.AdamW",
    "transformers.optimization.Adafactor",
    "lion_pytorch.",
)
NOT_OPTIMIZERS = ("torch.optim.lr_scheduler", "torch.optim.swa_utils", "torch.optim.Optimizer")
# Wrappers and frameworks that keep fp32 master weights for low-precision models.
MASTER_WEIGHT_WRAPPERS = (
    "FP16_Optimizer",
    "MixedPrecisionOptimizer",
    "initialize",
    "Float16OptimizerWithFloat16Params",
)
MASTER_WEIGHT_MODULES = ("apex.", "deepspeed.", "megatron.")


def is_optimizer_class(qualname: str | None) -> bool:
    if not qualname or qualname.startswith(NOT_OPTIMIZERS):
        return False
    return qualname.startswith(OPTIMIZER_PREFIXES)


@dataclass(eq=False)
class Event:
    kind: str
    site: Site
    key: str | None = None  # the receiver (scaler, optimizer, module) as dotted text, when known

    @property
    def call(self) -> cst.Call:
        assert isinstance(self.site.node, cst.Call)
        return self.site.node

    @property
    def order(self) -> int:
        return self.site.order


class Training:
    """Roles and events of one file; built lazily from the file model."""

    def __init__(self, model: FileModel) -> None:
        self.model = model

    # -- roles ----------------------------------------------------------------------------------------
    @functools.cached_property
    def _method_receivers(self) -> dict[str, set[str]]:
        """For each method name, the dotted receivers it is called on anywhere in the file."""
        out: dict[str, set[str]] = {}
        for site in self.model.calls:
            call = site.node
            assert isinstance(call, cst.Call)
            name = attr_name(call)
            key = dotted(receiver(call))
            if name and key and isinstance(call.func, cst.Attribute):
                out.setdefault(name, set()).add(key)
        return out

    def is_scaler(self, expr: cst.CSTNode | None, scope: Scope) -> bool:
        """A GradScaler by construction (``GradScaler(...)`` assigned to it) or by use: it is used as
        ``x.scale(loss).backward()`` and also has ``step``/``update``/``unscale_`` called on it."""
        key = dotted(expr)
        if key is None:
            return False
        for _, callee in self.model.call_values(expr, scope):
            if callee in GRAD_SCALERS:
                return True
        used = self._method_receivers
        return key in used.get("scale", set()) and any(
            key in used.get(m, set()) for m in ("step", "update", "unscale_")
        )

    def is_optimizer(self, expr: cst.CSTNode | None, scope: Scope) -> bool:
        return any(is_optimizer_class(callee) for _, callee in self.model.call_values(expr, scope))

    # -- events ---------------------------------------------------------------------------------------
    def _classify(self, site: Site) -> Event | None:
        call = site.node
        assert isinstance(call, cst.Call)
        model = self.model
        name = attr_name(call)
        recv = receiver(call)
        callee = model.callee(site)
        if callee in CLIP_FUNCTIONS:
            return Event("clip", site)
        if callee in CHECKPOINT_FUNCTIONS:
            return Event("checkpoint", site)
        if is_optimizer_class(callee):
            return Event("optimizer", site)
        if recv is None or name is None:
            return None
        if name == "backward":
            inner = recv
            if (
                isinstance(inner, cst.Call)
                and attr_name(inner) == "scale"
                and self.is_scaler(receiver(inner), site.scope)
            ):
                return Event("scaled_backward", site, dotted(receiver(inner)))
            return Event("backward", site, dotted(recv))
        if name in ("unscale_", "update") and self.is_scaler(recv, site.scope):
            return Event("unscale" if name == "unscale_" else "update", site, dotted(recv))
        if name == "step":
            if self.is_scaler(recv, site.scope):
                return Event("scaler_step", site, dotted(recv))
            return Event("step", site, dotted(recv))
        if name == "zero_grad":
            return Event("zero_grad", site, dotted(recv))
        if self.low_precision_conversion(call, site.scope):
            return Event("conversion", site, dotted(recv))
        return None

    def low_precision_conversion(self, call: cst.Call, scope: Scope) -> bool:
        """``.half()``, ``.bfloat16()``, ``.to(torch.float16)``, ``.to(device, dtype=torch.bfloat16)``."""
        name = attr_name(call)
        if not isinstance(call.func, cst.Attribute):
            return False
        if name in ("half", "bfloat16") and not call.args:
            return True
        if name == "to":
            candidates = [a.value for a in call.args if a.keyword is None or a.keyword.value == "dtype"]
            return any(self.is_low_precision_dtype(c, scope) for c in candidates)
        return False

    def is_low_precision_dtype(self, expr: cst.CSTNode, scope: Scope) -> bool:
        if self.model.qualname(expr, scope) in LOW_PRECISION_DTYPES:
            return True
        if isinstance(expr, cst.Name):
            values = self.model.values_of(expr, scope)
            return bool(values) and all(self.model.qualname(v, scope) in LOW_PRECISION_DTYPES for v in values)
        return False

    @functools.cached_property
    def events(self) -> list[Event]:
        out = []
        for site in self.model.calls:
            event = self._classify(site)
            if event is not None:
                out.append(event)
        return out

    def events_in(self, scope: Scope, *kinds: str) -> list[Event]:
        wanted = set(kinds)
        return [e for e in self.events if e.site.scope is scope and (not wanted or e.kind in wanted)]

    def of_kind(self, *kinds: str) -> list[Event]:
        wanted = set(kinds)
        return [e for e in self.events if e.kind in wanted]


def mentions_parameters_of(expr: cst.CSTNode, key: str) -> bool:
    """Whether ``expr`` contains ``<key>.parameters()`` or ``<key>.named_parameters()``."""
    for node in walk(expr):
        if (
            isinstance(node, cst.Call)
            and attr_name(node) in ("parameters", "named_parameters")
            and dotted(receiver(node)) == key
        ):
            return True
    return False


def first_arg(call: cst.Call, name: str | None = None) -> cst.BaseExpression | None:
    args = positional(call)
    if args:
        return args[0]
    if name is not None:
        kw = keyword(call, name)
        if kw is not None:
            return kw.value
    return None
