"""TL102's, TL103's and TL107's conditions on CPython's tree (``Rule.gate_check``): a direct optimizer step
paired with a loss-scaled backward (TL102), a scaler update outside the accumulation condition its step is
under (TL103), a loss-scaled backward with bf16 autocast only (TL107). Files without one never reach
libcst for the rule, and no finding changes."""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Callable

import pytest
from conftest import gate_check_keeps_findings

from trainlint.engine import lint_text
from trainlint.gates import gates, pass_tree_checks
from trainlint.model.gate_scaler_steps import (
    scaled_backward_may_meet_bf16,
    step_may_bypass_scaler,
    update_may_run_every_microstep,
)
from trainlint.results import LintOptions

CHECKS: dict[str, Callable[[ast.Module], bool]] = {
    "TL102": step_may_bypass_scaler,
    "TL103": update_may_run_every_microstep,
    "TL107": scaled_backward_may_meet_bf16,
}

# -- TL102 ----------------------------------------------------------------------------------------------
KEPT_102 = [
    # the optimizer from an aliased module, the scaler a parameter
    """
    from torch import optim as O
    def f(amp_scaler, params, loss):
        o = O.AdamW(params)
        amp_scaler.scale(loss).backward()
        o.step()
    """,
    # an optimizer passed to `scaler.unscale_` only, the step in a nested `if` of a `while`
    """
    import torch
    scaler = torch.amp.GradScaler()
    while True:
        scaler.scale(loss).backward()
        scaler.unscale_(model_opt)
        if ready:
            model_opt.step()
    """,
    # the trainer whose scaler is only ever scaled (split over two methods)
    """
    import torch
    class T:
        def __init__(self):
            self.scaler = torch.amp.GradScaler()
        def backward(self, loss):
            self.scaler.scale(loss).backward()
        def optimizer_step(self):
            self.optimizer.step()
    """,
    # MS-AMP's optimizer, bound again afterwards: the last binding is another optimizer
    """
    import torch, msamp
    def train(model, optimizer):
        model, optimizer = msamp.initialize(model, optimizer)
        optimizer = torch.optim.SGD(model.parameters())
        scaler = torch.amp.GradScaler()
        scaler.scale(loss).backward()
        optimizer.step()
    """,
    # `msamp` itself bound in a second way: the callee is not surely MS-AMP's
    """
    import torch, msamp
    from other import msamp
    model, optimizer = msamp.initialize(model, optimizer)
    scaler = torch.amp.GradScaler()
    scaler.scale(loss).backward()
    optimizer.step()
    """,
    # a backward in an f-string: its order is unknown
    """
    import torch
    scaler = torch.amp.GradScaler()
    print(f"{scaler.scale(loss).backward()}")
    opt.step()
    """,
    # a plain backward in the other branch of the scaled one does not end the pairing
    """
    import torch
    scaler = torch.amp.GradScaler()
    if amp:
        scaler.scale(loss).backward()
    else:
        loss.backward()
    optimizer.step()
    """,
]
REJECTED_102 = [
    # nanoGPT: only the scaler steps
    """
    import torch
    scaler = torch.cuda.amp.GradScaler(enabled=(dtype == 'float16'))
    for it in range(n):
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    """,
    # minGPT's trainer: the direct step is the other branch
    """
    import torch
    class Trainer:
        def _run_batch(self, loss):
            if self.config.use_amp:
                self.scaler.scale(loss).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                loss.backward()
                self.optimizer.step()
    """,
    # Lightning's precision plugin: the scaled loss goes to another backward
    """
    class MixedPrecision:
        def backward(self, tensor, model):
            if self.scaler is not None:
                tensor = self.scaler.scale(tensor)
            super().backward(tensor, model)
        def optimizer_step(self, optimizer):
            step_output = self.scaler.step(optimizer)
            self.scaler.update()
    """,
    # Accelerate: the scaler is used elsewhere, so the split over methods does not apply
    """
    class Accelerator:
        def backward(self, loss):
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
        def step(self, optimizer):
            optimizer.step()
    """,
    # MS-AMP's optimizer (a tuple target; a plain one too)
    """
    import torch, msamp
    def train(model, optimizer, params):
        optimizer = torch.optim.AdamW(params)
        model, optimizer = msamp.initialize(model, optimizer, opt_level='O2')
        scaler = torch.amp.GradScaler()
        for b in loader:
            scaler.scale(loss).backward()
            optimizer.step()
    """,
    # a GAN: the generator's loss is not scaled
    """
    import torch
    scaler = torch.amp.GradScaler()
    scaler.scale(loss_d).backward()
    scaler.step(opt_d)
    scaler.update()
    loss_g.backward()
    opt_g.step()
    """,
    # the step comes first
    """
    import torch
    scaler = torch.amp.GradScaler()
    optimizer.step()
    scaler.scale(loss).backward()
    """,
    # two ifs on one flag
    """
    import torch
    scaler = torch.amp.GradScaler(enabled=amp)
    if amp:
        scaler.scale(loss).backward()
    else:
        loss.backward()
    if amp:
        scaler.step(optimizer)
    else:
        optimizer.step()
    """,
    # already stepped through the scaler
    """
    import torch
    scaler = torch.amp.GradScaler()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    optimizer.step()
    """,
    # no optimizer: a scheduler, an EMA
    """
    import torch
    scaler = torch.amp.GradScaler()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scheduler.step()
    ema.step()
    """,
    # a scaled backward on something that is no scaler by any sign
    """
    loss_scale.scale(loss).backward()
    optimizer.step()
    """,
]

