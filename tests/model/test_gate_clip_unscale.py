"""TL101's, TL104's and TL108's conditions on CPython's tree (``Rule.gate_check``): a clip between a scaled
backward and the scaler's step with no unscale in between (TL101), an unscale that may repeat before the
update (TL104), a clip after a backward and the step that follows it (TL108). Files without one never
reach libcst for that rule, and no finding changes."""

from __future__ import annotations

import ast
import textwrap

import pytest
from conftest import gate_check_keeps_findings

from trainlint.engine import lint_text
from trainlint.gates import code_facts, gates, pass_tree_checks, raw_answers
from trainlint.model.gate_clip_unscale import (
    clip_may_follow_step,
    clip_may_precede_unscale,
    unscale_may_repeat,
)
from trainlint.results import LintOptions

CHECKS = {"TL101": clip_may_precede_unscale, "TL104": unscale_may_repeat, "TL108": clip_may_follow_step}

# Spellings of the rules' invalid examples: the rule reports each, and its check must keep it.
KEPT = {
    "TL101": [
        # the clip through an alias of its module; a scaler parameter by its name
        """
        import torch
        U = torch.nn.utils
        def train_step(model, opt, grad_scaler, loss):
            grad_scaler.scale(loss).backward()
            U.clip_grad_norm_(model.parameters(), 1.0)
            grad_scaler.step(opt)
            grad_scaler.update()
        """,
        # the clip function bound to a name; a parameter annotated GradScaler
        """
        import torch
        c = torch.nn.utils.clip_grad_value_
        def step(s: torch.amp.GradScaler, opt, loss):
            s.scale(loss).backward()
            c(params, 0.5)
            s.step(opt)
            s.update()
        """,
        # the scaled backward in another method of the class, never unscaled
        """
        import torch
        class T:
            def __init__(self):
                self.scaler = torch.amp.GradScaler()
            def backward(self, loss):
                self.scaler.scale(loss).backward()
            def step(self):
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                self.scaler.step(self.opt)
                self.scaler.update()
        """,
        # an unscale_ before the scaled backward does not cover the clip; async, a comprehension
        """
        import torch
        from torch.amp import GradScaler as GS
        scaler = GS() if amp else None
        async def train(loader, opt):
            async for x in loader:
                scaler.unscale_(opt)
                scaler.scale(model(x)).backward()
                [torch.nn.utils.clip_grad_norm_(g, 1.0) for g in groups]
                scaler.step(opt)
                scaler.update()
        """,
        # FSDP's scaler, the module path torch.nn.utils.clip_grad
        """
        import torch.nn.utils.clip_grad as cg
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        sc = ShardedGradScaler()
        while True:
            sc.scale(loss).backward()
            cg.clip_grad_norm_(params, 1.0)
            sc.step(opt)
            sc.update()
        """,
    ],
    "TL104": [
        # through a method of the class (self.name)
        """
        import torch
        class T:
            def __init__(self):
                self.scaler = torch.amp.GradScaler()
            def _unscale(self):
                self.scaler.unscale_(self.optimizer)
            def step(self, loss):
                self.scaler.scale(loss).backward()
                self._unscale()
                self.scaler.unscale_(self.optimizer)
                self.scaler.step(self.optimizer)
                self.scaler.update()
        """,
        # every micro-step of a `while` loop, the update under a modulo
        """
        import torch
        scaler = torch.amp.GradScaler()
        step = 0
        while True:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            step += 1
            if step % accum == 0:
                scaler.step(opt)
                scaler.update()
        """,
        # the update under a flag assigned a modulo, in a nested function's loop
        """
        import torch
        def train(data, opt):
            scaler = torch.cuda.amp.GradScaler()
            def loop():
                for i, x in enumerate(data):
                    scaler.scale(model(x)).backward()
                    scaler.unscale_(opt)
                    do_step = (i + 1) % accum == 0
                    if do_step:
                        scaler.step(opt)
                        scaler.update()
            loop()
        """,
        # a counter reset
        """
        import torch
        scaler = torch.amp.GradScaler()
        count = 0
        for x in data:
            scaler.scale(model(x)).backward()
            scaler.unscale_(opt)
            count += 1
            if count == accum:
                count = 0
                scaler.step(opt)
                scaler.update()
        """,
        # twice in an `async for`, keyword and positional optimizer
        """
        async def step(grad_scaler, opt, loader):
            async for loss in loader:
                grad_scaler.scale(loss).backward()
                grad_scaler.unscale_(optimizer=opt)
                grad_scaler.unscale_(opt)
                grad_scaler.step(opt)
                grad_scaler.update()
        """,
    ],
    "TL108": [
        # an alias import; an optimizer by its name
        """
        from torch.nn.utils import clip_grad_value_ as cv
        def step(loss, opt_g, params):
            loss.backward()
            opt_g.step()
            cv(params, 0.5)
        """,
        # an optimizer by construction on self; a framework's backward
        """
        import torch
        class T:
            def __init__(self):
                self.o = torch.optim.AdamW(self.model.parameters())
            def train(self, fabric, loss):
                fabric.backward(loss)
                self.o.step()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        """,
        # a scaler step in a `while` loop, the clip under the step's condition
        """
        import torch
        scaler = torch.amp.GradScaler()
        while True:
            scaler.scale(loss).backward()
            if ready:
                scaler.step(opt)
                if clip:
                    torch.nn.utils.clip_grad_norm_(params, 1.0)
                scaler.update()
        """,
        # the clip function bound to a name in a nested function
        """
        import torch
        def outer():
            clip = torch.nn.utils.clip_grad_norm_
            def inner(loss, optimizer):
                loss.backward()
                optimizer.step()
                clip(params, 1.0)
            return inner
        """,
    ],
}

