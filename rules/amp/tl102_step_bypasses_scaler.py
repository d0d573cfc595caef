"""TL102 step-bypasses-scaler."""

from __future__ import annotations

import re
from collections.abc import Iterator

import libcst as cst

from trainlint.api import (
    Applicability,
    Diagnostic,
    FixSpec,
    Invalid,
    Rule,
    RuleDoc,
    Severity,
    TextEditSpec,
    method_call_pattern,
)
from trainlint.model import (
    Event,
    FileModel,
    Scope,
    Site,
    dotted,
    exclusive,
    receiver,
    runs_with,
)
from trainlint.rules.amp._shared import optimizer_text


class StepBypassesScaler(Rule):
    id = "TL102"
    name = "step-bypasses-scaler"
    severity = Severity.ERROR
    probe = True
    SCALED_BACKWARD = "scaled-backward"
    summary = (
        "optimizer.step() called directly after a loss-scaled backward instead of scaler.step(optimizer)."
    )
    # Every finding needs a scaled backward `x.scale(...).backward()` and a `.step()` (method calls:
    # ``method_call_pattern``).
    tokens = ("scale",)
    requires = (
        ("backward",),
        ("step",),
        method_call_pattern("scale"),
        method_call_pattern("backward"),
        method_call_pattern("step"),
    )
    # In the tree: a possible optimizer's `.step()` after a scaled backward in its scope (nothing between
    # that ends the pairing), or in another method of the class of a `self.x.scale(...).backward()`.
    gate_check = "gate_scaler_steps.step_may_bypass_scaler"
    has_fix = True
    doc = RuleDoc(
        what=(
            "Reports `optimizer.step()` called directly in a function (or script) whose loss went "
            "through `scaler.scale(loss).backward()` with no `scaler.step(...)` in between. Not "
            "reported when the direct step is the non-AMP branch of an `if` whose other branch calls "
            "`scaler.step`, when a plain backward of another loss precedes it, or for the optimizer "
            "that MS-AMP's `msamp.initialize` returned, which handles the scale itself (another "
            "optimizer in the same file is still reported)."
        ),
        why=(
            "After a scaled backward every gradient is multiplied by the loss scale (65536 at the "
            "start). `optimizer.step()` applies them as they are: with SGD at lr 0.01 a true gradient "
            "of 0.001 moves the weight by 0.01 * 0.001 * 65536 ≈ 0.66 instead of 0.00001. Adam hides "
            "the factor in its normalisation, but only until an fp16 overflow: `scaler.step` skips the "
            "update when a gradient is inf or NaN, a direct `step()` writes the NaN into the weights. "
            "And since `scaler.step` never ran, `scaler.update()` has nothing to look at (it raises "
            "'No inf checks were recorded prior to update')."
        ),
        example=("scaler.scale(loss).backward()\noptimizer.step()\nscaler.update()"),
        use_instead=("scaler.scale(loss).backward()\nscaler.step(optimizer)\nscaler.update()"),
        fix_safety=(
            "The fix replaces `optimizer.step()` by `scaler.step(optimizer)`. It is safe when the call "
            "has no arguments and a `scaler.update()` follows it under the same loop and conditions "
            "(each `scaler.step` needs an `update()` before the next one). Otherwise, for example "
            "with a closure argument or no `update()` in sight, it is offered as unsafe or not at all."
        ),
        references=("https://pytorch.org/docs/stable/amp.html#gradient-scaling",),
    )
    valid = (
        """
        import torch
        scaler = torch.amp.GradScaler()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        """,
        # non-AMP branch of an if/else
        """
        import torch
        scaler = torch.amp.GradScaler()
        if use_amp:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        """,
        # two ifs on the same flag
        """
        import torch
        scaler = torch.amp.GradScaler(enabled=amp)
        if amp:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        if amp:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        """,
        # the scheduler steps directly, the optimizer through the scaler
        """
        import torch
        scaler = torch.amp.GradScaler()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        lr_scheduler.step()
        """,
        # GAN: the generator's loss is not scaled
        """
        import torch
        scaler = torch.amp.GradScaler()
        scaler.scale(loss_d).backward()
        scaler.step(opt_d)
        scaler.update()
        loss_g.backward()
        opt_g.step()
        """,
        # MS-AMP's optimizer (the one `msamp.initialize` returned) handles the scale
        """
        import torch, msamp
        model, optimizer = msamp.initialize(model, optimizer, opt_level='O2')
        scaler = torch.amp.GradScaler()
        scaler.scale(loss).backward()
        optimizer.step()
        """,
        # DummyGradScaler's own step method
        """
        class DummyGradScaler:
            def scale(self, loss):
                return loss
            def step(self, optimizer):
                optimizer.step()
        """,
        # no scaler at all
        """
        import torch
        loss.backward()
        optimizer.step()
        """,
        # a model engine, not an optimizer
        """
        import torch
        scaler = torch.amp.GradScaler()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        ema.step()
        """,
    )
    invalid = (
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler()
            scaler.scale(loss).backward()
            optimizer.step()
            scaler.update()
            """,
            line=4,
        ),
        # MS-AMP in the file, but this optimizer is not the one it returned: its step sees scaled grads
        Invalid(
            """
            import torch, msamp
            encoder, enc_opt = msamp.initialize(encoder, enc_opt, opt_level='O2')
            head_opt = torch.optim.AdamW(head.parameters())
            scaler = torch.amp.GradScaler()
            scaler.scale(loss).backward()
            head_opt.step()
            scaler.update()
            """,
            line=6,
        ),
        Invalid(
            """
            import torch
            class T:
                def __init__(self):
                    self.scaler = torch.cuda.amp.GradScaler()
                    self.optimizer = torch.optim.AdamW(self.model.parameters())
                def step(self, loss):
                    self.scaler.scale(loss).backward()
                    self.optimizer.step()
                    self.scaler.update()
            """,
            line=8,
        ),
        # the backward is scaled under a flag, the step is unconditional
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler()
            if use_amp:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            optimizer.step()
            """,
            line=7,
        ),
        # accumulation loop
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler()
            for i, b in enumerate(loader):
                scaler.scale(model(b) / accum).backward()
                if (i + 1) % accum == 0:
                    opt.step()
                    scaler.update()
                    opt.zero_grad()
            """,
            line=6,
        ),
        # scaler as a parameter, recognised by use
        Invalid(
            """
            def train_step(scaler, optimizer, loss):
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                optimizer.step()
                scaler.update()
            """,
            line=4,
        ),
        # closure argument
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler()
            opt = torch.optim.LBFGS(params)
            scaler.scale(loss).backward()
            opt.step(closure)
            scaler.update()
            """,
            line=5,
        ),
        # second optimizer after the first went through the scaler
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler()
            scaler.scale(loss).backward()
            scaler.step(opt_a)
            opt_b.step()
            scaler.update()
            """,
            line=5,
        ),
        # safe fix: scaler step
        Invalid(
            """
            import torch

            scaler = torch.amp.GradScaler()
            for x, y in loader:
                scaler.scale(loss_fn(model(x), y)).backward()
                # apply the update
                optimizer.step()  # every iteration
                scaler.update()
            """,
            fix="""
            import torch

            scaler = torch.amp.GradScaler()
            for x, y in loader:
                scaler.scale(loss_fn(model(x), y)).backward()
                # apply the update
                scaler.step(optimizer)  # every iteration
                scaler.update()
            """,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        yield from self._in_one_scope(model)
        yield from self._split_over_methods(model)

    def _split_over_methods(self, model: FileModel) -> Iterator[Diagnostic]:
        """A trainer whose ``self.scaler`` is only ever used as ``self.scaler.scale(loss).backward()``
        (one method) while another method steps the optimizer directly: nothing in the file unscales,
        steps or updates that scaler, and it is handed nowhere else."""
        training = model.training
        for backward in training.of_kind("scaled_backward"):
            key, cls = backward.key, backward.site.scope.enclosing_class
            if key is None or not key.startswith("self.") or cls is None or not _only_scales(model, key):
                continue
            for step in training.of_kind("step"):
                site = step.site
                recv = receiver(step.call)
                if (
                    site.scope is backward.site.scope
                    or site.scope.enclosing_class is not cls
                    or not training.is_optimizer_like(recv, site.scope)
                    or _from_msamp(model, recv, site.scope)
                ):
                    continue
                optimizer = dotted(recv) or "optimizer"
                line = model.position(backward.call).start.line
                yield Diagnostic(
                    step.call,
                    f"`{optimizer}.step()` applies gradients that `{key}.scale(...).backward()` (line {line}) "
                    f"multiplied by the loss scale: `{key}` is never stepped, unscaled or updated in this "
                    f"file; call `{key}.step({optimizer})` and `{key}.update()` instead.",
                    related=((backward.call, "scaled backward here", StepBypassesScaler.SCALED_BACKWARD),),
                )
            return

    def _in_one_scope(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        for step in training.of_kind("step"):
            site = step.site
            recv = receiver(step.call)
            if not training.is_optimizer_like(recv, site.scope) or _from_msamp(model, recv, site.scope):
                continue
            events = training.events_in(
                site.scope, "scaled_backward", "backward", "scaler_step", "update", "unscale"
            )

            def on_path(e: Event, site: Site = site) -> bool:
                return not exclusive(e.site.frames, site.frames)

            if any(e.kind == "scaler_step" and not on_path(e) for e in events):
                continue  # the direct step is the other branch of a scaler.step
            scaled = [
                e for e in events if e.kind == "scaled_backward" and e.order < step.order and on_path(e)
            ]
            if not scaled:
                continue
            backward = scaled[-1]
            between = [e for e in events if backward.order < e.order < step.order and on_path(e)]
            if any(e.kind == "scaler_step" and optimizer_text(e) == dotted(recv) for e in between):
                continue  # already stepped through the scaler: a double step is another problem
            if any(
                e.kind == "backward" and not exclusive(e.site.frames, backward.site.frames) for e in between
            ):
                continue  # a plain backward of another loss comes last
            scaler = backward.key or "scaler"
            optimizer = dotted(recv) or "optimizer"
            if any(e.kind == "unscale" for e in between):
                problem = (
                    "bypasses the GradScaler, so a step with inf/NaN gradients is applied instead of skipped"
                )
            else:
                problem = (
                    "applies gradients that are still multiplied by the loss scale and does not skip "
                    "inf/NaN steps"
                )
            yield Diagnostic(
                step.call,
                f"`{optimizer}.step()` {problem}; call `{scaler}.step({optimizer})` instead.",
                related=((backward.call, "scaled backward here", StepBypassesScaler.SCALED_BACKWARD),),
                fix=self._fix(model, step, scaler, optimizer, [e for e in events if e.kind == "update"]),
            )

    @staticmethod
    def _fix(
        model: FileModel, step: Event, scaler: str, optimizer: str, updates: list[Event]
    ) -> FixSpec | None:
        updates = [
            u for u in updates if u.order > step.order and not exclusive(u.site.frames, step.site.frames)
        ]
        if not updates or dotted(receiver(step.call)) is None:
            return None
        call = step.call
        parts = [optimizer]
        for arg in call.args:
            prefix = f"{arg.keyword.value}=" if arg.keyword is not None else arg.star
            parts.append(prefix + model.code(arg.value))
        safe = not call.args and runs_with(step.site, updates[0].site)
        return FixSpec(
            Applicability.SAFE if safe else Applicability.UNSAFE,
            f"Replace with `{scaler}.step({optimizer})`",
            (TextEditSpec(call, "replace", f"{scaler}.step({', '.join(parts)})"),),
        )


def _only_scales(model: FileModel, key: str) -> bool:
    """Every mention of ``self.x`` in the file's text is ``self.x.scale(`` or an assignment to it (a
    comment or a string naming it otherwise counts as a use: silence is the safe side)."""
    name = re.escape(key)
    others = len(re.findall(rf"\b{name}\b(?!\s*\.\s*scale\s*\()", model.source))
    return others == len(re.findall(rf"\b{name}\s*=(?!=)", model.source))


def _from_msamp(model: FileModel, optimizer: cst.BaseExpression | None, scope: Scope) -> bool:
    """The optimizer MS-AMP returned (``model, optimizer = msamp.initialize(...)``): its step handles
    the scale. Only that optimizer: another one in the same file steps scaled gradients."""
    key = dotted(optimizer)
    binding = model.lookup(key, scope) if key is not None and "." not in key else None
    node = binding.node if binding is not None else None
    value = node.value if isinstance(node, cst.Assign) else None
    return isinstance(value, cst.Call) and (model.qualname(value.func, scope) or "").startswith("msamp.")
