"""TL105 half-instead-of-autocast."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import libcst as cst

from trainlint.api import (
    Diagnostic,
    Invalid,
    Rule,
    RuleDoc,
    Severity,
    method_call_pattern,
)
from trainlint.model import (
    Event,
    FileModel,
    Scope,
    Site,
    Training,
    attr_name,
    dotted,
    exclusive,
    first_arg,
    grad_disabled,
    keyword,
    line_of,
    positional,
    receiver,
    walk,
    walk_scope,
)
from trainlint.model.crossfile import (
    assigned_name,
    constructed_class,
    converted_arguments,
    converted_when_built,
    returned_half_modules,
)
from trainlint.model.vocab import (
    MASTER_WEIGHT_CALLS,
    MASTER_WEIGHT_INITIALIZERS,
    MODULE_CHAIN,
    PARAM_CONTAINERS,
    PARAMETER_SHARING_WRAPPERS,
)


class HalfInsteadOfAutocast(Rule):
    id = "TL105"
    name = "half-instead-of-autocast"
    severity = Severity.ERROR
    probe = True
    OPTIMIZER = "optimizer"
    summary = (
        "A model converted to fp16/bf16 storage is then trained by an optimizer without fp32 master weights."
    )
    # Every finding needs a 16-bit conversion, an optimizer built from a class whose path has one of
    # the second group's names (`torch.optim.*`, `deepspeed.ops.adam.*`, `transformers.AdamW`...) and
    # its params reached through a `x.parameters()`/`x.named_parameters()` call (``method_call_pattern``).
    tokens = ("half", "bfloat16", "float16")
    requires = (
        ("parameters",),
        ("optim", "adam", "lamb", "AdamW", "Adafactor", "lion_pytorch"),
        method_call_pattern("parameters", "named_parameters"),
    )
    # A conversion made by a helper in another project file leaves no 16-bit token in this one.
    project_requires = requires
    CONVERSION = "conversion"

    # In the code: the `x.parameters()`/`x.named_parameters()` call the optimizer's params come from,
    # and the conversion (an event): `x.half()`, `x.bfloat16()` or `x.to(...)` with torch's 16-bit
    # dtype (the last part of its name imported or read as an attribute).
    gate = (
        ("call:parameters", "call:named_parameters"),
        ("call:half", "call:bfloat16", "call:to"),
        ("call:half", "call:bfloat16", "ref:float16", "ref:half", "ref:bfloat16"),
    )
    # A conversion by another file's helper, loader or class still needs the optimizer here, over a
    # `key.parameters()` call (``yields_parameters``) whose receiver is the converted module: an attribute
    # read on something other than a bare `self` (`model.parameters()`, `self.net.parameters()`), or
    # `self` itself, which a call can convert only when it is given `self` (`to_half(self)`) or assigns it.
    project_gate = (
        ("call:parameters", "call:named_parameters"),
        ("ref:parameters", "ref:named_parameters", "bare:self"),
    )
    # A conversion statement (``x.half()``, ``y = Net().to(torch.bfloat16)``) whose name's ``.parameters()``
    # are taken where the rule looks for its optimizer, and a call that may build an optimizer.
    gate_check = "gate_half_params.may_train_half_parameters"
    # Across files: a call of an imported name given or assigning a name whose `.parameters()` are
    # taken where the rule looks for its optimizer (the call standing for the conversion), and an optimizer.
    project_gate_check = "gate_half_params.may_train_parameters_converted_elsewhere"
    # Of the imported names, only a callee whose call leaves a trained name converted counts: an
    # `Accelerator()` whose instance is never trained does not, though its constructor may convert.
    project_callees = "gate_half_params.trained_callees"

    @classmethod
    def wants_fact(cls, kind: str, facts: dict[str, Any]) -> bool:
        if kind == "class":
            return bool(facts.get("init_may_convert"))
        return kind == "function" and bool(facts["half"] or facts.get("returns_half"))

    doc = RuleDoc(
        what=(
            "Reports a module converted to 16-bit storage (`model.half()`, `model.bfloat16()`, "
            "`model.to(torch.float16)`, `model.to(device, dtype=torch.bfloat16)`, chained as in "
            "`Net().cuda().half()`) whose parameters are then given to an optimizer (`torch.optim.*`, "
            "bitsandbytes, apex, `transformers.AdamW`, ...) in the same function, in the module's "
            "script code, or through `self.model` in the same class, or in a function of the file the "
            "model is passed to. Across the project: a helper that converts its argument, a loader that "
            "returns a converted module, a model class whose constructor converts a submodule (also "
            "when built through a classmethod such as `from_pretrained`), and the project's own "
            "`torch.optim.Optimizer` subclasses. A freeze loop that skips some parameters (`continue`, "
            "an `if`) leaves them trained in 16-bit. Not reported: inference "
            "(no optimizer gets those parameters, `eval()`, `torch.no_grad()`/`inference_mode()`), "
            "tensors such as inputs and labels, a frozen 16-bit backbone whose trainable part stays "
            "fp32, optimizers that keep fp32 master weights (apex `FP16_Optimizer`, `amp.initialize`, "
            "`deepspeed.initialize`, Megatron's Float16 optimizer) and hand-written fp32 master copies."
        ),
        why=(
            "The optimizer adds each update to the 16-bit parameter, and the sum is rounded to 16 bits. "
            "bf16 keeps 8 significant bits, so just below 1.0 the representable numbers are 2^-8 ≈ "
            "0.0039 apart (and 2^-7 ≈ 0.0078 apart just above 1.0): a weight of 1.0 that receives an "
            "update of -0.001 (learning rate 1e-3 times a gradient of 1) becomes 0.999, which rounds "
            "back to 1.0. The update is lost, every step, for every weight whose update is small "
            "relative to its size; training stalls while the loss curve only flattens. fp16 has 11 "
            "significant bits (spacing 2^-11 ≈ 0.00049 just below 1.0), so an update of 1e-4 on a "
            "weight near 1 vanishes the same way, and Adam's epsilon (1e-8) is zero in fp16. On top of "
            "that, `GradScaler.unscale_` refuses fp16 gradients and raises `Attempting to unscale "
            "FP16 gradients`. Automatic mixed precision keeps the parameters and the optimizer state "
            "in fp32 and only runs the forward pass in 16 bits."
        ),
        example=(
            "model = Net().cuda().half()\n"
            "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)\n"
            "loss = loss_fn(model(x.half()), y)\n"
            "loss.backward()\n"
            "optimizer.step()"
        ),
        use_instead=(
            "model = Net().cuda()\n"
            "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)\n"
            "with torch.autocast('cuda', dtype=torch.bfloat16):\n"
            "    loss = loss_fn(model(x), y)\n"
            "loss.backward()\n"
            "optimizer.step()"
        ),
        references=(
            "https://pytorch.org/docs/stable/amp.html",
            "https://pytorch.org/docs/stable/notes/amp_examples.html",
        ),
    )
    valid = (
        # inference only: no optimizer
        """
        import torch
        model = Net().cuda().half()
        model.eval()
        with torch.no_grad():
            out = model(x.half())
        """,
        # tensors, not modules
        """
        import torch
        model = Net().cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        images = batch['image'].half()
        labels = labels.to(torch.float16)
        loss = model(images)
        """,
        # autocast, the right way
        """
        import torch
        model = Net().cuda()
        opt = torch.optim.AdamW(model.parameters())
        with torch.autocast('cuda', dtype=torch.bfloat16):
            loss = model(x)
        """,
        # a frozen half backbone, trainable head in fp32
        """
        import torch
        backbone = Backbone().cuda().half()
        backbone.requires_grad_(False)
        head = torch.nn.Linear(512, 10).cuda()
        opt = torch.optim.SGD(head.parameters(), lr=0.1)
        """,
        # apex FP16_Optimizer keeps fp32 master weights
        """
        import torch
        from apex.fp16_utils import FP16_Optimizer
        model = Net().cuda().half()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = FP16_Optimizer(opt, static_loss_scale=128.0)
        """,
        # DeepSpeed owns the precision
        """
        import torch, deepspeed
        model = model.half()
        opt = torch.optim.AdamW(model.parameters())
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        """,
        # Megatron-FSDP: the sharded optimizer steps fp32 main weights of the bf16 model
        """
        import torch
        from megatron_fsdp import fully_shard, fully_shard_optimizer
        model = Net().to(dtype=torch.bfloat16)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        fully_shard_optimizer(opt)
        """,
        # Megatron-FSDP with fp32 main parameters named in its policy
        """
        import torch
        from megatron_fsdp import MixedPrecisionPolicy, fully_shard
        model = Net().to(dtype=torch.bfloat16)
        fully_shard(model, mixed_precision_policy=MixedPrecisionPolicy(main_params_dtype=torch.float32))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        """,
        # a hand-written fp32 master copy with manual loss scaling
        """
        import torch
        model = Net().cuda().half()
        master = [p.detach().clone().float() for p in model.parameters()]
        for p in master:
            p.requires_grad = True
        opt = torch.optim.SGD(master, lr=0.1)
        (loss * 128.0).backward()
        """,
        # the model is rebound by something else before the optimizer sees it
        """
        import torch
        from peft import get_peft_model
        model = base.to(torch.bfloat16)
        model = get_peft_model(model, config)
        opt = torch.optim.AdamW(model.parameters())
        """,
        # converted after training, for export
        """
        import torch
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train(model, opt)
        model.half()
        torch.save(model.state_dict(), 'fp16.pt')
        """,
        # converted back to fp32 in the chain
        """
        import torch
        model = Net().half().float()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        """,
        # a dtype that is not known to be 16-bit
        """
        import torch
        dtype = torch.float16 if args.fp16 else torch.float32
        model = model.to(dtype=dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        """,
        # a method that converts for inference
        """
        import torch
        class Runner:
            def __init__(self):
                self.model = Net()
                self.opt = torch.optim.AdamW(self.model.parameters())
            @torch.no_grad()
            def export(self):
                self.model.half()
                return self.model.state_dict()
        """,
    )
    invalid = (
        Invalid(
            """
            import torch
            model = Net().cuda().half()
            opt = torch.optim.AdamW(model.parameters())
            """,
            line=2,
        ),
        Invalid(
            """
            import torch
            model.bfloat16()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            """,
            line=2,
        ),
        Invalid(
            """
            import torch
            model = model.to(device, dtype=torch.bfloat16)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            """,
            line=2,
        ),
        Invalid(
            """
            import torch
            from torch import optim
            DTYPE = torch.float16
            model.to(DTYPE)
            opt = optim.Adam(model.parameters())
            """,
            line=4,
        ),
        # self.model in a class, optimizer in another method
        Invalid(
            """
            import torch
            class Trainer:
                def __init__(self, net):
                    self.model = net.cuda().half()
                def configure_optimizers(self):
                    return torch.optim.AdamW(self.model.parameters(), lr=1e-4)
            """,
            line=4,
        ),
        # param groups through a name, bitsandbytes optimizer
        Invalid(
            """
            import torch
            import bitsandbytes as bnb
            model = model.half()
            groups = [{'params': [p for n, p in model.named_parameters() if 'bias' not in n]}]
            opt = bnb.optim.AdamW8bit(groups, lr=1e-4)
            """,
            line=3,
        ),
        # wrapped in DDP after the conversion: same parameters
        Invalid(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP
            def main():
                model = Net().to(torch.half)
                model = DDP(model)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
            """,
            line=4,
        ),
        # transformers' AdamW, filtered parameters
        Invalid(
            """
            import torch
            from transformers import AdamW
            def train(model):
                model.half()
                opt = AdamW(filter(lambda p: p.requires_grad, model.parameters()), lr=1e-5)
            """,
            line=4,
        ),
        # module-level model, optimizer built inside a function
        Invalid(
            """
            import torch
            model = Net().bfloat16()
            def train():
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
            """,
            line=2,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        optimizers = training.of_kind("optimizer")
        if not optimizers or master_weight_machinery(model):
            return
        yield from self._converted_here(model, training, optimizers)
        if model.project is not None:
            yield from self._converted_elsewhere(model, training, optimizers)

    def _converted_elsewhere(
        self, model: FileModel, training: Training, optimizers: list[Event]
    ) -> Iterator[Diagnostic]:
        """``convert_weights(model)`` of another project file converts its argument in place; the
        optimizer here then trains 16-bit parameters. Reported at the optimizer, which is what the
        user changes (or the call), with the conversion in the other file as a related location."""
        for site in model.calls:
            converted = [(dotted(arg), where) for arg, where in converted_arguments(model, site)]
            converted += returned_half_modules(model, site)
            built = constructed_class(model, site.node, site.scope)
            when_built = converted_when_built(model, built) if built is not None else None
            if when_built is not None:  # ``model = Net.from_pretrained(...)``, Net converting itself
                converted.append((assigned_name(site), when_built))
            for key, where in converted:
                if key is None or inference_context(model, site):
                    continue
                found = self._optimizer_for(model, training, site, key, optimizers)
                if found is None and when_built is not None:
                    found = self._optimizer_in_caller(model, training, site, key, optimizers)
                if found is None:
                    continue
                yield Diagnostic(
                    found.call,
                    f"This optimizer trains `{key}`, which `{model.code(site.node.func)}` on line "
                    f"{line_of(model, site.node)} converted to 16-bit ({where.path}, line {where.line}): "
                    "updates smaller than the 16-bit spacing round away. Keep the parameters in fp32 "
                    "and run the forward pass under `torch.autocast(...)`.",
                    related=(
                        (site.node, "converted to 16-bit by this call", HalfInsteadOfAutocast.CONVERSION),
                    ),
                    elsewhere=(where.related(HalfInsteadOfAutocast.CONVERSION),),
                )

    def _converted_here(
        self, model: FileModel, training: Training, optimizers: list[Event]
    ) -> Iterator[Diagnostic]:
        for conversion in training.of_kind("conversion"):
            key = converted_module(conversion)
            if key is None or inference_context(model, conversion.site):
                continue
            found = self._optimizer_for(model, training, conversion.site, key, optimizers)
            if found is None:
                found = self._optimizer_in_caller(model, training, conversion.site, key, optimizers)
            if found is None:
                continue
            label = dtype_label(model, training, conversion.call, conversion.site.scope)
            yield Diagnostic(
                conversion.call,
                f"`{key}` is converted to {label} and its parameters are then trained by the optimizer on "
                f"line {line_of(model, found.call)}: updates smaller than the {label} spacing round away. "
                "Keep the parameters in fp32 and run the forward pass under `torch.autocast(...)`.",
                related=(
                    (
                        found.call,
                        "optimizer over the 16-bit parameters here",
                        HalfInsteadOfAutocast.OPTIMIZER,
                    ),
                ),
            )

    def _optimizer_for(
        self, model: FileModel, training: Training, site: Site, key: str, optimizers: list[Event]
    ) -> Event | None:
        """The first optimizer built after ``site`` over ``key``'s own parameters: in the same scope,
        in another method of the class for ``self.x``, or in a function for a module-level model."""
        scope = site.scope
        cls = scope.enclosing_class if key.startswith("self.") else None
        if self._frozen_or_inference(model, training, site, key):
            return None
        for opt in optimizers:
            opt_scope = opt.site.scope
            if opt_scope is scope:
                if opt.order < site.order or exclusive(opt.site.frames, site.frames):
                    continue
                if self._rebound(model, site, key, site.order, opt.order):
                    continue
            elif cls is not None:
                if opt_scope.enclosing_class is not cls or self._rebound_in_class(model, cls, site, key):
                    continue
            elif scope.kind == "module" and "." not in key and opt_scope.kind == "function":
                binding = model.lookup(key, opt_scope)
                if binding is None or key not in scope.bindings or binding is not scope.bindings[key][-1]:
                    continue
                if self._rebound(model, site, key, site.order, None):
                    continue
            else:
                continue
            params = first_arg(opt.call, "params")
            if params is not None and yields_parameters(model, params, key, opt_scope):
                return opt
        return self._optimizer_in_callee(model, site, key, optimizers)

    @staticmethod
    def _optimizer_in_callee(model: FileModel, site: Site, key: str, optimizers: list[Event]) -> Event | None:
        """An optimizer built by a function of the file that ``key`` is passed to after ``site``
        (``optimizer = prep_optimizer(args, model)``), over the parameter that receives it."""
        for call_site in model.calls_in(site.scope):
            call = call_site.node
            if call_site.order <= site.order or not isinstance(call, cst.Call):
                continue
            function = model.local_function(call, site.scope, methods=False)
            if function is None:
                continue
            names = [p.name.value for p in function.params.params]
            passed = [names[i] for i, a in enumerate(positional(call)) if i < len(names) and dotted(a) == key]
            passed += [a.keyword.value for a in call.args if a.keyword is not None and dotted(a.value) == key]
            for opt in optimizers:
                if opt.site.scope.node is not function:
                    continue
                params = first_arg(opt.call, "params")
                if params is not None and any(
                    yields_parameters(model, params, name, opt.site.scope) for name in passed
                ):
                    return opt
        return None

    def _optimizer_in_caller(
        self, model: FileModel, training: Training, site: Site, key: str, optimizers: list[Event]
    ) -> Event | None:
        """A module converted in a builder function that returns it (``return model`` or ``return
        tokenizer, model``), trained by the caller: ``tokenizer, model = build(name)`` then an
        optimizer over ``model.parameters()`` in the calling function."""
        function = site.scope.node
        if site.scope.kind != "function" or not isinstance(function, cst.FunctionDef):
            return None
        positions = set()
        for node in walk_scope(function):
            if isinstance(node, cst.Return) and node.value is not None:
                if dotted(node.value) == key:
                    positions.add(None)
                elif isinstance(node.value, cst.Tuple):
                    for index, element in enumerate(node.value.elements):
                        if dotted(element.value) == key:
                            positions.add((index, len(node.value.elements)))
        if len(positions) != 1 or self._frozen_or_inference(model, training, site, key):
            return None
        if self._rebound(model, site, key, site.order, None):
            return None
        (position,) = positions
        wanted = f"<local>.{function.name.value}"
        for call_site in model.calls:
            if model.callee(call_site) != wanted or call_site.scope is site.scope:
                continue
            binding = model.lookup(function.name.value, call_site.scope)
            if binding is None or binding.node is not function:
                continue
            statement = call_site.statement
            if not (
                isinstance(statement, cst.SimpleStatementLine) and isinstance(statement.body[0], cst.Assign)
            ):
                continue
            assign = statement.body[0]
            if assign.value is not call_site.node or len(assign.targets) != 1:
                continue
            target = assign.targets[0].target
            if position is None:
                caller_key = dotted(target)
            elif isinstance(target, cst.Tuple) and len(target.elements) == position[1]:
                caller_key = dotted(target.elements[position[0]].value)
            else:
                caller_key = None
            if caller_key is None or inference_context(model, call_site):
                continue
            found = self._optimizer_for(model, training, call_site, caller_key, optimizers)
            if found is not None:
                return found
        return None

    @staticmethod
    def _frozen_or_inference(model: FileModel, training: Training, site: Site, key: str) -> bool:
        """In the conversion's scope: the module or a part of it frozen (``requires_grad_(False)``, a
        loop setting ``p.requires_grad = False``), a part of it put back in fp32 (``.float()``: a frozen
        16-bit backbone with an fp32 head), or ``key.eval()`` with no ``train()`` and no backward."""

        def covers(text: str | None) -> bool:
            return text is not None and (text == key or text.startswith(key + "."))

        names = set()
        for other in model.calls_in(site.scope):
            call = other.node
            assert isinstance(call, cst.Call)
            target = dotted(receiver(call))
            if not covers(target):
                continue
            name = attr_name(call)
            if name == "requires_grad_" and call.args and dotted(call.args[0].value) == "False":
                return True
            if name == "float" and other.order > site.order:
                return True
            if target == key:
                names.add(name)
        if "eval" in names and "train" not in names and not training.events_in(site.scope, "backward"):
            return True
        for assign in model.assigns:
            node = assign.node
            if assign.scope is not site.scope or not isinstance(node, cst.Assign):
                continue
            freezes = dotted(node.value) == "False" and any(
                isinstance(t.target, cst.Attribute) and t.target.attr.value == "requires_grad"
                for t in node.targets
            )
            if not freezes:
                continue
            for index, frame in enumerate(assign.frames):
                if frame.kind != "loop" or not isinstance(frame.node, cst.For):
                    continue
                # a freeze under an `if` or past a `continue` in the loop leaves some parameters trained
                if any(f.kind == "if" for f in assign.frames[index + 1 :]) or any(
                    isinstance(sub, cst.Continue) for sub in walk(frame.node.body)
                ):
                    continue
                for sub in walk(frame.node.iter):
                    if (
                        isinstance(sub, cst.Call)
                        and attr_name(sub) in ("parameters", "named_parameters")
                        and covers(dotted(receiver(sub)))
                    ):
                        return True
        return False

    @staticmethod
    def _safe_rebinding(model: FileModel, value: cst.BaseExpression, key: str, scope: Scope) -> bool:
        """``model = model.cuda()``, ``model = DDP(model)``: still the same parameter objects."""
        links = []
        expr = value
        while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
            links.append(expr.func.attr.value)
            expr = expr.func.value
        if links and dotted(expr) == key and all(name in MODULE_CHAIN for name in links):
            return True
        if isinstance(value, cst.Call) and model.qualname(value.func, scope) in PARAMETER_SHARING_WRAPPERS:
            args = positional(value)
            inner = args[0] if args else None
            if inner is None:
                arg = keyword(value, "module") or keyword(value, "model")
                inner = arg.value if arg is not None else None
            return inner is not None and dotted(inner) == key
        return False

    def _rebound(self, model: FileModel, site: Site, key: str, start: int, end: int | None) -> bool:
        for assign in model.assigns:
            if assign.scope is not site.scope or assign.order <= start:
                continue
            if end is not None and assign.order >= end:
                continue
            if assign.statement is site.statement:
                continue
            node = assign.node
            targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
            if any(dotted(t) == key for t in targets):
                if node.value is None or not self._safe_rebinding(model, node.value, key, site.scope):
                    return True
        return False

    def _rebound_in_class(self, model: FileModel, cls: Scope, site: Site, key: str) -> bool:
        """With the optimizer in another method, any assignment to ``self.x`` outside the conversion's
        method (order unknown) or after it in that method may replace the converted module."""
        for assign in model.assigns:
            if assign.scope.enclosing_class is not cls or assign.statement is site.statement:
                continue
            node = assign.node
            targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
            if not any(dotted(t) == key for t in targets):
                continue
            if assign.scope is site.scope and assign.order < site.order:
                continue
            if node.value is None or not self._safe_rebinding(model, node.value, key, assign.scope):
                return True
        return False


def dtype_label(model: FileModel, training: Training, call: cst.Call, scope: Scope) -> str:
    name = attr_name(call)
    if name == "half":
        return "fp16"
    if name == "bfloat16":
        return "bf16"
    for arg in call.args:
        if arg.keyword is None or arg.keyword.value == "dtype":
            text = model.qualname(arg.value, scope) or ""
            values = model.values_of(arg.value, scope) if isinstance(arg.value, cst.Name) else []
            texts = [text, *(model.qualname(v, scope) or "" for v in values)]
            if any(t.endswith("bfloat16") for t in texts):
                return "bf16"
            if any(t.endswith(("float16", ".half")) for t in texts):
                return "fp16"
    return "16-bit"


def chain_contains(expr: cst.BaseExpression, target: cst.Call) -> bool | None:
    """Whether ``target`` is a link of the module-method chain ``expr`` (``Net().cuda().half()``).

    None when the chain converts back to full precision (``.float()``) or to eval after ``target``.
    """
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
        if expr is target:
            return True
        name = expr.func.attr.value
        if name in ("float", "double", "eval"):
            return None
        if name not in MODULE_CHAIN:
            return False
        expr = expr.func.value
    return False


def chain_root(expr: cst.BaseExpression) -> cst.BaseExpression:
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
        expr = expr.func.value
    return expr


def converted_module(conversion: Event) -> str | None:
    """The dotted name that holds the converted module: the assignment target of the chain, or the
    receiver of a conversion written as a statement (tensors' ``.half()`` is not in place, so a bare
    statement only makes sense for a module)."""
    statement = conversion.site.statement
    if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
        return None
    small = statement.body[0]
    call = conversion.call
    if isinstance(small, cst.Expr):
        if chain_contains(small.value, call):
            return dotted(chain_root(small.value))
        return None
    if isinstance(small, cst.Assign) and len(small.targets) == 1:
        value, target = small.value, small.targets[0].target
    elif isinstance(small, cst.AnnAssign) and small.value is not None:
        value, target = small.value, small.target
    else:
        return None
    if chain_contains(value, call):
        return dotted(target)
    return None


def master_weight_machinery(model: FileModel) -> bool:
    for site in model.calls:
        call = site.node
        assert isinstance(call, cst.Call)
        callee = model.callee(site) or dotted(call.func) or ""
        if callee.rsplit(".", 1)[-1] in MASTER_WEIGHT_CALLS:
            return True
        if callee.startswith(MASTER_WEIGHT_INITIALIZERS):
            return True
        if callee.rsplit(".", 1)[-1] == "MixedPrecisionPolicy" and fp32_main_params(call):
            return True
    return False


def fp32_main_params(call: cst.Call) -> bool:
    """Megatron-FSDP's ``MixedPrecisionPolicy(main_params_dtype=torch.float32)``: the sharded
    parameters the optimizer sees are fp32 main weights (torch's own policy has no such argument)."""
    return any(
        a.keyword is not None
        and a.keyword.value == "main_params_dtype"
        and (dotted(a.value) or "").rsplit(".", 1)[-1] in ("float32", "float")
        for a in call.args
    )


def yields_parameters(model: FileModel, expr: cst.CSTNode, key: str, scope: Scope, depth: int = 0) -> bool:
    """Whether ``expr`` evaluates to ``key``'s own parameter objects (not copies of them): directly,
    in param groups, filtered comprehensions, ``list``/``filter``/``chain``, or through local names."""
    if depth > 12:  # param groups of filtered lists of (name, parameter) pairs nest deep
        return False
    if isinstance(expr, cst.Call):
        name = attr_name(expr)
        if name in ("parameters", "named_parameters") and dotted(receiver(expr)) == key:
            return True
        if model.qualname(expr.func, scope) in PARAM_CONTAINERS:
            return any(yields_parameters(model, a.value, key, scope, depth + 1) for a in expr.args)
        return False
    if isinstance(expr, cst.List | cst.Tuple | cst.Set):
        return any(yields_parameters(model, e.value, key, scope, depth + 1) for e in expr.elements)
    if isinstance(expr, cst.Dict):
        return any(
            isinstance(e, cst.DictElement) and yields_parameters(model, e.value, key, scope, depth + 1)
            for e in expr.elements
        )
    if isinstance(expr, cst.ListComp | cst.GeneratorExp | cst.SetComp):
        elements = [e.value for e in expr.elt.elements] if isinstance(expr.elt, cst.Tuple) else [expr.elt]
        if not all(isinstance(e, cst.Name) for e in elements):
            # `p.detach().clone().float()`: a copy, e.g. hand-written fp32 master weights; `(n, p)`
            # pairs carry the parameter itself
            return False
        comp: cst.CompFor | None = expr.for_in
        while comp is not None:
            if yields_parameters(model, comp.iter, key, scope, depth + 1):
                return True
            comp = comp.inner_for_in
        return False
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add):
        return yields_parameters(model, expr.left, key, scope, depth + 1) or yields_parameters(
            model, expr.right, key, scope, depth + 1
        )
    if isinstance(expr, cst.Name):
        return any(yields_parameters(model, v, key, scope, depth + 1) for v in model.values_of(expr, scope))
    return False


def inference_context(model: FileModel, site: Site) -> bool:
    """Under ``no_grad``/``inference_mode``: a ``with`` block, or a decorated function around the site."""
    return grad_disabled(model, site)
