"""TL104 unscale-twice."""

from __future__ import annotations

from collections.abc import Iterator

from trainlint.api import (
    Applicability,
    Diagnostic,
    FixSpec,
    Invalid,
    Rule,
    RuleDoc,
    Severity,
    delete_statement,
    method_call_pattern,
)
from trainlint.model import (
    Event,
    EventKind,
    FileModel,
    Site,
    Training,
    exclusive,
    innermost_loop,
    line_of,
    standalone_call,
)
from trainlint.rules.amp._shared import optimizer_text


class UnscaleTwice(Rule):
    id = "TL104"
    name = "unscale-twice"
    severity = Severity.ERROR
    probe = True
    FIRST = "first-unscale"
    UPDATE = "conditional-update"
    summary = "scaler.unscale_(optimizer) called twice for one optimizer without scaler.update() in between."
    # Every finding needs `x.unscale_(...)` on a scaler: one by a `GradScaler` construction or by a
    # `x.scale(...)` call (``method_call_pattern``; `unscale_` itself is not a `.scale`).
    tokens = ("unscale_",)
    requires = (
        method_call_pattern("unscale_"),
        method_call_pattern("scale", or_tokens=("GradScaler",)),
    )
    # In the code: the scaler's unscale_ calls (events).
    gate = (("call:unscale_",),)
    # an unscale_ after another of its scope (or the file's helper that does one) with no sure update()
    # between, or in a loop whose update() may run only under an accumulation condition
    gate_check = "gate_clip_unscale.unscale_may_repeat"
    has_fix = True
    doc = RuleDoc(
        what=(
            "Reports a second `scaler.unscale_(opt)` for the same scaler and optimizer with no "
            "`scaler.update()` between the two (including an `unscale_` inside the file's own helper "
            "called before it), and an `unscale_` that runs on every micro-step of an accumulation "
            "loop whose `update()` runs only at the end of the window."
        ),
        why=(
            "`unscale_` divides the gradients in place by the current scale and records that it did; "
            "a second call before `update()` raises `RuntimeError: unscale_() has already been called "
            "on this optimizer since the last update()`. If it did not raise, gradients scaled by "
            "65536 would be divided twice and end up 65536 times too small. In an accumulation loop "
            "the failure appears on the second micro-step, so a quick test with `accum=1` passes and "
            "the real run crashes."
        ),
        example=(
            "scaler.scale(loss).backward()\n"
            "scaler.unscale_(optimizer)\n"
            "log_grad_norm(model)\n"
            "scaler.unscale_(optimizer)\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
            "scaler.step(optimizer)\n"
            "scaler.update()"
        ),
        use_instead=(
            "scaler.scale(loss).backward()\n"
            "scaler.unscale_(optimizer)\n"
            "log_grad_norm(model)\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
            "scaler.step(optimizer)\n"
            "scaler.update()"
        ),
        fix_safety=(
            "The fix deletes the line of the second `unscale_` call (with its trailing comment; a "
            "`pass` takes its place when it is the only statement of its block). It is safe: the "
            "gradients are already unscaled at that point, so the call can only raise, and removing "
            "it changes nothing else. It is offered only when the call stands alone on its line; the "
            "per-micro-step form has no automatic fix, because moving `unscale_` under the "
            "accumulation condition needs a decision about the clip that uses it."
        ),
        references=("https://pytorch.org/docs/stable/amp.html#torch.amp.GradScaler.unscale_",),
    )
    valid = (
        """
        import torch
        scaler = torch.amp.GradScaler()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(opt)
        scaler.update()
        """,
        # a loop: update between two iterations' unscale_
        """
        import torch
        scaler = torch.amp.GradScaler()
        for x in data:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        """,
        # two optimizers
        """
        import torch
        scaler = torch.amp.GradScaler()
        scaler.scale(loss).backward()
        scaler.unscale_(opt_a)
        scaler.unscale_(opt_b)
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()
        """,
        # other branches of an if/else
        """
        import torch
        scaler = torch.amp.GradScaler()
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        else:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        """,
        # accumulation recipe: unscale_ under the condition
        """
        import torch
        scaler = torch.amp.GradScaler()
        for i, x in enumerate(data):
            scaler.scale(loss).backward()
            if (i + 1) % k == 0:
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
        """,
        # update between the two
        """
        import torch
        scaler = torch.amp.GradScaler()
        scaler.scale(a).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        scaler.scale(b).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        """,
        # DummyGradScaler definitions
        """
        class DummyGradScaler:
            def unscale_(self, optimizer):
                pass
            def step(self, optimizer):
                self.unscale_(optimizer)
                self.unscale_(optimizer)
        """,
        # different functions
        """
        import torch
        scaler = torch.amp.GradScaler()
        def a():
            scaler.unscale_(opt)
        def b():
            scaler.unscale_(opt)
        """,
    )
    invalid = (
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            log(norm(params))
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            """,
            line=6,
        ),
        Invalid(
            """
            import torch
            class T:
                def __init__(self):
                    self.scaler = torch.amp.GradScaler()
                def step(self, loss):
                    self.scaler.scale(loss).backward()
                    self.scaler.unscale_(self.opt)
                    if self.clip:
                        self.scaler.unscale_(self.opt)
                        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
                    self.scaler.step(self.opt)
                    self.scaler.update()
            """,
            line=9,
        ),
        # through the file's own helper
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler()
            def clip_grads(opt):
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            def train_step(loss, opt):
                scaler.scale(loss).backward()
                clip_grads(opt)
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
            """,
            line=9,
        ),
        # every micro-step, update only at the end of the window
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler()
            for i, x in enumerate(data):
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                if (i + 1) % accum == 0:
                    scaler.step(opt)
                    scaler.update()
            """,
            line=5,
        ),
        # parameter scaler
        Invalid(
            """
            def step(scaler, optimizer, loss):
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                scaler.unscale_(optimizer)
                scaler.step(optimizer)
                scaler.update()
            """,
            line=4,
        ),
        # inside a loop, both per iteration
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler()
            for x in data:
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer=opt)
                if clip:
                    scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
            """,
            line=7,
        ),
        # safe fix: in a function
        Invalid(
            """
            def step(scaler, optimizer, loss):
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)  # once
                # measure before clipping
                log_norm(optimizer)
                scaler.unscale_(optimizer)  # again
                # step and update
                scaler.step(optimizer)
                scaler.update()
            """,
            fix="""
            def step(scaler, optimizer, loss):
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)  # once
                # measure before clipping
                log_norm(optimizer)
                # step and update
                scaler.step(optimizer)
                scaler.update()
            """,
        ),
        # safe fix: module level multi line
        Invalid(
            """
            import torch

            scaler = torch.amp.GradScaler()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            # twice
            scaler.unscale_(
                opt,
            )
            scaler.step(opt)
            scaler.update()
            """,
            fix="""
            import torch

            scaler = torch.amp.GradScaler()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            # twice
            scaler.step(opt)
            scaler.update()
            """,
        ),
        # safe fix: only statement of its block
        Invalid(
            """
            def step(scaler, optimizer, loss):
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                if clip:
                    scaler.unscale_(optimizer)  # for the clip
                scaler.step(optimizer)
                scaler.update()
            """,
            fix="""
            def step(scaler, optimizer, loss):
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                if clip:
                    pass  # for the clip
                scaler.step(optimizer)
                scaler.update()
            """,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        for unscale in training.of_kind("unscale"):
            yield from self._check(model, training, unscale)

    def _check(self, model: FileModel, training: Training, unscale: Event) -> Iterator[Diagnostic]:
        site = unscale.site
        optimizer = optimizer_text(unscale)
        events = training.events_in(site.scope, "unscale", "update")

        def on_path(e: Site) -> bool:
            return not exclusive(e.frames, site.frames)

        updates = [e for e in events if e.kind == "update" and on_path(e.site)]
        earlier: Site | None = None
        for e in events:
            if (
                e.kind == "unscale"
                and e.order < unscale.order
                and on_path(e.site)
                and e.key == unscale.key
                and optimizer_text(e) == optimizer
            ):
                earlier = e.site
        if earlier is None:
            for other in model.calls_in(site.scope):
                if (
                    other.order < unscale.order
                    and on_path(other)
                    and self._helper_unscales(model, training, other, unscale)
                ):
                    earlier = other
        if earlier is not None:
            if any(earlier.order < u.order < unscale.order for u in updates):
                return
            fix = None
            delete = (
                delete_statement(model, site.scope.node, site.statement)
                if standalone_call(site.statement, unscale.call)
                else None
            )
            if delete is not None:
                fix = FixSpec(Applicability.SAFE, "Remove the second `unscale_` call", (delete,))
            yield Diagnostic(
                unscale.call,
                f"`{unscale.key or 'scaler'}.unscale_({optimizer or '...'})` was already called on line "
                f"{line_of(model, earlier.node)} with no `update()` in between: this raises a RuntimeError; "
                "remove the second call.",
                related=((earlier.node, "first unscale_ here", UnscaleTwice.FIRST),),
                fix=fix,
            )
            return
        # Every micro-step: the same call runs again before the window's update().
        frame = innermost_loop(site, orelse=True)
        loop = frame.node if frame is not None else None
        if loop is None or training.under_accumulation(site, loop) is not None:
            return
        in_loop = [u for u in updates if getattr(innermost_loop(u.site, orelse=True), "node", None) is loop]
        if in_loop and all(training.under_accumulation(u.site, loop) is not None for u in in_loop):
            yield Diagnostic(
                unscale.call,
                f"`{unscale.key or 'scaler'}.unscale_(...)` runs on every micro-step but `update()` only at "
                "the end of the accumulation window: the second micro-step raises a RuntimeError; move "
                "`unscale_` under the same condition as `scaler.step`.",
                related=(
                    (in_loop[0].call, "update under the accumulation condition here", UnscaleTwice.UPDATE),
                ),
            )

    @staticmethod
    def _helper_unscales(model: FileModel, training: Training, site: Site, unscale: Event) -> bool:
        fn = model.local_callee(site)
        scope = model.scope_for(fn) if fn is not None else None
        if scope is not None:
            inner = training.events_in(scope, EventKind.UNSCALE, EventKind.UPDATE)
            if not any(e.kind == EventKind.UPDATE for e in inner) and any(
                e.kind == EventKind.UNSCALE and e.key == unscale.key for e in inner
            ):
                return True
        return False
