"""The runtime check (``--verify``) for the loss-scaling rules of the catalog: TL102, TL103 and TL104.

As in ``test_verify.py``, every snippet is linted and all findings are verified in one batch (one child
process; the two data-parallel ranks are started once). Expected values follow from the mechanism of
each hazard: a direct step applies gradients multiplied by the loss scale, ``update()`` without a
recorded step raises, a DDP backward outside ``no_sync`` all-reduces once per bucket, and so on.
"""

from __future__ import annotations

import pytest
from conftest import Snippets, planted_mistakes

from trainlint.rule import Applicability
from trainlint.verify import torch_available

pytestmark = pytest.mark.skipif(not torch_available(), reason="--verify needs torch")

VERIFY_RULES = ("TL102", "TL103", "TL104")


SNIPPETS = Snippets()
snippet = SNIPPETS.add


# TL102 ---------------------------------------------------------------------------------------------
snippet(
    "tl102_accumulation_with_update",
    "TL102",
    """
    import torch
    from torch import nn


    def train(model, loader, accum=4):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = torch.amp.GradScaler("cuda")
        for i, (x, y) in enumerate(loader):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x), y) / accum
            scaler.scale(loss).backward()
            if (i + 1) % accum == 0:
                opt.step()
                scaler.update()
                opt.zero_grad()
    """,
)
snippet(
    "tl102_trainer_method",
    "TL102",
    """
    import torch


    class Trainer:
        def __init__(self, model):
            self.model = model
            self.scaler = torch.cuda.amp.GradScaler()
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.01)

        def train_step(self, batch):
            self.optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = self.model(**batch)
            self.scaler.scale(out.loss).backward()
            self.optimizer.step()
            self.scaler.update()
            return out.loss.item()
    """,
)
snippet(
    "tl102_sgd_scaled_gradients",
    "TL102",
    """
    import torch
    import torch.nn.functional as F


    def fit(model, data):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler()
        for x, y in data:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            opt.step()
            opt.zero_grad()
    """,
)
snippet(
    "tl102_unscaled_but_not_skipped",
    "TL102",
    """
    def train_step(scaler, optimizer, loss):
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        optimizer.step()
        scaler.update()
    """,
)
snippet(
    "tl102_loss_in_both_branches",
    "TL102",
    """
    import torch
    import torch.nn.functional as F


    def train(model, loader, use_amp=True):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler(enabled=use_amp)
        for x, y in loader:
            if use_amp:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = F.mse_loss(model(x), y)
            else:
                loss = F.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            optimizer.step()
            optimizer.zero_grad()
    """,
)
snippet(
    "tl102_scaler_disabled",
    "TL102",
    """
    import torch
    from torch import nn

    use_amp = False


    def train(model, loader):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.cuda.amp.GradScaler(enabled=use_amp)
        for x, y in loader:
            with torch.autocast("cuda", enabled=use_amp):
                loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            optimizer.step()
            scaler.update()
            optimizer.zero_grad()
    """,
)
snippet(
    "tl102_unbindable",
    "TL102",
    """
    import torch


    def train(model, loader):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler()
        for x, y in loader:
            loss = model(x, y)
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), max_grad_value)
            optimizer.step()
            optimizer.zero_grad()
    """,
)

# TL103 ---------------------------------------------------------------------------------------------
snippet(
    "tl103_counter_reset",
    "TL103",
    """
    import torch

    ACCUM = 8


    def train(model, data):
        scaler = torch.amp.GradScaler()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        count = 0
        for x in data:
            scaler.scale(model(x).mean()).backward()
            count += 1
            if count == ACCUM:
                scaler.step(opt)
                opt.zero_grad()
                count = 0
            scaler.update()
    """,
)
snippet(
    "tl103_hf_loss",
    "TL103",
    """
    import torch


    def train(model, loader, optimizer, accum_steps=4):
        scaler = torch.amp.GradScaler()
        for step, batch in enumerate(loader):
            loss = model(**batch).loss / accum_steps
            scaler.scale(loss).backward()
            if (step + 1) % accum_steps == 0:
                scaler.step(optimizer)
                optimizer.zero_grad()
            scaler.update()
    """,
)
snippet(
    "tl103_amp_off_by_default",
    "TL103",
    """
    import argparse

    import torch


    def train(args, model, loader, optimizer):
        scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
        for step, batch in enumerate(loader):
            with torch.autocast("cuda", enabled=args.amp):
                loss = model(**batch).loss / args.grad_accum
            scaler.scale(loss).backward()
            if (step + 1) % args.grad_accum == 0:
                scaler.step(optimizer)
                optimizer.zero_grad()
            scaler.update()


    if __name__ == "__main__":
        parser = argparse.ArgumentParser()
        parser.add_argument("--amp", action="store_true")
        parser.add_argument("--grad-accum", type=int, default=4)
        train(parser.parse_args(), None, None, None)
    """,
)
snippet(
    "tl103_unbindable",
    "TL103",
    """
    import torch

    from .utils import clip_gradients


    def train(model, loader, optimizer, accum_steps=4):
        scaler = torch.amp.GradScaler()
        for step, batch in enumerate(loader):
            scaler.scale(model(**batch).loss / accum_steps).backward()
            if (step + 1) % accum_steps == 0:
                scaler.unscale_(optimizer)
                clip_gradients(model, 1.0)
                scaler.step(optimizer)
                optimizer.zero_grad()
            scaler.update()
    """,
)