# Files like those the prefilter and the gate send to libcst today, where the rule reports nothing.
REJECTED = {
    "TL101": [
        # a precision plugin: the clip, the backward and the step in different methods, no scaled backward
        """
        import torch
        class Precision:
            def pre_backward(self, tensor):
                return self.scaler.scale(tensor)
            def backward(self, tensor, model):
                model.backward(tensor)
            def optimizer_step(self, optimizer, closure):
                return optimizer.step(closure=closure)
            def clip_grad_by_norm(self, optimizer, clip_val):
                torch.nn.utils.clip_grad_norm_(self.params(optimizer), clip_val)
        """,
        # nanoGPT: unscale_ before the clip, both under the same condition
        """
        import torch
        scaler = torch.cuda.amp.GradScaler(enabled=(dtype == 'float16'))
        while True:
            for micro_step in range(gradient_accumulation_steps):
                loss = model(X, Y)
                scaler.scale(loss).backward()
            if grad_clip != 0.0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        """,
        # an fp32 loop (the optimizer is no scaler), and the amp loop unscaled; a clip after the step
        """
        import torch
        from torch import nn
        def train(agent, optimizer, loss):
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
            optimizer.step()
        def train_amp(agent, optimizer, loss, scaler):
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
            scaler.step(optimizer)
            scaler.update()
            torch.nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
        """,
        # accelerate's own clip, and a clip before the scaled backward of its scope
        """
        import torch
        def train(accelerator, scaler, optimizer, loss):
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        """,
        # the scaled backward elsewhere, but its scaler is unscaled in the file
        """
        import torch
        class T:
            def __init__(self):
                self.scaler = torch.amp.GradScaler()
            def backward(self, loss):
                self.scaler.scale(loss).backward()
                self.scaler.unscale_(self.opt)
            def step(self):
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                self.scaler.step(self.opt)
                self.scaler.update()
        """,
    ],
    "TL104": [
        # accelerate: one unscale_ per optimizer of a loop, the update in another method
        """
        class Accelerator:
            def unscale_gradients(self, optimizer=None):
                for opt in optimizer:
                    self.scaler.unscale_(opt)
            def clip_grad_norm_(self, parameters, max_norm):
                self.unscale_gradients()
                return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
            def step(self):
                self.scaler.scale(loss).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()
        """,
        # nanoGPT: in the loop under a condition, with the update on every iteration
        """
        import torch
        scaler = torch.cuda.amp.GradScaler(enabled=(dtype == 'float16'))
        while True:
            for micro_step in range(gradient_accumulation_steps):
                scaler.scale(model(X, Y)).backward()
            if grad_clip != 0.0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            scaler.step(optimizer)
            scaler.update()
        """,
        # Lightning: one unscale_ per call, the update after it
        """
        import torch
        class MixedPrecision:
            def __init__(self, scaler=None):
                self.scaler = scaler or torch.amp.GradScaler()
            def pre_backward(self, tensor):
                return self.scaler.scale(tensor)
            def optimizer_step(self, optimizer, closure):
                closure()
                self.scaler.unscale_(optimizer)
                step_output = self.scaler.step(optimizer)
                self.scaler.update()
                return step_output
            def unscale_gradients(self, optimizer):
                self.scaler.unscale_(optimizer)
        """,
        # the update between the two; two optimizers; a helper that updates too
        """
        import torch
        scaler = torch.amp.GradScaler()
        def helper(opt):
            scaler.unscale_(opt)
            scaler.update()
        def train(opt, opt2):
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.unscale_(opt2)
            scaler.step(opt)
            scaler.update()
            helper(opt)
            scaler.unscale_(opt)
        """,
        # DummyGradScaler-like: `self` is no scaler
        """
        class DummyGradScaler:
            def scale(self, loss):
                return loss
            def step(self, optimizer):
                self.unscale_(optimizer)
                self.unscale_(optimizer)
        """,
    ],
    "TL108": [
        # word_language_model: the clip between the backward and the step
        """
        import torch
        def train():
            for batch, i in enumerate(range(0, n, bptt)):
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                if opt:
                    optimizer.step()
                else:
                    for p in model.parameters():
                        p.data.add_(p.grad, alpha=-lr)
        """,
        # an environment's and a scheduler's step between the backward and the clip
        """
        import torch
        def rollout(env, scheduler, action, loss):
            loss.backward()
            obs = env.step(action)
            scheduler.step()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        """,
        # the step under a condition the clip does not have, or in a loop it is not in
        """
        import torch
        def a(loss, optimizer):
            loss.backward()
            if ready:
                optimizer.step()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        def b(loss, optimizer):
            loss.backward()
            for _ in range(2):
                optimizer.step()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        """,
        # a GAN: the clip followed by the other optimizer's step; the clip in another method
        """
        import torch
        class Trainer:
            def step(self, loss_d, loss_g):
                loss_d.backward()
                self.opt_d.step()
                torch.nn.utils.clip_grad_norm_(self.gen.parameters(), 1.0)
                self.opt_g.step()
            def clip(self):
                torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        """,
        # accelerate's own clip
        """
        from accelerate.utils import set_seed
        def train(accelerator, optimizer, loss):
            accelerator.backward(loss)
            optimizer.step()
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        """,
    ],
}


