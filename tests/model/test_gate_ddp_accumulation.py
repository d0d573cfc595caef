"""TL501's condition on CPython's tree (``Rule.gate_check``): in one scope that names no sync control, a
backward in a loop, a call of a DDP-wrapped (or Accelerate-prepared) model, and an optimizer step that makes
the loop an accumulation window. Files without one never reach libcst for TL501, and no finding changes."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest
from conftest import gate_check_keeps_findings

from trainlint.engine import lint_text
from trainlint.gates import gates, pass_tree_checks
from trainlint.model import gate_ddp_accumulation
from trainlint.model.gate_ddp_accumulation import ddp_backward_may_accumulate_without_no_sync as check
from trainlint.results import LintOptions

HEAD = "import torch\nimport torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
OPTIONS = LintOptions(("TL501",), prefilter=False)

# Spellings of the invalid examples that the rule reports (checked below): the check must keep each.
REPORTED = [
    # the wrapper through a module alias, an assigned name, an annotation
    """
    import torch.nn.parallel as par
    model = par.DistributedDataParallel(net)
    for i, b in enumerate(loader):
        model(b).loss.backward()
        if (i + 1) % accum == 0:
            opt.step()
    """,
    """
    Wrap = DDP
    W2 = Wrap
    model: nn.Module = W2(net)
    for i, b in enumerate(loader):
        model(b).loss.backward()
        if not (i + 1) % accum:
            opt.step()
    """,
    """
    from torch import nn
    import torch.nn.parallel.distributed as dist_ddp
    a = nn.parallel.DistributedDataParallel(net)
    model = dist_ddp.DistributedDataParallel(a)
    for i, b in enumerate(loader):
        model(b).loss.backward()
        if (i + 1) % accum == 0:
            opt.step()
    """,
    # a trainer: the model on self, the backward, the forward and the step in helper methods
    """
    class Trainer:
        def __init__(self, net):
            self.model = DDP(net)

        def forward_step(self, b):
            return self.model(b).loss

        def backward_step(self, loss):
            self.scaler.scale(loss).backward()

        def optimizer_step(self):
            self.scaler.step(self.optimizer)
            self.scaler.update()

        def train(self, loader):
            for step, b in enumerate(loader):
                self.backward_step(self.forward_step(b))
                if step % self.args.gradient_accumulation_steps == 0:
                    self.optimizer_step()
    """,
    # helpers of the module called by name, the model called in a comprehension
    """
    def backward(loss):
        loss.backward()

    def train(model, loader):
        model = DDP(model)
        for i, chunks in enumerate(loader):
            backward(sum([model(c) for c in chunks]))
            if (i + 1) % accum == 0:
                opt.step()
    """,
    # a flag through two names, in a `while` loop; a flag on self; a counter reset with `>=`
    """
    model = DDP(net)
    i = 0
    while True:
        last = (i + 1) % accum == 0
        do_step = last
        model(next(it)).loss.backward()
        i += 1
        if do_step:
            opt.step()
    """,
    """
    class T:
        def setup(self, net):
            self.model = DDP(net)

        def flags(self, i):
            self.update_now = i % self.accum == 0

        def fit(self):
            for i, b in enumerate(self.loader):
                self.model(b).loss.backward()
                if self.update_now:
                    self.opt.step()
    """,
    """
    async def train(net):
        model = DDP(net)
        n = 0
        async for b in loader:
            model(b).loss.backward()
            n += 1
            if n >= accum:
                n = 0
                opt.step()
    """,
    # a function defined in the loop: the model keeps the loop around it
    """
    model = DDP(net)
    for i, b in enumerate(loader):
        def micro():
            model(b).loss.backward()
            if (i + 1) % accum == 0 or last:
                opt.step()
        micro()
    """,
    # the micro-step loop over the accumulation count, the step after it (nanoGPT without the toggle)
    """
    def main(cfg):
        model = DDP(net)
        while True:
            for _ in range(cfg.train.grad_accum):
                model(X).loss.backward()
            opt.step()
    """,
    # Accelerate: unpacked, then taken out of a tuple, on self
    """
    class Runner:
        def setup(self):
            parts = self.accelerator.prepare(self.net, self.opt)
            self.model = parts[0]

        def run(self):
            for i, b in enumerate(self.loader):
                self.accelerator.backward(self.model(**b).loss)
                if i % self.accum == 0:
                    self.opt.step()
    """,
    """
    model, *rest = accelerator.prepare(net, opt, loader)
    for step, batch in enumerate(loader):
        loss = model(**batch).loss / accum
        accelerator.backward(loss)
        if step % accum == 0 or step == len(loader) - 1:
            opt.step()
    """,
]
# The check keeps these though the rule does not report them: it does not follow what it cannot tell.
KEPT_UNREPORTED = [
    # the sync control only in a helper: the rule looks there, the check does not
    """
    model = DDP(net)

    def backward(loss):
        with model.no_sync():
            loss.backward()

    for i, b in enumerate(loader):
        backward(model(b).loss)
        if (i + 1) % accum == 0:
            opt.step()
    """,
    # a flag with another value too (the rule wants every value to be an accumulation test)
    """
    model = DDP(net)
    flag = False
    for i, b in enumerate(loader):
        model(b).loss.backward()
        flag = (i + 1) % accum == 0
        if flag:
            opt.step()
    """,
]
# Like the corpus files that the prefilter and the gate send to libcst for TL501, where it reports nothing.
REJECTED = [
    # one backward per step (the DDP tutorials, ImageNet)
    """
    class Trainer:
        def __init__(self, model, gpu_id):
            self.model = DDP(model, device_ids=[gpu_id])

        def _run_batch(self, source, targets):
            self.optimizer.zero_grad()
            loss = F.cross_entropy(self.model(source), targets)
            loss.backward()
            self.optimizer.step()

        def _run_epoch(self, epoch):
            for source, targets in self.train_data:
                self._run_batch(source, targets)
    """,
    # synchronisation controlled: no_sync, require_backward_grad_sync, accumulate, sync_gradients
    """
    model = DDP(net)
    for i, b in enumerate(loader):
        ctx = model.no_sync() if (i + 1) % accum else nullcontext()
        with ctx:
            model(b).loss.backward()
        if (i + 1) % accum == 0:
            opt.step()
    """,
    """
    model = DDP(net)
    while True:
        for micro_step in range(gradient_accumulation_steps):
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            model(X, Y)[1].backward()
        opt.step()
    """,
    """
    model, opt = accelerator.prepare(model, opt)
    for b in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(b).loss)
            if accelerator.sync_gradients:
                opt.step()
    """,
    # Accelerate set up for DeepSpeed or FSDP, or a `prepare` of something else
    """
    from accelerate.utils import DeepSpeedPlugin
    model, opt = accelerator.prepare(model, opt)
    for i, b in enumerate(loader):
        accelerator.backward(model(b).loss)
        if i % accum == 0:
            opt.step()
    """,
    """
    model = processor.prepare(model)
    (other := accelerator.prepare(net))
    for i, b in enumerate(loader):
        model(b).loss.backward()
        other(b)
        if i % accum == 0:
            opt.step()
    """,
    # another library's DistributedDataParallel (apex, Megatron), a project's own class
    """
    from apex.parallel import DistributedDataParallel as ApexDDP
    from megatron.core.distributed import DistributedDataParallel
    class DistributedDataParallel2:
        pass
    model = ApexDDP(net)
    other = DistributedDataParallel(net)
    third = DistributedDataParallel2(net)
    for i, b in enumerate(loader):
        (model(b) + other(b) + third(b)).backward()
        if (i + 1) % accum == 0:
            opt.step()
    """,
    # the wrapped model not called where the backward runs, or not bound to a name
    """
    def setup(net):
        return DDP(net)

    def train(model):
        for i, b in enumerate(loader):
            model(b).loss.backward()
            if (i + 1) % accum == 0:
                opt.step()
    """,
    """
    model = DDP(net)
    def train(net):
        for i, b in enumerate(loader):
            net(b).loss.backward()
            if (i + 1) % accum == 0:
                opt.step()
    """,
    # parity, a string formatted, the backward under the same `if`, no loop, a step before the micro-steps
    """
    model = DDP(net)
    for i, b in enumerate(loader):
        model(b).loss.backward()
        if i % 2 == 0:
            opt.step()
        if "%d" % i == "3":
            opt.step()
    for i, b in enumerate(loader):
        if (i + 1) % accum == 0:
            model(b).loss.backward()
            opt.step()
    model(b).loss.backward()
    if (i + 1) % accum == 0:
        opt.step()
    """,
    """
    model = DDP(net)
    opt.step()
    for _ in range(grad_accum_steps):
        model(X).loss.backward()
    """,
    # a `for` over something else with the step after it; the step in another method
    """
    class T:
        def __init__(self, net):
            self.model = DDP(net)

        def fit(self):
            for b in self.loader:
                self.model(b).loss.backward()
            self.opt.step()

        def maybe_step(self, i):
            if i % self.accum == 0:
                self.opt.step()
    """,
]


def _text(code: str) -> str:
    return HEAD + textwrap.dedent(code)


def _reported(text: str) -> bool:
    return any(f.rule == "TL501" for f in lint_text(text, "x.py", OPTIONS).findings)


@pytest.mark.parametrize("code", REPORTED)
def test_a_reported_spelling_keeps_the_file(code: str) -> None:
    text = _text(code)
    assert _reported(text), "not a finding of the rule: the case tests nothing"
    assert check(ast.parse(text))


@pytest.mark.parametrize("code", KEPT_UNREPORTED)
def test_what_the_check_does_not_follow_keeps_the_file(code: str) -> None:
    text = _text(code)
    assert not _reported(text)
    assert check(ast.parse(text))


@pytest.mark.parametrize("code", REJECTED)
def test_a_file_without_such_a_loop_is_ruled_out(code: str) -> None:
    text = _text(code)
    assert not check(ast.parse(text))
    assert not pass_tree_checks([gates()["TL501"]], ast.parse(text))
    assert not _reported(text), "the check ruled out a file the rule reports"


def test_every_reported_text_passes_the_check_and_the_findings_do_not_change() -> None:
    extra = [_text(code) for code in REPORTED + KEPT_UNREPORTED + REJECTED]
    assert gate_check_keeps_findings("TL501", check, extra) >= len(REPORTED)


def test_the_check_does_not_load_libcst() -> None:
    tree = ast.parse(Path(gate_ddp_accumulation.__file__).read_text(encoding="utf-8"))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {
        "__future__",
        "ast",
        "collections.abc",
        "trainlint.model.gate_calls",
        "trainlint.model.gate_sharding_order",
        "trainlint.model.gate_zero_grad",
        "trainlint.model.pyast",
        "trainlint.model.summary",
        "trainlint.model.vocab",
    }