# TL104 ---------------------------------------------------------------------------------------------
snippet(
    "tl104_helper_unscales",
    "TL104",
    """
    import torch

    scaler = torch.amp.GradScaler()


    def clip_grads(model, opt):
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


    def train_step(model, loss, opt):
        scaler.scale(loss).backward()
        clip_grads(model, opt)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    """,
)
snippet(
    "tl104_every_micro_step",
    "TL104",
    """
    import torch


    def train(model, data, opt, accum=4):
        amp_scaler = torch.amp.GradScaler()
        for i, (x, y) in enumerate(data):
            loss = torch.nn.functional.mse_loss(model(x), y) / accum
            amp_scaler.scale(loss).backward()
            amp_scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if (i + 1) % accum == 0:
                amp_scaler.step(opt)
                amp_scaler.update()
                opt.zero_grad()
    """,
)
snippet(
    "tl104_scaler_disabled",
    "TL104",
    """
    import torch


    def train(model, data, opt):
        s = torch.amp.GradScaler(enabled=False)
        for x, y in data:
            loss = torch.nn.functional.mse_loss(model(x), y)
            s.scale(loss).backward()
            s.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            s.unscale_(opt)
            s.step(opt)
            s.update()
            opt.zero_grad()
    """,
)
snippet(
    "tl104_unbindable",
    "TL104",
    """
    import torch


    def train(model, data, opt, scaler):
        for x, y in data:
            scaler.scale(model(x, y)).backward()
            scaler.unscale_(opt)
            log_grad_norms(model, step_counter)
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
    """,
)


PLANTED = planted_mistakes(VERIFY_RULES)
VERIFY_FIXTURES = sorted({path for path, _, _ in PLANTED})
VERIFY_TIMEOUT = 90


def test_every_snippet_is_reported_by_its_rule(verified):
    verified.assert_each_snippet_reported_once(SNIPPETS)


def test_each_rule_has_a_true_bug_and_an_unbindable_snippet(verified):
    verified.assert_each_rule_confirms_and_names_what_it_cannot_bind(SNIPPETS, VERIFY_RULES)


# TL102 -------------------------------------------------------------------------------------------------


def test_tl102_update_after_a_direct_step_raises_at_the_first_step(verified):
    finding = verified.one("tl102_accumulation_with_update")
    v = finding.verify
    assert v["status"] == "confirmed"
    assert "No inf checks were recorded prior to update" in v["evidence"]["exception"]
    # the first optimizer step, and so the first update() without a recorded step, is iteration `accum`
    assert v["evidence"]["failing_iteration"] == 4
    assert v["evidence"]["fixed_vs_reference"]["max_rel"] == 0.0
    assert finding.fix.applicability is Applicability.VERIFIED


def test_tl102_trainer_method_with_self_roles(verified):
    v = verified.one("tl102_trainer_method").verify
    assert v["status"] == "confirmed"
    assert v["evidence"]["failing_iteration"] == 1
    assert "AdamW(lr=3e-4, weight_decay=0.01)" in v["detail"]


def test_tl102_sgd_applies_gradients_multiplied_by_the_loss_scale(verified):
    v = verified.one("tl102_sgd_scaled_gradients").verify
    ev = v["evidence"]
    assert v["status"] == "confirmed"
    assert ev["applied_gradient_norm_ratio"] == pytest.approx(ev["loss_scale"], rel=1e-3)
    assert ev["update_before_overflow_vs_reference"]["max_rel"] > 100
    # the scaler skips the overflowing step; the direct step applies it
    assert ev["optimizer_steps"]["as_written"] == ev["optimizer_steps"]["reference"] + 1
    assert ev["non_finite_parameters"]["reference"] == 0
    assert ev["non_finite_parameters"]["as_written"] > 0