def _reports(rule_id: str, text: str) -> bool:
    found = lint_text(text, "x.py", LintOptions((rule_id,), prefilter=False)).findings
    return any(f.rule == rule_id for f in found)


def _cases(table: dict[str, list[str]]) -> list[tuple[str, str]]:
    return [(rule_id, code) for rule_id, codes in table.items() for code in codes]


@pytest.mark.parametrize(("rule_id", "code"), _cases(KEPT))
def test_a_reported_file_is_kept(rule_id: str, code: str) -> None:
    text = textwrap.dedent(code)
    assert _reports(rule_id, text), "not a finding of the rule: the case tests nothing"
    assert CHECKS[rule_id](ast.parse(text))


@pytest.mark.parametrize(("rule_id", "code"), _cases(REJECTED))
def test_a_file_without_the_finding_is_ruled_out(rule_id: str, code: str) -> None:
    text = textwrap.dedent(code)
    tree = ast.parse(text)
    gate = gates()[rule_id]
    sent_today = raw_answers(text).can_fire(gate, text) and gate.in_code(code_facts(tree).text)
    assert sent_today, "the prefilter or the gate rules it out already: the case tests nothing"
    assert not CHECKS[rule_id](tree)
    assert not pass_tree_checks([gates()[rule_id]], tree)
    assert not _reports(rule_id, text), "the check ruled out a file the rule reports"


@pytest.mark.parametrize("rule_id", sorted(CHECKS))
def test_every_reported_text_passes_the_check_and_the_findings_do_not_change(rule_id: str) -> None:
    extra = [textwrap.dedent(c) for table in (KEPT, REJECTED) for codes in table.values() for c in codes]
    gate_check_keeps_findings(rule_id, CHECKS[rule_id], extra)


def test_the_checks_of_one_tree_share_a_walk_and_never_mix_trees() -> None:
    kept = ast.parse(textwrap.dedent(KEPT["TL108"][0]))
    rejected = ast.parse(textwrap.dedent(REJECTED["TL108"][1]))
    for _ in range(2):
        assert clip_may_follow_step(kept)
        assert not clip_may_follow_step(rejected)


def test_each_rule_names_its_check() -> None:
    assert gates()["TL101"].check == "gate_clip_unscale.clip_may_precede_unscale"
    assert gates()["TL104"].check == "gate_clip_unscale.unscale_may_repeat"
    assert gates()["TL108"].check == "gate_clip_unscale.clip_may_follow_step"
