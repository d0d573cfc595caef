"""TL4xx: measuring memory and time honestly (peak counters, asynchronous CUDA, lazy optimizer state)."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from trainlint.events import grad_disabled_function
from trainlint.evidence import frames_inside, innermost_loop, int_value, share_loop
from trainlint.model import (
    FileModel,
    Frame,
    Scope,
    Site,
    attr_name,
    dotted,
    positional,
    walk,
    walk_scope,
)
from trainlint.rule import Diagnostic, Invalid, Rule, RuleDoc, Severity, call_pattern

DEVICE_MODULES = ("torch.cuda", "torch.cuda.memory", "torch.xpu", "torch.xpu.memory", "torch.mps")
PEAK_READINGS = frozenset(
    f"{m}.{f}" for m in DEVICE_MODULES for f in ("max_memory_allocated", "max_memory_reserved")
)
MEMORY_READINGS = PEAK_READINGS | frozenset(
    f"{m}.{f}" for m in DEVICE_MODULES for f in ("memory_allocated", "memory_reserved", "mem_get_info")
)
# Any receiver: ``torch.cuda``, ``torch_accelerator_module``, ``getattr(torch, device_type)``.
RESET_METHODS = frozenset(
    {"reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached"}
)
EMPTY_CACHE = frozenset({"torch.cuda.empty_cache", "torch.cuda.memory.empty_cache", "torch.xpu.empty_cache"})
CLOCKS = frozenset(
    {
        "time.time",
        "time.perf_counter",
        "time.monotonic",
        "time.time_ns",
        "time.perf_counter_ns",
        "time.monotonic_ns",
        "timeit.default_timer",
    }
)
# Calls that wait for the device: explicit synchronisation and device-to-host copies.
SYNC_METHODS = frozenset({"synchronize", "item", "tolist", "cpu", "numpy", "barrier", "mark_step", "wait"})
TRAINING_WORK = ("backward", "scaled_backward", "step", "scaler_step")
# Calls that hand an optimizer over without stepping it.
OPTIMIZER_WRAPPERS = frozenset(
    {"prepare", "setup", "setup_optimizers", "initialize", "prepare_optimizer", "register_optimizer"}
)
SDPA = frozenset(
    {"torch.nn.functional.scaled_dot_product_attention", "torch.nn.functional.multi_head_attention_forward"}
)
SOFTMAX = frozenset({"torch.softmax", "torch.nn.functional.softmax", "torch.nn.functional.log_softmax"})


def _calls_in_order(model: FileModel, scope: Scope) -> list[Site]:
    return sorted(model.calls_in(scope), key=lambda s: s.order)


def _local_function_calls(model: FileModel, site: Site, predicate) -> bool:
    """Whether ``site`` calls a function of this file (``f()``, ``self.f()``) whose body has a call
    satisfying ``predicate`` (one level)."""
    call = site.node
    assert isinstance(call, cst.Call)
    definition = None
    path = dotted(call.func)
    if isinstance(call.func, cst.Name):
        found = model.definition(call.func.value, site.scope)
        definition = found if isinstance(found, cst.FunctionDef) else None
    elif path and path.startswith("self.") and path.count(".") == 1:
        cls = site.scope.enclosing_class
        definition = model.method(cls, path[5:]) if cls is not None else None
    if definition is None:
        return False
    inner = model.scope_for(definition)
    return any(predicate(s) for s in model.calls if s.scope is inner)


# -- TL401 -----------------------------------------------------------------------------------------------


class PeakMemoryWithoutReset(Rule):
    id = "TL401"
    name = "peak-memory-without-reset"
    severity = Severity.WARNING
    summary = "A peak-memory reading that measures a region, with no reset_peak_memory_stats() before it."
    # Prefilter: the reading's name; its qualified name starts with `torch`, imported in the text.
    tokens = ("max_memory_allocated", "max_memory_reserved")
    requires = (("torch",),)
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
        references=("https://pytorch.org/docs/stable/generated/torch.cuda.max_memory_allocated.html",),
    )
    valid = (
        "import torch\nbase = torch.cuda.memory_allocated()\ntorch.cuda.reset_peak_memory_stats()\nrun()\n"
        "peak = torch.cuda.max_memory_allocated() - base",
        "import torch\nfor b in loader:\n    step(b)\n    log(torch.cuda.max_memory_allocated())\n"
        "    torch.cuda.reset_peak_memory_stats()",
        # a context manager: reset in __enter__, read in __exit__
        "import torch\n\nclass PeakTracker:\n    def __enter__(self):\n        torch.cuda.reset_max_memory_allocated()\n"
        "        self.begin = torch.cuda.memory_allocated()\n        return self\n\n    def __exit__(self, *exc):\n"
        "        self.peak = torch.cuda.max_memory_allocated() - self.begin",
        # reset in a helper of this file called first
        "import torch\n\ndef start():\n    torch.cuda.empty_cache()\n    torch.cuda.reset_peak_memory_stats()\n\n"
        "def measure(fn):\n    start()\n    before = torch.cuda.memory_allocated()\n    fn()\n"
        "    return torch.cuda.max_memory_reserved() - before",
        # the whole run's peak, printed once at the end of a script
        "import torch\nmodel = load()\ntrain(model)\nprint(f'Memory used: {torch.cuda.max_memory_allocated() / 1e9:.02f} GB')",
        # a status report utility: current and peak since start
        "import torch\n\ndef report_memory(name):\n    mb = 1024 * 1024\n"
        "    print(name, torch.cuda.memory_allocated() / mb, torch.cuda.max_memory_allocated() / mb)",
        # not torch's function
        "from mylib import max_memory_allocated\nfor b in loader:\n    step(b)\n    x = max_memory_allocated()",
        # reset in the enclosing function of a nested reporter
        "import torch\n\ndef bench(fn):\n    torch.cuda.reset_peak_memory_stats()\n    def report():\n"
        "        return torch.cuda.max_memory_allocated() - base\n    fn()\n    return report()",
    )
    invalid = (
        Invalid(
            "import torch\nfor step, batch in enumerate(loader):\n    train_step(batch)\n"
            "    peak = torch.cuda.max_memory_allocated()\n",
            line=4,
        ),
        Invalid(
            "import torch\nbefore = torch.cuda.memory_allocated()\nrun()\n"
            "used = torch.cuda.max_memory_allocated() - before",
            line=4,
        ),
        Invalid(
            "from torch.cuda import max_memory_reserved\nresults = {}\nfor cfg in configs:\n    run(cfg)\n"
            "    results[cfg] = max_memory_reserved()",
            line=5,
        ),
        Invalid(
            "import torch\n\ndef measure(fn):\n    start = torch.cuda.memory_allocated()\n    fn()\n"
            "    peak = torch.cuda.max_memory_allocated()\n    return peak - start",
            line=6,
        ),
        # a reset that only comes after the loop
        Invalid(
            "import torch\nfor b in loader:\n    step(b)\n    log(torch.cuda.max_memory_allocated())\n"
            "torch.cuda.reset_peak_memory_stats()",
            line=4,
        ),
        Invalid(
            "import torch as T\nwhile running:\n    model(next(it)).sum().backward()\n"
            "    stats.append(T.cuda.memory.max_memory_allocated(0))",
            line=4,
        ),
        # a batch-size sweep: each size's figure includes the larger sizes before it
        Invalid(
            "import torch\nfor bs in (8, 16, 32):\n    run(bs)\n"
            "    print(bs, torch.cuda.max_memory_allocated())\ntorch.cuda.reset_peak_memory_stats()",
            line=4,
        ),
        # a reset in an unrelated function that is not called first
        Invalid(
            "import torch\n\ndef other():\n    torch.cuda.reset_peak_memory_stats()\n\n"
            "def measure(fn):\n    base = torch.cuda.max_memory_allocated()\n    fn()\n"
            "    return torch.cuda.max_memory_allocated() - base",
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
                if self._is_reset(site) or _local_function_calls(model, site, self._is_reset):
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


# -- TL402 -----------------------------------------------------------------------------------------------


class CudaTimingWithoutSync(Rule):
    id = "TL402"
    name = "cuda-timing-without-sync"
    severity = Severity.WARNING
    summary = "A wall-clock interval around CUDA work closed without torch.cuda.synchronize()."
    # Prefilter: "cuda" (checked first by `check`); a clock (even aliased) needs `import time[it]` or
    # `from time[it] import`, where the module name follows whitespace, a comma or a continuation
    # line; a subtraction `t1 - t0`.
    tokens = ("time", "timer")
    requires = (("cuda",), (" time", "\ttime", "\x0ctime", ",time", "\ntime", "\rtime"), ("-",))
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
        references=("https://pytorch.org/docs/stable/notes/cuda.html#asynchronous-execution",),
    )
    valid = (
        "import time, torch\nmodel.cuda()\nt0 = time.time()\nloss = model(x)\nloss.backward()\n"
        "torch.cuda.synchronize()\ndt = time.time() - t0",
        # .item() waits for the device
        "import time\nmodel.cuda()\nt0 = time.perf_counter()\nloss = model(x)\nloss.backward()\n"
        "opt.step()\nval = loss.item()\ndt = time.perf_counter() - t0",
        # CPU-only file
        "import time\nt0 = time.time()\nloss = model(x)\nloss.backward()\nopt.step()\ndt = time.time() - t0",
        # only data loading is timed
        "import time, torch\ndevice = 'cuda'\nt0 = time.time()\nbatch = next(it)\ndata_time = time.time() - t0",
        # event synchronize
        "import time, torch\nstart = time.perf_counter()\nout = model(x.cuda())\nend_event.record()\n"
        "end_event.synchronize()\nelapsed = time.perf_counter() - start",
        # a synchronize in a helper of this file
        "import time, torch\n\ndef sync():\n    torch.cuda.synchronize()\n\nt0 = time.time()\n"
        "model(x.cuda()).sum().backward()\nsync()\ndt = time.time() - t0",
        # the rolling timer of a loop that logs loss.item() every iteration
        "import time\nmodel.cuda()\nt0 = time.time()\nfor x in loader:\n    loss = model(x)\n    loss.backward()\n"
        "    opt.step()\n    t1 = time.time()\n    dt = t1 - t0\n    t0 = t1\n    print(loss.item(), dt)",
        # a timer around a whole run: the work is in data loops inside the interval
        "import time\nmodel.cuda()\nstart = time.time()\nfor epoch in range(args.epochs):\n"
        "    for x in loader:\n        model(x).backward()\n        opt.step()\n"
        "print(f'trained in {time.time() - start:.0f}s')",
        # not time's clock
        "from mytimer import time\nmodel.cuda()\nt0 = time()\nloss = model(x)\nloss.backward()\ndt = time() - t0",
    )
    invalid = (
        Invalid(
            "import time, torch\nmodel = model.cuda()\nt0 = time.time()\nloss = model(x)\nloss.backward()\n"
            "optimizer.step()\ndt = time.time() - t0",
            line=7,
        ),
        Invalid(
            "import time\nmodel.to('cuda')\nstart = time.perf_counter()\nout = model(batch)\n"
            "end = time.perf_counter()\nprint(end - start)",
            line=5,
        ),
        Invalid(
            "from time import perf_counter\nimport torch\n\ndef bench(model, x):\n    x = x.cuda()\n    t0 = perf_counter()\n"
            "    for _ in range(10):\n        model(x).sum().backward()\n    return (perf_counter() - t0) / 10",
            line=9,
        ),
        Invalid(
            "import time, torch\nscaler = torch.cuda.amp.GradScaler()\nfor batch in loader:\n"
            "    iter_t0 = time.monotonic()\n    scaler.scale(model(batch)).backward()\n"
            "    scaler.step(optimizer)\n    scaler.update()\n    step_time = time.monotonic() - iter_t0",
            line=8,
        ),
        # a sync before the work does not help
        Invalid(
            "import time, torch\ntorch.cuda.synchronize()\nt0 = time.time()\nmodel(x.cuda()).backward()\n"
            "opt.step()\nelapsed = time.time() - t0",
            line=6,
        ),
        # timing the forward only, in a method
        Invalid(
            "import time\nimport torch\n\nclass Bench:\n    def forward_time(self, x):\n"
            "        x = x.to('cuda')\n        t0 = time.perf_counter()\n        y = self.model(x)\n"
            "        return time.perf_counter() - t0",
            line=9,
        ),
        # a benchmark loop over a literal range
        Invalid(
            "import time, torch\nmodel = model.cuda()\nstart = time.time()\nfor _ in range(20):\n"
            "    out = model(x)\n    out.sum().backward()\n    opt.step()\nper_iter = (time.time() - start) / 20",
            line=8,
        ),
        Invalid(
            "import timeit, torch\ndevice = torch.device('cuda')\nt = timeit.default_timer()\n"
            "loss = model(x.to(device))\nloss.backward()\ndt = timeit.default_timer() - t",
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
                for name in _assigned_to(c):
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

        return direct(site) or _local_function_calls(model, site, direct)


def _assigned_to(site: Site) -> list[str]:
    statement = site.statement
    out = []
    if isinstance(statement, cst.SimpleStatementLine):
        for small in statement.body:
            if isinstance(small, cst.Assign) and small.value is site.node:
                out.extend(t.target.value for t in small.targets if isinstance(t.target, cst.Name))
    return out


def _subtracted_from(model: FileModel, clock: Site, scope: Scope) -> str | None:
    """``t0`` when the clock read is the left side of ``clock() - t0``, or is assigned to ``t1`` and
    ``t1 - t0`` follows in the scope."""
    parent = clock.parent
    if isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, cst.Subtract):
        if parent.left is clock.node and isinstance(parent.right, cst.Name):
            return parent.right.value
        return None
    names = set(_assigned_to(clock))
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


# -- TL403 -----------------------------------------------------------------------------------------------


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
        references=("https://pytorch.org/docs/stable/notes/cuda.html#memory-management",),
    )
    valid = (
        "import torch\nfor epoch in range(E):\n    for b in loader:\n        model(b).loss.backward()\n"
        "        opt.step()\n    evaluate()\n    torch.cuda.empty_cache()",
        "import torch\nfor step, b in enumerate(loader):\n    model(b).loss.backward()\n    opt.step()\n"
        "    if step % 1000 == 0:\n        torch.cuda.empty_cache()",
        "import torch\nfor b in loader:\n    try:\n        model(b).loss.backward()\n        opt.step()\n"
        "    except torch.cuda.OutOfMemoryError:\n        torch.cuda.empty_cache()",
        # after eval, outside the loop
        "import torch\nfor b in loader:\n    model(b).loss.backward()\n    opt.step()\ntorch.cuda.empty_cache()",
        # an inference loop: no backward or step
        "import torch\nfor prompt in prompts:\n    out = model.generate(prompt)\n    torch.cuda.empty_cache()",
        # not torch's
        "from mylib import empty_cache\nfor b in loader:\n    model(b).loss.backward()\n    empty_cache()",
        # on the way out of the loop after an out-of-memory skip (a handler, not every step)
        "import torch\nfor b in loader:\n    try:\n        model(b).loss.backward()\n    except RuntimeError:\n"
        "        optimizer.zero_grad()\n        torch.cuda.empty_cache()\n        continue\n    optimizer.step()",
        # between training phases (the loop runs one phase per iteration; steps are in the inner loop)
        "import torch\nfor phase in phases:\n    for b in phase.loader:\n        model(b).loss.backward()\n"
        "        opt.step()\n    torch.cuda.empty_cache()",
    )
    invalid = (
        Invalid(
            "import torch\nfor b in loader:\n    loss = model(b).loss\n    loss.backward()\n    opt.step()\n"
            "    torch.cuda.empty_cache()",
            line=6,
        ),
        Invalid(
            "import torch\nfor b in loader:\n    torch.cuda.empty_cache()\n    model(b).loss.backward()\n    opt.step()",
            line=3,
        ),
        Invalid(
            "from torch.cuda import empty_cache\nwhile step < n:\n    scaler.scale(model(b)).backward()\n"
            "    scaler.step(opt)\n    scaler.update()\n    empty_cache()",
            line=6,
        ),
        Invalid(
            "import torch\n\ndef train(self):\n    for batch in self.loader:\n        with torch.autocast('cuda'):\n"
            "            loss = self.model(batch)\n        self.accelerator.backward(loss)\n"
            "        self.optimizer.step()\n        torch.cuda.empty_cache()",
            line=9,
        ),
        Invalid(
            "import torch as th\nfor i, b in enumerate(loader):\n    model(b).loss.backward()\n"
            "    if (i + 1) % accum == 0:\n        opt.step()\n    th.cuda.empty_cache()",
            line=6,
        ),
        Invalid(
            "import torch\nfor epoch in range(3):\n    for b in loader:\n        fabric.backward(model(b))\n"
            "        torch.cuda.empty_cache()\n        opt.step()",
            line=5,
        ),
        # inside a with block of the step
        Invalid(
            "import torch\nfor b in loader:\n    with torch.autocast('cuda', dtype=torch.bfloat16):\n"
            "        loss = model(b).loss\n        torch.cuda.empty_cache()\n    loss.backward()\n    opt.step()",
            line=5,
        ),
        # a DeepSpeed engine's backward and step
        Invalid(
            "import torch\nfor step, batch in enumerate(loader):\n    loss = engine(batch)\n    engine.backward(loss)\n"
            "    engine.step()\n    torch.cuda.empty_cache()",
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


# -- TL404 -----------------------------------------------------------------------------------------------


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
        references=("https://pytorch.org/docs/stable/optim.html",),
    )
    valid = (
        "import torch\nm0 = torch.cuda.memory_allocated()\nopt = torch.optim.AdamW(model.parameters())",
        "import torch\nopt = torch.optim.AdamW(model.parameters())\nfor b in loader:\n    model(b).sum().backward()\n"
        "    opt.step()\nprint(torch.cuda.memory_allocated())",
        # inside the loop that steps: only the first iteration lacks state
        "import torch\nopt = torch.optim.AdamW(model.parameters())\nfor b in loader:\n"
        "    print(torch.cuda.memory_allocated())\n    model(b).sum().backward()\n    opt.step()",
        # the optimizer is handed to a function that trains
        "import torch\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\ntrain(model, opt, loader)\n"
        "print(torch.cuda.max_memory_allocated())",
        # ... or to a trainer inside a tuple, or through a state dict
        "import torch\nopt = torch.optim.AdamW(model.parameters())\n"
        "trainer = Trainer(model=model, optimizers=(opt, None))\ntrainer.train()\n"
        "print(torch.cuda.max_memory_allocated())",
        "import torch\nopt = torch.optim.AdamW(model.parameters())\nstate = {'model': model, 'optimizer': opt}\n"
        "fit(fabric, state)\nprint(torch.cuda.memory_allocated())",
        # no optimizer in this scope
        "import torch\nmodel = Net().cuda()\nprint(torch.cuda.memory_allocated())",
        # a step before the reading in straight-line code
        "import torch\nopt = torch.optim.Adam(model.parameters())\nloss.backward()\nopt.step()\n"
        "free, total = torch.cuda.mem_get_info()",
        # not torch's
        "from mylib import memory_allocated\nopt = torch.optim.Adam(p)\nmemory_allocated()",
    )
    invalid = (
        Invalid(
            "import torch\nopt = torch.optim.AdamW(model.parameters())\nprint(torch.cuda.memory_allocated())\n"
            "for b in loader:\n    model(b).sum().backward()\n    opt.step()",
            line=3,
        ),
        Invalid(
            "import torch\nopt = torch.optim.Adam(model.parameters())\nfree, total = torch.cuda.mem_get_info()",
            line=3,
        ),
        Invalid(
            "import torch\n\ndef setup(model):\n    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
            "    log('memory', torch.cuda.memory_reserved())\n    return optimizer",
            line=5,
        ),
        # accelerate's prepare does not step
        Invalid(
            "import torch\nopt = torch.optim.AdamW(model.parameters())\n"
            "model, opt = accelerator.prepare(model, opt)\nmem = torch.cuda.max_memory_allocated()",
            line=4,
        ),
        Invalid(
            "from torch.cuda import memory_allocated\nfrom torch.optim import AdamW\nopt = AdamW(params)\n"
            "m = memory_allocated(0)",
            line=4,
        ),
        # a method that builds and reports
        Invalid(
            "import torch\n\nclass Runner:\n    def setup(self):\n"
            "        self.optimizer = torch.optim.Adam(self.model.parameters())\n"
            "        self.log(mem=torch.cuda.memory_allocated())",
            line=6,
        ),
        # reserved memory after fabric.setup_optimizers (which does not step)
        Invalid(
            "import torch\noptimizer = torch.optim.AdamW(model.parameters())\n"
            "optimizer = fabric.setup_optimizers(optimizer)\nfabric.print(torch.cuda.memory_reserved())",
            line=4,
        ),
        Invalid(
            "import torch\nimport bitsandbytes as bnb\nopt = bnb.optim.AdamW8bit(model.parameters())\n"
            "print(torch.cuda.memory_allocated() / 1e9)\nloss.backward()\nopt.step()",
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
            optimizer_names = {n for e in built for n in _assigned_to(e.site)}
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


# -- TL405 -----------------------------------------------------------------------------------------------


class MaterializedAttentionScores(Rule):
    id = "TL405"
    name = "materialized-attention-scores"
    severity = Severity.INFO
    summary = "Attention written out by hand stores the full sequence x sequence score matrix for backward."
    # Prefilter: a softmax, a score product (`@` or `matmul`) of a transposed key (`transpose`,
    # `swapaxes`, `mT`), in a class whose base ends with `Module`.
    tokens = ("softmax",)
    requires = (("@", "matmul"), ("transpose", "swapaxes", "mT"), ("Module",))
    doc = RuleDoc(
        what=(
            "Reports the score product `q @ k.transpose(-2, -1)` (or `torch.matmul(q, k.transpose(...))`, "
            "`k.mT`) of attention written out by hand, when the scores go through a softmax whose result "
            "multiplies the values, inside a method of a module class, and every step in between is "
            "one the fused kernel also performs (scaling, an additive bias or mask, `masked_fill`, "
            "dtype casts, dropout). Not reported when the file calls `scaled_dot_product_attention` "
            "anywhere (the hand-written path is then a fallback or a deliberate variant), for "
            "variants the kernel cannot express (talking-heads projections across heads, "
            "probabilities re-weighted after the softmax), nor in functions decorated with "
            "`torch.no_grad()` / `torch.inference_mode()`."
        ),
        why=(
            "Autograd keeps the softmax output (and usually the scores and the dropout mask) for the "
            "backward pass, one value per query-key pair. For batch 8, 32 heads and 4096 tokens that "
            "is 8 x 32 x 4096 x 4096 values, 4.3 billion, or 8.6 GB in bf16 for a single layer; it "
            "grows with the square of the sequence length. "
            "`torch.nn.functional.scaled_dot_product_attention` computes the same result with fused "
            "kernels that never store the matrix."
        ),
        example=(
            "att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))\n"
            "att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))\n"
            "att = F.softmax(att, dim=-1)\n"
            "y = att @ v"
        ),
        use_instead="y = F.scaled_dot_product_attention(q, k, v, is_causal=True)",
        references=(
            "https://pytorch.org/docs/stable/generated/torch.nn.functional.scaled_dot_product_attention.html",
        ),
    )
    _HEAD = "import math\nimport torch\nimport torch.nn.functional as F\nfrom torch import nn\n\nclass Attn(nn.Module):\n"
    valid = (
        # cross-covariance attention: a channels x channels map of L2-normalised q and k
        "import torch.nn as nn\nimport torch.nn.functional as F\n\nclass XCA(nn.Module):\n"
        "    def forward(self, q, k, v):\n"
        "        attn = (F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)) * self.temperature\n"
        "        return attn.softmax(dim=-1) @ v",
        # the fused kernel
        _HEAD
        + "    def forward(self, q, k, v):\n        return F.scaled_dot_product_attention(q, k, v, is_causal=True)",
        # nanoGPT: a fallback for old PyTorch next to the fused path
        _HEAD + "    def forward(self, q, k, v):\n        if self.flash:\n"
        "            return F.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
        "        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))\n"
        "        att = F.softmax(att, dim=-1)\n        return att @ v",
        # inference only
        _HEAD + "    @torch.no_grad()\n    def forward(self, q, k, v):\n"
        "        return F.softmax(q @ k.transpose(-2, -1), dim=-1) @ v",
        # a plain matmul without softmax (a bilinear score, not attention)
        _HEAD + "    def forward(self, a, b):\n        return a @ b.transpose(-2, -1)",
        # softmax over a projection, not over q @ k^T
        _HEAD
        + "    def forward(self, x, v):\n        w = F.softmax(self.proj(x), dim=-1)\n        return w @ v",
        # talking-heads attention mixes the heads before and after the softmax: no fused equivalent
        _HEAD + "    def forward(self, q, k, v):\n        attn = q @ k.transpose(-2, -1)\n"
        "        attn = self.proj_l(attn.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)\n        attn = attn.softmax(dim=-1)\n"
        "        attn = self.proj_w(attn.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)\n        return attn @ v",
        # the probabilities are re-weighted after the softmax (gated positional attention)
        _HEAD
        + "    def forward(self, q, k, v, pos):\n        patch = (q @ k.transpose(-2, -1)).softmax(dim=-1)\n"
        "        gate = self.gating.sigmoid()\n        attn = (1.0 - gate) * patch + gate * pos\n"
        "        attn /= attn.sum(dim=-1, keepdim=True)\n        return attn @ v",
        # another module of the file uses the fused kernel: this variant is deliberate
        _HEAD
        + "    def forward(self, q, k, v):\n        a = F.softmax(q @ k.transpose(-2, -1), dim=-1)\n        return a @ v\n\n"
        "class Fast(nn.Module):\n    def forward(self, q, k, v):\n        return F.scaled_dot_product_attention(q, k, v)",
        # class-token attention: one query, scores linear in the length
        _HEAD
        + "    def forward(self, x):\n        q = self.wq(x[:, 0:1, ...])\n        k, v = self.wk(x), self.wv(x)\n"
        "        attn = (q @ k.transpose(-2, -1)).softmax(dim=-1)\n        return attn @ v",
        # a free function outside any module class (a reference implementation in a test)
        "import torch\n\ndef reference_attention(q, k, v):\n"
        "    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v",
    )
    invalid = (
        Invalid(
            _HEAD + "    def forward(self, q, k, v):\n"
            "        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))\n"
            "        att = att.masked_fill(self.mask == 0, float('-inf'))\n"
            "        att = F.softmax(att, dim=-1)\n        att = self.attn_dropout(att)\n        return att @ v",
            line=8,
        ),
        Invalid(
            _HEAD + "    def forward(self, q, k, v):\n"
            "        return F.softmax(q @ k.transpose(-1, -2) / 8, dim=-1) @ v",
            line=8,
        ),
        Invalid(
            _HEAD + "    def forward(self, q, k, v):\n"
            "        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.d)\n"
            "        probs = scores.softmax(dim=-1)\n        return torch.matmul(probs, v)",
            line=8,
        ),
        Invalid(
            _HEAD + "    def forward(self, q, k, v):\n        w = q @ k.mT\n"
            "        w = torch.softmax(w, dim=-1)\n        out = w @ v\n        return out",
            line=8,
        ),
        Invalid(
            "import torch\nimport pytorch_lightning as pl\n\nclass Block(pl.LightningModule):\n"
            "    def attend(self, q, k, v, mask):\n        s = q @ k.transpose(-2, -1)\n"
            "        s = s.masked_fill(mask, -1e9)\n        p = s.softmax(-1)\n        return p @ v",
            line=6,
        ),
        Invalid(
            _HEAD + "    def forward(self, x):\n        q, k, v = self.qkv(x).chunk(3, dim=-1)\n"
            "        attn = (q @ k.transpose(-2, -1)) * self.scale\n        attn = attn.softmax(dim=-1)\n"
            "        attn = self.attn_drop(attn)\n        x = (attn @ v).transpose(1, 2)\n        return x",
            line=9,
        ),
    )

    invalid = (
        *invalid,
        # relative-position bias added to the scores, a head mask on the probabilities (BERT style)
        Invalid(
            _HEAD + "    def forward(self, q, k, v, mask, head_mask):\n"
            "        scores = torch.matmul(q, k.transpose(-1, -2))\n"
            "        scores = scores / math.sqrt(self.head_size) + mask\n"
            "        probs = F.softmax(scores, dim=-1)\n        probs = self.dropout(probs)\n"
            "        probs = probs * head_mask\n        return torch.matmul(probs, v)",
            line=8,
        ),
        # softmax in float32 then cast back
        Invalid(
            _HEAD + "    def forward(self, q, k, v):\n        w = q @ k.transpose(2, 3) * self.scale\n"
            "        w = F.softmax(w.float(), dim=-1).type_as(q)\n        return torch.matmul(w, v)",
            line=8,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        if self._file_uses_sdpa(model):
            return
        # Only functions that call a softmax can hold hand-written attention: walk just those.
        with_softmax: dict[int, Scope] = {}
        for site in model.calls:
            call = site.node
            assert isinstance(call, cst.Call)
            if attr_name(call) in ("softmax", "log_softmax") and self._is_softmax(model, call, site.scope):
                with_softmax.setdefault(id(site.scope), site.scope)
        for scope in with_softmax.values():
            cls = scope.enclosing_class
            function = scope.node
            if scope.kind != "function" or cls is None or not isinstance(function, cst.FunctionDef):
                continue
            products = [n for n in walk_scope(function) if self._score_product(model, n, scope) is not None]
            if not products:
                continue
            if not self._is_module_class(cls.node) or grad_disabled_function(model, function, scope):
                continue
            statements = _statement_index(function)
            for product in products:
                if self._single_query(model, product, scope) or self._channel_attention(
                    model, product, scope
                ):
                    continue
                if self._softmax_then_values(model, scope, function, statements, product):
                    yield Diagnostic(
                        product,
                        "Attention written out by hand stores the full sequence x sequence score matrix "
                        "for backward (memory grows with the square of the length); use "
                        "`torch.nn.functional.scaled_dot_product_attention`.",
                    )

    @classmethod
    def _channel_attention(cls, model: FileModel, product: cst.CSTNode, scope: Scope) -> bool:
        """Cross-covariance attention (XCiT, EdgeNeXt): q and k are L2-normalised along the tokens and
        multiplied as channels x channels, so the map does not grow with the sequence length."""
        operands = cls._score_product(model, product, scope)
        if operands is None:
            return False

        def normalized(expr: cst.CSTNode) -> bool:
            values = model.values_of(expr, scope) if isinstance(expr, cst.Name) else [expr]
            return any(
                isinstance(node, cst.Call)
                and model.qualname(node.func, scope) == "torch.nn.functional.normalize"
                for value in values
                for node in walk(value)
            )

        return all(normalized(operand) for operand in operands)

    @staticmethod
    def _single_query(model: FileModel, product: cst.CSTNode, scope: Scope) -> bool:
        """The queries are one token (``self.wq(x[:, 0:1])``, a class-token attention): the scores
        grow linearly with the length, there is no square matrix to save."""
        if isinstance(product, cst.BinaryOperation):
            query = product.left
        elif isinstance(product, cst.Call) and product.args:
            query = product.args[0].value
        else:
            return False
        values = model.values_of(query, scope) if isinstance(query, cst.Name) else [query]
        for value in values:
            for node in walk(value):
                if isinstance(node, cst.Subscript):
                    for element in node.slice:
                        inner = element.slice
                        if (
                            isinstance(inner, cst.Slice)
                            and (inner.lower is None or int_value(inner.lower) == 0)
                            and int_value(inner.upper) == 1
                        ):
                            return True
        return False

    @staticmethod
    def _score_product(
        model: FileModel, node: cst.CSTNode, scope: Scope
    ) -> tuple[cst.CSTNode, cst.CSTNode] | None:
        """(q, k^T) for ``q @ k.transpose(-2, -1)`` / ``torch.matmul(q, k.transpose(...))``."""
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.MatrixMultiply):
            left, right = node.left, node.right
        elif (
            isinstance(node, cst.Call)
            and attr_name(node) == "matmul"
            and len(node.args) == 2
            and model.qualname(node.func, scope) == "torch.matmul"
        ):
            left, right = node.args[0].value, node.args[1].value
        else:
            return None
        if isinstance(right, cst.Attribute) and right.attr.value == "mT":
            return left, right
        if isinstance(right, cst.Call) and attr_name(right) in ("transpose", "swapaxes"):
            args = [int_value(a) for a in positional(right)]
            if len(args) == 2 and None not in args and {args[0], args[1]} in ({-2, -1}, {2, 3}):
                return left, right
        return None

    @staticmethod
    def _is_module_class(cls: cst.CSTNode) -> bool:
        assert isinstance(cls, cst.ClassDef)
        return any((dotted(b.value) or "").endswith("Module") for b in cls.bases)

    @staticmethod
    def _file_uses_sdpa(model: FileModel) -> bool:
        """The file calls the fused kernel somewhere: attention written by hand elsewhere in it is a
        deliberate fallback or a variant the kernel cannot express."""
        return bool(model.calls_to(*SDPA))

    def _softmax_then_values(
        self,
        model: FileModel,
        scope: Scope,
        function: cst.FunctionDef,
        statements: dict[int, int],
        product: cst.CSTNode,
    ) -> bool:
        """The scores go through a softmax whose result multiplies the values, with only steps that
        ``scaled_dot_product_attention`` can express in between: scaling, an additive bias or mask,
        ``masked_fill``, dtype casts, dropout. Anything else (talking-heads projections across heads,
        re-weighting the probabilities) means the fused kernel is no replacement."""
        start = statements.get(id(product), -1)
        smalls = sorted(
            (
                (statements.get(id(small), -1), small)
                for line in walk_scope(function)
                if isinstance(line, cst.SimpleStatementLine)
                for small in line.body
            ),
            key=lambda pair: pair[0],
        )
        scores: set[str] = set()
        probs: set[str] = set()
        softmax_roots: set[int] = set()
        for index, small in smalls:
            if index < start:
                continue
            for node in walk(small):
                if isinstance(node, cst.Call) and self._is_softmax(model, node, scope):
                    source = _softmax_input(node)
                    if source is not None and _expressible(source, {id(product)}, scores, "scores"):
                        softmax_roots.add(id(node))
            for node in walk(small):
                left = None if node is product else self._matmul_left(model, node, scope)
                if left is not None and softmax_roots and _expressible(left, softmax_roots, probs, "probs"):
                    return True
            value: cst.BaseExpression | None = None
            targets: set[str] = set()
            if isinstance(small, cst.Assign):
                targets = {t.target.value for t in small.targets if isinstance(t.target, cst.Name)}
                value = small.value
            elif isinstance(small, cst.AugAssign) and isinstance(small.target, cst.Name):
                # ``t /= x`` is ``t = t / x``
                targets = {small.target.value}
                operator = AUG_OPERATORS.get(type(small.operator))
                value = cst.BinaryOperation(small.target, operator(), small.value) if operator else None
            for names, roots, mode in ((scores, {id(product)}, "scores"), (probs, softmax_roots, "probs")):
                if value is not None and _expressible(value, roots, names, mode):
                    names |= targets
                else:
                    names -= targets
        return False

    @staticmethod
    def _matmul_left(model: FileModel, node: cst.CSTNode, scope: Scope) -> cst.CSTNode | None:
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.MatrixMultiply):
            return node.left
        if isinstance(node, cst.Call) and node.args and model.qualname(node.func, scope) == "torch.matmul":
            return node.args[0].value
        return None

    @staticmethod
    def _is_softmax(model: FileModel, call: cst.Call, scope: Scope) -> bool:
        if isinstance(call.func, cst.Attribute) and call.func.attr.value == "softmax":
            qual = model.qualname(call.func, scope)
            return qual is None or qual in SOFTMAX
        return model.qualname(call.func, scope) in SOFTMAX


def _statement_index(function: cst.FunctionDef) -> dict[int, int]:
    """For every node of the function body (nested defs excluded), the index of its statement in
    program order."""
    index: dict[int, int] = {}
    count = 0
    for node in walk_scope(function):
        if isinstance(node, cst.SimpleStatementLine | cst.BaseCompoundStatement):
            count += 1
            if isinstance(node, cst.SimpleStatementLine):
                for inner in walk(node):
                    index[id(inner)] = count
            else:
                # the header of a compound statement (an if test, a with item, a return's value)
                for child in node.children:
                    if not isinstance(child, cst.BaseSuite):
                        for inner in walk(child):
                            index.setdefault(id(inner), count)
    return index


AUG_OPERATORS = {
    cst.AddAssign: cst.Add,
    cst.SubtractAssign: cst.Subtract,
    cst.MultiplyAssign: cst.Multiply,
    cst.DivideAssign: cst.Divide,
}
SCORE_METHODS = frozenset(
    {"masked_fill", "masked_fill_", "float", "to", "type_as", "half", "bfloat16", "contiguous"}
)
PROB_METHODS = frozenset({"float", "to", "type_as", "half", "bfloat16", "contiguous"})
DROPOUT = frozenset({"torch.nn.functional.dropout", "torch.dropout"})


def _softmax_input(call: cst.Call) -> cst.BaseExpression | None:
    if isinstance(call.func, cst.Attribute) and call.func.attr.value == "softmax":
        # ``x.softmax(-1)`` (a tensor method) or ``F.softmax(x, -1)`` / ``torch.softmax(x, -1)``
        args = positional(call)
        if dotted(call.func.value) in ("F", "torch", "nn.functional", "torch.nn.functional") and args:
            return args[0]
        return call.func.value
    args = positional(call)
    return args[0] if args else None


def _mentions_tracked(expr: cst.CSTNode, roots: set[int], names: set[str]) -> bool:
    return any(id(n) in roots or (isinstance(n, cst.Name) and n.value in names) for n in walk(expr))


def _expressible(expr: cst.CSTNode, roots: set[int], names: set[str], mode: str) -> bool:
    """``expr`` is a tracked value (a root node or a tracked name) after steps that the fused
    attention kernel also performs (see ``_softmax_then_values``)."""
    if id(expr) in roots or (isinstance(expr, cst.Name) and expr.value in names):
        return True
    # scores take a scale, a bias or a mask; probabilities only a scale (a head mask)
    arithmetic = (
        (cst.Add, cst.Subtract, cst.Multiply, cst.Divide) if mode == "scores" else (cst.Multiply, cst.Divide)
    )
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, arithmetic):
        left = _expressible(expr.left, roots, names, mode)
        right = _expressible(expr.right, roots, names, mode)
        if left != right:
            other = expr.right if left else expr.left
            return not _mentions_tracked(other, roots, names)
        return False
    if isinstance(expr, cst.Call):
        func = expr.func
        name = attr_name(expr) or ""
        methods = SCORE_METHODS if mode == "scores" else PROB_METHODS
        if isinstance(func, cst.Attribute) and name in methods:
            return _expressible(func.value, roots, names, mode) and not any(
                _mentions_tracked(a.value, roots, names) for a in expr.args
            )
        if mode == "probs" and ("drop" in name.lower() or dotted(func) in DROPOUT):
            args = positional(expr)
            return bool(args) and _expressible(args[0], roots, names, mode)
    return False
