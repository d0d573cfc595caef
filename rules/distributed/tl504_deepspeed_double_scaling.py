"""TL504 deepspeed-double-scaling."""

from __future__ import annotations

import re
from collections.abc import Iterator

import libcst as cst

from trainlint.api import Diagnostic, Invalid, Rule, RuleDoc, Severity, method_call_pattern
from trainlint.model import (
    FileModel,
    Scope,
    Site,
    attr_name,
    dotted,
    first_arg,
    keyword,
    receiver,
    switch_of,
    walk_scope,
)
from trainlint.model.training import is_step_count_name
from trainlint.model.vocab import DEEPSPEED_INITIALIZE, DEEPSPEED_SWITCH
from trainlint.rules.distributed._sharding import deepspeed_engines


class DeepspeedDoubleScaling(Rule):
    id = "TL504"
    name = "deepspeed-double-scaling"
    severity = Severity.ERROR
    probe = True
    DIVISION = "division"
    summary = "The loss is divided by the accumulation steps before a DeepSpeed engine's backward, which divides again."
    # A finding needs DeepSpeed (`deepspeed.initialize`, or a switch such as `args.deepspeed` that
    # selects the engine's backward) and the engine's `.backward(` call.
    tokens = ("deepspeed",)
    requires = (method_call_pattern("backward"),)
    # In the code: the engine's backward call.
    gate = (("call:backward",),)
    # And a `.backward(loss)` without `scale_wrt_gas=`, and a division by an accumulation count.
    gate_check = "gate_deepspeed.backward_and_step_count_division"
    doc = RuleDoc(
        what=(
            "Reports `engine.backward(loss)` of an engine returned by `deepspeed.initialize` when the "
            "loss was divided by a gradient-accumulation count first (`loss / gradient_accumulation_steps`"
            ", `loss /= args.grad_accum`, `loss / get_num_microbatches()`, or "
            "`engine.backward(loss / accum)`), unless the call passes `scale_wrt_gas=`. The engine is "
            "also recognised as the receiver of `.backward(loss)` in the branch a DeepSpeed switch "
            "selects (`if args.deepspeed:`), and the division may sit in another function of the file "
            "whose result the caller passes on (Megatron's `forward_step` and `backward_step`). `--verify` runs the loop for one accumulation window through a real "
            "DeepSpeed engine (ZeRO stage 0 on the CPU accelerator, over the probe's two-process gloo "
            "group, configured with the division's accumulation count) and compares the gradient with "
            "the one the engine's own scaling gives; without DeepSpeed installed (it is not a "
            "dependency of trainlint) the verdict is `not-executable: deepspeed is not installed`. "
            "DeepSpeed's shared-memory all-reduce op is switched off in the probe: on a CPU-only "
            "machine `deepspeed.init_distributed` would otherwise JIT-compile it with a C++ toolchain "
            "first (154 s on 2 cores with DeepSpeed 0.19.8, into `~/.cache/torch_extensions`)."
        ),
        why=(
            "`DeepSpeedEngine.backward` already divides the loss by the engine's configured "
            "`gradient_accumulation_steps` (its `scale_wrt_gas=True` default). Dividing by hand as "
            "well makes the gradients K times too small: with 8 accumulation steps every update is "
            "1/8 of what the learning rate says, Adam's normalisation hides part of it but SGD and "
            "gradient clipping thresholds do not (DeepSpeed issue 7439, transformers issue 35808)."
        ),
        example=(
            "engine, optimizer, _, _ = deepspeed.initialize(model=model, config=cfg)\n"
            "for batch in loader:\n"
            "    loss = engine(batch) / args.gradient_accumulation_steps\n"
            "    engine.backward(loss)\n"
            "    engine.step()"
        ),
        use_instead=(
            "engine, optimizer, _, _ = deepspeed.initialize(model=model, config=cfg)\n"
            "for batch in loader:\n"
            "    loss = engine(batch)\n"
            "    engine.backward(loss)  # divides by the configured accumulation steps\n"
            "    engine.step()"
        ),
        references=("https://deepspeed.readthedocs.io/en/latest/training.html",),
    )
    _HEAD = "import deepspeed\nengine, opt, _, _ = deepspeed.initialize(model=net, config=cfg)\n"
    valid = (
        # the engine's backward without manual division
        _HEAD + "for b in loader:\n    loss = engine(b)\n    engine.backward(loss)\n    engine.step()",
        # manual division with the engine told not to divide
        _HEAD
        + "for b in loader:\n    loss = engine(b) / accum_steps\n    engine.backward(loss, scale_wrt_gas=False)",
        # division for logging only, after the backward
        _HEAD + "for b in loader:\n    loss = engine(b)\n    engine.backward(loss)\n"
        "    log_loss = loss / gradient_accumulation_steps",
        # plain PyTorch backward: the division is needed there
        "import torch\nfor b in loader:\n    loss = model(b) / gradient_accumulation_steps\n    loss.backward()",
        # divided by something other than an accumulation count
        _HEAD + "for b in loader:\n    loss = engine(b).sum() / num_tokens\n    engine.backward(loss)",
        # the division is the plain backward's only
        "import torch\nfor b in loader:\n    loss = model(b)\n"
        "    if args.gradient_accumulation_steps > 1 and not args.deepspeed:\n"
        "        loss = loss / args.gradient_accumulation_steps\n"
        "    if args.deepspeed:\n        model.backward(loss)\n    else:\n        loss.backward()",
        # a variable that is not the DeepSpeed engine
        "import deepspeed\nfor b in loader:\n    loss = model(b) / grad_accum\n    accelerator.backward(loss)",
    )
    invalid = (
        Invalid(
            _HEAD
            + "for b in loader:\n    loss = engine(b)\n    loss = loss / args.gradient_accumulation_steps\n"
            "    engine.backward(loss)\n    engine.step()",
            line=6,
        ),
        Invalid(
            _HEAD + "for b in loader:\n    engine.backward(engine(b).loss / accum_steps)\n    engine.step()",
            line=4,
        ),
        Invalid(
            _HEAD
            + "for b in loader:\n    loss = engine(b)\n    loss /= grad_accum\n    engine.backward(loss)",
            line=6,
        ),
        Invalid(
            """
            import deepspeed

            def train(args, model):
                model_engine = deepspeed.initialize(args=args, model=model)[0]
                for step, batch in enumerate(loader):
                    outputs = model_engine(**batch)
                    loss = outputs.loss / model_engine.gradient_accumulation_steps()
                    model_engine.backward(loss)
                    model_engine.step()
            """,
            line=8,
        ),
        Invalid(
            """
            import deepspeed

            class Trainer:
                def __init__(self):
                    self.engine, self.opt, _, self.sched = deepspeed.initialize(model=self.net, config=self.cfg)

                def step(self, batch):
                    loss = self.engine(batch) / self.args.gradient_accumulation_steps
                    self.engine.backward(loss)
            """,
            line=9,
        ),
        Invalid(
            _HEAD + "for b in loader:\n    loss = compute(engine, b) / cfg['gradient_accumulation_steps']\n"
            "    engine.backward(loss)",
            line=5,
        ),
        # Megatron-DeepSpeed: forward_step divides, backward_step runs the engine's backward
        Invalid(
            """
            def forward_step(model, batch):
                loss = model(batch)
                return loss / get_num_microbatches()

            def backward_step(loss, model):
                if args.deepspeed:
                    model.backward(loss)
                else:
                    loss.backward()

            def train_step(model, batches):
                for batch in batches:
                    loss = forward_step(model, batch)
                    backward_step(loss, model)
            """,
            line=7,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        engines = deepspeed_engines(model, DEEPSPEED_INITIALIZE)
        for site in model.calls:
            call = site.node
            assert isinstance(call, cst.Call)
            if attr_name(call) != "backward":
                continue
            if dotted(receiver(call)) not in engines and not _engine_under_guard(model, site):
                continue
            loss = first_arg(call, "loss")
            if loss is None or keyword(call, "scale_wrt_gas") is not None:
                continue
            division = (
                _accumulation_division(loss)
                or _divided_before(model, site, loss)
                or _divided_by_the_caller(model, site, loss)
            )
            if division is None:
                continue
            yield Diagnostic(
                call,
                "The DeepSpeed engine's backward divides the loss by its gradient_accumulation_steps "
                "already; dividing it by hand as well makes every gradient that many times too small. "
                "Remove the manual division.",
                related=((division, "the loss is divided here", DeepspeedDoubleScaling.DIVISION),),
            )


def _counts_steps(expr: cst.BaseExpression) -> bool:
    """An accumulation count: ``accum``, ``args.gradient_accumulation_steps``, ``cfg['grad_accum']``,
    ``engine.gradient_accumulation_steps()``."""
    if isinstance(expr, cst.Call):
        expr = expr.func
    if isinstance(expr, cst.Subscript) and len(expr.slice) == 1:
        index = expr.slice[0].slice
        if isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString):
            return is_step_count_name(index.value.value.strip("'\""))
    name = dotted(expr)
    last = (name or "").rsplit(".", 1)[-1]
    # Megatron's ``get_num_microbatches()``: the micro-batches of one step are the accumulation steps
    return name is not None and (is_step_count_name(last) or _MICRO_BATCH_COUNT.fullmatch(last) is not None)


_MICRO_BATCH_COUNT = re.compile(r"(get_)?(num|n)_?micro_?batch(es)?", re.IGNORECASE)


def _engine_under_guard(model: FileModel, site: Site) -> bool:
    """``model.backward(loss)`` in the branch a DeepSpeed switch selects (``if args.deepspeed:``, the
    ``else`` of ``if not self.use_deepspeed:``): the engine arrives as a parameter or attribute."""
    recv = receiver(site.node) if isinstance(site.node, cst.Call) else None
    key = dotted(recv)
    if key is None or (model.qualname(recv, site.scope) or "").startswith("torch."):
        return False
    return switch_of(site, DEEPSPEED_SWITCH) is not None


def _divided_by_the_caller(model: FileModel, site: Site, loss: cst.BaseExpression) -> cst.CSTNode | None:
    """The loss is a parameter of the file's own function (a pipeline's ``backward_step``) whose
    caller passes what another of its functions (``forward_step``) returned divided by the steps."""
    function = site.scope.node
    if not isinstance(loss, cst.Name) or not isinstance(function, cst.FunctionDef):
        return None
    params = [p.name.value for p in (*function.params.posonly_params, *function.params.params)]
    if loss.value not in params:
        return None  # (the parameter may be rebound on another branch: Megatron scales it for apex)
    index = params.index(loss.value)
    for caller in model.calls:
        if model.local_callee(caller, methods=False) is not function:
            continue
        call = caller.node
        assert isinstance(call, cst.Call)
        passed = keyword(call, loss.value)
        given = [a for a in call.args if a.keyword is None and a.star == ""]
        value = (
            passed.value if passed is not None else given[index].value if 0 <= index < len(given) else None
        )
        for made in model.values_of(value, caller.scope) if value is not None else ():
            producer = (
                model.local_function(made, caller.scope, methods=False)
                if isinstance(made, cst.Call)
                else None
            )
            found = _returns_division(model, producer) if producer is not None else None
            if found is not None:
                return found
    return None


def _returns_division(model: FileModel, function: cst.FunctionDef) -> cst.CSTNode | None:
    """Where ``function`` returns a value divided by an accumulation count (directly or by a name)."""
    scope = model.scope_for(function)
    for node in walk_scope(function.body) if scope is not None else ():
        if isinstance(node, cst.Return) and node.value is not None:
            values = (
                [node.value, *model.values_of(node.value, scope)]
                if isinstance(node.value, cst.Name)
                else [node.value]
            )
            found = next((d for d in map(_accumulation_division, values) if d is not None), None)
            if found is not None:
                return found
    return None


def _accumulation_division(expr: cst.BaseExpression) -> cst.CSTNode | None:
    """``x / accum`` at the top of ``expr`` (parentheses aside)."""
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Divide):
        if _counts_steps(expr.right):
            return expr
    return None


