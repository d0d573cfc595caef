"""TL106's and TL109's conditions on CPython's tree (``Rule.gate_check``): a backward inside an autocast
region, and, for TL109, one whose loss comes from an fp16 region in a file with no loss scaling. Files
without one never reach libcst for these rules, and no finding changes."""

from __future__ import annotations

import ast
import textwrap

import pytest
from conftest import gate_check_keeps_findings

from trainlint.engine import lint_text
from trainlint.gates import gates, pass_tree_checks
from trainlint.model.gate_autocast_backward import backward_may_run_in_autocast, fp16_backward_may_lack_scaler
from trainlint.results import LintOptions

CHECKS = {"TL106": backward_may_run_in_autocast, "TL109": fp16_backward_may_lack_scaler}

# Spellings of the rules' invalid examples: each rule reports each, and its check must keep it.
KEPT_BOTH = [
    # an alias of the function, and of its module
    """
    from torch import autocast as ac
    with ac("cuda"):
        loss = model(x)
        loss.backward()
    """,
    """
    import torch
    amp = torch.cuda.amp
    with amp.autocast():
        loss = model(x)
        loss.backward()
    """,
    """
    import torch.cuda.amp as mp
    cast = mp.autocast
    other = cast
    with other():
        loss = model(x)
        loss.backward()
    """,
    # a context kept on self in another method, picked by a conditional
    """
    import torch
    from contextlib import nullcontext
    class T:
        def __init__(self, amp):
            self.ctx = torch.autocast("cuda") if amp else nullcontext()
        def step(self, x):
            with self.ctx:
                loss = self.model(x)
                loss.backward()
    """,
    # a conditional written in the `with`, and a one-line `with`
    """
    import torch
    with (torch.autocast("cuda") if amp else nullcontext()):
        loss = model(x)
        loss.backward()
    with torch.autocast("cuda"): loss.backward()
    """,
    # a nested function and a comprehension in the region: the model's frames stay
    """
    import torch
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x)
        def go():
            loss.backward()
    """,
    """
    import torch
    with torch.autocast("cuda", dtype=torch.float16):
        losses = model(x)
        [l.backward() for l in losses]
    """,
    # async, and a method decorated with autocast, nested function inside it
    """
    import torch
    async def f():
        async with torch.amp.autocast("cuda"):
            loss = model(x)
            loss.backward()
    class T:
        @torch.autocast(device_type="cuda")
        def step(self, x):
            loss = self.model(x)
            def inner():
                loss.backward()
            inner()
    """,
    # a context bound by a walrus; the dtype through names
    """
    import torch
    from torch import float16 as f16
    half = f16
    if (ctx := torch.autocast("cuda", dtype=half)) is not None:
        pass
    with ctx:
        loss = model(x)
        loss.backward()
    """,
    # the positional dtype
    """
    import torch
    with torch.autocast("cpu", torch.float16):
        loss = model(x)
        loss.backward()
    """,
]
# TL109 only: the loss computed in the region, the backward after it.
KEPT_TL109 = [
    """
    import torch
    def step(x):
        with torch.autocast("cuda"):
            out = model(x)
        out.loss.backward()
    """,
    """
    import torch
    with torch.cuda.amp.autocast(enabled=flag):
        logits, (aux, loss) = model(x)
    torch.autograd.grad(loss, p)
    (loss + aux).backward()
    """,
    # `None` is a name to libcst: `x[None]` binds it, the receiver holds it
    """
    import torch
    with torch.autocast("cuda"):
        losses[None] = model(x)
    (total or None).backward()
    """,
    # an annotated assignment, in a lambda-free class method with a decorated outer function
    """
    import torch
    @torch.autocast("cuda")
    def forward(x):
        loss: torch.Tensor = model(x)
        return loss
    def train(x):
        loss = forward(x)
        loss.backward()
    @torch.autocast("cuda")
    def both(x):
        loss: torch.Tensor = model(x)
        def later():
            pass
        loss.mean().backward()
    """,
]
KEPT_TL106 = [
    # a scaled backward (a scaler's name) in a bf16 region, and torch.autograd.backward
    """
    import torch
    grad_scaler = torch.amp.GradScaler()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x)
        grad_scaler.scale(loss).backward()
    with torch.autocast("cpu"):
        torch.autograd.backward(loss)
    """,
    # accelerate imported: TL106 still reports a backward in torch's region
    """
    import torch
    import accelerate
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x)
        loss.backward()
    """,
]