# -- TL103 ----------------------------------------------------------------------------------------------
KEPT_103 = [
    # `while`, an `elif` branch, a counter that is reset with `>=`
    """
    import torch
    scaler = torch.amp.GradScaler()
    count = 0
    while True:
        scaler.scale(loss).backward()
        count += 1
        if debug:
            pass
        elif count >= accum:
            scaler.step(opt)
            count = 0
        scaler.update()
    """,
    # a flag through two names; the update under a flag that is not always a modulo
    """
    import torch
    scaler = torch.amp.GradScaler()
    for i, b in enumerate(loader):
        last = (i + 1) % accum == 0
        do_step = last
        scaler.scale(loss).backward()
        if do_step:
            scaler.step(opt)
        flag = (i + 1) % accum == 0
        flag = False
        if flag:
            pass
        scaler.update()
    """,
    # `async for`, the scaler a parameter
    """
    async def train(grad_scaler, opt):
        async for i, b in loader:
            grad_scaler.scale(loss).backward()
            if i % n == 0:
                grad_scaler.step(opt)
            grad_scaler.update()
    """,
    # a nested function inside the loop sees the loop as its own (the model's frames go on)
    """
    import torch
    scaler = torch.amp.GradScaler()
    for i, b in enumerate(loader):
        def micro():
            scaler.scale(loss).backward()
            if (i + 1) % accum == 0:
                scaler.step(opt)
            scaler.update()
    """,
]
REJECTED_103 = [
    # PyTorch's recipe
    """
    import torch
    scaler = torch.amp.GradScaler()
    for i, (x, y) in enumerate(data):
        scaler.scale(loss_fn(model(x), y) / n).backward()
        if (i + 1) % n == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    """,
    # a flag computed from a modulo, both under it
    """
    import torch
    scaler = torch.amp.GradScaler()
    for i, x in enumerate(data):
        sync = (i + 1) % accum == 0
        scaler.scale(loss).backward()
        if not sync:
            continue
        if sync:
            scaler.step(opt)
            scaler.update()
    """,
    # a trainer's flag in `self`, both under it
    """
    class T:
        def __init__(self):
            self.scaler = GradScaler()
        def fit(self, loader):
            for i, b in enumerate(loader):
                self.ready = i % self.accum == 0 or i == self.last
                self.scaler.scale(b).backward()
                if self.ready:
                    self.scaler.step(self.opt)
                    self.scaler.update()
    """,
    # a counter reset, both under it
    """
    import torch
    scaler = torch.amp.GradScaler()
    count = 0
    for x in data:
        scaler.scale(loss).backward()
        count += 1
        if count == accum:
            scaler.step(opt)
            scaler.update()
            count = 0
    """,
    # nanoGPT: no condition inside the loop
    """
    import torch
    scaler = torch.cuda.amp.GradScaler(enabled=(dtype == 'float16'))
    while True:
        for micro_step in range(accum):
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    """,
    # Lightning's plugin: no loop
    """
    class MixedPrecision:
        def optimizer_step(self, optimizer):
            if self.scaler.sync_gradients:
                step_output = self.scaler.step(optimizer)
            self.scaler.update()
    """,
    # parity is no accumulation; other receivers
    """
    import torch
    scaler = torch.amp.GradScaler()
    for i, x in enumerate(data):
        scaler.scale(loss).backward()
        if i % 2 == 0:
            scaler.step(opt)
        if (i + 1) % accum == 0:
            other.step(opt)
        scaler.update()
        pbar.update(1)
    """,
]

