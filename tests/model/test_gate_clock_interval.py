"""TL402's condition on CPython's tree (``Rule.gate_check``): a clock interval around training work with
nothing that waits for the device. Files whose intervals time no work, wait (``.item()``, a sync, a
helper of the file that syncs), time a whole run, or read no clock of ``time`` never reach libcst for
TL402, and no finding changes."""

from __future__ import annotations

import ast
import textwrap

import pytest
from conftest import gate_check_keeps_findings

from trainlint.engine import lint_text
from trainlint.gates import gates, pass_tree_checks
from trainlint.model.gate_clock_interval import interval_may_miss_sync
from trainlint.results import LintOptions
from trainlint.rule import registry

HEAD = "import time, torch\nmodel.cuda()\n"


def _text(code: str) -> str:
    return HEAD + textwrap.dedent(code).lstrip("\n")


def _reported(text: str) -> bool:
    off = lint_text(text, "x.py", LintOptions(("TL402",), prefilter=False))
    return any(f.rule == "TL402" for f in off.findings)


# Spellings of the rule's findings (each is reported: the test checks it).
KEPT = [
    # the clock bound under another name: an alias, an import ``as``, a module imported ``as``
    "clock = time.perf_counter\nt0 = clock()\nmodel(x).backward()\ndt = clock() - t0",
    "from time import perf_counter as pc\nt0 = pc()\nout = model(x)\ndt = pc() - t0",
    "import time as tm\nt0 = tm.monotonic()\nloss.backward()\nopt.step()\ndt = tm.monotonic() - t0",
    "c = time\nt0 = c.time()\nout = self_model(x)\ndt = c.time() - t0",
    "from timeit import default_timer as timer\nt0 = timer()\nnet(x)\ndt = timer() - t0",
    # ``t1 = clock()`` then ``t1 - t0`` in a call, an assignment, a ``/``
    "t0 = time.time()\nout = model(x)\nt1 = time.time()\nprint(t1 - t0)",
    "t0 = time.time()\nout = model(x)\nt1 = time.time()\nrate = n / (t1 - t0)",
    # a method timing ``self.model``, a nested function, an ``async def`` loop
    """
    class Bench:
        def run(self, x):
            t0 = time.perf_counter()
            self.model(x)
            return time.perf_counter() - t0
    """,
    """
    def outer():
        def inner(x):
            t0 = time.time()
            y = teacher_model(x)
            return time.time() - t0
        return inner
    """,
    """
    async def bench(loader):
        async for x in loader:
            t0 = time.time()
            model(x).backward()
            t1 = time.time()
            log(t1 - t0)
    """,
    # a ``while`` loop around both reads; a loop over ``range(<literal>)`` inside the interval
    "while True:\n    t0 = time.time()\n    model(x)\n    dt = time.time() - t0",
    "t0 = time.time()\nfor _ in range(10):\n    model(x).sum().backward()\ndt = time.time() - t0",
    # a rolling timer ``t0 = t1`` without a wait in the loop
    "t0 = time.time()\nfor x in loader:\n    model(x)\n    t1 = time.time()\n    dt = t1 - t0\n    t0 = t1",
    # a local ``sync`` that is not the file's synchronizing function (the name resolves elsewhere)
    """
    def sync():
        torch.cuda.synchronize()

    def bench(x):
        sync = print
        t0 = time.time()
        model(x)
        sync()
        return time.time() - t0
    """,
    # a wait in a method of another class: ``self.sync`` is not it
    """
    class A:
        def sync(self):
            torch.cuda.synchronize()

    class B:
        def sync(self):
            pass

        def run(self, x):
            t0 = time.time()
            self.model(x)
            self.sync()
            return time.time() - t0
    """,
    # source order, not the tree's field order: the sync is before the clock read in ``a if b else c``
    "x = torch.cuda.synchronize() if time.time() else 0\nloss = model(x)\ndt = time.time() - t0",
    # ``if c: t0 = clock()`` on one line is no opening for the rule (libcst's one-line block): the
    # interval starts at the last clock read, after the wait
    """
    if c: t0 = time.time()
    loss.item()
    mark = time.time()
    out = model(x)
    dt = time.time() - t0
    """,
]