# Files like those the prefilter and the gate send to libcst today, where the rule reports nothing.
REJECTED_BOTH = [
    # another library's autocast, and the user's own (accelerate, Lightning, Fabric)
    """
    import torch
    class Accelerator:
        def autocast(self):
            return torch.autocast("cuda")
        def backward(self, loss):
            loss.backward()
        def train(self, x):
            with self.autocast():
                loss = self.model(x)
            with self.precision.forward_context():
                self.backward(loss)
                loss.backward()
    """,
    # a region written `enabled=False`
    """
    import torch
    with torch.autocast("cuda", enabled=False):
        loss = model(x)
        loss.backward()
    """,
    # the autocast in a `with` item, a lambda in a decorated function, or a class in one
    """
    import torch
    with torch.autocast("cuda"), guard(loss.backward()):
        pass
    @torch.autocast("cuda")
    def f(x):
        g = lambda: x.backward()
        class C:
            def h(self):
                x.backward()
    """,
    # a user function called autocast, and a name assigned from a call
    """
    import torch
    def autocast():
        return nullcontext()
    ctx = make_context()
    with autocast(), ctx:
        loss = model(x)
        loss.backward()
    """,
    # a decorator that is not a call, and a `with` of a dotted name that is not `self.x`
    """
    import torch
    amp_ctx = torch.autocast("cuda")
    @amp_ctx
    def step(x):
        x.backward()
    with cfg.ctx:
        x.backward()
    """,
]
# TL106 only: the backward after the region (TL109's finding when the loss comes from an fp16 one).
REJECTED_TL106 = [
    """
    import torch
    from torch.cuda.amp import autocast
    with autocast():
        loss = model(x)
    loss.backward()
    """,
]
REJECTED_TL109 = [
    # a scaler (any identifier naming one), or a framework that scales
    """
    import torch
    def step(x, loss_scaler):
        with torch.autocast("cuda"):
            loss = model(x)
        loss.backward()
    """,
    """
    import torch
    def step(x):
        with torch.autocast("cuda"):
            loss = model(x)
        loss.backward()
        log(self.grad_scaler)
    """,
    """
    import torch
    with torch.autocast("cuda"):
        loss = model(x)
    loss.backward()
    amp_scaler.update()
    """,
    """
    import torch
    from lightning.fabric import Fabric
    with torch.autocast("cuda"):
        loss = model(x)
    loss.backward()
    """,
    """
    import torch
    def f():
        import deepspeed.comm
    with torch.autocast("cuda"):
        loss = model(x)
    loss.backward()
    """,
    # bf16, cpu, an unknown device or dtype
    """
    import torch
    from torch import bfloat16
    dt = torch.bfloat16
    with torch.autocast("cuda", dtype=torch.bfloat16):
        a = model(x)
        a.backward()
    with torch.autocast("cuda", dtype=dt):
        b = model(x)
    b.backward()
    with torch.autocast("cuda", bfloat16):
        c = model(x)
    c.backward()
    with torch.cpu.amp.autocast():
        d = model(x)
    d.backward()
    with torch.autocast(device_type=device, dtype=ptdtype):
        e = model(x)
    e.backward()
    with torch.autocast("cuda", dtype=dtypes["fp16"]):
        f = model(x)
    f.backward()
    """,
    # the backward's names bound elsewhere: another scope, after it, or other names
    """
    import torch
    def a(x):
        with torch.autocast("cuda"):
            loss = model(x)
    def b(loss):
        loss.backward()
    def c(x):
        loss.backward()
        with torch.autocast("cuda"):
            loss = model(x)
    with torch.autocast("cuda"):
        feats = model(x)
    loss2.backward()
    """,
]


def _reports(rule_id: str, text: str) -> bool:
    found = lint_text(text, "x.py", LintOptions((rule_id,), prefilter=False)).findings
    return any(f.rule == rule_id for f in found)


KEPT = [(r, c) for c in KEPT_BOTH for r in CHECKS] + [("TL109", c) for c in KEPT_TL109]
KEPT += [("TL106", c) for c in KEPT_TL106]
REJECTED = [(r, c) for c in REJECTED_BOTH for r in CHECKS] + [("TL109", c) for c in REJECTED_TL109]
REJECTED += [("TL106", c) for c in REJECTED_TL106]


@pytest.mark.parametrize(("rule_id", "code"), KEPT)
def test_a_reported_backward_keeps_the_file(rule_id: str, code: str) -> None:
    text = textwrap.dedent(code)
    assert _reports(rule_id, text), "not a finding of the rule: the case tests nothing"
    assert CHECKS[rule_id](ast.parse(text))


@pytest.mark.parametrize(("rule_id", "code"), REJECTED)
def test_a_file_without_such_a_backward_is_ruled_out(rule_id: str, code: str) -> None:
    text = textwrap.dedent(code)
    assert not CHECKS[rule_id](ast.parse(text))
    assert not pass_tree_checks([gates()[rule_id]], ast.parse(text))
    assert not _reports(rule_id, text), "the check ruled out a file the rule reports"


@pytest.mark.parametrize("rule_id", sorted(CHECKS))
def test_every_reported_text_passes_the_check_and_the_findings_do_not_change(rule_id: str) -> None:
    cases = KEPT_BOTH + KEPT_TL109 + KEPT_TL106 + REJECTED_BOTH + REJECTED_TL106 + REJECTED_TL109
    extra = [textwrap.dedent(c) for c in cases]
    gate_check_keeps_findings(rule_id, CHECKS[rule_id], extra)


def test_each_rule_names_its_check() -> None:
    assert gates()["TL106"].check == "gate_autocast_backward.backward_may_run_in_autocast"
    assert gates()["TL109"].check == "gate_autocast_backward.fp16_backward_may_lack_scaler"
