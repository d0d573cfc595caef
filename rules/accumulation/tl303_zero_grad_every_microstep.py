"""TL303 zero-grad-every-microstep."""

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
    call_pattern,
)
from trainlint.model import (
    Event,
    FileModel,
    Frame,
    Scope,
    Site,
    attr_name,
    block_of,
    dotted,
    ends_file,
    frames_inside,
    in_loop,
    line_indent,
    positional,
    receiver,
    reindented,
    standalone_call,
    whole_lines,
)
from trainlint.model.flow import iteration_frame
from trainlint.model.training import mentions_parameters_of


class ZeroGradEveryMicrostep(Rule):
    id = "TL303"
    name = "zero-grad-every-microstep"
    severity = Severity.ERROR
    probe = True
    STEP = "conditional-step"
    summary = (
        "zero_grad() runs on every iteration while step() runs only at the end of an accumulation window."
    )
    # Prefilter: zero_grad, step and backward method calls (events, ``call_pattern``), and an
    # accumulation condition (`%`, `sync_gradients`, or a counter reset `if n == k` / `if n >= k`).
    tokens = ("zero_grad",)
    requires = (
        call_pattern("zero_grad"),
        call_pattern("step"),
        call_pattern("backward"),
        ("%", "sync_gradients", "==", ">="),
    )
    # In the code: the zero_grad call, and the step call under an accumulation condition (an `if`
    # statement), the events it reports.
    gate = (("call:zero_grad",), ("if:step",))
    # In the tree: a step under an `if` that may be an accumulation test, in a loop (or training_step)
    # whose scope also has a backward outside that `if` and an unconditional zero_grad of that optimizer.
    gate_check = "gate_zero_grad.zero_grad_may_run_every_microstep"
    has_fix = True
    doc = RuleDoc(
        what=(
            "Reports `optimizer.zero_grad()` (or `model.zero_grad()` for the model that optimizer "
            "updates) that runs on every iteration of a loop in which `optimizer.step()` runs only "
            "under an accumulation condition (`(i + 1) % accum == 0`, `accelerator.sync_gradients`, "
            "`if not is_accumulating:`, a counter compared with the accumulation count), while a "
            "backward runs on every iteration. Lightning's `training_step(self, batch, batch_idx)` "
            "counts as such a loop's body (the framework runs it once per batch; with manual "
            "optimization it calls `step()` itself). Not reported when `zero_grad()` sits under the same "
            "condition, inside `accelerator.accumulate(...)` (whose prepared optimizer skips it "
            "between updates), or for a different optimizer (a GAN's discriminator)."
        ),
        why=(
            "Accumulation relies on `.grad` summing over the window's backward passes. Clearing it on "
            "every iteration leaves only the last microbatch's gradient when `step()` finally runs. "
            "With 8 accumulation steps of 4 examples each, the update is computed from 4 examples "
            "instead of 32, so it is about sqrt(8), nearly three times, noisier than intended; and if "
            "the loss was also divided by 8, the step is 8 times too small as well. Nothing fails and "
            "the loss still goes down, only slower."
        ),
        example=(
            "for i, (x, y) in enumerate(loader):\n"
            "    optimizer.zero_grad()\n"
            "    loss = criterion(model(x), y) / accum_steps\n"
            "    loss.backward()\n"
            "    if (i + 1) % accum_steps == 0:\n"
            "        optimizer.step()"
        ),
        use_instead=(
            "for i, (x, y) in enumerate(loader):\n"
            "    loss = criterion(model(x), y) / accum_steps\n"
            "    loss.backward()\n"
            "    if (i + 1) % accum_steps == 0:\n"
            "        optimizer.step()\n"
            "        optimizer.zero_grad()"
        ),
        fix_safety=(
            "The fix moves the `zero_grad()` line (with its trailing comment) to right after the step "
            "line, inside the branch that steps. It is offered only when that is the loop's one step "
            "of that optimizer, both calls stand alone on their lines, and the `zero_grad()` sits "
            "directly in the loop body (or in a `with` block there) that keeps another statement. It "
            "is unsafe because it changes when gradients are cleared beyond the bug itself: code that "
            "reads `.grad` after the step in the same iteration now sees it cleared, and gradients "
            "from before the loop or from an incomplete window at the end of the previous epoch are no "
            "longer cleared at the start of the next window (add a `zero_grad()` before the loop if "
            "that matters)."
        ),
    )
    valid = (
        """
        for i, (x, y) in enumerate(loader):
            loss = crit(model(x), y) / n
            loss.backward()
            if (i + 1) % n == 0:
                optimizer.step()
                optimizer.zero_grad()
        """,
        # zero_grad at the start of a window
        """
        for i, (x, y) in enumerate(loader):
            if i % accum == 0:
                optimizer.zero_grad()
            crit(model(x), y).backward()
            if (i + 1) % accum == 0:
                optimizer.step()
        """,
        # no accumulation: step every iteration
        """
        for x, y in loader:
            optimizer.zero_grad()
            crit(model(x), y).backward()
            optimizer.step()
        """,
        # zero_grad once per epoch, in the outer loop
        """
        for epoch in range(E):
            optimizer.zero_grad()
            for i, b in enumerate(loader):
                model(b).loss.backward()
                if (i + 1) % accum == 0:
                    optimizer.step()
        """,
        # accelerate's accumulate(): the prepared optimizer skips zero_grad between updates
        """
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    optimizer.step()
                optimizer.zero_grad()
        """,
        # a GAN: the generator steps every n_critic iterations with its own zero_grad
        """
        for i, real in enumerate(loader):
            d_opt.zero_grad()
            d_loss(real).backward()
            d_opt.step()
            if i % n_critic == 0:
                g_opt.zero_grad()
                g_loss().backward()
                g_opt.step()
        """,
        # a skipped step that is not accumulation (NaN guard)
        """
        for x, y in loader:
            optimizer.zero_grad()
            loss = crit(model(x), y)
            loss.backward()
            if torch.isfinite(loss):
                optimizer.step()
        """,
        # nanoGPT: inner micro-step loop, step and zero_grad after it
        """
        while True:
            for micro_step in range(gradient_accumulation_steps):
                logits, loss = model(X, Y)
                scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        """,
        # Lightning manual optimization: clears right after the step, under the same condition
        """
        class Net(LightningModule):
            def training_step(self, batch, batch_idx):
                opt = self.optimizers()
                self.manual_backward(self.loss(batch) / self.accum)
                if (batch_idx + 1) % self.accum == 0:
                    opt.step()
                    opt.zero_grad()
        """,
        # litgpt / Fabric: step and zero_grad both under `if not is_accumulating`
        """
        for batch in loader:
            iter_num += 1
            is_accumulating = iter_num % accum_iters != 0
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                fabric.backward(model(batch).loss / accum_iters)
            if not is_accumulating:
                optimizer.step()
                optimizer.zero_grad()
        """,
    )
    invalid = (
        Invalid(
            """
            for i, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                loss = crit(model(x), y) / n
                loss.backward()
                if (i + 1) % n == 0:
                    optimizer.step()
            """,
            line=2,
        ),
        # zero_grad after the conditional step, but unconditional
        Invalid(
            """
            for i, b in enumerate(loader):
                model(b).loss.backward()
                if (i + 1) % accum_steps == 0:
                    optimizer.step()
                optimizer.zero_grad()
            """,
            line=5,
        ),
        # a flag computed from a modulo
        Invalid(
            """
            for it, batch in enumerate(loader):
                is_accumulating = (it + 1) % accum != 0
                opt.zero_grad()
                fabric.backward(model(batch).loss)
                if not is_accumulating:
                    opt.step()
            """,
            line=3,
        ),
        # scaler.step(opt) under the condition, self.optimizer
        Invalid(
            """
            def train(self):
                for step, batch in enumerate(self.loader):
                    self.optimizer.zero_grad()
                    self.scaler.scale(self.model(batch)).backward()
                    if step % self.args.gradient_accumulation_steps == 0 or step == len(self.loader) - 1:
                        self.scaler.step(self.optimizer)
                        self.scaler.update()
            """,
            line=3,
        ),
        # model.zero_grad() on the model the optimizer updates
        Invalid(
            """
            import torch
            opt = torch.optim.AdamW(model.parameters())
            for i, b in enumerate(loader):
                model.zero_grad()
                model(b).loss.backward()
                if (i + 1) % accum == 0:
                    opt.step()
            """,
            line=4,
        ),
        # a counter compared with the accumulation count
        Invalid(
            """
            count = 0
            for b in loader:
                optimizer.zero_grad(set_to_none=True)
                model(b).loss.backward()
                count += 1
                if count == args.gradient_accumulation_steps:
                    optimizer.step()
                    count = 0
            """,
            line=3,
        ),
        # Lightning manual optimization: the framework's loop calls training_step once per batch
        Invalid(
            """
            class Net(LightningModule):
                def training_step(self, batch, batch_idx):
                    opt = self.optimizers()
                    opt.zero_grad()
                    self.manual_backward(self.loss(batch))
                    if (batch_idx + 1) % self.accum == 0:
                        opt.step()
            """,
            line=4,
        ),
        # accelerate without accumulate(): the flag is never False, zero_grad really clears
        Invalid(
            """
            for step, batch in enumerate(loader):
                outputs = model(**batch)
                accelerator.backward(outputs.loss / accum)
                optimizer.zero_grad()
                if step % accum == 0:
                    optimizer.step()
                    lr_scheduler.step()
            """,
            line=4,
        ),
        # inside a `with` block (autocast) in the loop
        Invalid(
            """
            import torch
            for i, b in enumerate(loader):
                with torch.autocast('cuda'):
                    optimizer.zero_grad()
                    loss = model(b).loss
                loss.backward()
                if (i + 1) % grad_accum == 0:
                    optimizer.step()
            """,
            line=4,
        ),
        # unsafe fix: top of the loop
        Invalid(
            """
            for i, (x, y) in enumerate(loader):
                # start of the micro-step
                optimizer.zero_grad()  # clear
                loss = crit(model(x), y) / accum
                loss.backward()
                if (i + 1) % accum == 0:
                    optimizer.step()  # update
                    lr_scheduler.step()
            """,
            unsafe_fix="""
            for i, (x, y) in enumerate(loader):
                # start of the micro-step
                loss = crit(model(x), y) / accum
                loss.backward()
                if (i + 1) % accum == 0:
                    optimizer.step()  # update
                    optimizer.zero_grad()  # clear
                    lr_scheduler.step()
            """,
        ),
        # unsafe fix: the blank line under the moved call goes with it (no blank line opens the loop)
        Invalid(
            """
            for i, (x, y) in enumerate(loader):
                optimizer.zero_grad()  # clear

                # forward
                loss = crit(model(x), y) / accum
                loss.backward()
                if (i + 1) % accum == 0:
                    optimizer.step()
            """,
            unsafe_fix="""
            for i, (x, y) in enumerate(loader):
                # forward
                loss = crit(model(x), y) / accum
                loss.backward()
                if (i + 1) % accum == 0:
                    optimizer.step()
                    optimizer.zero_grad()  # clear
            """,
        ),
        # unsafe fix: the blank line under the moved call goes with it (no doubled blank line)
        Invalid(
            """
            for i, (x, y) in enumerate(loader):
                loss = crit(model(x), y) / accum
                loss.backward()
                if (i + 1) % accum == 0:
                    optimizer.step()  # update

                optimizer.zero_grad()  # clear

            print("done")
            """,
            unsafe_fix="""
            for i, (x, y) in enumerate(loader):
                loss = crit(model(x), y) / accum
                loss.backward()
                if (i + 1) % accum == 0:
                    optimizer.step()  # update
                    optimizer.zero_grad()  # clear

            print("done")
            """,
        ),
        # unsafe fix: after the branch with a scaler
        Invalid(
            """
            import torch

            class Trainer:
                def __init__(self):
                    self.scaler = torch.amp.GradScaler()

                def train(self):
                    for step, batch in enumerate(self.loader):
                        self.scaler.scale(self.model(batch)).backward()
                        if (step + 1) % self.accum == 0:
                            self.scaler.step(self.optimizer)
                            self.scaler.update()
                        self.optimizer.zero_grad(set_to_none=True)  # free the memory
                        self.log(step)
            """,
            unsafe_fix="""
            import torch

            class Trainer:
                def __init__(self):
                    self.scaler = torch.amp.GradScaler()

                def train(self):
                    for step, batch in enumerate(self.loader):
                        self.scaler.scale(self.model(batch)).backward()
                        if (step + 1) % self.accum == 0:
                            self.scaler.step(self.optimizer)
                            self.optimizer.zero_grad(set_to_none=True)  # free the memory
                            self.scaler.update()
                        self.log(step)
            """,
        ),
        # unsafe fix: model zero grad in a with block step on the last line
        Invalid(
            """
            import torch

            opt = torch.optim.AdamW(model.parameters())
            for i, b in enumerate(loader):
                with torch.autocast("cuda"):
                    model.zero_grad()
                    # forward
                    loss = model(b).loss
                loss.backward()
                if (i + 1) % accum == 0:
                    opt.step()""",
            unsafe_fix="""
            import torch

            opt = torch.optim.AdamW(model.parameters())
            for i, b in enumerate(loader):
                with torch.autocast("cuda"):
                    # forward
                    loss = model(b).loss
                loss.backward()
                if (i + 1) % accum == 0:
                    opt.step()
                    model.zero_grad()""",
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        reported: set[int] = set()
        for step in training.of_kind("step", "scaler_step"):
            optimizer = _optimizer_expr(step)
            key = dotted(optimizer)
            loop = iteration_frame(step.site)
            if key is None or loop is None:
                continue
            condition = training.under_accumulation(step.site, loop.node)
            if condition is None:
                continue
            scope = step.site.scope
            if not self._backward_every_iteration(model, scope, loop, condition):
                continue
            for zero in training.events_in(scope, "zero_grad"):
                if id(zero.site.node) in reported or not in_loop(zero.site, loop):
                    continue
                if not self._same_optimizer(model, zero, optimizer, scope):
                    continue
                if not self._unconditional(zero.site, loop) or self._inside_accumulate(zero.site):
                    continue
                reported.add(id(zero.site.node))
                step_line = model.position(step.site.node).start.line
                yield Diagnostic(
                    zero.call,
                    f"`{model.code(zero.call.func)}()` runs on every iteration but the optimizer steps only "
                    f"at the end of an accumulation window (line {step_line}), so all but the last "
                    "microbatch's gradients are thrown away; call it right after the step, under the "
                    "same condition.",
                    related=(
                        (
                            step.site.node,
                            "the optimizer steps here, under an accumulation condition",
                            ZeroGradEveryMicrostep.STEP,
                        ),
                    ),
                    fix=self._move_fix(model, training, zero, step, loop),
                )

    @staticmethod
    def _move_fix(model: FileModel, training, zero: Event, step: Event, loop: Frame) -> FixSpec | None:
        """Move the ``zero_grad()`` line to right after the step line. Only when the step is the one
        step of that optimizer in the loop, both calls stand alone on their lines, the ``zero_grad()``
        sits in the loop body (or a ``with`` block in it) and its block keeps another statement."""
        key = dotted(_optimizer_expr(step))
        steps = [
            e
            for e in training.events_in(step.site.scope, "step", "scaler_step")
            if in_loop(e.site, loop) and dotted(_optimizer_expr(e)) == key
        ]
        zero_statement, step_statement = zero.site.statement, step.site.statement
        if (
            steps != [step]
            or not standalone_call(zero_statement, zero.call)
            or not standalone_call(step_statement, step.call)
            or any(f.kind != "with" for f in frames_inside(zero.site, loop))
        ):
            return None
        block = block_of(zero.site.scope.node, zero_statement)
        if not isinstance(block, cst.IndentedBlock) or len(block.body) < 2:
            return None
        indent = line_indent(model, step_statement)
        moved = reindented(model, zero_statement, indent) if indent is not None else None
        if moved is None or line_indent(model, zero_statement) is None:
            return None
        content = "".join(line + "\n" for line in whole_lines(model, step_statement)) + moved
        if ends_file(model, step_statement):
            content = content[:-1]
        first = block.body[0] is zero_statement
        return FixSpec(
            Applicability.UNSAFE,
            f"Move `{model.code(zero.call.func)}()` right after the step on line "
            f"{model.position(step.call).start.line}",
            (
                TextEditSpec(zero_statement, "delete_lines", ""),
                *_orphaned_blank_lines(model, zero_statement, first),
                TextEditSpec(step_statement, "delete_lines", content),
            ),
        )

    @staticmethod
    def _backward_every_iteration(model: FileModel, scope: Scope, loop: Frame, condition: Frame) -> bool:
        """A backward runs on every iteration, and none runs only with the step: a backward under the
        step's own condition (a GAN generator updated every n_critic iterations) means the
        unconditional backward belongs to something else. Lightning's ``self.manual_backward(loss)``
        counts as a backward."""
        sites = [e.site for e in model.training.events_in(scope, "backward", "scaled_backward")]
        sites += [
            s
            for s in model.calls_in(scope)
            if attr_name(s.node) == "manual_backward" and dotted(receiver(s.node)) == "self"
        ]
        every = False
        for site in sites:
            if not in_loop(site, loop):
                continue
            if any(f.node is condition.node for f in site.frames):
                return False
            every = True
        return every

    @staticmethod
    def _same_optimizer(model: FileModel, zero: Event, optimizer: cst.BaseExpression, scope: Scope) -> bool:
        if zero.key is None:
            return False
        if zero.key == dotted(optimizer):
            return True
        # model.zero_grad() where the optimizer is built from model.parameters()
        return any(
            isinstance(value, cst.Call) and mentions_parameters_of(value, zero.key)
            for value in model.values_of(optimizer, scope)
        )

    @staticmethod
    def _unconditional(site: Site, loop: Frame) -> bool:
        """No ``if``, loop or exception handler between the loop body and the site."""
        for frame in frames_inside(site, loop):
            if frame.kind in ("if", "loop") or (frame.kind == "try" and frame.branch == "handler"):
                return False
        return True

    @staticmethod
    def _inside_accumulate(site: Site) -> bool:
        for frame in site.frames:
            if frame.kind == "with" and isinstance(frame.node, cst.With):
                for item in frame.node.items:
                    if isinstance(item.item, cst.Call) and attr_name(item.item) in ("accumulate", "no_sync"):
                        return True
        return False


def _optimizer_expr(event: Event) -> cst.BaseExpression | None:
    """The optimizer a step acts on: the receiver of ``opt.step()``, the argument of
    ``scaler.step(opt)``."""
    if event.kind == "scaler_step":
        args = positional(event.call)
        return args[0] if args else None
    return receiver(event.call)


def _orphaned_blank_lines(model: FileModel, statement: cst.CSTNode, first: bool) -> Iterator[TextEditSpec]:
    """Deletions of the blank lines right after a statement that is moved away, when they would be
    left at the top of its block or doubled with the blank lines before it."""
    start, end = model.position(statement).start.line, model.position(statement).end.line
    if not first and (start < 2 or model.lines[start - 2].strip()):
        return
    blank = {}
    stack: list[cst.CSTNode] = [model.module]
    while stack:  # the blank lines are nodes (EmptyLine) of whatever statement follows
        node = stack.pop()
        if isinstance(node, cst.EmptyLine) and node.comment is None:
            blank[model.position(node).start.line] = node
        stack.extend(node.children)
    line = end + 1
    while line in blank:
        yield TextEditSpec(blank[line], "replace", "")
        line += 1