# Files the rule sends to libcst today for nothing.
REJECTED = [
    # no work between the reads: data loading only, or a call of the file's own ``load_model``
    "t0 = time.time()\nbatch = next(it)\ndata_time = time.time() - t0",
    "def load_model():\n    pass\nt0 = time.time()\nload_model()\ndt = time.time() - t0",
    # a wait between the reads, direct, in a helper of the file, in a method of the class
    "t0 = time.time()\nloss = model(x)\nprint(loss.item())\ndt = time.time() - t0",
    "t0 = time.time()\nout = model.generate(x)\ndt = time.time() - t0",
    "t0 = time.time()\nout = model(x)\ntorch.save(out, 'o.pt')\ndt = time.time() - t0",
    """
    def sync():
        torch.cuda.synchronize()

    t0 = time.time()
    model(x).backward()
    sync()
    dt = time.time() - t0
    """,
    """
    class Bench:
        def wait(self):
            self.stream.synchronize()

        def run(self, x):
            t0 = time.time()
            self.model(x)
            self.wait()
            return time.time() - t0
    """,
    # the rolling timer of a loop that logs ``loss.item()`` after the closing read
    "t0 = time.time()\nfor x in loader:\n    loss = model(x)\n    t1 = time.time()\n    dt = t1 - t0\n"
    "    t0 = t1\n    print(loss.item())",
    # a timer around a whole run: the work is in a data loop inside the interval
    "start = time.time()\nfor x in loader:\n    model(x).backward()\nprint(time.time() - start)",
    # not ``time``'s clock: another module's, a parameter named ``time``
    "from mytimer import time\nt0 = time()\nmodel(x)\ndt = time() - t0",
    "def f(time):\n    t0 = time.time()\n    model(x)\n    return time.time() - t0",
    # one read per scope; the start an attribute; the read subtracted from; ``t1 - t0`` only returned
    "def a():\n    return time.time()\ndef b(t0):\n    model(x)\n    return time.time() - t0",
    "self.t0 = time.time()\nmodel(x)\ndt = time.time() - self.t0",
    "t0 = time.time()\nmodel(x)\ndt = t0 - time.time()",
    "def f(x):\n    t0 = time.time()\n    model(x)\n    t1 = time.time()\n    return t1 - t0",
    # no interval at all: a read, and the clock named but not subtracted
    "stamp = time.time()\nmodel(x)\nlog(stamp, time.time())",
]


@pytest.mark.parametrize("code", KEPT)
def test_a_file_that_may_hold_the_finding_is_kept(code: str) -> None:
    text = _text(code)
    assert _reported(text), "a spelling the rule does not report (the case tests nothing)"
    assert interval_may_miss_sync(ast.parse(text))


@pytest.mark.parametrize("code", REJECTED)
def test_a_file_without_the_finding_is_ruled_out(code: str) -> None:
    text = _text(code)
    assert not interval_may_miss_sync(ast.parse(text))
    assert not pass_tree_checks([gates()["TL402"]], ast.parse(text))
    assert not _reported(text), "the check ruled out a file the rule reports"


def test_every_invalid_example_is_kept() -> None:
    rule = registry().get("TL402")
    assert all(interval_may_miss_sync(ast.parse(e.code)) for e in rule.invalid)
    assert rule.gate_check == "gate_clock_interval.interval_may_miss_sync"


def test_every_reported_text_passes_the_check_and_the_findings_do_not_change() -> None:
    extra = [_text(code) for code in KEPT + REJECTED]
    gate_check_keeps_findings("TL402", interval_may_miss_sync, extra)
