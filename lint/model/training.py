"""Roles and training events: the file model's view of a training step.

From the call sites of a ``FileModel`` this derives, once per file, which values are GradScalers and
optimizers, and an ordered list of classified events per scope (scaled backward, unscale, clip, step,
update, zero_grad, dtype conversion, checkpoint call, optimizer construction) that rules query.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import libcst as cst

from trainlint.model.crossfile import project_optimizer_class, returned_callee
from trainlint.model.filemodel import FileModel, Frame, Scope, Site
from trainlint.model.syntax import attr_name, dotted, first_arg, receiver, walk, walk_scope
from trainlint.model.vocab import (
    BACKWARD_NAMES,
    CHECKPOINT_FUNCTIONS,
    CLIP_FUNCTIONS,
    DDP_CLASSES,
    GRAD_SCALERS,
    LOW_PRECISION_DTYPES,
    NOT_OPTIMIZERS,
    OPTIMIZER_PREFIXES,
    OTHER_ENGINES,
    SCALER_CLASS_SUFFIX,
    SYNC_CONTROLS,
)
from trainlint.model.vocab import OPTIMIZER_NAME as OPTIMIZER_NAME  # (rules import these from here)
from trainlint.model.vocab import is_step_count_name as is_step_count_name


class EventKind(str, enum.Enum):
    """What a classified call does in a training step. A ``str`` enum: ``kind == "update"`` holds."""

    BACKWARD = "backward"
    SCALED_BACKWARD = "scaled_backward"
    UNSCALE = "unscale"
    UPDATE = "update"
    SCALER_STEP = "scaler_step"
    STEP = "step"
    ZERO_GRAD = "zero_grad"
    CLIP = "clip"
    CHECKPOINT = "checkpoint"
    OPTIMIZER = "optimizer"
    CONVERSION = "conversion"

    def __str__(self) -> str:
        return self.value


def is_backward_call(call: cst.Call) -> bool:
    """``x.backward()``, ``fabric.backward(loss)``, ``self.manual_backward(loss)``."""
    return attr_name(call) in BACKWARD_NAMES


def is_modulo(expr: cst.CSTNode) -> bool:
    """``a % b`` where ``b`` is not the literal 2 (parity is not an accumulation schedule)."""
    return (
        isinstance(expr, cst.BinaryOperation)
        and isinstance(expr.operator, cst.Modulo)
        and not (isinstance(expr.right, cst.Integer) and expr.right.value == "2")
        and not isinstance(expr.left, cst.SimpleString | cst.FormattedString | cst.ConcatenatedString)
    )


def is_optimizer_class(qualname: str | None) -> bool:
    if not qualname or qualname.startswith(NOT_OPTIMIZERS):
        return False
    return qualname.startswith(OPTIMIZER_PREFIXES)


@dataclass(eq=False)
class Event:
    kind: EventKind
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
        for value in self.model.values_of(expr, scope):
            # ``GradScaler(...) if use_amp else None`` counts: the scaler path is the one that matters.
            options = [value.body, value.orelse] if isinstance(value, cst.IfExp) else [value]
            for option in options:
                if isinstance(option, cst.Call) and self._makes_scaler(option, scope):
                    return True
        if "." not in key and self._scaler_parameter(key, scope):
            return True
        used = self._method_receivers
        return key in used.get("scale", set()) and any(
            key in used.get(m, set()) for m in ("step", "update", "unscale_")
        )

    def _makes_scaler(self, call: cst.Call, scope: Scope) -> bool:
        """``GradScaler(...)``, or a call of another project file's factory that returns one."""
        callee = self.model.qualname(call.func, scope)
        if callee in GRAD_SCALERS:
            return True
        fact = self.model.elsewhere(callee)
        returned = returned_callee(self.model, fact) if fact is not None else None
        return returned is not None and returned[0] in GRAD_SCALERS

    def _scaler_parameter(self, name: str, scope: Scope) -> bool:
        """A parameter annotated ``GradScaler`` or named ``scaler``/``grad_scaler``/...: the caller
        (often in another file: an "updater" or a callback) passes the trainer's scaler in."""
        binding = self.model.lookup(name, scope)
        if binding is None or binding.kind != "param" or not isinstance(binding.node, cst.Param):
            return False
        annotation = binding.node.annotation
        if annotation is not None:
            # ``Optional[GradScaler]``, ``GradScaler | None``: the scaler when one is passed
            return any(
                (dotted(node) or "").endswith(SCALER_CLASS_SUFFIX) for node in walk(annotation.annotation)
            )
        lowered = name.lower()
        return lowered.endswith("scaler") and not lowered.startswith(("lr", "sched"))

    def is_optimizer(self, expr: cst.CSTNode | None, scope: Scope) -> bool:
        return any(is_optimizer_class(callee) for _, callee in self.model.call_values(expr, scope))

    @functools.cached_property
    def _scaler_arguments(self) -> set[str]:
        """Dotted texts passed to ``scaler.step(x)`` / ``scaler.unscale_(x)`` anywhere in the file."""
        out = set()
        for event in self.events:
            if event.kind in (EventKind.SCALER_STEP, EventKind.UNSCALE):
                arg = first_arg(event.call, "optimizer")
                key = dotted(arg) if arg is not None else None
                if key:
                    out.add(key)
        return out

    def is_optimizer_like(self, expr: cst.CSTNode | None, scope: Scope) -> bool:
        """An optimizer by construction, by use (passed to ``scaler.step``/``scaler.unscale_``), or,
        for parameters, factories (``build_optimizer(cfg)``) and attributes whose construction is not
        visible, by a name such as ``optimizer``, ``self.optim``, ``opt_g`` or ``d_optimizer`` (never a
        ``*sched*`` name nor something built by a learning-rate scheduler class)."""
        key = dotted(expr)
        if key is None:
            return False
        if self.is_optimizer(expr, scope) or key in self._scaler_arguments:
            return True
        for _, callee in self.model.call_values(expr, scope):
            if callee and ("lr_scheduler" in callee or "sched" in callee.rsplit(".", 1)[-1].lower()):
                return False
        return bool(OPTIMIZER_NAME.match(key.rsplit(".", 1)[-1])) and "sched" not in key.lower()

    # -- accumulation ---------------------------------------------------------------------------------
    def accumulation_condition(self, frame_or_test: Frame | cst.BaseExpression, scope: Scope) -> bool:
        """Whether an ``if`` (a Frame of kind ``if``, or a test expression) is a gradient-accumulation
        condition, in either polarity. Recognised forms:

        - a modulo comparison: ``(i + 1) % accum == 0``, ``step % n != 0``, ``not i % n``,
          ``i % n == n - 1`` (any modulo whose divisor is not the literal 2, which is parity);
        - ``accelerator.sync_gradients`` (any ``x.sync_gradients``) and ``not ...`` of it;
        - any ``and``/``or`` that contains one: ``step % accum == 0 or is_last_batch``;
        - a local name or ``self.attr`` every assignment of which is one: ``is_update_step = (i + 1)
          % accum == 0`` then ``if is_update_step:``;
        - for a Frame only: a counter reset, ``if count == accum:`` whose body sets ``count = 0``.
        """
        if isinstance(frame_or_test, Frame):
            node = frame_or_test.node
            if frame_or_test.kind != "if" or not isinstance(node, cst.If):
                return False
            if self._accumulation_test(node.test, scope, 0):
                return True
            return self._counter_reset(node)
        return self._accumulation_test(frame_or_test, scope, 0)

    def _accumulation_test(self, test: cst.BaseExpression, scope: Scope, depth: int) -> bool:
        if depth > 4:
            return False
        if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
            return self._accumulation_test(test.expression, scope, depth + 1)
        if isinstance(test, cst.BooleanOperation):
            return self._accumulation_test(test.left, scope, depth + 1) or self._accumulation_test(
                test.right, scope, depth + 1
            )
        if isinstance(test, cst.Attribute) and test.attr.value == "sync_gradients":
            return True
        if is_modulo(test) or (
            isinstance(test, cst.Comparison)
            and (is_modulo(test.left) or any(is_modulo(c.comparator) for c in test.comparisons))
        ):
            return True
        if isinstance(test, cst.Name | cst.Attribute):
            values = self.model.values_of(test, scope)
            return bool(values) and all(self._accumulation_test(v, scope, depth + 1) for v in values)
        return False

    @staticmethod
    def _counter_reset(node: cst.If) -> bool:
        test = node.test
        if not (
            isinstance(test, cst.Comparison)
            and isinstance(test.comparisons[0].operator, cst.Equal | cst.GreaterThanEqual)
        ):
            return False
        names = {dotted(test.left), *(dotted(c.comparator) for c in test.comparisons)} - {None}
        for sub in walk(node.body):
            if isinstance(sub, cst.Assign) and isinstance(sub.value, cst.Integer) and sub.value.value == "0":
                if any(dotted(t.target) in names for t in sub.targets):
                    return True
        return False

    def under_accumulation(self, site: Site, loop: cst.CSTNode | None = None) -> Frame | None:
        """The innermost ``if`` frame around ``site`` that is an accumulation condition, looking only
        inside ``loop`` when it is given (frames outside that loop do not count)."""
        frames = list(site.frames)
        if loop is not None and loop is not site.scope.node:  # (a framework step method: all frames)
            index = next((i for i, f in enumerate(frames) if f.node is loop), None)
            if index is None:
                return None
            frames = frames[index + 1 :]
        for frame in reversed(frames):
            if frame.kind == "if" and self.accumulation_condition(frame, site.scope):
                return frame
        return None

    # -- events ---------------------------------------------------------------------------------------
    def _classify(self, site: Site) -> Event | None:
        call = site.node
        assert isinstance(call, cst.Call)
        model = self.model
        name = attr_name(call)
        recv = receiver(call)
        callee = model.callee(site)
        if callee in CLIP_FUNCTIONS:
            return Event(EventKind.CLIP, site)
        if callee in CHECKPOINT_FUNCTIONS:
            return Event(EventKind.CHECKPOINT, site)
        if is_optimizer_class(callee) or project_optimizer_class(model, callee):
            return Event(EventKind.OPTIMIZER, site)
        if recv is None or name is None:
            return None
        if name == "backward":
            inner = recv
            if (
                isinstance(inner, cst.Call)
                and attr_name(inner) == "scale"
                and self.is_scaler(receiver(inner), site.scope)
            ):
                return Event(EventKind.SCALED_BACKWARD, site, dotted(receiver(inner)))
            return Event(EventKind.BACKWARD, site, dotted(recv))
        if name in ("unscale_", "update") and self.is_scaler(recv, site.scope):
            kind = EventKind.UNSCALE if name == "unscale_" else EventKind.UPDATE
            return Event(kind, site, dotted(recv))
        if name == "step":
            if self.is_scaler(recv, site.scope):
                return Event(EventKind.SCALER_STEP, site, dotted(recv))
            return Event(EventKind.STEP, site, dotted(recv))
        if name == "zero_grad":
            return Event(EventKind.ZERO_GRAD, site, dotted(recv))
        if self.low_precision_conversion(call, site.scope):
            return Event(EventKind.CONVERSION, site, dotted(recv))
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
        """``torch.float16``/``torch.half``/``torch.bfloat16``, or a local name every assignment of which
        is one (``weight_dtype = torch.float32`` then ``= torch.bfloat16`` under a flag is unknown)."""
        if isinstance(expr, cst.Name):
            values = self.model.values_of(expr, scope)
            if values:
                return all(self.model.qualname(v, scope) in LOW_PRECISION_DTYPES for v in values)
        return self.model.qualname(expr, scope) in LOW_PRECISION_DTYPES

    @functools.cached_property
    def events(self) -> list[Event]:
        out = []
        for site in self.model.calls:
            event = self._classify(site)
            if event is not None:
                out.append(event)
        return out

    def events_in(self, scope: Scope, *kinds: EventKind | str) -> list[Event]:
        wanted = set(kinds)
        return [e for e in self.events if e.site.scope is scope and (not wanted or e.kind in wanted)]

    def of_kind(self, *kinds: EventKind | str) -> list[Event]:
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


