"""TL303's condition on CPython's tree (``Rule.gate_check``): a ``zero_grad()`` on every iteration of a loop
whose optimizer steps only under an accumulation condition, with a backward on every iteration. Files with
no such loop never reach libcst for TL303, and no finding changes."""

from __future__ import annotations

import ast
import textwrap

import pytest
from conftest import gate_check_keeps_findings

from trainlint.engine import lint_text
from trainlint.gates import gates, pass_tree_checks
from trainlint.model.gate_zero_grad import zero_grad_may_run_every_microstep
from trainlint.results import LintOptions
from trainlint.rule import registry

RULE = registry().get("TL303")
OPTIONS = LintOptions(("TL303",), prefilter=False)

# Spellings of the invalid examples the rule reports: the check must keep each.
KEPT = [
    # the step's optimizer passed to a scaler, and the counter, under `self`
    """
    class T:
        def fit(self):
            for i, b in enumerate(self.loader):
                self.opt.zero_grad()
                self.scaler.scale(self.model(b)).backward()
                if (i + 1) % self.accum == 0:
                    self.scaler.step(self.opt)
                    self.scaler.update()
    """,
    # a flag through two names
    """
    for i, b in enumerate(loader):
        last = (i + 1) % accum == 0
        do_step = last
        optimizer.zero_grad()
        model(b).loss.backward()
        if do_step:
            optimizer.step()
    """,
    # a flag kept on self, in another method
    """
    class T:
        def prepare(self, i):
            self.update_now = i % self.accum == 0

        def fit(self):
            for i, b in enumerate(self.loader):
                self.optimizer.zero_grad()
                self.model(b).loss.backward()
                if self.update_now:
                    self.optimizer.step()
    """,
    # accelerate's flag without accumulate(), in a `while` loop and an `elif`
    """
    while True:
        b = next(it)
        optimizer.zero_grad()
        accelerator.backward(model(b).loss)
        if b is None:
            break
        elif accelerator.sync_gradients:
            optimizer.step()
    """,
    # the model the optimizer updates, both on self
    """
    import torch
    class T:
        def __init__(self):
            self.opt = torch.optim.SGD(self.net.parameters(), lr=0.1)

        def fit(self):
            for i, b in enumerate(self.loader):
                self.net.zero_grad()
                self.net(b).sum().backward()
                if not (i + 1) % self.accum:
                    self.opt.step()
    """,
    # a counter reset with `>=`, in an `async for`, inside a `try` body
    """
    async def train():
        n = 0
        async for b in loader:
            try:
                opt.zero_grad()
                model(b).loss.backward()
                n += 1
                if n >= accum:
                    n = 0
                    opt.step()
            finally:
                pass
    """,
    # a function defined in the loop: the model keeps the loop around it
    """
    for i, b in enumerate(loader):
        def micro():
            optimizer.zero_grad()
            model(b).loss.backward()
            if (i + 1) % accum == 0 or last:
                optimizer.step()
        micro()
    """,
    # Lightning manual optimization with a flag
    """
    class Net(LightningModule):
        def training_step(self, batch, batch_idx, *rest):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(self.loss(batch))
            if batch_idx % self.n == self.n - 1:
                opt.step()
    """,
]

