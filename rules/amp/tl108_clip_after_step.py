"""TL108 clip-after-step."""

from __future__ import annotations

from collections.abc import Iterator

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
    attr_name,
    dotted,
    exclusive,
    line_of,
    positional,
    receiver,
    runs_with,
)
from trainlint.model.vocab import (
    INFINITIES,
)


class ClipAfterStep(Rule):
    id = "TL108"
    name = "clip-after-step"
    severity = Severity.WARNING
    summary = "Gradient clipping after the optimizer step that consumed those gradients."
    # Every finding needs a clip (`clip_grad`, `utils` of torch.nn.utils), a `x.backward()` before it
    # and a `x.step(...)` between them (``method_call_pattern``).
    tokens = ("clip_grad",)
    requires = (
        ("utils",),
        ("backward",),
        ("step",),
        method_call_pattern("backward"),
        method_call_pattern("step"),
    )
    # In the code: a call of torch's clip function (by its name, or a name bound to it), and the
    # backward and step calls (events).
    gate = (
        tuple(
            f"{kind}:{name}"
            for kind in ("call", "alias")
            for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "clip_grad_norm")
        ),
        ("call:backward",),
        ("call:step",),
    )
    # a clip after a backward and then a step of its scope (same loops), with no sure step after it
    gate_check = "gate_clip_unscale.clip_may_follow_step"
    doc = RuleDoc(
        what=(
            "Reports `torch.nn.utils.clip_grad_norm_` / `clip_grad_value_` that runs after "
            "`optimizer.step()` (or `scaler.step(optimizer)`) and before the next backward, with no "
            "other step after it that could use the clipped gradients. A `clip_grad_norm_` with an "
            "infinite threshold (`float('inf')`), which only measures the norm, is not reported."
        ),
        why=(
            "The optimizer has already applied the gradients, so clipping them afterwards changes "
            "nothing in that update; then `zero_grad()` (or the next backward) discards or overwrites "
            "them. A run that was meant to cap the update at a norm of 1.0 applies a gradient of norm "
            "250 unchanged, and a loss spike that clipping should have absorbed goes straight into "
            "the weights, while the loss curve gives no hint that clipping never took effect."
        ),
        example=(
            "loss.backward()\n"
            "optimizer.step()\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
            "optimizer.zero_grad()"
        ),
        use_instead=(
            "loss.backward()\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
            "optimizer.step()\n"
            "optimizer.zero_grad()"
        ),
        references=("https://pytorch.org/docs/stable/generated/torch.nn.utils.clip_grad_norm_.html",),
    )
    valid = (
        """
        import torch
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        """,
        # measuring the norm after the step
        """
        import torch
        loss.backward()
        optimizer.step()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float('inf'))
        """,
        # GAN: the clip is for the second optimizer, stepped after it
        """
        import torch
        loss_d.backward()
        opt_d.step()
        loss_g.backward()
        torch.nn.utils.clip_grad_norm_(gen.parameters(), 1.0)
        opt_g.step()
        """,
        # step of one optimizer, clip then step of another, same backward
        """
        import torch
        loss.backward()
        opt_a.step()
        torch.nn.utils.clip_grad_value_(b.parameters(), 0.5)
        opt_b.step()
        """,
        # scheduler step is not the optimizer step
        """
        import torch
        loss.backward()
        scheduler.step()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        """,
        # in a loop: clip at the top of the iteration, after the previous backward... and the step after it
        """
        import torch
        for x in data:
            loss = model(x)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad()
        """,
        # the step is in the other branch
        """
        import torch
        loss.backward()
        if skip:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        else:
            optimizer.step()
        """,
        # a step with no backward before it in the function
        """
        import torch
        def finish(optimizer):
            optimizer.step()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        """,
    )
    invalid = (
        Invalid(
            """
            import torch
            loss.backward()
            optimizer.step()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.zero_grad()
            """,
            line=4,
        ),
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            """,
            line=6,
        ),
        Invalid(
            """
            import torch
            for x in data:
                loss = model(x)
                loss.backward()
                optimizer.step()
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)
                optimizer.zero_grad()
            """,
            line=6,
        ),
        Invalid(
            """
            from torch.nn.utils import clip_grad_norm_
            class T:
                def __init__(self):
                    self.optimizer = torch.optim.AdamW(self.model.parameters())
                def step(self, loss):
                    loss.backward()
                    self.optimizer.step()
                    if self.max_norm:
                        clip_grad_norm_(self.model.parameters(), self.max_norm)
            """,
            line=9,
        ),
        Invalid(
            """
            import torch
            for i, x in enumerate(data):
                model(x).backward()
                if (i + 1) % k == 0:
                    opt.step()
                    torch.nn.utils.clip_grad_norm_(params, 1.0)
                    opt.zero_grad()
            """,
            line=6,
        ),
        Invalid(
            """
            import torch.nn as nn
            def train(model, optimizer, loss):
                loss.backward()
                optimizer.step()
                total = nn.utils.clip_grad_norm_(model.parameters(), max_norm=5.0)
                return total
            """,
            line=5,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        for clip in training.of_kind("clip"):
            site = clip.site
            norm = positional(clip.call)[1:2] or [
                a.value for a in clip.call.args if a.keyword and a.keyword.value in ("max_norm", "clip_value")
            ]
            if norm and is_infinite(model, norm[0], site.scope):
                continue
            events = training.events_in(site.scope, "backward", "scaled_backward", "step", "scaler_step")
            on_path = [e for e in events if not exclusive(e.site.frames, site.frames)]
            backwards = [e for e in on_path if e.kind in ("backward", "scaled_backward")]
            before = [e for e in backwards if e.order < clip.order]
            if not before:
                continue
            last_backward = before[-1]

            def optimizer_step(e: Event) -> bool:
                if e.kind == "scaler_step":
                    return True
                return e.kind == "step" and training.is_optimizer_like(receiver(e.call), e.site.scope)

            # Only when the clip runs exactly on the iterations where the step ran (same loops, and
            # every condition of the step also guards the clip).
            steps = [
                e
                for e in on_path
                if optimizer_step(e)
                and last_backward.order < e.order < clip.order
                and runs_with(site, e.site)
            ]
            if not steps:
                continue
            next_backward = min((e.order for e in backwards if e.order > clip.order), default=None)
            if any(
                e.kind in ("step", "scaler_step")
                and e.order > clip.order
                and (next_backward is None or e.order < next_backward)
                and "sched" not in (dotted(receiver(e.call)) or "").lower()
                for e in on_path
            ):
                continue
            yield Diagnostic(
                clip.call,
                f"`{attr_name(clip.call)}` runs after the optimizer step on line {line_of(model, steps[-1].call)} "
                "has already applied the gradients, so it changes nothing; clip between backward and step.",
                related=((steps[-1].call, "optimizer step here"),),
            )


def is_infinite(model: FileModel, expr: cst.BaseExpression | None, scope: Scope) -> bool:
    """``float('inf')``, ``math.inf``, ``torch.inf``: a clip that only measures the norm."""
    if expr is None:
        return False
    if isinstance(expr, cst.Call) and model.qualname(expr.func, scope) == "builtins.float":
        args = positional(expr)
        return (
            bool(args)
            and isinstance(args[0], cst.SimpleString)
            and "inf" in str(args[0].evaluated_value).lower()
        )
    return model.qualname(expr, scope) in INFINITIES
