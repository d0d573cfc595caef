"""TL103 scaler-update-per-microstep."""

from __future__ import annotations

from collections.abc import Iterator

from trainlint.api import (
    Diagnostic,
    Invalid,
    Rule,
    RuleDoc,
    Severity,
    method_call_pattern,
)
from trainlint.model import (
    FileModel,
    exclusive,
    innermost_loop,
    line_of,
)


class ScalerUpdatePerMicrostep(Rule):
    id = "TL103"
    name = "scaler-update-per-microstep"
    severity = Severity.WARNING
    probe = True
    SCALER_STEP = "scaler-step"
    summary = (
        "scaler.update() runs on every micro-step while scaler.step() runs once per accumulation window."
    )
    # Every finding needs `x.update()` and `x.step(...)` on a scaler, which is one by a `GradScaler`
    # construction or by a `x.scale(...)` call (``method_call_pattern``).
    tokens = ("update",)
    requires = (
        ("step",),
        ("scale", "GradScaler"),
        method_call_pattern("update"),
        method_call_pattern("step"),
        method_call_pattern("scale", or_tokens=("GradScaler",)),
    )
    # In the code: the scaler's update and step calls (events).
    gate = (("call:update",), ("call:step",))
    # In the tree: `K.update()` and `K.step()` in one loop body, the step under an `if` inside it that may
    # be an accumulation condition, the update under none that surely is.
    gate_check = "gate_scaler_steps.update_may_run_every_microstep"
    doc = RuleDoc(
        what=(
            "Reports `scaler.update()` that runs on every iteration of a loop in which "
            "`scaler.step(...)` runs only under a gradient-accumulation condition (`(i + 1) % accum "
            "== 0`, `step % accum == 0 or last`, `accelerator.sync_gradients`, a flag computed from a "
            "modulo, a counter that is reset)."
        ),
        why=(
            "`update()` consumes the inf/NaN checks that `scaler.step` (or `unscale_`) recorded since "
            "the last update and picks the next scale. On a micro-step where nothing was stepped it "
            "raises `AssertionError: No inf checks were recorded prior to update` (unless the scaler "
            "is disabled, which is why a run without AMP does not notice). Code that silences this by "
            "calling `unscale_` on every micro-step is worse off: each `unscale_` divides the whole "
            "accumulated gradient by the scale again, so with a scale of 65536 and 4 micro-steps the "
            "first micro-step's gradient ends up divided by 65536^3 ≈ 2.8e14 and is erased. The scale "
            "must stay fixed for the whole window and be updated once, right after `scaler.step`."
        ),
        example=(
            "for i, batch in enumerate(loader):\n"
            "    scaler.scale(loss_fn(model(batch)) / accum).backward()\n"
            "    if (i + 1) % accum == 0:\n"
            "        scaler.step(optimizer)\n"
            "        optimizer.zero_grad()\n"
            "    scaler.update()"
        ),
        use_instead=(
            "for i, batch in enumerate(loader):\n"
            "    scaler.scale(loss_fn(model(batch)) / accum).backward()\n"
            "    if (i + 1) % accum == 0:\n"
            "        scaler.step(optimizer)\n"
            "        scaler.update()\n"
            "        optimizer.zero_grad()"
        ),
        references=("https://pytorch.org/docs/stable/notes/amp_examples.html#gradient-accumulation",),
    )
    valid = (
        # PyTorch's accumulation recipe
        """
        import torch
        scaler = torch.amp.GradScaler()
        for i, (x, y) in enumerate(data):
            scaler.scale(loss_fn(model(x), y) / n).backward()
            if (i + 1) % n == 0:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
        """,
        # no accumulation: both every iteration
        """
        import torch
        scaler = torch.amp.GradScaler()
        for x in data:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        """,
        # accumulation by `continue`: both after it
        """
        import torch
        scaler = torch.amp.GradScaler()
        for i, x in enumerate(data):
            scaler.scale(loss).backward()
            if (i + 1) % accum != 0:
                continue
            scaler.step(opt)
            scaler.update()
        """,
        # nanoGPT: accumulation by an inner loop
        """
        import torch
        scaler = torch.amp.GradScaler()
        while True:
            for micro in range(accum):
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        """,
        # flag from a modulo guards both
        """
        import torch
        scaler = torch.amp.GradScaler()
        for i, x in enumerate(data):
            sync = (i + 1) % accum == 0
            scaler.scale(loss).backward()
            if sync:
                scaler.step(opt)
                scaler.update()
        """,
        # the step is under a non-accumulation condition (skip on a flag), update beside it
        """
        import torch
        scaler = torch.amp.GradScaler()
        for x in data:
            scaler.scale(loss).backward()
            if not skip_step:
                scaler.step(opt)
            scaler.update()
        """,
        # accelerate-style sync flag guards both
        """
        import torch
        scaler = torch.amp.GradScaler()
        for x in data:
            scaler.scale(loss).backward()
            if accelerator.sync_gradients:
                scaler.step(opt)
                scaler.update()
        """,
        # an update() of something that is not a scaler
        """
        import torch
        scaler = torch.amp.GradScaler()
        for i, x in enumerate(data):
            scaler.scale(loss).backward()
            if (i + 1) % accum == 0:
                scaler.step(opt)
                scaler.update()
            pbar.update(1)
            meter.update(loss.item())
        """,
    )
    invalid = (
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler()
            for i, (x, y) in enumerate(data):
                scaler.scale(loss_fn(model(x), y) / n).backward()
                if (i + 1) % n == 0:
                    scaler.step(optimizer)
                    optimizer.zero_grad()
                scaler.update()
            """,
            line=8,
        ),
        Invalid(
            """
            import torch
            scaler = torch.cuda.amp.GradScaler()
            for step, batch in enumerate(loader):
                scaler.scale(model(batch)).backward()
                if step % accum == 0 or step == len(loader) - 1:
                    scaler.step(opt)
                    opt.zero_grad()
                scaler.update()
            """,
            line=8,
        ),
        Invalid(
            """
            import torch
            def train(model, loader, opt, scaler, accelerator):
                for batch in loader:
                    scaler.scale(model(batch)).backward()
                    if accelerator.sync_gradients:
                        scaler.step(opt)
                    scaler.update()
            """,
            line=7,
        ),
        # a flag computed from a modulo
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler()
            for i, x in enumerate(data):
                is_update_step = (i + 1) % accum == 0
                scaler.scale(loss).backward()
                if is_update_step:
                    scaler.step(opt)
                scaler.update()
            """,
            line=8,
        ),
        # a counter that is reset
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler()
            count = 0
            for x in data:
                scaler.scale(loss).backward()
                count += 1
                if count == accum:
                    scaler.step(opt)
                    count = 0
                scaler.update()
            """,
            line=10,
        ),
        # self.scaler in a trainer, update under an unrelated flag
        Invalid(
            """
            import torch
            class T:
                def __init__(self):
                    self.scaler = torch.amp.GradScaler()
                def fit(self, loader):
                    for i, b in enumerate(loader):
                        self.scaler.scale(self.model(b)).backward()
                        if (i + 1) % self.accum == 0:
                            self.scaler.step(self.opt)
                        if self.use_amp:
                            self.scaler.update()
            """,
            line=11,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        for update in training.of_kind("update"):
            site = update.site
            loop = innermost_loop(site)
            if loop is None:
                continue
            if training.under_accumulation(site, loop.node) is not None:
                continue
            for step in training.events_in(site.scope, "scaler_step"):
                if innermost_loop(step.site) is not loop or exclusive(step.site.frames, site.frames):
                    continue
                if update.key and step.key and update.key != step.key:
                    continue
                condition = training.under_accumulation(step.site, loop.node)
                if condition is None:
                    continue
                yield Diagnostic(
                    update.call,
                    f"`{update.key or 'scaler'}.update()` runs on every micro-step but `scaler.step()` only "
                    f"when the accumulation condition on line {line_of(model, condition.node)} holds; "
                    "move `update()` next to `step()` so the scale stays fixed for the whole window.",
                    related=(
                        (
                            step.call,
                            "scaler.step under the accumulation condition here",
                            ScalerUpdatePerMicrostep.SCALER_STEP,
                        ),
                    ),
                )
                break
