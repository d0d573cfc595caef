"""Loop windows: the statements of one training-loop body (or step function) cut from the user's file
and run for a few iterations on stand-ins (TL102, TL103, TL104, TL302, TL303, TL501).

The window is the run of the body's statements from the first to the last one that takes part in the
training step (the loss computation, backward, unscale/clip, optimizer and scaler steps, zero_grad, the
flagged statement), plus earlier statements that compute flags or counters it reads. Inside it:

- the statement that computes the loss keeps its place, but its value becomes the probe's loss of one
  microbatch on the tiny model (each call takes the next batch), so the user's scaling, division and
  backward calls all run as written;
- assignments whose results nothing in the window reads any more (moving data to the device, the
  forward whose output only fed the loss) become ``pass``, and logging calls become ``None``;
- the loop's index variable counts the probe's iterations (in a step function run once per batch,
  Lightning's ``training_step``, its ``batch_idx`` parameter does); counters and running totals start
  from the literal value the function gives them before the loop;
- a loss read by key (``out["loss"].backward()``, ``f(x)["loss"].mean()``) comes in a dict under
  that key; a flagged statement in a loop nested in the training loop (``for k, v in
  out.items(): total[k] += v``) gets the body of the loop that also holds the backward.

Roles are bound as elsewhere: the scaler to a GradScaler with a large fixed scale (``enabled=`` kept),
the optimizer to the user's class over the tiny model (watched, so that every real step records the
gradients it applied), the model to the tiny model, ``accelerator``/``fabric`` to a plain backward, the
accumulation count to the file's value, learning-rate schedulers to no-ops (noted), Lightning's
``self.manual_backward`` to a plain backward. Names the probe cannot build but whose use does not
decide the verdict are named in the notes: a context manager only entered (a no-op context), keyword
arguments only unpacked (``**kwargs``, passed empty), a clip threshold set at run time (1.0). Any other
free name goes through the ``Binder`` and, if it cannot be bound, makes the probe ``not-executable``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import libcst as cst

from trainlint.model import (
    FileModel,
    Frame,
    Scope,
    Site,
    attr_name,
    dotted,
    exclusive,
    in_loop,
    innermost_loop,
    is_backward_call,
    positional,
    receiver,
    walk,
)
from trainlint.verify.context import ProbeContext, TextEdit, replace_node
from trainlint.verify.loop_roles import (
    accumulation_roles,
    index_bindings,
    parameters_owner,
    training_roles,
)
from trainlint.verify.source import NotExecutable, analyse_names, indent, is_literal
from trainlint.verify.window import (
    Binder,
    Region,
    clip_threshold_names,
    context_only_names,
    output_key,
    start_value,
    unpacked_only_names,
    window_code,
)

LOGGING_HEADS = frozenset(
    {
        "print",
        "logger",
        "logging",
        "log",
        "wandb",
        "writer",
        "tb_writer",
        "summary_writer",
        "pbar",
        "progress_bar",
        "tqdm",
        "mlflow",
        "neptune",
        "tracker",
        "swanlab",
        "comet_ml",
        "experiment",
    }
)
LOGGING_CALLS = frozenset(
    {
        "accelerator.print",
        "accelerator.log",
        "fabric.print",
        "fabric.log",
        "fabric.log_dict",
        "self.log",
        "self.log_dict",
        "self.logger.info",
    }
)
# Methods that keep a loss a loss: ``loss.mean()``, ``loss.float()``.
LOSS_METHODS = frozenset(
    {
        "mean",
        "sum",
        "float",
        "double",
        "half",
        "to",
        "cuda",
        "contiguous",
        "squeeze",
        "clone",
        "view",
        "reshape",
    }
)
EMA_CALL = re.compile(
    r"(^|[._])(update_)?ema(_model)?([._]|$)", re.IGNORECASE
)  # ``update_ema(...)``, ``ema.update()``
LIGHTNING_ACCESSORS = frozenset({"self.optimizers", "self.lr_schedulers"})
LIGHTNING_CLIPS = frozenset({"self.clip_gradients", "self.configure_gradient_clipping"})
STEP_KINDS = ("scaled_backward", "backward", "unscale", "update", "scaler_step", "step", "zero_grad", "clip")
MAX_ITERATIONS = 16


def loss_expression(model, call: cst.Call) -> tuple[cst.BaseExpression, str | None]:
    """The loss a backward call differentiates, and the receiver of ``x.backward(loss)`` (an
    ``accelerator``/``fabric``) when the loss is its argument."""
    recv = receiver(call)
    if isinstance(recv, cst.Call) and attr_name(recv) == "scale" and positional(recv):
        return positional(recv)[0], None
    args = positional(call)
    if args and recv is not None:
        return args[0], dotted(recv)
    if recv is None:
        raise NotExecutable("the backward call has no loss the probe can find")
    return recv, None


def _loss_root(model, scope: Scope, expr: cst.BaseExpression) -> tuple[str, cst.CSTNode]:
    """Where the loss comes from inside the differentiated expression: ``("name", Name)``,
    ``("attr", Attribute)`` for ``outputs.loss``, ``("call", Call)`` for a loss computed inline,
    ``("output", Call)`` for ``model(b).loss``."""
    node: cst.CSTNode = expr
    for _ in range(20):
        if isinstance(node, cst.BinaryOperation):
            node = node.right if is_literal(node.left) else node.left
        elif isinstance(node, cst.UnaryOperation):
            node = node.expression
        elif isinstance(node, cst.Subscript):
            node = node.value
        elif (
            isinstance(node, cst.Call)
            and isinstance(node.func, cst.Attribute)
            and node.func.attr.value in LOSS_METHODS
            and model.qualname(node.func.value, scope) is None  # not ``torch.mean(x)``
        ):
            node = node.func.value  # ``loss.mean()``, ``loss.float()``
        elif isinstance(node, cst.Name):
            return "name", node
        elif isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name):
            return "attr", node
        elif isinstance(node, cst.Attribute) and isinstance(node.value, cst.Call):
            return "output", node.value
        elif isinstance(node, cst.Call):
            return "call", node
        else:
            break
    raise NotExecutable("the probe cannot tell which value is the loss of the backward call")


def _target_names(target: cst.BaseExpression) -> list[str]:
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, cst.Tuple | cst.List):
        out = []
        for element in target.elements:
            out.extend(_target_names(element.value))
        return out
    return []


def _names_read(expr: cst.CSTNode) -> set[str]:
    """Names in ``expr``, leaving out attribute names (``loss`` in ``out.loss``) and keywords."""
    skip = set()
    for node in walk(expr):
        if isinstance(node, cst.Attribute):
            skip.add(id(node.attr))
        elif isinstance(node, cst.Arg) and node.keyword is not None:
            skip.add(id(node.keyword))
    return {n.value for n in walk(expr) if isinstance(n, cst.Name) and id(n) not in skip}


def _contains(outer: cst.CSTNode, inner: cst.CSTNode) -> bool:
    return any(n is inner for n in walk(outer))


def _is_logging_call(call: cst.Call) -> bool:
    name = dotted(call.func) or ""
    head = name.split(".")[0]
    return name in LOGGING_CALLS or head in LOGGING_HEADS or name.startswith("self.logger.")


def _nested_defs(node: cst.CSTNode) -> list[cst.CSTNode]:
    return [n for n in walk(node) if isinstance(n, cst.FunctionDef | cst.ClassDef | cst.Lambda)]


def _without_nested(node: cst.CSTNode):
    """Nodes of ``node`` not inside a nested def, class or lambda."""
    skip = {id(m) for d in _nested_defs(node) for m in walk(d) if m is not d}
    return [n for n in walk(node) if id(n) not in skip]


@dataclass
class LoopWindow:
    """A loop body cut out of the file, ready to be rendered once per variant."""

    ctx: ProbeContext
    scope: Scope
    loop: Frame | None
    regions: list[Region]
    common: list[TextEdit]
    model_expr: str
    iterations: int
    accumulation: int | None
    roles: dict[str, str] = field(default_factory=dict)
    per_iteration: list[str] = field(default_factory=list)
    state: list[str] = field(default_factory=list)
    reserved: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    contexts: set[str] = field(default_factory=set)  # names only used as ``with name:``

    def code(self, edits: list[TextEdit]) -> str:
        return window_code(self.ctx.model.source, self.regions, [*self.common, *edits])

    def render(
        self,
        edits: list[TextEdit],
        *,
        roles: dict[str, str] | None = None,
        setup: list[str] = (),  # type: ignore[assignment]
        overflow: int | None = None,
        census: bool = False,
        iterations: int | None = None,
    ) -> str:
        """The program of one variant."""
        window = self.code(edits)
        variant_roles = dict(self.roles)
        variant_roles.update(roles or {})
        binder = Binder(self.ctx.model, self.scope, roles=variant_roles)
        names = analyse_names(window)
        wanted: list[str] = []
        attrs = list(names.attrs)
        for role in variant_roles.values():
            inner = analyse_names(f"_ = {role}\n")
            wanted.extend(n for n in inner.free if n not in variant_roles)
            attrs.extend(a for a in inner.attrs if a not in attrs)
        wanted.extend(names.free)
        for line in self.state:  # a start value may name an import (``defaultdict``)
            wanted.extend(n for n in analyse_names(line + "\n").free if n not in wanted)
        free = [n for n in dict.fromkeys(wanted) if n not in self.reserved and not n.startswith("__tl")]
        binder.bind(free, attrs)
        unpacked = unpacked_only_names(window)
        # a clip threshold the function sets at run time (not one it never sets: that stays unbound)
        thresholds = {
            n for n in clip_threshold_names(window) if self.ctx.model.values_of(cst.Name(n), self.scope)
        }
        for name in binder.unbound:
            if name in self.contexts:  # only ever entered as ``with ctx:``: a no-op context
                binder.lines.append(f"{name} = __tl__.NullContext({name!r})")
                note = f"`{name}` (a context manager the probe cannot build) entered as a no-op context"
            elif name in thresholds:  # it does not decide these probes
                binder.lines.append(f"{name} = 1.0")
                note = f"`{name}` (the clip threshold, set at run time) taken as 1.0"
            elif name in unpacked:  # only ever passed as ``f(**kwargs)``: the callee's defaults
                binder.lines.append(f"{name} = {{}}")
                note = (
                    f"`{name}` (keyword arguments the probe cannot build) passed empty: `**{name}` gives none"
                )
            else:
                continue
            if note not in self.notes:
                self.notes.append(note)
        self.notes.extend(n for n in binder.notes if n not in self.notes)
        assert binder.carry is not None
        steps = iterations or self.iterations
        lines = [
            "import torch as __tl_torch__",
            binder.carry.code().rstrip("\n"),
            "__tl__.seed(0)",
            "__tl_model__ = __tl__.tiny_model()",
            *setup,
            *binder.lines,
            *self.state,
            f"__tl__.begin_run(__tl_model__, {overflow!r})",
            "__tl_before__ = __tl__.snapshot(__tl_model__)",
            f"__tl_iterations__ = {steps}",
            f"for __tl_step__ in range({steps}):",
            "    __tl__.iteration(__tl_step__)",
        ]
        if census:
            lines.append("    __tl__.census(globals())")
        lines.extend(f"    {line}" for line in self.per_iteration)
        body = "\n".join(line for line in lines if line) + "\n" + indent(window)
        if census:
            body += "__tl__.census(globals())\n"
        return body


@dataclass
class _Cut:
    """The statement list a loop window is cut from, and the edits made to it so far."""

    model: FileModel
    scope: Scope
    body: list[cst.CSTNode]
    index: dict[int, int]  # id of every node -> the index of the body statement that holds it
    common: list[TextEdit] = field(default_factory=list)
    excluded: set[int] = field(default_factory=set)  # ids of nodes whose text the edits replace
    per_iteration: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    step_function: bool = False  # the window is cut from a function body, not a loop's

    def at(self, node: cst.CSTNode) -> int:
        if id(node) not in self.index:
            raise NotExecutable(f"line {self.model.position(node).start.line} is outside the loop body")
        return self.index[id(node)]

    def replace(self, node: cst.CSTNode, text: str) -> None:
        self.common.append(replace_node(self.model, node, text))
        self.excluded.update(id(n) for n in walk(node))

    def statements(self, kept: list[int]) -> list[cst.CSTNode]:
        return [self.body[i] for i in kept]


def build_loop(
    ctx: ProbeContext,
    anchor: Site,
    backward: Site,
    relevant: list[Site],
    *,
    model_expr: str = "__tl_model__",
    iterations: int | None = None,
) -> LoopWindow:
    """The loop window around ``anchor`` (the flagged call) whose loss is the one ``backward``
    differentiates; ``relevant`` are other sites the window must contain."""
    loop, cut = _loop_body(ctx.model, anchor, backward)
    backward_receiver, producer_index = _replace_loss(cut, backward, model_expr)
    events, lo, hi, kept = _which_statements(cut, anchor, backward, relevant, producer_index)
    kept = _with_later_counters(cut, _with_earlier_statements(cut, kept, lo), hi)
    _drop_dead_assignments(cut, kept, {id(s.node) for s in (anchor, backward, *relevant)}, events)
    window = LoopWindow(
        ctx=ctx,
        scope=cut.scope,
        loop=loop,
        regions=_regions(ctx.model, cut.body, kept),
        common=cut.common,
        model_expr=model_expr,
        iterations=iterations or 3,
        accumulation=None,
        per_iteration=cut.per_iteration,
    )
    as_written = window.code([])
    names = analyse_names(as_written)
    window.contexts = context_only_names(as_written)
    # -- the loop's own variables -------------------------------------------------------------------
    cut.per_iteration[:0] = index_bindings(ctx.model, loop, names.free, window)
    # -- roles --------------------------------------------------------------------------------------
    if backward_receiver == "self" and attr_name(backward.node) == "manual_backward":  # type: ignore[arg-type]
        window.roles["self.manual_backward"] = "__tl__.Backward().backward"
        window.notes.append("`self.manual_backward(loss)` (Lightning) runs `loss.backward()`")
    elif backward_receiver:
        window.roles[backward_receiver] = "__tl__.Backward()"
    window.notes.extend(n for n in cut.notes if n not in window.notes)
    window_events = [e for e in events if lo <= cut.at(e.site.node) <= hi or cut.at(e.site.node) in kept]
    training_roles(cut, window, window_events, events, kept)
    count = accumulation_roles(ctx, cut.scope, cut.statements(kept), window.roles, window.notes)
    window.accumulation = count
    inner = innermost_loop(backward)
    if iterations is None:
        if inner is not None and (loop is None or inner.node is not loop.node):
            window.iterations = 2  # the micro-steps run in an inner loop: each iteration is one window
        else:
            window.iterations = max(2, min(MAX_ITERATIONS, 2 * count)) if count else 3
    _carried_state(window, as_written, names.free)
    return window


def _loop_body(model: FileModel, anchor: Site, backward: Site) -> tuple[Frame | None, _Cut]:
    """The innermost loop around ``anchor`` (None: the function itself) and its statements."""
    scope = anchor.scope
    if backward.scope is not scope:
        raise NotExecutable("the backward call is in another function than the flagged call")
    loop = innermost_loop(anchor)
    if loop is not None and not in_loop(backward, loop):
        # ``for name, value in out.items(): total[name] += value`` inside the training loop: the
        # window is the body of the loop that holds both
        around = [
            f for f in anchor.frames if f.kind == "loop" and f.branch == "body" and in_loop(backward, f)
        ]
        if not around:
            raise NotExecutable("the backward call is not in the loop of the flagged call")
        loop = around[-1]
    if loop is not None:
        block = loop.node.body  # type: ignore[attr-defined]
        if not isinstance(block, cst.IndentedBlock):
            raise NotExecutable("the loop body is on one line")
        body = list(block.body)
    elif isinstance(scope.node, cst.FunctionDef) and isinstance(scope.node.body, cst.IndentedBlock):
        body = list(scope.node.body.body)
    elif isinstance(scope.node, cst.Module):
        body = list(scope.node.body)
    else:
        raise NotExecutable("the flagged call is not in a loop or function body the probe can run")
    index: dict[int, int] = {}
    for i, stmt in enumerate(body):
        for node in walk(stmt):
            index[id(node)] = i
    return loop, _Cut(model, scope, body, index, step_function=loop is None)


def _replace_loss(cut: _Cut, backward: Site, model_expr: str) -> tuple[str | None, int | None]:
    """Replace the loss ``backward`` differentiates by the probe's own (``__tl__.micro_loss``), where
    the file computes it. Returns the receiver of the backward (``accelerator`` in
    ``accelerator.backward(loss)``) and the index of the first statement that computes the loss."""
    model, scope = cut.model, cut.scope
    call = backward.node
    assert isinstance(call, cst.Call)
    if not is_backward_call(call):  # a function of the file that runs the backward
        raise NotExecutable(
            f"the backward runs inside `{model.code(call.func)}(...)` (line {model.position(call).start.line}), "
            "which the loop calls: the probe runs the loop's own statements, not the functions it calls"
        )
    loss_expr, backward_receiver = loss_expression(model, call)
    kind, root = _loss_root(model, scope, loss_expr)
    base = synthetic = f"__tl__.micro_loss({model_expr})"
    output = f"__tl__.Output(loss={synthetic}, logits=None)"
    if kind in ("call", "output"):
        key = output_key(loss_expr, root) if kind == "call" else None
        cut.replace(root, (f"{{{key!r}: {base}}}" if key else synthetic) if kind == "call" else output)
        return backward_receiver, None
    name = root.value if kind == "name" else root.value.value  # type: ignore[union-attr]
    key = output_key(loss_expr, root) if kind == "name" else None
    if key is not None:  # ``output["loss"].backward()``: what computes ``output`` gives a dict
        synthetic = f"{{{key!r}: {synthetic}}}"
    value_text = synthetic if kind == "name" else output
    producers = _loss_producers(cut, backward, name)
    if not producers:
        cut.per_iteration.append(f"{name} = {value_text}")
    producer_index = None
    for node, targets, value in producers:  # each branch that computes the loss (``if use_amp:``)
        target = targets[0]
        replaced = value
        if isinstance(target, cst.Tuple | cst.List):
            parts = []
            for element in target.elements:
                if isinstance(element, cst.StarredElement):
                    raise NotExecutable("the loss is unpacked with a starred target")
                parts.append(value_text if name in _target_names(element.value) else "None")
            text = "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
        else:
            text = value_text
            # only the call that computes the loss: ``criterion(out, y) / accum`` keeps ``/ accum``
            try:
                inner_kind, inner = _loss_root(model, scope, value)
            except NotExecutable:
                inner_kind, inner = "", value
            if inner_kind == "call" and kind == "name":
                inner_key = output_key(value, inner)  # ``training_losses(...)["loss"].mean()``
                replaced, text = inner, (f"{{{inner_key!r}: {base}}}" if inner_key else synthetic)
            elif inner_kind == "output":
                replaced, text = inner, output
        cut.replace(replaced, text)
        index_here = cut.at(node)
        producer_index = index_here if producer_index is None else min(producer_index, index_here)
    return backward_receiver, producer_index


def _loss_producers(cut: _Cut, backward: Site, name: str) -> list[tuple[cst.CSTNode, list, cst.CSTNode]]:
    """(assignment, its targets, its value) for each assignment of the body that computes ``name``
    before the backward, on a path that reaches it."""
    producers = []
    for site in cut.model.assigns:
        node = site.node
        if site.scope is not cut.scope or site.order >= backward.order or id(node) not in cut.index:
            continue
        if exclusive(site.frames, backward.frames):
            continue
        targets = (
            [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]  # type: ignore[attr-defined]
        )
        if not any(name in _target_names(t) for t in targets):
            continue
        value = node.value  # type: ignore[attr-defined]
        if value is None or name in _names_read(value):
            continue  # ``loss = loss / accum`` keeps the loss: it stays as written
        producers.append((node, targets, value))
    return producers


def _which_statements(
    cut: _Cut, anchor: Site, backward: Site, relevant: list[Site], producer_index: int | None
) -> tuple[list, int, int, list[int]]:
    """The training events of the body, the first and last statement the window needs (the flagged
    call, the backward, the loss, the optimizer's steps) and the statements between them."""
    model, scope = cut.model, cut.scope
    training = model.training
    events = [
        e
        for e in training.events_in(scope, *STEP_KINDS)
        if id(e.site.node) in cut.index and not exclusive(e.site.frames, anchor.frames)
    ]
    wanted = [cut.at(anchor.node), cut.at(backward.node), *(cut.at(s.node) for s in relevant)]
    if producer_index is not None:
        wanted.append(producer_index)
    # a step function (``training_step``) may go on to train another model (a GAN's discriminator)
    # after this one's step: another optimizer's steps after it are left out
    last = max(wanted) if cut.step_function else len(cut.body)
    own = {e.key for e in events if e.kind in ("step", "zero_grad") and cut.at(e.site.node) <= last}
    for e in events:
        if e.kind in ("step", "zero_grad") and not training.is_optimizer_like(receiver(e.call), scope):
            if not (e.kind == "zero_grad" and parameters_owner(model, scope, e, events)):
                continue
        if e.kind in ("step", "zero_grad") and cut.at(e.site.node) > last and e.key not in own:
            continue
        wanted.append(cut.at(e.site.node))
    lo, hi = min(wanted), max(wanted)
    for stmt in cut.body[lo : hi + 1]:
        for node in _without_nested(stmt):
            if isinstance(node, cst.Return | cst.Yield):
                raise NotExecutable(
                    f"the loop body returns or yields at line {model.position(node).start.line}"
                )
    # logging calls become None
    for stmt in cut.body[lo : hi + 1]:
        for node in _without_nested(stmt):
            if (
                isinstance(node, cst.Expr)
                and isinstance(node.value, cst.Call)
                and _is_logging_call(node.value)
            ):
                if not any(_contains(node, s.node) for s in (anchor, backward, *relevant)):
                    cut.replace(node.value, "None")
            elif (
                isinstance(node, cst.Expr)
                and isinstance(node.value, cst.Call)
                and (
                    dotted(node.value.func) in LIGHTNING_CLIPS
                    or EMA_CALL.search(dotted(node.value.func) or "")
                )
            ):
                # Lightning's own clipping runs the same in both variants; an EMA of the weights does
                # not change the model nor the gradients a step applies
                cut.replace(node.value, "None")
                what = (
                    "Lightning"
                    if dotted(node.value.func) in LIGHTNING_CLIPS
                    else "a moving average of the weights"
                )
                cut.notes.append(f"`{dotted(node.value.func)}(...)` ({what}) left out")
    return events, lo, hi, list(range(lo, hi + 1))


def _reads(stmts: list[cst.CSTNode], excluded: set[int], dropped: set[int]) -> set[str]:
    """The names ``stmts`` read, leaving out what they assign, replaced text and dropped statements."""
    out: set[str] = set()
    for stmt in stmts:
        targets: set[int] = set()
        for node in walk(stmt):
            if isinstance(node, cst.Assign):
                for t in node.targets:
                    if isinstance(t.target, cst.Name | cst.Tuple | cst.List):
                        targets.update(id(n) for n in walk(t.target))
            elif isinstance(node, cst.AnnAssign) and isinstance(node.target, cst.Name):
                targets.add(id(node.target))
            elif isinstance(node, cst.For):
                targets.update(id(n) for n in walk(node.target))
        skip = set(excluded) | targets
        for node in walk(stmt):
            if id(node) in dropped:
                skip.update(id(n) for n in walk(node))
        for node in walk(stmt):
            if isinstance(node, cst.Attribute):
                skip.add(id(node.attr))
            elif isinstance(node, cst.Arg) and node.keyword is not None:
                skip.add(id(node.keyword))
        for node in walk(stmt):
            if isinstance(node, cst.Name) and id(node) not in skip:
                out.add(node.value)
    return out


def _with_later_counters(cut: _Cut, kept: list[int], hi: int) -> list[int]:
    """``kept`` with the later statements of the body that count iterations the window's conditions
    read (``global_step += 1`` at the end of the loop body): without them the count never moves."""
    needed = _reads(cut.statements(kept), cut.excluded, set())
    later = []
    for i in range(hi + 1, len(cut.body)):
        stmt = cut.body[i]
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        if any(
            isinstance(small, cst.AugAssign)
            and isinstance(small.target, cst.Name)
            and small.target.value in needed
            for small in stmt.body
        ) and all(isinstance(small, cst.AugAssign) and is_literal(small.value) for small in stmt.body):
            later.append(i)
    return sorted({*kept, *later})


def _with_earlier_statements(cut: _Cut, kept: list[int], lo: int) -> list[int]:
    """``kept`` with the earlier statements that compute names the window reads (flags, counters)."""
    kept = list(kept)
    needed = _reads(cut.statements(kept), cut.excluded, set())
    for i in range(lo - 1, -1, -1):
        stmt = cut.body[i]
        if not isinstance(stmt, cst.SimpleStatementLine) or _lightning_accessor(stmt):
            continue
        assigned = set()
        for small in stmt.body:
            if isinstance(small, cst.Assign):
                for t in small.targets:
                    assigned.update(_target_names(t.target))
            elif isinstance(small, cst.AugAssign | cst.AnnAssign) and isinstance(small.target, cst.Name):
                assigned.add(small.target.value)
        if assigned & needed:
            kept.insert(0, i)
            needed |= _reads([stmt], cut.excluded, set())
    kept.sort()
    return kept


def _lightning_accessor(stmt: cst.SimpleStatementLine) -> bool:
    """``g_opt, d_opt = self.optimizers()``: the probe builds the optimizers and schedulers itself."""
    return any(
        isinstance(small, cst.Assign)
        and isinstance(small.value, cst.Call)
        and dotted(small.value.func) in LIGHTNING_ACCESSORS
        for small in stmt.body
    )


def _assignment_lines(cut: _Cut, kept: list[int], protected: set[int]) -> list[tuple[cst.CSTNode, set[str]]]:
    """(line, names) for each kept line that only assigns plain names and holds no protected node."""
    candidates = []
    for i in kept:
        for node in _without_nested(cut.body[i]):
            if not isinstance(node, cst.SimpleStatementLine):
                continue
            if any(id(n) in protected for n in walk(node)):
                continue
            names: list[str] = []
            ok = True
            for small in node.body:
                if isinstance(small, cst.Assign):
                    for t in small.targets:
                        got = _target_names(t.target)
                        if not got or not isinstance(t.target, cst.Name | cst.Tuple | cst.List):
                            ok = False
                        names.extend(got)
                elif isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name):
                    names.append(small.target.value)
                else:
                    ok = False
            if ok and names:
                candidates.append((node, set(names)))
    return candidates


