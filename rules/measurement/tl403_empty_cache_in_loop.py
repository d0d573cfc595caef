"""TL403 empty-cache-in-loop."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from trainlint.api import Diagnostic, Invalid, Rule, RuleDoc, Severity, call_pattern
from trainlint.model import (
    FileModel,
    Site,
    frames_inside,
    innermost_loop,
)
from trainlint.model.vocab import EMPTY_CACHE
from trainlint.rules.measurement._shared import TRAINING_WORK


class EmptyCacheInLoop(Rule):
    id = "TL403"
    name = "empty-cache-in-loop"
    severity = Severity.WARNING
    summary = "torch.cuda.empty_cache() on every iteration of a training loop."
    # Prefilter: torch's empty_cache, and a backward or step method call (an event) in its loop.
    tokens = ("empty_cache",)
    requires = (
        ("torch",),
        call_pattern("backward", "step"),
    )
    # An empty_cache() directly in a loop body (no if/loop/except between) whose loop, in the same scope,
    # has an `x.backward()` or `x.step()` call of its own.
    gate_check = "gate_memory_measurement.empty_cache_in_training_loop"
    doc = RuleDoc(
        what=(
            "Reports `torch.cuda.empty_cache()` that runs on every iteration of a loop whose iterations "
            "run a backward or an optimizer step. Calls in an outer loop (once per epoch), under a "
            "condition (`if step % 100 == 0`), in an exception handler (after an out-of-memory "
            "error), or after evaluation are not reported."
        ),
        why=(
            "`empty_cache()` hands the caching allocator's unused blocks back to the driver. It cannot "
            "free memory that tensors still use, so it does not lower the peak of the next step. It "
            "does make the next step allocate every block again through `cudaMalloc`, which "
            "synchronises the device: on a step of 300 ms with a few hundred allocations this easily "
            "adds 10 to 50 ms, 3 to 15% of the run, for nothing."
        ),
        example=(
            "for batch in loader:\n"
            "    loss = model(batch).loss\n"
            "    loss.backward()\n"
            "    optimizer.step()\n"
            "    optimizer.zero_grad()\n"
            "    torch.cuda.empty_cache()"
        ),
        use_instead=(
            "for batch in loader:\n"
            "    loss = model(batch).loss\n"
            "    loss.backward()\n"
            "    optimizer.step()\n"
            "    optimizer.zero_grad()\n"
            "# if memory is fragmented, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True instead"
        ),
        references=(
            "https://pytorch.org/docs/stable/notes/cuda.html#memory-management",
            "`trainlint memory` shows what a step really keeps (the bill per rank, its peak), without "
            'a GPU: README, "`trainlint memory`"',
        ),
    )
    valid = (
        """
        import torch
        for epoch in range(E):
            for b in loader:
                model(b).loss.backward()
                opt.step()
            evaluate()
            torch.cuda.empty_cache()
        """,
        """
        import torch
        for step, b in enumerate(loader):
            model(b).loss.backward()
            opt.step()
            if step % 1000 == 0:
                torch.cuda.empty_cache()
        """,
        """
        import torch
        for b in loader:
            try:
                model(b).loss.backward()
                opt.step()
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
        """,
        # after eval, outside the loop
        """
        import torch
        for b in loader:
            model(b).loss.backward()
            opt.step()
        torch.cuda.empty_cache()
        """,
        # an inference loop: no backward or step
        """
        import torch
        for prompt in prompts:
            out = model.generate(prompt)
            torch.cuda.empty_cache()
        """,
        # not torch's
        """
        from mylib import empty_cache
        for b in loader:
            model(b).loss.backward()
            empty_cache()
        """,
        # on the way out of the loop after an out-of-memory skip (a handler, not every step)
        """
        import torch
        for b in loader:
            try:
                model(b).loss.backward()
            except RuntimeError:
                optimizer.zero_grad()
                torch.cuda.empty_cache()
                continue
            optimizer.step()
        """,
        # between training phases (the loop runs one phase per iteration; steps are in the inner loop)
        """
        import torch
        for phase in phases:
            for b in phase.loader:
                model(b).loss.backward()
                opt.step()
            torch.cuda.empty_cache()
        """,
    )
    invalid = (
        Invalid(
            """
            import torch
            for b in loader:
                loss = model(b).loss
                loss.backward()
                opt.step()
                torch.cuda.empty_cache()
            """,
            line=6,
        ),
        Invalid(
            """
            import torch
            for b in loader:
                torch.cuda.empty_cache()
                model(b).loss.backward()
                opt.step()
            """,
            line=3,
        ),
        Invalid(
            """
            from torch.cuda import empty_cache
            while step < n:
                scaler.scale(model(b)).backward()
                scaler.step(opt)
                scaler.update()
                empty_cache()
            """,
            line=6,
        ),
        Invalid(
            """
            import torch

            def train(self):
                for batch in self.loader:
                    with torch.autocast('cuda'):
                        loss = self.model(batch)
                    self.accelerator.backward(loss)
                    self.optimizer.step()
                    torch.cuda.empty_cache()
            """,
            line=9,
        ),
        Invalid(
            """
            import torch as th
            for i, b in enumerate(loader):
                model(b).loss.backward()
                if (i + 1) % accum == 0:
                    opt.step()
                th.cuda.empty_cache()
            """,
            line=6,
        ),
        Invalid(
            """
            import torch
            for epoch in range(3):
                for b in loader:
                    fabric.backward(model(b))
                    torch.cuda.empty_cache()
                    opt.step()
            """,
            line=5,
        ),
        # inside a with block of the step
        Invalid(
            """
            import torch
            for b in loader:
                with torch.autocast('cuda', dtype=torch.bfloat16):
                    loss = model(b).loss
                    torch.cuda.empty_cache()
                loss.backward()
                opt.step()
            """,
            line=5,
        ),
        # a DeepSpeed engine's backward and step
        Invalid(
            """
            import torch
            for step, batch in enumerate(loader):
                loss = engine(batch)
                engine.backward(loss)
                engine.step()
                torch.cuda.empty_cache()
            """,
            line=6,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        for site in model.calls_to(*EMPTY_CACHE):
            loop = innermost_loop(site)
            if loop is None:
                continue
            if any(
                f.kind in ("if", "loop") or (f.kind == "try" and f.branch != "body")
                for f in frames_inside(site, loop)
            ):
                continue
            work = [
                e
                for e in training.events_in(site.scope, *TRAINING_WORK)
                if self._loop_of(e.site) is loop.node
            ]
            if not work:
                continue
            yield Diagnostic(
                site.node,
                "`empty_cache()` on every training iteration frees nothing that is still in use and makes "
                "the next step allocate its blocks again, synchronising the GPU; remove it (or run it "
                "rarely, outside the step loop).",
                related=((work[0].site.node, "this loop trains"),),
            )

    @staticmethod
    def _loop_of(site: Site) -> cst.CSTNode | None:
        loop = innermost_loop(site)
        return loop.node if loop is not None else None
