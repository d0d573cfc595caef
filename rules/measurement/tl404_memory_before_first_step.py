"""TL404 memory-before-first-step."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from trainlint.api import Diagnostic, Invalid, Rule, RuleDoc, Severity
from trainlint.model import (
    FileModel,
    Scope,
    attr_name,
    share_loop,
    walk,
)
from trainlint.model.vocab import OPTIMIZER_WRAPPERS
from trainlint.rules.measurement._shared import MEMORY_READINGS, assigned_to


class MemoryBeforeFirstStep(Rule):
    id = "TL404"
    name = "memory-before-first-step"
    severity = Severity.INFO
    summary = (
        "A memory reading after the optimizer is built but before its first step (no optimizer state yet)."
    )
    # Prefilter: torch's reading, and an optimizer construction (a qualified name with a part of an
    # OPTIMIZER_PREFIXES entry: `optim`, `adam`, `lamb`, `AdamW`, `Adafactor`, `lion_pytorch`).
    tokens = ("memory_allocated", "memory_reserved", "mem_get_info")
    requires = (("torch",), ("optim", "adam", "lamb", "AdamW", "Adafactor", "lion_pytorch"))
    # A reading after a possible optimizer construction of its scope, with no `x.step()` of that scope
    # surely before it or in a loop with it.
    gate_check = "gate_memory_measurement.memory_read_before_first_step"
    doc = RuleDoc(
        what=(
            "Reports a device memory reading (`torch.cuda.memory_allocated()`, `max_memory_allocated()`, "
            "`memory_reserved()`, `mem_get_info()`) taken after an optimizer is constructed in the same "
            "scope but before any `optimizer.step()` there, and not inside a loop that steps. A call "
            "that receives the optimizer in between (`train(model, optimizer)`) may step it, so the "
            "reading is not reported then."
        ),
        why=(
            "Adam and AdamW create their state (two moments per parameter) lazily, on the first "
            "`step()`. For a 1B-parameter model trained in fp32 that is 8 GB that does not exist "
            "yet: a reading after construction shows about 4 GB of weights where the steady state "
            "holds 4 GB of weights, 4 GB of gradients and 8 GB of optimizer state, 16 GB in all."
        ),
        example=(
            "optimizer = torch.optim.AdamW(model.parameters())\n"
            "print(torch.cuda.memory_allocated() / 2**30, 'GiB')\n"
            "for batch in loader:\n"
            "    ..."
        ),
        use_instead=(
            "optimizer = torch.optim.AdamW(model.parameters())\n"
            "for step, batch in enumerate(loader):\n"
            "    ...\n"
            "    optimizer.step()\n"
            "    if step == 0:\n"
            "        print(torch.cuda.memory_allocated() / 2**30, 'GiB')"
        ),
        references=(
            "https://pytorch.org/docs/stable/optim.html",
            "`trainlint memory` gives the whole bill (weights, gradients, master copy, optimizer state, "
            "activations, temporaries) per rank after the first step, without a GPU: README, "
            '"`trainlint memory`"',
        ),
    )
    valid = (
        """
        import torch
        m0 = torch.cuda.memory_allocated()
        opt = torch.optim.AdamW(model.parameters())
        """,
        """
        import torch
        opt = torch.optim.AdamW(model.parameters())
        for b in loader:
            model(b).sum().backward()
            opt.step()
        print(torch.cuda.memory_allocated())
        """,
        # inside the loop that steps: only the first iteration lacks state
        """
        import torch
        opt = torch.optim.AdamW(model.parameters())
        for b in loader:
            print(torch.cuda.memory_allocated())
            model(b).sum().backward()
            opt.step()
        """,
        # the optimizer is handed to a function that trains
        """
        import torch
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train(model, opt, loader)
        print(torch.cuda.max_memory_allocated())
        """,
        # ... or to a trainer inside a tuple, or through a state dict
        """
        import torch
        opt = torch.optim.AdamW(model.parameters())
        trainer = Trainer(model=model, optimizers=(opt, None))
        trainer.train()
        print(torch.cuda.max_memory_allocated())
        """,
        """
        import torch
        opt = torch.optim.AdamW(model.parameters())
        state = {'model': model, 'optimizer': opt}
        fit(fabric, state)
        print(torch.cuda.memory_allocated())
        """,
        # no optimizer in this scope
        """
        import torch
        model = Net().cuda()
        print(torch.cuda.memory_allocated())
        """,
        # a step before the reading in straight-line code
        """
        import torch
        opt = torch.optim.Adam(model.parameters())
        loss.backward()
        opt.step()
        free, total = torch.cuda.mem_get_info()
        """,
        # not torch's
        """
        from mylib import memory_allocated
        opt = torch.optim.Adam(p)
        memory_allocated()
        """,
    )
    invalid = (
        Invalid(
            """
            import torch
            opt = torch.optim.AdamW(model.parameters())
            print(torch.cuda.memory_allocated())
            for b in loader:
                model(b).sum().backward()
                opt.step()
            """,
            line=3,
        ),
        Invalid(
            """
            import torch
            opt = torch.optim.Adam(model.parameters())
            free, total = torch.cuda.mem_get_info()
            """,
            line=3,
        ),
        Invalid(
            """
            import torch

            def setup(model):
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                log('memory', torch.cuda.memory_reserved())
                return optimizer
            """,
            line=5,
        ),
        # accelerate's prepare does not step
        Invalid(
            """
            import torch
            opt = torch.optim.AdamW(model.parameters())
            model, opt = accelerator.prepare(model, opt)
            mem = torch.cuda.max_memory_allocated()
            """,
            line=4,
        ),
        Invalid(
            """
            from torch.cuda import memory_allocated
            from torch.optim import AdamW
            opt = AdamW(params)
            m = memory_allocated(0)
            """,
            line=4,
        ),
        # a method that builds and reports
        Invalid(
            """
            import torch

            class Runner:
                def setup(self):
                    self.optimizer = torch.optim.Adam(self.model.parameters())
                    self.log(mem=torch.cuda.memory_allocated())
            """,
            line=6,
        ),
        # reserved memory after fabric.setup_optimizers (which does not step)
        Invalid(
            """
            import torch
            optimizer = torch.optim.AdamW(model.parameters())
            optimizer = fabric.setup_optimizers(optimizer)
            fabric.print(torch.cuda.memory_reserved())
            """,
            line=4,
        ),
        Invalid(
            """
            import torch
            import bitsandbytes as bnb
            opt = bnb.optim.AdamW8bit(model.parameters())
            print(torch.cuda.memory_allocated() / 1e9)
            loss.backward()
            opt.step()
            """,
            line=4,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        for site in model.calls_to(*MEMORY_READINGS):
            scope = site.scope
            built = [e for e in training.events_in(scope, "optimizer") if e.order < site.order]
            if not built:
                continue
            optimizer_names = {n for e in built for n in assigned_to(e.site)}
            steps = training.events_in(scope, "step", "scaler_step")
            if any(s.order < site.order or share_loop(s.site, site) for s in steps):
                continue
            if self._handed_over(model, scope, optimizer_names, built[0].order, site.order):
                continue
            yield Diagnostic(
                site.node,
                "This memory reading comes after the optimizer is built but before its first `step()`, "
                "so it leaves out the optimizer state (Adam's two moments are created at the first "
                "step); read memory after the first step.",
                related=((built[-1].site.node, "the optimizer is built here"),),
            )

    @staticmethod
    def _handed_over(model: FileModel, scope: Scope, names: set[str], start: int, end: int) -> bool:
        """The optimizer escapes between its construction and the reading: passed to a call (other than
        a wrapper such as ``accelerator.prepare``), even inside a tuple or dict (``Trainer(optimizers=
        (optimizer, None))``), or put in a container (``state = {"optimizer": optimizer}``). Whatever
        receives it may step it."""

        def mentions(expr: cst.CSTNode) -> bool:
            return any(isinstance(n, cst.Name) and n.value in names for n in walk(expr))

        for call_site in model.calls_in(scope):
            call = call_site.node
            assert isinstance(call, cst.Call)
            if not start < call_site.order < end or attr_name(call) in OPTIMIZER_WRAPPERS:
                continue
            if any(mentions(arg.value) for arg in call.args):
                return True
        for assign in model.assigns:
            node = assign.node
            if (
                assign.scope is not scope
                or not start < assign.order < end
                or not isinstance(node, cst.Assign)
            ):
                continue
            if isinstance(node.value, cst.Dict | cst.Tuple | cst.List | cst.Set) and mentions(node.value):
                return True
        return False


# Calls that hand an optimizer over without stepping it.