def _divided_before(model: FileModel, backward: Site, loss: cst.BaseExpression) -> cst.CSTNode | None:
    """An assignment ``loss = ... / accum`` or ``loss /= accum`` in the backward's scope, above it."""
    name = dotted(loss)
    if name is None:
        return None
    line = model.position(backward.node).start.line
    skipped = _without_deepspeed(model, backward.scope)
    for node in _statements(backward.scope):
        at = model.position(node).start.line
        if at >= line or any(start <= at <= end for start, end in skipped):
            continue
        if isinstance(node, cst.AugAssign) and isinstance(node.operator, cst.DivideAssign):
            if dotted(node.target) == name and _counts_steps(node.value):
                return node
        if isinstance(node, cst.Assign) and any(dotted(t.target) == name for t in node.targets):
            found = _accumulation_division(node.value)
            if found is not None:
                return found
    return None


def _without_deepspeed(model: FileModel, scope: Scope) -> list[tuple[int, int]]:
    """The lines of ``if ... not args.deepspeed:`` bodies: a division there is the plain backward's."""
    out = []
    for node in walk_scope(scope.node):
        if isinstance(node, cst.If) and any(
            isinstance(test, cst.UnaryOperation)
            and isinstance(test.operator, cst.Not)
            and DEEPSPEED_SWITCH in (dotted(test.expression) or "").lower()
            for test in _walk_expr(node.test)
        ):
            span = model.position(node.body)
            out.append((span.start.line, span.end.line))
    return out


def _walk_expr(expr: cst.BaseExpression) -> Iterator[cst.BaseExpression]:
    """An ``if`` test and the operands of its ``and``/``or``."""
    yield expr
    if isinstance(expr, cst.BooleanOperation):
        yield from _walk_expr(expr.left)
        yield from _walk_expr(expr.right)


def _statements(scope: Scope) -> Iterator[cst.CSTNode]:
    for node in walk_scope(scope.node):
        if isinstance(node, cst.Assign | cst.AugAssign):
            yield node
