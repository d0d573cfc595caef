"""The memory-measurement rules' conditions on CPython's tree (``Rule.gate_check``): TL401 (a peak reading
that measures a region with no reset proven before it), TL403 (``empty_cache()`` directly in a loop that
trains) and TL404 (a reading after an optimizer's construction with no step before it). Files whose
readings are whole-run figures, whose ``empty_cache()`` runs under a condition or outside the step loop,
or whose readings come after a step never reach libcst for these rules, and no finding changes."""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Callable

import pytest
from conftest import gate_check_keeps_findings

from trainlint.engine import lint_text
from trainlint.gates import gates, pass_tree_checks
from trainlint.model.gate_memory_measurement import (
    empty_cache_in_training_loop,
    memory_read_before_first_step,
    peak_reading_may_measure_region,
)
from trainlint.results import LintOptions

Check = Callable[[ast.Module], bool]
CHECKS: dict[str, Check] = {
    "TL401": peak_reading_may_measure_region,
    "TL403": empty_cache_in_training_loop,
    "TL404": memory_read_before_first_step,
}


def _code(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


# -- TL401 --------------------------------------------------------------------------------------------------
PEAK_KEPT = [
    # aliases: `import ... as`, `from ... import ... as`, an assignment of the function or of its module
    """
    from torch.cuda import max_memory_allocated as mma
    for b in loader:
        step(b)
        log(mma())
    """,
    """
    import torch
    read = torch.cuda.max_memory_reserved
    while running:
        step()
        stats.append(read())
    """,
    """
    import torch.cuda as tc
    async def bench():
        async for b in loader:
            await step(b)
            print(tc.memory.max_memory_allocated())
    """,
    # a nested function in a loop: the model's loop frames go on into it
    """
    import torch
    for b in loader:
        def report():
            print(torch.cuda.max_memory_allocated())
        report()
    """,
    # a baseline subtracted through names, divisions and `self.x`
    """
    import torch
    base = torch.cuda.memory_allocated() / 2**20
    run()
    peak = torch.cuda.max_memory_allocated() / 2**20
    used = peak - base
    """,
    """
    import torch

    class Tracker:
        def __enter__(self):
            self.begin = torch.cuda.memory_allocated()

        def __exit__(self, *exc):
            self.peak = torch.cuda.max_memory_allocated()
            self.used = self.peak - self.begin
    """,
    # resets that do not count: after the reading, in another class, in a function not called first
    """
    import torch
    before = torch.cuda.memory_allocated()
    run()
    used = torch.cuda.max_memory_allocated() - before
    torch.cuda.reset_peak_memory_stats()
    """,
    """
    import torch

    class Other:
        def start(self):
            torch.cuda.reset_peak_memory_stats()

    class Bench:
        def measure(self, fn):
            base = torch.cuda.memory_allocated()
            fn()
            return torch.cuda.max_memory_allocated() - base
    """,
    # a helper that resets, called after the reading only
    """
    import torch

    def start():
        torch.cuda.reset_peak_memory_stats()

    def measure(fn):
        base = torch.cuda.memory_allocated()
        fn()
        used = torch.cuda.max_memory_allocated() - base
        start()
        return used
    """,
    # a name that may be bound to something else than the helper: unsure, kept
    """
    import torch

    def start():
        torch.cuda.reset_peak_memory_stats()

    def measure(fn, start=None):
        start()
        base = torch.cuda.memory_allocated()
        fn()
        return torch.cuda.max_memory_allocated() - base
    """,
]
PEAK_REJECTED = [
    # a script's final figure, after the loop (Lightning's tensor-parallel examples)
    """
    import torch
    for i, batch in enumerate(loader):
        step(batch)
    print(f"Peak memory usage: {torch.cuda.max_memory_allocated() / 1e9:.02f} GB")
    """,
    # the device module from getattr: no torch name (accelerate's examples)
    """
    import torch
    mod = getattr(torch, device_type, torch.cuda)
    for b in loader:
        step(b)
        log(mod.max_memory_allocated() - mod.memory_allocated())
    """,
    # a context manager: reset in __enter__, read in __exit__ (accelerate's TorchTracemalloc)
    """
    import torch

    class TorchTracemalloc:
        def __enter__(self):
            torch.cuda.empty_cache()
            torch.cuda.reset_max_memory_allocated()
            self.begin = torch.cuda.memory_allocated()
            return self

        def __exit__(self, *exc):
            self.end = torch.cuda.memory_allocated()
            self.peak = torch.cuda.max_memory_allocated()
            self.peaked = b2mb(self.peak - self.begin)
    """,
    # reset in the same loop (after), before in the scope, in the module around a function
    """
    import torch
    for b in loader:
        step(b)
        log(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
    """,
    """
    import torch
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    peak = torch.cuda.max_memory_allocated() - base
    """,
    """
    import torch
    torch.cuda.reset_peak_memory_stats()

    def measure(fn):
        base = torch.cuda.memory_allocated()
        fn()
        return torch.cuda.max_memory_allocated() - base
    """,
    # a helper of the file, or a method of the class, that resets, called first
    """
    import torch

    def start():
        torch.cuda.reset_peak_memory_stats()

    def measure(fn):
        start()
        before = torch.cuda.memory_allocated()
        fn()
        return torch.cuda.max_memory_reserved() - before
    """,
    """
    import torch

    class Bench:
        def start(self):
            torch.cuda.reset_peak_memory_stats()

        def run(self, fn):
            self.start()
            base = torch.cuda.memory_allocated()
            fn()
            return torch.cuda.max_memory_allocated() - base
    """,
    # the reading the only call of its loop; a status report; not torch's
    """
    import torch
    for size in sizes:
        peak = torch.cuda.max_memory_allocated()
    """,
    """
    import torch

    def report_memory(name):
        print(name, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated())
    """,
    """
    import torch
    from mylib import max_memory_allocated
    for b in loader:
        step(b)
        x = max_memory_allocated()
    """,
]


# -- TL403 --------------------------------------------------------------------------------------------------
EMPTY_KEPT = [
    """
    import torch
    ec = torch.cuda.empty_cache
    for b in loader:
        model(b).loss.backward()
        opt.step()
        ec()
    """,
    """
    from torch.cuda import empty_cache as free
    async def train():
        async for b in loader:
            with ctx():
                try:
                    free()
                finally:
                    pass
            engine.backward(engine(b))
    """,
    """
    import torch.cuda as tc
    while True:
        fabric.backward(model(next(it)))
        tc.memory.empty_cache()
    """,
    """
    import torch
    for b in loader:
        if (i + 1) % accum == 0:
            optimizer.step()
        torch.xpu.empty_cache()
    """,
    # a nested function in the loop that trains and frees: the model's loop frames go on into it
    """
    import torch
    for b in loader:
        def go():
            loss(b).backward()
            torch.cuda.empty_cache()
        go()
    """,
]
EMPTY_REJECTED = [
    # under a condition, in a handler, in `finally`, in the loop's `else`
    """
    import torch
    for i, b in enumerate(loader):
        model(b).loss.backward()
        opt.step()
        if i % 100 == 0:
            torch.cuda.empty_cache()
    """,
    """
    import torch
    for b in loader:
        try:
            model(b).loss.backward()
        except RuntimeError:
            torch.cuda.empty_cache()
            continue
        opt.step()
    """,
    """
    import torch
    for b in loader:
        try:
            model(b).loss.backward()
        finally:
            torch.cuda.empty_cache()
    """,
    """
    import torch
    for b in loader:
        model(b).loss.backward()
    else:
        torch.cuda.empty_cache()
    """,
    # once per epoch: the steps are in the inner loop
    """
    import torch
    for epoch in range(E):
        for b in loader:
            model(b).loss.backward()
            opt.step()
        torch.cuda.empty_cache()
    """,
    # the step in a helper (the rule follows none), or outside the lambda that frees
    """
    import torch

    def train_step(b):
        model(b).loss.backward()
        opt.step()

    for b in loader:
        train_step(b)
        torch.cuda.empty_cache()
    """,
    """
    import torch
    for b in loader:
        model(b).loss.backward()
        opt.step()
        free = lambda: torch.cuda.empty_cache()
    """,
    # outside any loop (Lightning's strategies, teardown), another device's, a device module from getattr
    """
    import torch

    def teardown(self):
        self.model.cpu()
        torch.cuda.empty_cache()

    def fit(self):
        for b in self.loader:
            self.model(b).backward()
    """,
    """
    import torch
    for b in loader:
        model(b).loss.backward()
        torch.mlu.empty_cache()
    """,
    """
    import torch
    acc = getattr(torch, device)
    for b in loader:
        model(b).loss.backward()
        acc.empty_cache()
    """,
]


# -- TL404 --------------------------------------------------------------------------------------------------
READ_KEPT = [
    """
    from torch.optim import AdamW as A
    import torch.cuda as tc
    opt = A(params)
    print(tc.memory_reserved())
    """,
    """
    import torch
    Optim = torch.optim.SGD
    def setup():
        opt = Optim(params)
        mem = torch.cuda.memory_allocated
        log(mem())
    """,
    # an optimizer class of another project file (a name with an optimizer's word) may be one
    """
    import torch
    from .optimizers import FusedLion
    opt = FusedLion(params)
    print(torch.cuda.memory_allocated())
    """,
    # in an f-string; a step only after, outside any loop around the reading
    """
    import torch
    opt = torch.optim.Adam(params)
    print(f"{torch.cuda.max_memory_allocated() / 1e9:.1f} GB")
    for b in loader:
        opt.step()
    """,
    # a step in another scope does not count
    """
    import torch

    def train(opt):
        opt.step()

    def setup():
        opt = torch.optim.Adam(params)
        free, total = torch.cuda.mem_get_info()
    """,
    # handed over before it is built, or only to a wrapper that does not step it
    """
    import torch
    train(model, opt)
    opt = torch.optim.SGD(params)
    print(torch.cuda.memory_allocated())
    """,
    """
    import torch
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer = fabric.setup_optimizers(optimizer)
    fabric.print(torch.cuda.memory_reserved())
    """,
    # a body on the line of its colon: the model finds no name the optimizer is assigned to
    """
    import torch

    def setup():
        if True: opt = torch.optim.SGD(params); state = {"optimizer": opt}
        print(torch.cuda.memory_allocated())
    """,
]
READ_REJECTED = [
    # a step before the reading (Lightning's tensor-parallel example: the loop, then the figure)
    """
    import torch
    optimizer = torch.optim.AdamW(model.parameters())
    for i, batch in enumerate(loader):
        model(batch).sum().backward()
        optimizer.step()
    print(f"Peak memory usage: {torch.cuda.max_memory_allocated() / 1e9:.02f} GB")
    """,
    # any `.step()` counts for the rule (a scheduler's), and one in a loop around the reading
    """
    import torch
    opt = torch.optim.AdamW(params)
    for epoch in range(E):
        train(epoch)
        scheduler.step()
        if rank == 0:
            print(torch.cuda.memory_allocated())
    """,
    """
    import torch
    opt = torch.optim.AdamW(params)
    for b in loader:
        print(torch.cuda.memory_reserved())
        loss(b).backward()
        opt.step()
    """,
    # the optimizer built after the reading, in another scope, or not an optimizer (a scheduler)
    """
    import torch
    m0 = torch.cuda.memory_allocated()
    opt = torch.optim.AdamW(model.parameters())
    """,
    """
    import torch

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_start(self):
        self.start_memory = torch.cuda.memory_allocated()
    """,
    """
    import torch
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    print(torch.cuda.memory_allocated())
    """,
    # not torch's reading
    """
    import torch
    from mylib import memory_allocated
    opt = torch.optim.Adam(p)
    memory_allocated()
    """,
    # the optimizer handed over between: to a trainer in a tuple, in a state dict, to a function
    """
    import torch
    from torch.optim import AdamW

    def main():
        optimizer = AdamW(groups, weight_decay=0.01)
        trainer = Trainer(model=model, optimizers=(optimizer, None))
        trainer.train()
        print(f"Peak Allocated: {torch.cuda.max_memory_allocated() / 1024**3:.2f} GB")
    """,
    """
    import torch
    from litgpt.utils import instantiate_torch_optimizer

    def main(fabric):
        optimizer = instantiate_torch_optimizer("AdamW", model.parameters())
        optimizer = fabric.setup_optimizers(optimizer)
        state = {"model": model, "optimizer": optimizer, "iter_num": 0}
        fit(fabric, state)
        fabric.print(f"Memory used: {torch.cuda.max_memory_allocated() / 1e9:.02f} GB")
    """,
    """
    import torch

    def test_memory(device):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        fully_shard_optimizer(optimizer)
        resting = torch.cuda.memory_allocated(device)
    """,
]

CASES = [
    ("TL401", PEAK_KEPT, PEAK_REJECTED),
    ("TL403", EMPTY_KEPT, EMPTY_REJECTED),
    ("TL404", READ_KEPT, READ_REJECTED),
]
KEPT = [(rule, _code(text)) for rule, kept, _ in CASES for text in kept]
REJECTED = [(rule, _code(text)) for rule, _, rejected in CASES for text in rejected]


def _reported(rule_id: str, text: str) -> bool:
    off = lint_text(text, "x.py", LintOptions((rule_id,), prefilter=False))
    return any(f.rule == rule_id for f in off.findings)


@pytest.mark.parametrize(("rule_id", "text"), KEPT)
def test_a_file_that_may_hold_the_finding_is_kept(rule_id: str, text: str) -> None:
    assert CHECKS[rule_id](ast.parse(text))


@pytest.mark.parametrize(("rule_id", "text"), REJECTED)
def test_a_file_without_the_finding_is_ruled_out(rule_id: str, text: str) -> None:
    tree = ast.parse(text)
    assert not CHECKS[rule_id](tree)
    assert not pass_tree_checks([gates()[rule_id]], tree)
    assert not _reported(rule_id, text), "the check ruled out a file the rule reports"


@pytest.mark.parametrize("rule_id", sorted(CHECKS))
def test_the_rule_reports_most_kept_files(rule_id: str) -> None:
    """The kept spellings are findings of the rule (not just texts the check lets through), but for the
    project's optimizer class TL404 keeps for another file's facts."""
    kept = [text for rule, text in KEPT if rule == rule_id]
    missed = [text for text in kept if not _reported(rule_id, text)]
    assert missed == ([text for text in kept if "FusedLion" in text] if rule_id == "TL404" else [])


@pytest.mark.parametrize("rule_id", sorted(CHECKS))
def test_every_reported_text_passes_the_check_and_the_findings_do_not_change(rule_id: str) -> None:
    extra = [text for _, text in KEPT + REJECTED]
    gate_check_keeps_findings(rule_id, CHECKS[rule_id], extra)


@pytest.mark.parametrize("rule_id", sorted(CHECKS))
def test_the_gate_asks_the_check(rule_id: str) -> None:
    assert gates()[rule_id].check.endswith(CHECKS[rule_id].__name__)