# Files like those the prefilter and the gate send to libcst for TL303 today, where it reports nothing.
REJECTED = [
    # the step only skipped on parity, or a string formatted
    """
    for i, b in enumerate(loader):
        optimizer.zero_grad()
        model(b).loss.backward()
        if i % 2 == 0:
            optimizer.step()
        if "%d" % i == "3":
            print(i)
    """,
    # no loop: a hook that steps under a condition (Lightning's optimizer_step, a closure)
    """
    class Module:
        def optimizer_step(self, epoch, batch_idx, optimizer, closure=None):
            optimizer.zero_grad()
            closure().backward()
            if batch_idx % 2 == 1 or self.trainer.sync_gradients:
                optimizer.step()
    """,
    # training_step without batch_idx is no loop body
    """
    class Net(LightningModule):
        def training_step(self, batch):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(self.loss(batch))
            if self.global_step % self.accum == 0:
                opt.step()
    """,
    # zero_grad in a helper: the rule follows none
    """
    def clear():
        optimizer.zero_grad()

    for i, b in enumerate(loader):
        clear()
        model(b).loss.backward()
        if (i + 1) % accum == 0:
            optimizer.step()
    """,
    # zero_grad under a condition of its own, in a handler, or in an inner loop
    """
    for i, b in enumerate(loader):
        if reset:
            optimizer.zero_grad()
        try:
            model(b).loss.backward()
        except RuntimeError:
            optimizer.zero_grad()
        for p in params:
            optimizer.zero_grad()
        if (i + 1) % accum == 0:
            optimizer.step()
    """,
    # zero_grad inside accumulate() or no_sync()
    """
    for i, b in enumerate(loader):
        with model.no_sync():
            optimizer.zero_grad()
            model(b).loss.backward()
        if (i + 1) % accum == 0:
            optimizer.step()
    """,
    # the only backward runs with the step (a GAN generator), or none runs in the loop
    """
    for i, b in enumerate(loader):
        g_opt.zero_grad()
        if i % n_critic == 0:
            g_loss(b).backward()
            g_opt.step()
    for i, b in enumerate(loader):
        optimizer.zero_grad()
        if (i + 1) % accum == 0:
            optimizer.step()
    loss.backward()
    """,
    # another optimizer's zero_grad, or a model it does not update
    """
    import torch
    opt = torch.optim.AdamW(model.parameters())
    for i, b in enumerate(loader):
        d_opt.zero_grad()
        other.zero_grad()
        model(b).loss.backward()
        if (i + 1) % accum == 0:
            opt.step()
    """,
    # a flag that is no accumulation test; an `==` whose body resets nothing compared
    """
    for i, b in enumerate(loader):
        finite = torch.isfinite(loss)
        optimizer.zero_grad()
        model(b).loss.backward()
        if finite:
            optimizer.step()
        if epoch == last:
            count = 0
            optimizer.step()
    """,
    # a scheduler stepped on a modulo, the optimizer every iteration
    """
    for i, b in enumerate(loader):
        optimizer.zero_grad()
        model(b).loss.backward()
        optimizer.step()
        if i % log_every == 0:
            logger.step()
            scheduler.step(i)
    """,
]


def _reported(text: str) -> bool:
    return bool(lint_text(text, "x.py", OPTIONS).findings)


@pytest.mark.parametrize("code", [e.code for e in RULE.invalid] + KEPT)
def test_a_reported_loop_keeps_the_file(code: str) -> None:
    text = textwrap.dedent(code)
    assert _reported(text), "not a finding of TL303: the case tests nothing"
    assert zero_grad_may_run_every_microstep(ast.parse(text))


@pytest.mark.parametrize("code", [*RULE.valid, *REJECTED])
def test_a_file_without_such_a_loop_is_ruled_out(code: str) -> None:
    text = textwrap.dedent(code)
    assert not _reported(text)
    assert not zero_grad_may_run_every_microstep(ast.parse(text))


def test_the_engine_asks_the_check() -> None:
    text = textwrap.dedent(REJECTED[0])
    assert gates()["TL303"].check == "gate_zero_grad.zero_grad_may_run_every_microstep"
    assert not pass_tree_checks([gates()["TL303"]], ast.parse(text))
    assert pass_tree_checks([gates()["TL303"]], ast.parse(textwrap.dedent(KEPT[0])))


def test_every_reported_text_passes_the_check_and_the_findings_do_not_change() -> None:
    reported = gate_check_keeps_findings(
        "TL303", zero_grad_may_run_every_microstep, [textwrap.dedent(code) for code in KEPT + REJECTED]
    )
    assert reported >= len(RULE.invalid) + len(KEPT)
