"""TL501 ddp-accumulation-without-no-sync."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from trainlint.api import Diagnostic, Invalid, Rule, RuleDoc, Severity, call_pattern
from trainlint.model import (
    FileModel,
    Scope,
    Site,
    dotted,
    innermost_loop,
    walk,
    walk_scope,
)
from trainlint.model.training import (
    backward_sites,
    ddp_models,
    helper_scopes,
    is_step_count_name,
    mentions_sync_control,
    prepared_models,
    sites_doing,
)


class DdpAccumulationWithoutNoSync(Rule):
    id = "TL501"
    name = "ddp-accumulation-without-no-sync"
    severity = Severity.WARNING
    probe = True
    STEP = "optimizer-step"
    summary = "Gradient accumulation on a DistributedDataParallel model without no_sync(): all-reduce on every microbatch."
    # Prefilter: a `DistributedDataParallel(...)` call (its imported name is in the text even when it
    # is called as `DDP`) or an `accelerator.prepare(...)`, and backward and step method calls (events).
    tokens = ("DistributedDataParallel", "DDP", "prepare")
    requires = (
        ("DistributedDataParallel", "prepare"),
        call_pattern("backward"),
        call_pattern("step"),
    )
    # In the code: a call of the DDP class (by its name, or a name bound to it) or of `prepare`, and a
    # backward call (an event; a helper of this file that runs one holds one).
    gate = (
        ("call:DistributedDataParallel", "alias:DistributedDataParallel", "call:prepare"),
        ("call:backward",),
    )
    # In one scope naming no sync control: a backward in a loop, a call of the wrapped model (or through
    # the file's helpers) and a step under an accumulation `if` in that loop or after a micro-step loop.
    gate_check = "gate_ddp_accumulation.ddp_backward_may_accumulate_without_no_sync"
    doc = RuleDoc(
        what=(
            "Reports the backward of a gradient-accumulation loop (the optimizer steps only under an "
            "accumulation condition, or after a `for micro_step in range(accum_steps)` loop) on a "
            "model wrapped in `torch.nn.parallel.DistributedDataParallel` or prepared by "
            "`accelerator.prepare(...)` in this file, also when the loop calls the backward and the step "
            "through the file's own functions or methods (`self.backward_step(loss)`), when nothing in "
            "the scope or those helpers controls gradient synchronisation: no `model.no_sync()` (directly or through "
            "a variable), no `require_backward_grad_sync`, no `accelerator.accumulate` / "
            "`accelerator.no_sync`, no Fabric `no_backward_sync`."
        ),
        why=(
            "DDP all-reduces the gradients during every backward. Inside an accumulation window only "
            "the last all-reduce matters, since the earlier ones are summed over again. With 8 "
            "microbatches per step and a 1B-parameter model in fp32, each backward sends 4 GB "
            "through the all-reduce: 32 GB per optimizer step where 4 GB would do, and on a slow "
            "interconnect communication then dominates the step time. The result is the same, so "
            "nothing looks wrong except the speed."
        ),
        example=(
            "model = DDP(model, device_ids=[rank])\n"
            "for i, batch in enumerate(loader):\n"
            "    loss = model(batch).loss / accum\n"
            "    loss.backward()\n"
            "    if (i + 1) % accum == 0:\n"
            "        optimizer.step()\n"
            "        optimizer.zero_grad()"
        ),
        use_instead=(
            "model = DDP(model, device_ids=[rank])\n"
            "for i, batch in enumerate(loader):\n"
            "    last = (i + 1) % accum == 0\n"
            "    with contextlib.nullcontext() if last else model.no_sync():\n"
            "        loss = model(batch).loss / accum\n"
            "        loss.backward()\n"
            "    if last:\n"
            "        optimizer.step()\n"
            "        optimizer.zero_grad()"
        ),
        references=(
            "https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html",
        ),
    )
    _HEAD = "import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net, device_ids=[rank])\n"
    valid = (
        # no_sync for the non-final microbatches
        _HEAD
        + "for i, b in enumerate(loader):\n    ctx = model.no_sync() if (i + 1) % accum else nullcontext()\n"
        "    with ctx:\n        model(b).loss.backward()\n    if (i + 1) % accum == 0:\n        opt.step()\n        opt.zero_grad()",
        # nanoGPT: require_backward_grad_sync toggled by hand
        _HEAD + "for micro_step in range(gradient_accumulation_steps):\n"
        "    model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)\n"
        "    logits, loss = model(X, Y)\n    scaler.scale(loss).backward()\nscaler.step(opt)\nscaler.update()",
        # model.no_sync through a variable (Accelerate's autoregressive example)
        _HEAD + "for i, b in enumerate(window):\n"
        "    ctx = model.no_sync if i < len(window) - 1 else contextlib.nullcontext\n"
        "    with ctx():\n        accelerator.backward(model(**b).loss)\nopt.step()",
        # no accumulation: one backward per step
        _HEAD + "for b in loader:\n    model(b).loss.backward()\n    opt.step()\n    opt.zero_grad()",
        # not DDP: a single-process model
        """
        import torch
        for i, b in enumerate(loader):
            model(b).loss.backward()
            if (i + 1) % accum == 0:
                opt.step()
        """,
        # Accelerate handles synchronisation inside accumulate()
        _HEAD
        + "for b in loader:\n    with accelerator.accumulate(model):\n        accelerator.backward(model(b).loss)\n"
        "        if accelerator.sync_gradients:\n            opt.step()",
        # Fabric's no_backward_sync
        _HEAD + "for it, b in enumerate(loader):\n    is_accumulating = (it + 1) % accum != 0\n"
        "    with fabric.no_backward_sync(model, enabled=is_accumulating):\n        fabric.backward(model(b))\n"
        "    if not is_accumulating:\n        opt.step()",
    )
    invalid = (
        Invalid(
            _HEAD + "for i, b in enumerate(loader):\n    loss = model(b).loss / accum\n    loss.backward()\n"
            "    if (i + 1) % accum == 0:\n        opt.step()\n        opt.zero_grad()",
            line=6,
        ),
        # nanoGPT's micro-step loop without the toggle
        Invalid(
            _HEAD + "while True:\n    for micro_step in range(gradient_accumulation_steps):\n"
            "        logits, loss = model(X, Y)\n        scaler.scale(loss / gradient_accumulation_steps).backward()\n"
            "    scaler.step(opt)\n    scaler.update()\n    opt.zero_grad(set_to_none=True)",
            line=7,
        ),
        Invalid(
            """
            import torch

            class Trainer:
                def __init__(self, net):
                    self.model = torch.nn.parallel.DistributedDataParallel(net)

                def train(self, loader):
                    for step, batch in enumerate(loader):
                        out = self.model(batch)
                        self.scaler.scale(out.loss).backward()
                        if step % self.args.gradient_accumulation_steps == 0:
                            self.scaler.step(self.optimizer)
                            self.scaler.update()
            """,
            line=10,
        ),
        # a flag computed from a modulo
        Invalid(
            _HEAD + "for it, b in enumerate(loader):\n    is_update = (it + 1) % accum == 0\n"
            "    model(b).sum().backward()\n    if is_update:\n        opt.step()",
            line=6,
        ),
        # the DDP model passed into a training function
        Invalid(
            """
            from torch.nn.parallel import DistributedDataParallel

            def main():
                model = DistributedDataParallel(Net().cuda())
                train(model)

            def train(model):
                for i, (x, y) in enumerate(loader):
                    F.cross_entropy(model(x), y).backward()
                    if (i + 1) % n == 0:
                        opt.step()
            """,
            line=9,
        ),
        # a counter reset
        Invalid(
            _HEAD + "count = 0\nfor b in loader:\n    model(b).loss.backward()\n    count += 1\n"
            "    if count == accum_steps:\n        opt.step()\n        count = 0",
            line=6,
        ),
    )

    valid = (
        *valid,
        # DeepSpeed's engine accumulates and synchronises by itself
        """
        import deepspeed
        engine, opt, _, _ = deepspeed.initialize(model=net, config=cfg)
        for b in loader:
            loss = engine(b)
            engine.backward(loss)
            engine.step()
        """,
    )
    invalid = (
        *invalid,
        # the HF no_trainer condition: every N steps or at the end of the epoch
        Invalid(
            _HEAD + "for step, batch in enumerate(loader):\n    outputs = model(**batch)\n"
            "    (outputs.loss / args.gradient_accumulation_steps).backward()\n"
            "    if step % args.gradient_accumulation_steps == 0 or step == len(loader) - 1:\n"
            "        opt.step()\n        lr_scheduler.step()\n        opt.zero_grad()",
            line=6,
        ),
        # the step every N micro-batches with a scaler
        Invalid(
            _HEAD + "scaler = torch.cuda.amp.GradScaler()\nfor i, (x, y) in enumerate(loader):\n"
            "    with torch.autocast('cuda'):\n        loss = F.cross_entropy(model(x), y) / grad_accum\n"
            "    scaler.scale(loss).backward()\n    if (i + 1) % grad_accum == 0:\n"
            "        scaler.step(opt)\n        scaler.update()\n        opt.zero_grad()",
            line=8,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        ddp = ddp_models(model)
        wrapped = ddp | prepared_models(model)
        if not wrapped:
            return
        checked: dict[int, str | None] = {}
        for backward in backward_sites(model):
            scope = backward.scope
            if id(scope) not in checked:
                helpers = [scope, *helper_scopes(model, scope)]
                synced = any(mentions_sync_control(s) for s in helpers)
                checked[id(scope)] = None if synced else self._ddp_model_used(helpers, wrapped)
            used = checked[id(scope)]
            step = self._accumulation_step(model, backward) if used is not None else None
            if used is None or step is None:
                continue
            if used in ddp:
                what = "This backward of a DistributedDataParallel model"
                remedy = "run the non-final microbatches' forward and backward inside `model.no_sync()`"
            else:  # Accelerate wraps the model in DistributedDataParallel on several processes
                what = (
                    f"This backward of `{used}`, prepared by `accelerator.prepare(...)` (wrapped in "
                    "DistributedDataParallel when it runs on several processes),"
                )
                remedy = (
                    f"run each microbatch inside `accelerator.accumulate({used})` (or the non-final ones "
                    f"inside `accelerator.no_sync({used})`)"
                )
            yield Diagnostic(
                backward.node,
                f"{what} runs on every microbatch of an accumulation window, so gradients are all-reduced "
                f"each time; {remedy}.",
                related=(
                    (
                        step.node,
                        "the optimizer steps once per window here",
                        DdpAccumulationWithoutNoSync.STEP,
                    ),
                ),
            )

    @staticmethod
    def _ddp_model_used(scopes: list[Scope], wrapped: set[str]) -> str | None:
        """The first wrapped model the scopes call (its dotted name), if any."""
        for scope in scopes:
            for node in walk_scope(scope.node):
                if isinstance(node, cst.Call) and (name := dotted(node.func)) in wrapped:
                    return name
        return None

    @staticmethod
    def _accumulation_step(model: FileModel, backward: Site) -> Site | None:
        """The optimizer step that makes ``backward`` part of an accumulation window, or None."""
        training = model.training
        loop = innermost_loop(backward)
        steps = sites_doing(model, backward.scope, "step", "scaler_step")
        if loop is None:
            return None
        for step in steps:
            # shape 1: step under an accumulation condition in the backward's loop
            if any(f.node is loop.node for f in step.frames):
                condition = training.under_accumulation(step, loop.node)
                if condition is not None and not any(f.node is condition.node for f in backward.frames):
                    return step
        # shape 2: a micro-step loop over the accumulation count, the step after it
        if isinstance(loop.node, cst.For) and any(
            isinstance(n, cst.Name | cst.Attribute)
            and is_step_count_name((dotted(n) or "").rsplit(".", 1)[-1])
            for n in walk(loop.node.iter)
        ):
            for step in steps:
                if step.order > backward.order and not any(f.node is loop.node for f in step.frames):
                    return step
        return None