def modulo_divisors(node: cst.CSTNode) -> list[str]:
    """``n`` of every ``x % n`` below ``node`` (dotted)."""
    out = []
    for inner in walk(node):
        if isinstance(inner, cst.BinaryOperation) and isinstance(inner.operator, cst.Modulo):
            key = dotted(inner.right)
            if key is not None:
                out.append(key)
    return out


def ddp_models(model: FileModel) -> set[str]:
    """Dotted names bound to a ``DistributedDataParallel(...)`` anywhere in the file."""
    out = set()
    for site in model.calls_to(*DDP_CLASSES):
        statement = site.statement
        if isinstance(statement, cst.SimpleStatementLine):
            for small in statement.body:
                if isinstance(small, cst.Assign | cst.AnnAssign) and small.value is site.node:
                    targets = (
                        [t.target for t in small.targets] if isinstance(small, cst.Assign) else [small.target]
                    )
                    out.update(k for k in (dotted(t) for t in targets) if k)
    return out


def counted_by_callers(model: FileModel, expr: cst.BaseExpression, scope: Scope) -> bool:
    """A parameter that every call of its function in the file passes as ``len(batches)`` from inside
    a loop over ``batches``: the number of micro-batches, counted by the trainer's other method that
    loops over them (``self.micro_step(batch, len(micro_batches))``)."""
    binding = model.lookup(expr.value, scope) if isinstance(expr, cst.Name) else None
    function = scope.node
    if binding is None or binding.kind != "param" or not isinstance(function, cst.FunctionDef):
        return False
    params = [p.name.value for p in (*function.params.posonly_params, *function.params.params)]
    if scope.parent is not None and scope.parent.kind == "class" and params[:1] == ["self"]:
        params = params[1:]
    if binding.name not in params:
        return False
    index, found = params.index(binding.name), False
    for site in model.calls:
        if model.local_callee(site) is not function:
            continue
        call = site.node
        assert isinstance(call, cst.Call)
        passed = [a.value for a in call.args if a.keyword is not None and a.keyword.value == binding.name]
        positional_args = [a.value for a in call.args if a.keyword is None and not a.star]
        passed += positional_args[index : index + 1]
        value = passed[0] if passed else None
        if value is None or not _len_of_a_loop(model, value, site):
            return False
        found = True
    return found


