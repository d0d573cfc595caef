"""TL101 clip-before-unscale."""

from __future__ import annotations

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
    Site,
    Training,
    attr_name,
    block_of,
    exclusive,
    indentation,
    line_of,
    runs_with,
    source_text,
    walk,
)
from trainlint.model.crossfile import Elsewhere, related_elsewhere, shown_path
from trainlint.rules.amp._shared import optimizer_text


class ClipBeforeUnscale(Rule):
    id = "TL101"
    name = "clip-before-unscale"
    severity = Severity.ERROR
    probe = True
    SCALED_BACKWARD = "scaled-backward"
    summary = "Gradient clipping on gradients that are still multiplied by the GradScaler's loss scale."
    # Every finding needs a clip (`clip_grad` in the call or its import, `utils` of torch.nn.utils), a
    # scaled backward `x.scale(...).backward()` and the scaler's `x.step(...)`. A method call's name
    # always stands between `.` or whitespace and `(`, whitespace, `)`, `\` or `#`, however it is laid
    # out: the last groups ask that of each method (which skips `grad_scale`, `scaled`, prose).
    tokens = ("clip_grad",)
    requires = (
        ("utils",),
        ("backward",),
        ("scale",),
        ("step",),
        method_call_pattern("scale"),
        method_call_pattern("backward"),
        method_call_pattern("step"),
    )
    # An updater in another file than the scaled backward: the clip and the scaler's step are here.
    project_requires = (("clip_grad",), ("utils",), ("step",), method_call_pattern("step"))
    project_callers = True
    # In the code: a call of torch's clip function (by its name, or a name bound to it), and the
    # scaled backward and scaler step calls (events).
    _CLIP_CALLED = tuple(
        f"{kind}:{name}"
        for kind in ("call", "alias")
        for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "clip_grad_norm")
    )
    gate = (_CLIP_CALLED, ("call:scale",), ("call:backward",), ("call:step",))
    # every finding, the cross-file ones too, is about a clip and a later scaler step of this file
    project_gate = (_CLIP_CALLED, ("call:step",))
    # a clip with a scaler's step after it and a scaled backward before it in its scope (or on the step's
    # scaler in another scope), no sure unscale_ or scaler step in between
    gate_check = "gate_clip_unscale.clip_may_precede_unscale"
    has_fix = True
    doc = RuleDoc(
        what=(
            "Reports `torch.nn.utils.clip_grad_norm_`, `clip_grad_value_` and `clip_grads_with_norm_` "
            "(under any import alias) when they run after a loss-scaled backward "
            "(`scaler.scale(loss).backward()` with a `torch.amp.GradScaler`) and before "
            "`scaler.step(...)`, with no `scaler.unscale_(optimizer)` earlier on that path. An "
            "`unscale_` that only comes after the clip is reported too. The scaler is recognised by "
            "its construction (`torch.amp.GradScaler`, `torch.cuda.amp.GradScaler`, `torch.GradScaler`, "
            "FSDP's `ShardedGradScaler`, whatever `enabled=` says), through `self.scaler` assigned "
            "anywhere in the class, or by use (a parameter called as `x.scale(loss).backward()` and "
            "`x.step(...)`). An updater that only steps the scaler it receives (a function, or a "
            "method of a class that another file holds as `self.updater = Updater(...)`, with a "
            "parameter named `grad_scaler` or annotated `Optional[GradScaler]`) is reported when "
            "another project file calls it after its scaled backward with no `unscale_` in between. "
            "Helpers that unscale by themselves, such as Accelerate's "
            "`accelerator.clip_grad_norm_`, Lightning's `self.clip_gradients` or apex's "
            "`amp.scale_loss` context, are not reported."
        ),
        why=(
            "A GradScaler multiplies the loss by a large factor (65536 = 2^16 at the start) so that "
            "small fp16 gradients do not underflow; every gradient is multiplied by the same factor "
            "until `unscale_` divides it back out. Clipping in between compares the *scaled* gradients "
            "with your threshold. Say the true gradient norm is 3.0 and `max_norm=1.0`: the clip sees a "
            "norm of 3.0 * 65536 ≈ 196608, rescales by 1/196608, and after `scaler.step` unscales the "
            "gradient its norm is 1/65536 ≈ 0.000015 instead of 1.0. Every step is clipped, and the "
            "update is about 65536 times smaller than intended; the loss barely moves and nothing "
            "raises. With `clip_grad_value_(params, 0.5)` every scaled component above 0.5 (that is, "
            "every true component above 0.5/65536 ≈ 0.0000076) is cut, which also destroys the "
            "direction of the update."
        ),
        example=(
            "scaler.scale(loss).backward()\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
            "scaler.step(optimizer)\n"
            "scaler.update()"
        ),
        use_instead=(
            "scaler.scale(loss).backward()\n"
            "scaler.unscale_(optimizer)\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
            "scaler.step(optimizer)\n"
            "scaler.update()"
        ),
        fix_safety=(
            "The fix inserts `scaler.unscale_(optimizer)` (with the optimizer passed to `scaler.step`) "
            "just before the clip, in the same block, or moves a later `unscale_` there. It is safe: "
            "`scaler.step` skips its own unscaling when `unscale_` already ran, so the update is the "
            "one the author meant, and the inf/NaN check still happens. No fix is offered when the "
            "optimizer is not a plain name, when the clip could run more often than `scaler.step` "
            "(for example on every micro-step of an accumulation loop, where a second `unscale_` "
            "before `update()` would raise), or when several optimizers are stepped."
        ),
        references=(
            "https://pytorch.org/docs/stable/notes/amp_examples.html#working-with-unscaled-gradients",
        ),
    )
    valid = (
        # PyTorch's recipe "Working with Unscaled Gradients"
        """
        import torch
        scaler = torch.amp.GradScaler('cuda')
        for x, y in data:
            optimizer.zero_grad()
            with torch.autocast('cuda', dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            scaler.step(optimizer)
            scaler.update()
        """,
        # PyTorch's gradient accumulation recipe
        """
        import torch
        scaler = torch.cuda.amp.GradScaler()
        for i, (x, y) in enumerate(data):
            with torch.autocast('cuda'):
                loss = loss_fn(model(x), y) / iters_to_accumulate
            scaler.scale(loss).backward()
            if (i + 1) % iters_to_accumulate == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
        """,
        # the scaled backward is in the other branch
        """
        import torch
        scaler = torch.amp.GradScaler()
        if use_amp:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        """,
        # Accelerate unscales inside its own clip helper
        """
        from accelerate import Accelerator
        accelerator = Accelerator(mixed_precision='fp16')
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        """,
        # Lightning's helper
        """
        import torch
        class M(LightningModule):
            def configure_gradient_clipping(self, opt, clip_val, algo):
                self.clip_gradients(opt, gradient_clip_val=clip_val, gradient_clip_algorithm=algo)
        """,
        # apex unscales when the context exits
        """
        import torch
        from apex import amp
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()
        """,
        # a scaler-less fp32 loop
        """
        import torch
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        """,
        # timm's NativeScaler: unscale_ under the same condition as the clip
        """
        import torch
        class NativeScaler:
            def __init__(self):
                self._scaler = torch.cuda.amp.GradScaler()
            def __call__(self, loss, optimizer, clip_grad=None, parameters=None):
                self._scaler.scale(loss).backward()
                if clip_grad is not None:
                    self._scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
                self._scaler.step(optimizer)
                self._scaler.update()
        """,
        # DummyGradScaler method definitions are not calls
        """
        import torch
        class DummyGradScaler:
            def scale(self, loss):
                return loss
            def unscale_(self, optimizer):
                pass
            def step(self, optimizer):
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
        """,
        # clip after the step belongs to another rule (TL108)
        """
        import torch
        scaler = torch.amp.GradScaler()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        """,
        # unscale_ done in the file's own helper method
        """
        import torch
        class T:
            def __init__(self):
                self.scaler = torch.amp.GradScaler()
            def unscale(self):
                self.scaler.unscale_(self.opt)
            def train_step(self, loss):
                self.scaler.scale(loss).backward()
                self.unscale()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                self.scaler.step(self.opt)
                self.scaler.update()
        """,
        # a user's own function called clip_grad_norm_
        """
        import torch
        def clip_grad_norm_(params, m):
            pass
        scaler = torch.amp.GradScaler()
        scaler.scale(loss).backward()
        clip_grad_norm_(params, 1.0)
        scaler.step(opt)
        scaler.update()
        """,
    )
    invalid = (
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler()
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            """,
            line=4,
        ),
        # alias import, torch.cuda.amp scaler with enabled=
        Invalid(
            """
            from torch.cuda.amp import GradScaler
            from torch.nn.utils import clip_grad_norm_ as clip
            scaler = GradScaler(enabled=args.amp)
            for x in data:
                scaler.scale(loss).backward()
                clip(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
            """,
            line=6,
        ),
        # self.scaler assigned in __init__, used in another method (minGPT-ddp)
        Invalid(
            """
            import torch
            class Trainer:
                def __init__(self, cfg):
                    self.scaler = torch.amp.GradScaler(enabled=cfg.use_amp)
                def run_batch(self, loss):
                    if self.cfg.use_amp:
                        self.scaler.scale(loss).backward()
                        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                        self.scaler.step(self.optimizer)
                        self.scaler.update()
                    else:
                        loss.backward()
                        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                        self.optimizer.step()
            """,
            line=8,
        ),
        # the clip is inside `if max_norm:`
        Invalid(
            """
            import torch
            scaler = torch.GradScaler()
            scaler.scale(loss).backward()
            if max_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            scaler.step(opt)
            scaler.update()
            """,
            line=5,
        ),
        # unscale_ comes after the clip
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler()
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            """,
            line=4,
        ),
        # the scaler is a parameter, recognised by its use
        Invalid(
            """
            import torch.nn as nn
            def train_step(model, opt, scaler, loss):
                scaler.scale(loss).backward()
                nn.utils.clip_grad_value_(model.parameters(), 0.5)
                scaler.step(opt)
                scaler.update()
            """,
            line=4,
        ),
        # unscale_ in the other branch of an if/else does not cover the clip
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler()
            scaler.scale(loss).backward()
            if log_grads:
                scaler.unscale_(opt)
            else:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(opt)
            scaler.update()
            """,
            line=7,
        ),
        # accumulation: clip on every micro-step, step under the condition
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler()
            for i, batch in enumerate(loader):
                scaler.scale(model(batch)).backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                if (i + 1) % accum == 0:
                    scaler.step(opt)
                    scaler.update()
            """,
            line=5,
        ),
        # scaler built as `GradScaler() if amp else None`; the clip runs after either backward
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler() if amp else None
            if scaler is not None:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            """,
            line=7,
        ),
        # module path torch.nn.utils.clip_grad
        Invalid(
            """
            import torch
            from torch.nn.utils.clip_grad import clip_grad_norm_
            scaler = torch.amp.GradScaler('cuda')
            scaler.scale(loss).backward()
            total = clip_grad_norm_(params, 1.0)
            scaler.step(opt)
            scaler.update()
            """,
            line=5,
        ),
        # safe fix: insert unscale
        Invalid(
            """
            import torch

            scaler = torch.amp.GradScaler()
            for x, y in loader:
                # forward and scaled backward
                scaler.scale(loss_fn(model(x), y)).backward()
                # clip the gradients
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # max norm 1
                scaler.step(optimizer)  # apply
                scaler.update()
            """,
            fix="""
            import torch

            scaler = torch.amp.GradScaler()
            for x, y in loader:
                # forward and scaled backward
                scaler.scale(loss_fn(model(x), y)).backward()
                # clip the gradients
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # max norm 1
                scaler.step(optimizer)  # apply
                scaler.update()
            """,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        for clip in training.of_kind("clip"):
            yield from self._check_clip(model, training, clip)

    def _check_clip(self, model: FileModel, training: Training, clip: Event) -> Iterator[Diagnostic]:
        site = clip.site
        events = training.events_in(site.scope, "scaled_backward", "unscale", "scaler_step", "clip")

        def on_path(e: Event) -> bool:
            return not exclusive(e.site.frames, site.frames)

        steps = [e for e in events if e.kind == "scaler_step" and on_path(e)]
        later_steps = [e for e in steps if e.order > clip.order]
        if not later_steps:
            return
        backwards = [e for e in events if e.kind == "scaled_backward" and e.order < clip.order and on_path(e)]
        caller = None
        if backwards:
            backward = backwards[-1]
            window_start = backward.order
        else:
            # The scaled backward may sit in another method of the same trainer class.
            found = self._backward_elsewhere(model, training, site, later_steps)
            caller = None if found is not None else scaled_by_caller(model, site, later_steps)
            if found is None and caller is None:
                return
            backward, window_start = found, -1
        if any(window_start < e.order < clip.order for e in steps):
            return  # the clip follows a step: not this rule's concern
        unscales = [e for e in events if e.kind == "unscale" and on_path(e)]
        # only an unscale_ after the scaled backward counts: one before it leaves these gradients scaled
        if any(window_start < e.order < clip.order for e in unscales):
            return
        if any(
            window_start < other.order < clip.order and helper_does(model, training, other, "unscale")
            for other in model.calls_in(site.scope)
            if not exclusive(other.frames, site.frames)
        ):
            return
        step = later_steps[0]
        later_unscales = [e for e in unscales if clip.order < e.order < step.order]
        # Only the first clip of a window gets the fix: a second inserted unscale_ would raise.
        first_clip = not any(
            e.kind == "clip" and on_path(e) and window_start < e.order < clip.order for e in events
        )
        scaler = step.key or (backward.key if backward else None) or "scaler"
        clip_name = attr_name(clip.call) or "clip"
        related = (
            ((backward.call, "scaled backward here", ClipBeforeUnscale.SCALED_BACKWARD),) if backward else ()
        )
        if later_unscales:
            moved = later_unscales[0]
            message = (
                f"`{clip_name}` runs before `{scaler}.unscale_(...)` on line {line_of(model, moved.call)}, "
                "so it clips gradients still multiplied by the loss scale; move the `unscale_` call "
                "before the clip."
            )
            fix = self._move_fix(model, site, moved)
        else:
            optimizer = optimizer_text(step)
            message = (
                f"`{clip_name}` runs on gradients still multiplied by the GradScaler's loss scale, so "
                f"the threshold is compared with scaled values; call "
                f"`{scaler}.unscale_({optimizer or 'optimizer'})` before clipping."
            )
            fix = self._insert_fix(model, site, later_steps, scaler, optimizer) if first_clip else None
        elsewhere = related_elsewhere(caller, ClipBeforeUnscale.SCALED_BACKWARD)
        yield Diagnostic(clip.call, message, related=related, fix=fix, elsewhere=elsewhere)

    @staticmethod
    def _backward_elsewhere(
        model: FileModel, training: Training, site: Site, steps: list[Event]
    ) -> Event | None:
        """A scaled backward on the same scaler in another method of the class (``self.scaler``) or
        another function (a module-level scaler), when that scaler is never unscaled anywhere."""
        keys = {e.key for e in steps if e.key}
        if len(keys) != 1:
            return None
        (key,) = keys
        if any(e.key == key for e in training.of_kind("unscale")):
            return None
        head = key.split(".")[0]
        cls = site.scope.enclosing_class
        for event in training.of_kind("scaled_backward"):
            if event.key != key or event.site.scope is site.scope:
                continue
            if head == "self":
                if cls is not None and event.site.scope.enclosing_class is cls:
                    return event
                continue
            here = model.lookup(head, site.scope)
            there = model.lookup(head, event.site.scope)
            if here is not None and here is there and here.kind != "param":
                return event
        return None

    @staticmethod
    def _insertion_point(model: FileModel, site: Site) -> tuple[cst.CSTNode, str] | None:
        statement = site.statement
        if not isinstance(statement, cst.SimpleStatementLine) and any(
            f.node is statement for f in site.frames
        ):
            return None  # `if x: clip(...)` on one line: an insertion before it would be unconditional
        if isinstance(statement, cst.SimpleStatementLine) and not any(
            node is site.node for node in walk(statement.body[0])
        ):
            return (
                None  # `backward(); clip(...)` on one line: inserting before the line precedes the backward
            )
        indent = indentation(model, statement)
        if indent is None:
            return None
        return statement, indent

    def _insert_fix(
        self, model: FileModel, site: Site, steps: list[Event], scaler: str, optimizer: str | None
    ) -> FixSpec | None:
        if optimizer is None or {optimizer_text(s) for s in steps} != {optimizer}:
            return None
        if not all(runs_with(site, s.site) for s in steps[:1]):
            return None
        point = self._insertion_point(model, site)
        if point is None:
            return None
        statement, indent = point
        return FixSpec(
            Applicability.SAFE,
            f"Insert `{scaler}.unscale_({optimizer})` before the clip",
            (TextEditSpec(statement, "before", f"{scaler}.unscale_({optimizer})\n{indent}"),),
        )

    def _move_fix(self, model: FileModel, site: Site, moved: Event) -> FixSpec | None:
        """Swap the clip with an ``unscale_`` statement that directly follows it in the same block."""
        statement = moved.site.statement
        clip_statement = site.statement
        if not (
            isinstance(statement, cst.SimpleStatementLine)
            and isinstance(clip_statement, cst.SimpleStatementLine)
            and len(statement.body) == 1
            and isinstance(statement.body[0], cst.Expr)
            and statement.body[0].value is moved.call
        ):
            return None
        block = block_of(site.scope.node, clip_statement)
        if block is None:
            return None
        body = list(block.body)
        index = next(i for i, s in enumerate(body) if s is clip_statement)
        if index + 1 >= len(body) or body[index + 1] is not statement:
            return None
        return FixSpec(
            Applicability.SAFE,
            "Move the `unscale_` call before the clip",
            (
                TextEditSpec(clip_statement, "replace", source_text(model, statement)),
                TextEditSpec(statement, "replace", source_text(model, clip_statement)),
            ),
        )


def helper_does(model: FileModel, training: Training, site: Site, kind: str) -> bool:
    """Whether a call of the file's own function/method runs an event of ``kind`` (one level deep)."""
    fn = model.local_callee(site)
    scope = model.scope_for(fn) if fn is not None else None
    return scope is not None and bool(training.events_in(scope, kind))


