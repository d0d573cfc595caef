"""TL402 cuda-timing-without-sync."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from trainlint.api import Diagnostic, Invalid, Rule, RuleDoc, Severity, imported
from trainlint.model import (
    FileModel,
    Scope,
    Site,
    attr_name,
    dotted,
    innermost_loop,
    positional,
    walk,
)
from trainlint.model.vocab import CLOCKS, SYNC_METHODS
from trainlint.rules.measurement._shared import TRAINING_WORK, assigned_to, local_function_calls


class CudaTimingWithoutSync(Rule):
    id = "TL402"
    name = "cuda-timing-without-sync"
    severity = Severity.WARNING
    summary = "A wall-clock interval around CUDA work closed without torch.cuda.synchronize()."
    # Prefilter: "cuda" (checked first by `check`); a clock (even aliased) needs `import time[it]` or
    # `from time[it] import` (the gate checks the import itself: "time" in prose does not count); a
    # subtraction `t1 - t0`.
    tokens = ("time", "timer")
    requires = (("cuda",), imported("time", "timeit"), ("-",))
    # Two clock reads of one scope paired as an interval, with work between them and nothing that waits
    # for the device between them or in the loop around the closing read.
    gate_check = "gate_clock_interval.interval_may_miss_sync"
    doc = RuleDoc(
        what=(
            "Reports the closing clock read (`time.time()`, `time.perf_counter()`, `time.monotonic()`) "
            "of an interval `t1 - t0` in which training work runs (a backward, an optimizer step, a "
            "model call) in a file that uses CUDA, when nothing between the two reads waits for the "
            "device: no `torch.cuda.synchronize()`, no event or stream `synchronize()`, and no "
            "device-to-host copy such as `.item()`, `.cpu()` or `.tolist()`."
        ),
        why=(
            "CUDA kernels run asynchronously: the Python call returns as soon as the kernel is queued. "
            "A step whose kernels take 120 ms can be queued in 8 ms, and a timer closed right after "
            "it reports 8 ms, fifteen times too fast; the missing time shows up in whatever later "
            "call happens to wait for the GPU (often the logging `.item()`), so the numbers move "
            "around when unrelated code changes."
        ),
        example=(
            "t0 = time.perf_counter()\n"
            "loss = model(x).loss\n"
            "loss.backward()\n"
            "optimizer.step()\n"
            "dt = time.perf_counter() - t0"
        ),
        use_instead=(
            "t0 = time.perf_counter()\n"
            "loss = model(x).loss\n"
            "loss.backward()\n"
            "optimizer.step()\n"
            "torch.cuda.synchronize()\n"
            "dt = time.perf_counter() - t0"
        ),
        references=(
            "https://pytorch.org/docs/stable/notes/cuda.html#asynchronous-execution",
            "`trainlint run` finds such intervals in a real run and, on a GPU, measures the device time "
            'they leave out: README, "Watching a real run"',
        ),
    )
    valid = (
        """
        import time, torch
        model.cuda()
        t0 = time.time()
        loss = model(x)
        loss.backward()
        torch.cuda.synchronize()
        dt = time.time() - t0
        """,
        # .item() waits for the device
        """
        import time
        model.cuda()
        t0 = time.perf_counter()
        loss = model(x)
        loss.backward()
        opt.step()
        val = loss.item()
        dt = time.perf_counter() - t0
        """,
        # CPU-only file
        """
        import time
        t0 = time.time()
        loss = model(x)
        loss.backward()
        opt.step()
        dt = time.time() - t0
        """,
        # only data loading is timed
        """
        import time, torch
        device = 'cuda'
        t0 = time.time()
        batch = next(it)
        data_time = time.time() - t0
        """,
        # event synchronize
        """
        import time, torch
        start = time.perf_counter()
        out = model(x.cuda())
        end_event.record()
        end_event.synchronize()
        elapsed = time.perf_counter() - start
        """,
        # a synchronize in a helper of this file
        """
        import time, torch

        def sync():
            torch.cuda.synchronize()

        t0 = time.time()
        model(x.cuda()).sum().backward()
        sync()
        dt = time.time() - t0
        """,
        # the rolling timer of a loop that logs loss.item() every iteration
        """
        import time
        model.cuda()
        t0 = time.time()
        for x in loader:
            loss = model(x)
            loss.backward()
            opt.step()
            t1 = time.time()
            dt = t1 - t0
            t0 = t1
            print(loss.item(), dt)
        """,
        # a timer around a whole run: the work is in data loops inside the interval
        """
        import time
        model.cuda()
        start = time.time()
        for epoch in range(args.epochs):
            for x in loader:
                model(x).backward()
                opt.step()
        print(f'trained in {time.time() - start:.0f}s')
        """,
        # not time's clock
        """
        from mytimer import time
        model.cuda()
        t0 = time()
        loss = model(x)
        loss.backward()
        dt = time() - t0
        """,
    )
    invalid = (
        Invalid(
            """
            import time, torch
            model = model.cuda()
            t0 = time.time()
            loss = model(x)
            loss.backward()
            optimizer.step()
            dt = time.time() - t0
            """,
            line=7,
        ),
        Invalid(
            """
            import time
            model.to('cuda')
            start = time.perf_counter()
            out = model(batch)
            end = time.perf_counter()
            print(end - start)
            """,
            line=5,
        ),
        Invalid(
            """
            from time import perf_counter
            import torch

            def bench(model, x):
                x = x.cuda()
                t0 = perf_counter()
                for _ in range(10):
                    model(x).sum().backward()
                return (perf_counter() - t0) / 10
            """,
            line=9,
        ),
        Invalid(
            """
            import time, torch
            scaler = torch.cuda.amp.GradScaler()
            for batch in loader:
                iter_t0 = time.monotonic()
                scaler.scale(model(batch)).backward()
                scaler.step(optimizer)
                scaler.update()
                step_time = time.monotonic() - iter_t0
            """,
            line=8,
        ),
        # a sync before the work does not help
        Invalid(
            """
            import time, torch
            torch.cuda.synchronize()
            t0 = time.time()
            model(x.cuda()).backward()
            opt.step()
            elapsed = time.time() - t0
            """,
            line=6,
        ),
        # timing the forward only, in a method
        Invalid(
            """
            import time
            import torch

            class Bench:
                def forward_time(self, x):
                    x = x.to('cuda')
                    t0 = time.perf_counter()
                    y = self.model(x)
                    return time.perf_counter() - t0
            """,
            line=9,
        ),
        # a benchmark loop over a literal range
        Invalid(
            """
            import time, torch
            model = model.cuda()
            start = time.time()
            for _ in range(20):
                out = model(x)
                out.sum().backward()
                opt.step()
            per_iter = (time.time() - start) / 20
            """,
            line=8,
        ),
        Invalid(
            """
            import timeit, torch
            device = torch.device('cuda')
            t = timeit.default_timer()
            loss = model(x.to(device))
            loss.backward()
            dt = timeit.default_timer() - t
            """,
            line=6,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        if not model.text_mentions("cuda"):
            return
        clocks = model.calls_to(*CLOCKS)
        if len(clocks) < 2:
            return
        training = model.training
        for close, start in self._intervals(model, clocks):
            scope = close.scope
            calls = [s for s in _calls_in_order(model, scope) if start.order < s.order < close.order]
            work = [
                e.site
                for e in training.events_in(scope, *TRAINING_WORK)
                if start.order < e.order < close.order
            ] or [s for s in calls if self._model_call(model, s)]
            if not work or not any(self._bounded(w, start, close) for w in work):
                continue
            if any(self._waits(model, s) for s in calls):
                continue
            loop = innermost_loop(close)
            if loop is not None and any(
                self._waits(model, s)
                for s in model.calls_in(scope)
                if any(f.node is loop.node for f in s.frames)
            ):
                continue
            yield Diagnostic(
                close.node,
                "This clock read closes an interval around CUDA work without waiting for the GPU: "
                "kernels run asynchronously, so it measures queueing time; call "
                "`torch.cuda.synchronize()` before reading the clock.",
                related=((start.node, "the interval starts here"),),
            )

    @staticmethod
    def _bounded(work: Site, start: Site, close: Site) -> bool:
        """Whether the interval times a bounded piece of work, where the unmeasured tail of queued
        kernels is a large part: straight-line work, one iteration of the loop that also holds the
        closing read, or a benchmark loop over ``range(<literal>)``. A timer around a whole training
        run (the work in a data loop inside the interval) misses at most its last kernels."""
        closing_loops = {id(f.node) for f in close.frames if f.kind == "loop"}
        for frame in work.frames:
            if frame.kind != "loop" or id(frame.node) in closing_loops:
                continue
            node = frame.node
            if isinstance(node, cst.For) and isinstance(node.iter, cst.Call):
                args = positional(node.iter)
                if dotted(node.iter.func) == "range" and len(args) == 1 and isinstance(args[0], cst.Integer):
                    continue
            return False
        return True

    @staticmethod
    def _intervals(model: FileModel, clocks: list[Site]) -> Iterator[tuple[Site, Site]]:
        """(closing read, opening read) pairs: ``clock() - t0`` or ``t1 = clock()`` ... ``t1 - t0``
        where ``t0`` was bound to an earlier clock read (directly or through ``t0 = t1``)."""
        by_scope: dict[int, list[Site]] = {}
        for c in clocks:
            by_scope.setdefault(id(c.scope), []).append(c)
        for scope_clocks in by_scope.values():
            scope = scope_clocks[0].scope
            opening: dict[str, list[Site]] = {}
            for c in scope_clocks:
                for name in assigned_to(c):
                    opening.setdefault(name, []).append(c)
            for c in scope_clocks:
                start_name = _subtracted_from(model, c, scope)
                if start_name is None:
                    continue
                starts = [s for s in opening.get(start_name, ()) if s.order < c.order and s is not c]
                if not starts:
                    # ``t0 = t1`` rolling timers: the first clock read before the loop
                    starts = [s for s in scope_clocks if s.order < c.order and s is not c]
                if starts:
                    yield c, starts[-1]

    @staticmethod
    def _model_call(model: FileModel, site: Site) -> bool:
        """A forward call of a model value (``model(x)``, ``self.net(x)``, ``teacher_model(x)``), not a
        function of this file or an import whose name happens to mention a model."""
        call = site.node
        assert isinstance(call, cst.Call)
        path = dotted(call.func)
        if path is None or model.qualname(call.func, site.scope) is not None:
            return False
        last = path.rsplit(".", 1)[-1].lower()
        return last in ("model", "module", "net", "engine", "forward") or last.endswith(
            ("_model", "_net", "_engine")
        )

    @staticmethod
    def _waits(model: FileModel, site: Site) -> bool:
        def direct(s: Site) -> bool:
            call = s.node
            assert isinstance(call, cst.Call)
            name = (attr_name(call) or "").lower()
            if isinstance(call.func, cst.Attribute) and name in SYNC_METHODS:
                return True
            # ``synchronize_func()``, ``cuda_synchronize()``; autoregressive generation checks its
            # stopping condition on the host after every token; ``torch.save`` copies to the host.
            return "synchronize" in name or "generate" in name or model.callee(s) == "torch.save"

        return direct(site) or local_function_calls(model, site, direct)


def _calls_in_order(model: FileModel, scope: Scope) -> list[Site]:
    return sorted(model.calls_in(scope), key=lambda s: s.order)


def _subtracted_from(model: FileModel, clock: Site, scope: Scope) -> str | None:
    """``t0`` when the clock read is the left side of ``clock() - t0``, or is assigned to ``t1`` and
    ``t1 - t0`` follows in the scope."""
    parent = clock.parent
    if isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, cst.Subtract):
        if parent.left is clock.node and isinstance(parent.right, cst.Name):
            return parent.right.value
        return None
    names = set(assigned_to(clock))
    if not names:
        return None
    for site in model.binops + model.assigns + model.calls:
        if site.scope is not scope or site.order <= clock.order:
            continue
        for node in walk(site.node):
            if (
                isinstance(node, cst.BinaryOperation)
                and isinstance(node.operator, cst.Subtract)
                and isinstance(node.left, cst.Name)
                and node.left.value in names
                and isinstance(node.right, cst.Name)
            ):
                return node.right.value
    return None