def test_tl102_unscaled_step_still_applies_an_overflowing_step(verified):
    v = verified.one("tl102_unscaled_but_not_skipped").verify
    ev = v["evidence"]
    assert v["status"] == "confirmed"
    # unscale_ ran first: the normal steps are right, only the overflow step differs
    assert ev["update_before_overflow_vs_reference"]["max_rel"] < 1e-3
    assert ev["non_finite_parameters"]["as_written"] == ev["non_finite_parameters"]["of"]
    assert "construction is not in this function" in v["detail"]


def test_tl102_loss_computed_in_either_branch(verified):
    v = verified.one("tl102_loss_in_both_branches").verify
    assert v["status"] == "confirmed"
    assert v["evidence"]["applied_gradient_norm_ratio"] == pytest.approx(
        v["evidence"]["loss_scale"], rel=1e-3
    )


def test_tl102_disabled_scaler_is_not_reproduced(verified):
    v = verified.one("tl102_scaler_disabled").verify
    assert v["status"] == "not-reproduced"
    assert v["evidence"]["optimizer_steps"]["as_written"] == v["evidence"]["optimizer_steps"]["reference"]


def test_tl102_unbindable_name(verified):
    v = verified.one("tl102_unbindable").verify
    assert v["status"] == "not-executable"
    assert "max_grad_value" in v["detail"]


# TL103 -------------------------------------------------------------------------------------------------


def test_tl103_counter_window_raises_on_the_first_micro_step(verified):
    v = verified.one("tl103_counter_reset").verify
    assert v["status"] == "confirmed"
    assert v["evidence"]["failing_iteration"] == 1
    assert "No inf checks were recorded prior to update" in v["detail"]


def test_tl103_model_output_loss(verified):
    v = verified.one("tl103_hf_loss").verify
    assert v["status"] == "confirmed"
    assert v["evidence"]["failing_iteration"] == 1


def test_tl103_scaler_disabled_by_the_argparse_default_is_not_reproduced(verified):
    v = verified.one("tl103_amp_off_by_default").verify
    assert v["status"] == "not-reproduced"
    assert "`args.amp` = False (argparse default)" in v["detail"]
    # two windows of the file's accumulation count
    assert v["evidence"]["optimizer_steps"] == {"as_written": 2, "reference": 2}
    assert v["evidence"]["iterations"] == 8


def test_tl103_unbindable_import(verified):
    v = verified.one("tl103_unbindable").verify
    assert v["status"] == "not-executable"
    assert "clip_gradients" in v["detail"]


# TL104 -------------------------------------------------------------------------------------------------


def test_tl104_unscale_inside_a_helper_then_again(verified):
    finding = verified.one("tl104_helper_unscales")
    v = finding.verify
    assert v["status"] == "confirmed"
    assert "unscale_() has already been called" in v["evidence"]["exception"]
    assert v["evidence"]["failing_iteration"] == 1
    assert v["evidence"]["fixed_vs_reference"]["max_rel"] == 0.0


def test_tl104_unscale_every_micro_step_fails_on_the_second(verified):
    v = verified.one("tl104_every_micro_step").verify
    assert v["status"] == "confirmed"
    assert v["evidence"]["failing_iteration"] == 2


def test_tl104_disabled_scaler_is_not_reproduced(verified):
    v = verified.one("tl104_scaler_disabled").verify
    assert v["status"] == "not-reproduced"


def test_tl104_unbindable_name(verified):
    v = verified.one("tl104_unbindable").verify
    assert v["status"] == "not-executable"
    assert "log_grad_norms" in v["detail"] or "step_counter" in v["detail"]


# fixtures ----------------------------------------------------------------------------------------------


def test_planted_fixture_mistakes_with_a_probe_are_found():
    assert {rule for _, rule, _ in PLANTED} == set(VERIFY_RULES)


@pytest.mark.parametrize(("path", "rule", "line"), PLANTED)
def test_planted_fixture_mistakes_are_confirmed(verified, path, rule, line):
    verified.assert_confirmed(path, rule, line)


def test_fixture_direct_step_with_adamw_shows_both_halves_of_the_hazard(verified):
    (finding,) = [f for f in verified["fixtures/bad_amp_loops.py"] if f.rule == "TL102"]
    ev = finding.verify["evidence"]
    # Adam's normalisation hides the scale in normal steps...
    assert ev["applied_gradient_norm_ratio"] == pytest.approx(ev["loss_scale"], rel=1e-3)
    assert ev["update_before_overflow_vs_reference"]["max_rel"] < 1e-3
    # ...but the step the scaler would have skipped writes NaN into the weights
    assert ev["non_finite_parameters"]["as_written"] > 0 == ev["non_finite_parameters"]["reference"]