def scaled_by_caller(model: FileModel, site: Site, steps: list[Event]) -> Elsewhere | None:
    """The scaler stepped here is a parameter of a module-level function or of a method of a
    module-level class (an "updater") that another project file calls after its scaled backward,
    without an ``unscale_`` in between: where it does."""
    keys = {e.key for e in steps if e.key}
    scope = site.scope
    function = scope.node
    if len(keys) != 1 or model.project is None or not isinstance(function, cst.FunctionDef):
        return None
    name = function.name.value
    params = [p.name.value for p in (*function.params.posonly_params, *function.params.params)]
    owner = scope.parent
    if owner is not None and isinstance(owner.node, cst.ClassDef) and owner.parent is model.module_scope:
        name, params = f"{owner.node.name.value}.{name}", params[1:]  # (``self`` is the instance)
    elif owner is not model.module_scope:
        return None
    (key,) = keys
    binding = model.lookup(key, scope)
    if binding is None or binding.kind != "param":
        return None
    for path, call in model.project.callers(model.project.path, name):
        passed = call["keywords"].get(key)
        if passed is None and key in params and params.index(key) < len(call["args"]):
            passed = call["args"][params.index(key)]
        if passed and call["after_scaled_backward"] and not call["after_unscale"]:
            line, column = call["at"]
            return Elsewhere(
                shown_path(path), line, column, f"passes `{passed}` after its scaled backward here"
            )
    return None