def _drop_dead_assignments(cut: _Cut, kept: list[int], protected: set[int], events: list) -> None:
    """Replace by ``pass`` the kept assignments nothing in the window reads (until none is left)."""
    protected = protected | {id(e.site.node) for e in events}
    candidates = _assignment_lines(cut, kept, protected)
    dropped: set[int] = set()
    changed = True
    while changed:
        changed = False
        for node, names in candidates:
            if id(node) in dropped:
                continue
            live = _reads(cut.statements(kept), cut.excluded, dropped | {id(node)})
            if not (names & live):
                dropped.add(id(node))
                changed = True
    for node, _ in candidates:
        if id(node) in dropped:
            inner = [e for e in cut.common if _edit_inside(cut.model, e, node)]
            for e in inner:
                cut.common.remove(e)
            cut.common.append(replace_node(cut.model, node, "pass"))


def _carried_state(window: LoopWindow, as_written: str, free: list[str]) -> None:
    """State carried from one iteration to the next: names the window assigns, set to their value
    before the loop."""
    model = window.ctx.model
    assigned_in_window, augmented = _assigned_in(as_written)
    for name in dict.fromkeys([*free, *augmented]):
        if name in window.roles or name in window.reserved or name not in assigned_in_window:
            continue
        value = _initial_value(model, window.scope, window.loop, name)
        if value is not None:
            window.state.append(f"{name} = {value}")
            window.reserved.add(name)
        elif name not in free:  # only ever updated in place: its start value is unknown
            window.state.append(f"{name} = __tl__.Unbound({name!r})")
            window.reserved.add(name)