# -- TL107 ----------------------------------------------------------------------------------------------
KEPT_107 = [
    # autocast imported by name, bf16 through two names
    """
    from torch import autocast, bfloat16 as bf
    import torch
    DT = bf
    scaler = torch.amp.GradScaler()
    with autocast('cuda', dtype=DT):
        loss = model(x)
    scaler.scale(loss).backward()
    """,
    # an alias of the autocast function; the cpu device spelled with an escape
    """
    import torch
    ac = torch.autocast
    scaler = torch.amp.GradScaler()
    with ac('\\x63pu'):
        loss = model(x)
    scaler.scale(loss).backward()
    """,
    # the backward's scope has none: every autocast of the file counts
    """
    import torch
    class T:
        def forward_loss(self, x):
            with torch.cpu.amp.autocast():
                return self.model(x)
        def step(self, x, s: torch.amp.GradScaler):
            s.scale(self.forward_loss(x)).backward()
    """,
    # `torch` bound twice: no autocast call is sure to be one (the rule finds none here)
    """
    import torch
    def f(torch):
        scaler = torch.amp.GradScaler()
        with torch.autocast('cuda', dtype=torch.bfloat16):
            loss = model(x)
        with torch.autocast('cuda', dtype=torch.float16):
            loss = model(x)
        scaler.scale(loss).backward()
    """,
    # the disabled scaler is assigned in another scope
    """
    import torch
    scaler = torch.amp.GradScaler(enabled=False)
    def f(scaler):
        with torch.autocast('cuda', dtype=torch.bfloat16):
            loss = model(x)
        scaler.scale(loss).backward()
    """,
]
REJECTED_107 = [
    # fp16 and bf16 in one function
    """
    import torch
    def f():
        scaler = torch.amp.GradScaler()
        with torch.autocast('cuda', dtype=torch.bfloat16):
            a = enc(x)
        with torch.autocast('cuda', dtype=torch.float16):
            loss = dec(a)
        scaler.scale(loss).backward()
    """,
    # the default cuda autocast is fp16, also when the backward's scope has none
    """
    import torch
    from torch.cuda.amp import autocast
    def fwd(x):
        with autocast():
            return model(x)
    def bwd(scaler, x):
        scaler.scale(fwd(x)).backward()
    with torch.autocast('cpu'):
        pass
    """,
    # nanoGPT: a scaler enabled only for fp16, the dtype from a table
    """
    import torch
    ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16}[dtype]
    ctx = torch.amp.autocast(device_type=device_type, dtype=ptdtype)
    scaler = torch.cuda.amp.GradScaler(enabled=(dtype == 'float16'))
    with torch.autocast('cuda', dtype=torch.bfloat16):
        loss = model(x)
    scaler.scale(loss).backward()
    """,
    # a trainer's scaler built disabled
    """
    import torch
    class T:
        def __init__(self):
            self.scaler = torch.amp.GradScaler(enabled=self.fp16)
        def step(self, x):
            with torch.autocast('cuda', dtype=torch.bfloat16):
                loss = self.model(x)
            self.scaler.scale(loss).backward()
    """,
    # the dtype is configurable
    """
    import torch
    dtype = torch.bfloat16 if bf16 else torch.float16
    scaler = torch.amp.GradScaler()
    with torch.autocast('cuda', dtype=dtype):
        loss = model(x)
    scaler.scale(loss).backward()
    """,
    # a scaled loss handed on: no scaled backward
    """
    import torch
    scaler = torch.amp.GradScaler()
    with torch.autocast('cuda', dtype=torch.bfloat16):
        loss = scaler.scale(model(x))
    loss.backward()
    """,
]

CASES = [
    ("TL102", KEPT_102, REJECTED_102),
    ("TL103", KEPT_103, REJECTED_103),
    ("TL107", KEPT_107, REJECTED_107),
]


def _text(code: str) -> str:
    return textwrap.dedent(code).lstrip("\n")


@pytest.mark.parametrize(
    ("rule_id", "code"), [(rule_id, code) for rule_id, kept, _ in CASES for code in kept]
)
def test_a_file_that_may_hold_the_finding_is_kept(rule_id: str, code: str) -> None:
    assert CHECKS[rule_id](ast.parse(_text(code)))


@pytest.mark.parametrize(
    ("rule_id", "code"), [(rule_id, code) for rule_id, _, rejected in CASES for code in rejected]
)
def test_a_file_that_cannot_hold_it_is_ruled_out(rule_id: str, code: str) -> None:
    text = _text(code)
    assert not CHECKS[rule_id](ast.parse(text))
    assert not pass_tree_checks([gates()[rule_id]], ast.parse(text))
    off = lint_text(text, "x.py", LintOptions((rule_id,), prefilter=False))
    assert not off.findings, "the check ruled out a file the rule reports"


def test_the_rules_own_valid_examples_are_ruled_out() -> None:
    """Each valid example is a file the rule sends to libcst today for nothing."""
    from trainlint.rule import registry

    for rule_id, check in CHECKS.items():
        for text in registry().get(rule_id).valid:
            assert not check(ast.parse(text)), (rule_id, text)


@pytest.mark.parametrize("rule_id", sorted(CHECKS))
def test_every_reported_text_passes_the_check_and_the_findings_do_not_change(rule_id: str) -> None:
    extra = [_text(code) for _, kept, rejected in CASES for code in kept + rejected]
    reported = gate_check_keeps_findings(rule_id, CHECKS[rule_id], extra)
    assert reported > 0