def _len_of_a_loop(model: FileModel, value: cst.BaseExpression, site: Site) -> bool:
    """``len(batches)`` where ``site`` sits in a ``for`` loop over ``batches`` (or ``enumerate(batches)``)."""
    if not (isinstance(value, cst.Call) and model.qualname(value.func, site.scope) == "builtins.len"):
        return False
    counted = dotted(value.args[0].value) if value.args else None
    if counted is None:
        return False
    for frame in site.frames:
        if frame.kind == "loop" and isinstance(frame.node, cst.For):
            source = frame.node.iter
            if isinstance(source, cst.Call) and dotted(source.func) == "enumerate" and source.args:
                source = source.args[0].value
            if dotted(source) == counted:
                return True
    return False


def counts_loop_items(model: FileModel, expr: cst.BaseExpression, site: Site) -> bool:
    """The number of micro-batches a division inside the loop over them divides by: ``len(batches)``
    in ``for batch in batches``, or a name of the scope bound to it before (``n = len(batches)``)."""
    if _len_of_a_loop(model, expr, site):
        return True
    if not isinstance(expr, cst.Name):
        return False
    values = [
        s.node.value
        for s in model.assigns
        if s.scope is site.scope
        and s.order < site.order
        and isinstance(s.node, cst.Assign)
        and any(isinstance(t.target, cst.Name) and t.target.value == expr.value for t in s.node.targets)
    ]
    return bool(values) and _len_of_a_loop(model, values[-1], site)