def _edit_inside(model, edit: TextEdit, node: cst.CSTNode) -> bool:
    pos = model.position(node)
    start = (pos.start.line, pos.start.column + 1)
    end = (pos.end.line, pos.end.column + 1)
    return start <= (edit.line, edit.column) and (edit.end_line, edit.end_column) <= end


def _regions(model, body: list[cst.CSTNode], kept: list[int]) -> list[Region]:
    regions: list[Region] = []
    run: list[int] = []
    for i in kept:
        if run and i != run[-1] + 1:
            regions.append(_region(model, body, run))
            run = []
        run.append(i)
    if run:
        regions.append(_region(model, body, run))
    return regions


def _region(model, body: list[cst.CSTNode], run: list[int]) -> Region:
    first, last = body[run[0]], body[run[-1]]
    start = model.position(first).start.line
    # comments and blank lines that libcst attaches to the statement come first
    return Region(start, model.position(last).end.line)


def _assigned_in(code: str) -> tuple[set[str], list[str]]:
    """Names the code assigns, and those it updates in place (``count += 1``)."""
    out: set[str] = set()
    augmented: list[str] = []
    for node in walk(cst.parse_module(code)):
        if isinstance(node, cst.Assign):
            for t in node.targets:
                out.update(_target_names(t.target))
        elif isinstance(node, cst.AugAssign | cst.AnnAssign) and isinstance(node.target, cst.Name):
            out.add(node.target.value)
            if isinstance(node, cst.AugAssign) and node.target.value not in augmented:
                augmented.append(node.target.value)
        elif (
            isinstance(node, cst.AugAssign)
            and isinstance(node.target, cst.Subscript)
            and isinstance(node.target.value, cst.Name)
        ):  # ``totals[name] += value``: the container is a running total too
            out.add(node.target.value.value)
            if node.target.value.value not in augmented:
                augmented.append(node.target.value.value)
    return out, augmented


def _initial_value(model, scope: Scope, loop: Frame | None, name: str) -> str | None:
    """The literal a counter or running total gets before the loop (``count = 0``)."""
    if loop is None:
        return None
    start = model.position(loop.node).start.line
    value = None
    for site in model.assigns:
        node = site.node
        if site.scope is not scope or not isinstance(node, cst.Assign):
            continue
        if model.position(node).start.line >= start:
            continue
        if any(isinstance(t.target, cst.Name) and t.target.value == name for t in node.targets):
            value = node.value if start_value(node.value) else None
    return model.code(value) if value is not None else None
