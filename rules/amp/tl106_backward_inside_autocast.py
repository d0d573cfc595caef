"""TL106 backward-inside-autocast."""

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
    ends_file,
    line_indent,
    reindented,
    standalone_call,
    whole_lines,
)
from trainlint.rules.amp._shared import autocast_call, autocast_frames


class BackwardInsideAutocast(Rule):
    id = "TL106"
    name = "backward-inside-autocast"
    severity = Severity.WARNING
    summary = "backward() called inside an autocast region."
    # Every finding needs an autocast region and a `x.backward()` call (``method_call_pattern``).
    tokens = ("autocast",)
    requires = (("backward",), method_call_pattern("backward"))
    # In the code: the backward call (an event).
    gate = (("call:backward",),)
    # In the tree: a `x.backward()` in the body of a `with` or in a decorated function whose item or
    # decorator may be an autocast call not written `enabled=False`.
    gate_check = "gate_autocast_backward.backward_may_run_in_autocast"
    has_fix = True
    doc = RuleDoc(
        what=(
            "Reports `.backward()` and `scaler.scale(loss).backward()` written inside a `with "
            "torch.autocast(...)`, `torch.amp.autocast(...)` or `torch.cuda.amp.autocast()` block "
            "(also through a context stored in a variable, such as nanoGPT's `ctx`, and in a "
            "function decorated with autocast). An inner `autocast(enabled=False)` turns the region off."
        ),
        why=(
            "Autocast is meant for the forward pass only. Backward ops already run in the dtype "
            "autocast chose for the matching forward ops, so the region buys nothing for the backward "
            "itself, while every autocast-eligible op placed beside it (the matmuls of a gradient "
            "penalty, an auxiliary forward for metrics) also runs in 16 bits: an fp16 matmul whose "
            "result exceeds 65504, the largest finite fp16 value, returns inf. PyTorch's "
            "documentation recommends leaving the context before calling backward."
        ),
        example=(
            "with torch.autocast('cuda', dtype=torch.bfloat16):\n"
            "    loss = loss_fn(model(x), y)\n"
            "    loss.backward()"
        ),
        use_instead=(
            "with torch.autocast('cuda', dtype=torch.bfloat16):\n"
            "    loss = loss_fn(model(x), y)\n"
            "loss.backward()"
        ),
        fix_safety=(
            "The fix moves the backward line (with its trailing comment) out of the `with` block to "
            "just after it, at the `with` statement's indentation; the only thing that now runs "
            "before it is the region's exit. It is offered only when the backward is the block's last "
            "statement and stands alone on its line, the block keeps another statement, every context "
            "manager of that `with` is an autocast (leaving a `model.no_sync()` or a timer as well "
            "would change more than precision), and no other enabled autocast region surrounds it. It "
            "is unsafe: the backward now runs with autocast off, which is the point, but code that "
            "runs during backward and follows the caller's autocast state (a custom "
            "`autograd.Function` without `custom_bwd`, hooks that compute, a `create_graph=True` "
            "backward for a gradient penalty) can then produce slightly different numbers."
        ),
        references=("https://pytorch.org/docs/stable/amp.html#torch.autocast",),
    )
    valid = (
        """
        import torch
        with torch.autocast('cuda'):
            loss = loss_fn(model(x), y)
        loss.backward()
        """,
        """
        import torch
        with torch.autocast('cuda'):
            loss = model(x)
        scaler.scale(loss).backward()
        """,
        # an inner region that is switched off
        """
        import torch
        with torch.autocast('cuda'):
            loss = model(x)
            with torch.autocast('cuda', enabled=False):
                loss.float().backward()
        """,
        # another library's autocast
        """
        from accelerate import Accelerator
        with accelerator.autocast():
            loss = model(x)
            accelerator.backward(loss)
        """,
        # a user function called autocast
        """
        from contextlib import contextmanager
        @contextmanager
        def autocast():
            yield
        with autocast():
            loss = model(x)
            loss.backward()
        """,
        # a no_grad block
        """
        import torch
        with torch.no_grad():
            out = model(x)
        loss.backward()
        """,
        # nanoGPT: ctx is autocast, backward after it
        """
        import torch
        from contextlib import nullcontext
        ctx = nullcontext() if device_type == 'cpu' else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
        with ctx:
            logits, loss = model(X, Y)
        scaler.scale(loss).backward()
        """,
        # decorated forward, backward outside
        """
        import torch
        class M(torch.nn.Module):
            @torch.autocast('cuda')
            def forward(self, x):
                return self.net(x)
        loss = M()(x).sum()
        loss.backward()
        """,
    )
    invalid = (
        # the scaled backward of a GradScaler loop, inside torch.amp.autocast
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler('cuda')
            for x in loader:
                with torch.amp.autocast('cuda'):
                    loss = model(x).mean()
                    scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            """,
            line=6,
        ),
        Invalid(
            """
            import torch
            with torch.autocast('cuda', dtype=torch.bfloat16):
                loss = loss_fn(model(x), y)
                loss.backward()
            """,
            line=4,
        ),
        Invalid(
            """
            from torch.cuda.amp import autocast
            with autocast():
                loss = model(x)
                scaler.scale(loss).backward()
            """,
            line=4,
        ),
        Invalid(
            """
            import torch
            for x, y in data:
                with torch.amp.autocast(device_type='cuda'):
                    out = model(x)
                    loss = crit(out, y)
                    if train:
                        loss.backward()
            """,
            line=7,
        ),
        # through a context variable
        Invalid(
            """
            import torch
            from contextlib import nullcontext
            ctx = nullcontext() if cpu else torch.autocast('cuda', dtype=torch.float16)
            with ctx:
                loss = model(x)
                scaler.scale(loss).backward()
            """,
            line=6,
        ),
        # a decorated training step
        Invalid(
            """
            import torch
            @torch.autocast(device_type='cuda', dtype=torch.float16)
            def train_step(x):
                loss = model(x).mean()
                loss.backward()
            """,
            line=5,
        ),
        # inside several context managers
        Invalid(
            """
            import torch
            with torch.no_grad(), torch.autocast('cpu'):
                pass
            with timer(), torch.autocast('cpu', dtype=torch.bfloat16):
                loss = model(x)
                torch.autograd.backward(loss)
            """,
            line=6,
        ),
        Invalid(
            """
            import torch
            with torch.autocast('cuda'):
                with torch.autocast('cuda', enabled=False):
                    loss = model(x.float())
                loss.backward()
            """,
            line=5,
        ),
        # unsafe fix: last statement in a loop
        Invalid(
            """
            import torch

            for x, y in loader:
                with torch.autocast("cuda", dtype=torch.bfloat16):  # forward only
                    # the loss
                    loss = loss_fn(model(x), y)
                    loss.backward()  # backprop
                # update
                optimizer.step()
            """,
            unsafe_fix="""
            import torch

            for x, y in loader:
                with torch.autocast("cuda", dtype=torch.bfloat16):  # forward only
                    # the loss
                    loss = loss_fn(model(x), y)
                loss.backward()  # backprop
                # update
                optimizer.step()
            """,
        ),
        # unsafe fix: context variable multi line and footer comment
        Invalid(
            """
            import torch
            from contextlib import nullcontext

            ctx = nullcontext() if cpu else torch.autocast("cuda", dtype=torch.float16)
            with ctx:
                loss = model(x)
                scaler.scale(
                    loss
                ).backward()
                # scaler.update() comes later

            scaler.step(opt)
            """,
            unsafe_fix="""
            import torch
            from contextlib import nullcontext

            ctx = nullcontext() if cpu else torch.autocast("cuda", dtype=torch.float16)
            with ctx:
                loss = model(x)
                # scaler.update() comes later
            scaler.scale(
                loss
            ).backward()

            scaler.step(opt)
            """,
        ),
        # unsafe fix: nested in a method at the end of the file
        Invalid(
            """
            import torch

            class Trainer:
                def step(self, batch):
                    with torch.amp.autocast("cuda"):  # forward
                        loss = self.model(batch).loss
                        loss.backward()""",
            unsafe_fix="""
            import torch

            class Trainer:
                def step(self, batch):
                    with torch.amp.autocast("cuda"):  # forward
                        loss = self.model(batch).loss
                    loss.backward()""",
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        for event in training.of_kind("backward", "scaled_backward"):
            regions = autocast_frames(model, event.site)
            if not regions:
                continue
            innermost, enabled = regions[-1]
            if not enabled:
                continue
            yield Diagnostic(
                event.call,
                "backward() runs inside an autocast region, which is meant for the forward pass only "
                "(backward ops already follow the dtype of their forward ops); call backward after the "
                "autocast block.",
                related=((innermost, "autocast region opened here"),),
                fix=self._move_out_fix(model, event, regions),
            )

    @staticmethod
    def _move_out_fix(model: FileModel, event: Event, regions: list[tuple[cst.Call, bool]]) -> FixSpec | None:
        """Dedent the backward line out of the ``with`` block it ends: the same as deleting it and
        inserting it after the block. Only for a ``with`` all of whose items are autocast (moving out
        of ``model.no_sync()`` or a timer would change more), that keeps another statement, and
        around which no other enabled autocast region remains."""
        site = event.site
        statement = site.statement
        if not site.frames or not standalone_call(statement, event.call):
            return None
        frame = site.frames[-1]
        block = frame.node.body if isinstance(frame.node, cst.With) else None
        if (
            frame.kind != "with"
            or not isinstance(block, cst.IndentedBlock)
            or len(block.body) < 2
            or block.body[-1] is not statement
        ):
            return None
        own = [autocast_call(model, item.item, site.scope) for item in frame.node.items]
        if any(call is None for call in own):
            return None
        outer = [(call, on) for call, on in regions if not any(call is mine for mine in own)]
        if outer and outer[-1][1]:
            return None  # still inside an enabled region after the move
        indent = line_indent(model, frame.node)
        content = reindented(model, statement, indent) if indent is not None else None
        if content is None:
            return None
        footer = [line.comment for line in block.footer if line.comment is not None]
        if footer:
            # comments indented under the block after its last statement stay inside the block
            anchor = footer[-1]
            kept = "".join(line + "\n" for line in whole_lines(model, anchor))
            edits = (
                TextEditSpec(statement, "delete_lines", ""),
                TextEditSpec(anchor, "delete_lines", kept + content),
            )
        else:
            edits = (TextEditSpec(statement, "delete_lines", content),)
            anchor = statement
        if ends_file(model, anchor):
            last = edits[-1]
            edits = (*edits[:-1], TextEditSpec(last.anchor, last.where, last.content[:-1]))
        return FixSpec(
            Applicability.UNSAFE,
            "Move the backward call after the autocast block",
            edits,
        )