# -- the file's own helpers that a scope calls, and the events they run -------------------------------
def called_scope(model: FileModel, site: Site) -> Scope | None:
    """The scope of the file's own function or method (``f()``, ``self.f()``) the call at ``site`` runs."""
    function = model.local_callee(site)
    return model.scope_for(function) if function is not None else None


def helper_scopes(model: FileModel, scope: Scope) -> list[Scope]:
    """The scopes of the file's own functions and ``self.`` methods that ``scope`` calls directly: a
    trainer's loop often calls a ``backward_step`` and an ``optimizer_step`` method."""
    out: list[Scope] = []
    for site in model.calls:
        if site.scope is not scope:
            continue
        found = called_scope(model, site)
        if found is not None and found is not scope and all(found is not s for s in out):
            out.append(found)
    return out


def sites_doing(model: FileModel, scope: Scope, *kinds: EventKind | str) -> list[Site]:
    """The calls in ``scope`` that are events of ``kinds``, and the calls in ``scope`` of the file's own
    functions or methods whose body has such an event (one level: ``self.optimizer_step()``), in order."""
    training = model.training
    out = [e.site for e in training.events_in(scope, *kinds)]
    for site in model.calls:
        if site.scope is not scope:
            continue
        found = called_scope(model, site)
        if found is not None and found is not scope and training.events_in(found, *kinds):
            out.append(site)
    return sorted(out, key=lambda s: s.order)


