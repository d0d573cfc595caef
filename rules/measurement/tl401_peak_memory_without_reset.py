"""TL401 peak-memory-without-reset."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from trainlint.api import Diagnostic, Invalid, Rule, RuleDoc, Severity
from trainlint.model import (
    FileModel,
    Frame,
    Scope,
    Site,
    attr_name,
    dotted,
    innermost_loop,
    share_loop,
    walk_scope,
)
from trainlint.model.vocab import RESET_METHODS
from trainlint.rules.measurement._shared import MEMORY_READINGS, PEAK_READINGS, local_function_calls


class PeakMemoryWithoutReset(Rule):
    id = "TL401"
    name = "peak-memory-without-reset"
    severity = Severity.WARNING
    summary = "A peak-memory reading that measures a region, with no reset_peak_memory_stats() before it."
    # Prefilter: the reading's name; its qualified name starts with `torch`, imported in the text.
    tokens = ("max_memory_allocated", "max_memory_reserved")
    requires = (("torch",),)
    # A peak reading in a loop body with another call, or with a baseline subtracted, and no reset
    # proven before it (in its class, an enclosing scope, earlier in its own, or a helper that resets).
    gate_check = "gate_memory_measurement.peak_reading_may_measure_region"
    doc = RuleDoc(
        what=(
            "Reports `torch.cuda.max_memory_allocated()` and `max_memory_reserved()` used to measure a "
            "part of the program, with no `torch.cuda.reset_peak_memory_stats()` (or the older "
            "`reset_max_memory_allocated()`) before the reading: a peak read on every iteration of a "
            "loop that does work, or a peak from which a baseline is subtracted (`peak - before`). A "
            "reset earlier in the scope, in the same loop, in an enclosing function, in another method "
            "of the same class (a context manager's `__enter__`), or in a function of this file called "
            "earlier counts. A single reading outside loops with no baseline (a script's final "
            '"memory used" line, a status report) is the peak of the whole run, which is what it '
            "says, and is not reported."
        ),
        why=(
            "The peak counters are high-water marks since the process started (or since the last "
            "reset). Loading a 7B model in fp32 before casting it to bf16 peaks at 28 GB; a training "
            "step afterwards that needs 18 GB still reports 28 GB, and so does every later step, so "
            "a per-step log shows one flat line. Subtracting a baseline does not help: `peak - "
            "before` is 0 whenever the region's own peak stays under the earlier one. Comparing two "
            "configurations measured this way compares the loading code, not the training step."
        ),
        example=(
            "for step, batch in enumerate(loader):\n"
            "    train_step(model, batch)\n"
            "    peak = torch.cuda.max_memory_allocated() / 2**30\n"
            "    print(f'step {step}: peak {peak:.1f} GiB')"
        ),
        use_instead=(
            "for step, batch in enumerate(loader):\n"
            "    torch.cuda.reset_peak_memory_stats()\n"
            "    train_step(model, batch)\n"
            "    peak = torch.cuda.max_memory_allocated() / 2**30\n"
            "    print(f'step {step}: peak {peak:.1f} GiB')"
        ),
        references=(
            "https://pytorch.org/docs/stable/generated/torch.cuda.max_memory_allocated.html",
            "`trainlint memory` predicts a training step's peak and which phase reaches it, without a "
            'GPU: README, "`trainlint memory`"',
        ),
    )
    valid = (
        """
        import torch
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        peak = torch.cuda.max_memory_allocated() - base
        """,
        """
        import torch
        for b in loader:
            step(b)
            log(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        """,
        # a context manager: reset in __enter__, read in __exit__
        """
        import torch

        class PeakTracker:
            def __enter__(self):
                torch.cuda.reset_max_memory_allocated()
                self.begin = torch.cuda.memory_allocated()
                return self

            def __exit__(self, *exc):
                self.peak = torch.cuda.max_memory_allocated() - self.begin
        """,
        # reset in a helper of this file called first
        """
        import torch

        def start():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

        def measure(fn):
            start()
            before = torch.cuda.memory_allocated()
            fn()
            return torch.cuda.max_memory_reserved() - before
        """,
        # the whole run's peak, printed once at the end of a script
        """
        import torch
        model = load()
        train(model)
        print(f'Memory used: {torch.cuda.max_memory_allocated() / 1e9:.02f} GB')
        """,
        # a status report utility: current and peak since start
        """
        import torch

        def report_memory(name):
            mb = 1024 * 1024
            print(name, torch.cuda.memory_allocated() / mb, torch.cuda.max_memory_allocated() / mb)
        """,
        # not torch's function
        """
        from mylib import max_memory_allocated
        for b in loader:
            step(b)
            x = max_memory_allocated()
        """,
        # reset in the enclosing function of a nested reporter
        """
        import torch

        def bench(fn):
            torch.cuda.reset_peak_memory_stats()
            def report():
                return torch.cuda.max_memory_allocated() - base
            fn()
            return report()
        """,
    )
    invalid = (
        Invalid(
            """
            import torch
            for step, batch in enumerate(loader):
                train_step(batch)
                peak = torch.cuda.max_memory_allocated()

            """,
            line=4,
        ),
        Invalid(
            """
            import torch
            before = torch.cuda.memory_allocated()
            run()
            used = torch.cuda.max_memory_allocated() - before
            """,
            line=4,
        ),
        Invalid(
            """
            from torch.cuda import max_memory_reserved
            results = {}
            for cfg in configs:
                run(cfg)
                results[cfg] = max_memory_reserved()
            """,
            line=5,
        ),
        Invalid(
            """
            import torch

            def measure(fn):
                start = torch.cuda.memory_allocated()
                fn()
                peak = torch.cuda.max_memory_allocated()
                return peak - start
            """,
            line=6,
        ),
        # a reset that only comes after the loop
        Invalid(
            """
            import torch
            for b in loader:
                step(b)
                log(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            """,
            line=4,
        ),
        Invalid(
            """
            import torch as T
            while running:
                model(next(it)).sum().backward()
                stats.append(T.cuda.memory.max_memory_allocated(0))
            """,
            line=4,
        ),
        # a batch-size sweep: each size's figure includes the larger sizes before it
        Invalid(
            """
            import torch
            for bs in (8, 16, 32):
                run(bs)
                print(bs, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            """,
            line=4,
        ),
        # a reset in an unrelated function that is not called first
        Invalid(
            """
            import torch

            def other():
                torch.cuda.reset_peak_memory_stats()

            def measure(fn):
                base = torch.cuda.max_memory_allocated()
                fn()
                return torch.cuda.max_memory_allocated() - base
            """,
            line=9,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        for site in model.calls_to(*PEAK_READINGS):
            how = self._measures_region(model, site)
            if how is None or self._reset_before(model, site):
                continue
            yield Diagnostic(
                site.node,
                f"`{model.code(site.node.func)}()` {how}, but it is a high-water mark since the process "  # type: ignore[attr-defined]
                "started or the last reset; call `torch.cuda.reset_peak_memory_stats()` before the "
                "code you measure.",
            )

    @staticmethod
    def _measures_region(model: FileModel, site: Site) -> str | None:
        """Why this reading is meant for part of the program, or None for a whole-run figure."""
        loop = innermost_loop(site)
        if loop is not None and any(
            s is not site and s.node is not site.parent and in_same_frame(s, loop)
            for s in model.calls_in(site.scope)
        ):
            return "is read on every iteration of a loop"
        for minuend, subtrahend in _subtractions(model, site.scope):
            if _is_reading(model, minuend, site) and _is_reading(model, subtrahend, None):
                return "has a baseline subtracted from it"
        return None

    @staticmethod
    def _is_reset(site: Site) -> bool:
        return attr_name(site.node) in RESET_METHODS  # type: ignore[arg-type]

    def _reset_before(self, model: FileModel, reading: Site) -> bool:
        scope: Scope | None = reading.scope
        first = True
        while scope is not None and scope.kind in ("function", "lambda", "module"):
            for site in model.calls_in(scope):
                # In an enclosing scope, a reset anywhere may run before this function is called.
                before = not first or site.order < reading.order or share_loop(site, reading)
                if not before:
                    continue
                if self._is_reset(site) or local_function_calls(model, site, self._is_reset):
                    return True
            if scope.kind == "module":
                break
            first = False
            scope = scope.parent
        cls = reading.scope.enclosing_class
        if cls is not None:
            for site in model.calls:
                if site.scope.enclosing_class is cls and self._is_reset(site):
                    return True
        return False


# Any receiver: ``torch.cuda``, ``torch_accelerator_module``, ``getattr(torch, device_type)``.


def in_same_frame(site: Site, loop: Frame) -> bool:
    return any(f.node is loop.node and f.branch == loop.branch for f in site.frames)


def _subtractions(model: FileModel, scope: Scope) -> Iterator[tuple[cst.CSTNode, cst.CSTNode]]:
    for node in walk_scope(scope.node):
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Subtract):
            yield node.left, node.right


def _is_reading(model: FileModel, expr: cst.CSTNode, site: Site | None) -> bool:
    """``expr`` is the memory reading ``site`` (or any memory reading when ``site`` is None), directly,
    divided by a unit, or through a name or ``self.x`` bound to it."""
    while isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Divide):
        expr = expr.left
    if isinstance(expr, cst.Call):
        if site is not None:
            return expr is site.node
        return any(s.node is expr for s in model.calls_to(*MEMORY_READINGS))
    key = dotted(expr)
    if key is None:
        return False
    for assign in model.assigns:
        node = assign.node
        if not isinstance(node, cst.Assign) or not any(dotted(t.target) == key for t in node.targets):
            continue
        if _is_reading(model, node.value, site):
            return True
    return False