def backward_sites(model: FileModel) -> list[Site]:
    """Every backward, and every call of a function or method of the file that runs one."""
    scopes = {id(s.scope): s.scope for s in model.calls}
    return [
        site for scope in scopes.values() for site in sites_doing(model, scope, "backward", "scaled_backward")
    ]


def mentions_sync_control(scope: Scope) -> bool:
    """The scope names something that controls DDP's gradient synchronisation (``model.no_sync()``,
    ``require_backward_grad_sync``, ``accelerator.accumulate``, Fabric's ``no_backward_sync``...)."""
    for node in walk_scope(scope.node):
        if isinstance(node, cst.Attribute) and node.attr.value in SYNC_CONTROLS:
            return True
        if isinstance(node, cst.Name) and node.value in SYNC_CONTROLS:
            return True
    return False


# -- models prepared by Accelerate ----------------------------------------------------------------------
def accelerate_prepare_calls(model: FileModel) -> list[Site]:
    """The ``<accelerator>.prepare(...)`` calls of the file: a ``prepare`` method of a receiver whose
    dotted name mentions "accelerator" (``accelerator``, ``self.accelerator``)."""
    out = []
    for site in model.calls:
        call = site.node
        assert isinstance(call, cst.Call)
        if attr_name(call) == "prepare" and "accelerator" in (dotted(receiver(call)) or "").lower():
            out.append(site)
    return out


def prepared_models(model: FileModel) -> set[str]:
    """Dotted names bound to what ``accelerator.prepare(...)`` returns: Accelerate wraps the model in
    DistributedDataParallel when it runs on several processes. Unpacked (``model, opt =
    accelerator.prepare(model, opt)``) or indexed once (``self.model = prepared[0]``); the other
    prepared objects (optimizer, loaders) are never called like a model, so callers that look for a
    called model are not misled by them.
    None in a file that sets Accelerate up for DeepSpeed or FSDP: ``accelerator.backward`` then hands
    the loss to the DeepSpeed engine, which owns the accumulation window (Accelerate's own test scripts
    read their accumulation count from the DeepSpeed config), and under FSDP skipping the
    reduce-scatter keeps unsharded gradients, a memory trade-off rather than a plain waste."""
    bound: set[str] = set()
    if any(names_other_engine(node) for node in walk(model.module)):
        return bound
    for site in accelerate_prepare_calls(model):
        bound.update(bound_names(site.statement, site.node))
    if not bound:
        return bound
    for node in walk(model.module):
        if isinstance(node, cst.Assign) and isinstance(node.value, cst.Subscript):
            if dotted(node.value.value) in bound:
                bound.update(bound_names(node, node.value))
    return bound


def bound_names(statement: cst.CSTNode | None, value: cst.CSTNode) -> set[str]:
    """The dotted names ``statement`` assigns ``value`` to, tuples and lists unpacked
    (``model, opt = value``)."""
    smalls = statement.body if isinstance(statement, cst.SimpleStatementLine) else [statement]
    out: set[str] = set()
    for small in smalls:
        if isinstance(small, cst.Assign) and small.value is value:
            for target in small.targets:
                node = target.target
                elements = (
                    [e.value for e in node.elements] if isinstance(node, cst.Tuple | cst.List) else [node]
                )
                out.update(k for k in map(dotted, elements) if k)
    return out


def names_other_engine(node: cst.CSTNode) -> bool:
    """A name or attribute that mentions DeepSpeed or FSDP (``use_deepspeed``, ``FSDPPlugin``)."""
    if isinstance(node, cst.Attribute):
        name = node.attr.value.lower()
    elif isinstance(node, cst.Name):
        name = node.value.lower()
    else:
        return False
    return any(engine in name for engine in OTHER_ENGINES)
