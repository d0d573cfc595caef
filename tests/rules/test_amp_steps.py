"""Targeted tests of the mixed-precision rules TL102-TL109: messages, related locations, fixes, and the
accumulation conditions they share."""

from __future__ import annotations

import textwrap

import pytest
from amp_helpers import fixed, run

from trainlint.rule import Applicability

# ---------------------------------------------------------------------------------------------------
# TL102
# ---------------------------------------------------------------------------------------------------


def test_tl102_message_related_and_safe_fix() -> None:
    before = """
    import torch
    scaler = torch.amp.GradScaler()
    for x, y in data:
        scaler.scale(loss_fn(model(x), y)).backward()
        optimizer.step()
        scaler.update()
        optimizer.zero_grad()
    """
    (finding,) = run(before, "TL102")
    assert (finding.line, finding.column) == (6, 5)
    assert finding.message == (
        "`optimizer.step()` applies gradients that are still multiplied by the loss scale and does not "
        "skip inf/NaN steps; call `scaler.step(optimizer)` instead."
    )
    assert [(r.line, r.message) for r in finding.related] == [(5, "scaled backward here")]
    assert finding.fix is not None and finding.fix.applicability is Applicability.SAFE
    after = before.replace("optimizer.step()", "scaler.step(optimizer)")
    assert fixed(before, "TL102") == textwrap.dedent(after)
    assert run(after, "TL102") == []


def test_tl102_fix_is_unsafe_with_arguments_and_absent_without_update() -> None:
    with_closure = """
    import torch
    scaler = torch.amp.GradScaler()
    scaler.scale(loss).backward()
    opt.step(closure=closure)
    scaler.update()
    """
    (finding,) = run(with_closure, "TL102")
    assert finding.fix is not None and finding.fix.applicability is Applicability.UNSAFE
    assert finding.fix.edits[0].content == "scaler.step(opt, closure=closure)"
    without_update = """
    import torch
    scaler = torch.amp.GradScaler()
    scaler.scale(loss).backward()
    opt.step()
    """
    (finding,) = run(without_update, "TL102")
    assert finding.fix is None


def test_tl102_after_unscale_mentions_the_skipped_inf_check() -> None:
    code = """
    import torch
    scaler = torch.amp.GradScaler()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    scaler.update()
    """
    (finding,) = run(code, "TL102")
    assert "inf/NaN gradients is applied instead of skipped" in finding.message
    assert "still multiplied" not in finding.message


def test_tl102_ms_amp_benchmark_is_not_reported() -> None:
    # huggingface/accelerate benchmarks/fp8/ms_amp: MS-AMP's optimizer handles the scale
    code = """
    import msamp
    import torch
    scaler = torch.amp.GradScaler()
    model, optimizer = msamp.initialize(model, optimizer, opt_level="O2")
    for batch in loader:
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        optimizer.step()
        optimizer.zero_grad()
    """
    assert run(code, "TL102") == []


# ---------------------------------------------------------------------------------------------------
# TL103
# ---------------------------------------------------------------------------------------------------


def test_tl103_names_the_accumulation_condition() -> None:
    code = """
    import torch
    scaler = torch.amp.GradScaler()
    for i, batch in enumerate(loader):
        scaler.scale(model(batch) / accum).backward()
        if (i + 1) % accum == 0:
            scaler.step(optimizer)
            optimizer.zero_grad()
        scaler.update()
    """
    (finding,) = run(code, "TL103")
    assert (finding.line, finding.column) == (9, 5)
    assert "accumulation condition on line 6" in finding.message
    assert finding.related[0].line == 7


def test_tl103_update_in_the_else_branch_is_not_per_microstep() -> None:
    code = """
    import torch
    scaler = torch.amp.GradScaler()
    for i, batch in enumerate(loader):
        scaler.scale(model(batch)).backward()
        if (i + 1) % accum == 0:
            scaler.step(optimizer)
        else:
            scaler.update()
    """
    assert run(code, "TL103") == []


# ---------------------------------------------------------------------------------------------------
# TL104
# ---------------------------------------------------------------------------------------------------


def test_tl104_fix_removes_the_second_call_with_its_line() -> None:
    before = """
    def step(scaler, optimizer, loss):
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        log_norm(optimizer)
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
    """
    after = """
    def step(scaler, optimizer, loss):
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        log_norm(optimizer)
        scaler.step(optimizer)
        scaler.update()
    """
    (finding,) = run(before, "TL104")
    assert finding.line == 6
    assert "already called on line 4" in finding.message
    assert finding.related[0].line == 4
    assert fixed(before, "TL104") == textwrap.dedent(after)


def test_tl104_fix_keeps_the_block_valid() -> None:
    before = """
    def step(scaler, optimizer, loss):
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        if clip:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
    """
    after = """
    def step(scaler, optimizer, loss):
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        if clip:
            pass
        scaler.step(optimizer)
        scaler.update()
    """
    assert fixed(before, "TL104") == textwrap.dedent(after)


def test_tl104_every_microstep_has_no_fix() -> None:
    code = """
    import torch
    scaler = torch.amp.GradScaler()
    for i, x in enumerate(data):
        scaler.scale(model(x)).backward()
        scaler.unscale_(opt)
        if (i + 1) % accum == 0:
            scaler.step(opt)
            scaler.update()
    """
    (finding,) = run(code, "TL104")
    assert finding.line == 6
    assert "every micro-step" in finding.message
    assert finding.fix is None


# ---------------------------------------------------------------------------------------------------
# TL106, TL107, TL108, TL109
# ---------------------------------------------------------------------------------------------------


def test_tl106_related_points_at_the_innermost_enabled_region() -> None:
    code = """
    import torch
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x)
        loss.backward()
    """
    (finding,) = run(code, "TL106")
    assert (finding.line, finding.column) == (5, 5)
    assert [(r.line, r.column, r.message) for r in finding.related] == [(3, 6, "autocast region opened here")]


def test_tl107_reported_once_per_function() -> None:
    code = """
    import torch
    scaler = torch.amp.GradScaler()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        l0 = m0(x)
        l1 = m1(x)
    scaler.scale(l0).backward(retain_graph=True)
    scaler.scale(l1).backward()
    """
    (finding,) = run(code, "TL107")
    assert finding.line == 7
    assert finding.severity.value == "info"
    assert finding.related[0].line == 4


def test_tl108_message_and_norm_measurement() -> None:
    code = """
    import math
    import torch
    loss.backward()
    optimizer.step()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    norm = torch.nn.utils.clip_grad_norm_(params, math.inf)
    """
    (finding,) = run(code, "TL108")
    assert finding.line == 6
    assert "after the optimizer step on line 5" in finding.message
    assert finding.related[0].line == 5


def test_tl108_conditional_step_and_unconditional_clip_is_not_reported() -> None:
    # On micro-steps without a step the clip does act on the accumulating gradient.
    code = """
    import torch
    for i, x in enumerate(data):
        model(x).backward()
        if (i + 1) % accum == 0:
            optimizer.step()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    """
    assert run(code, "TL108") == []


def test_tl109_message_and_related_region() -> None:
    code = """
    import torch
    for x, y in data:
        with torch.autocast(device_type="cuda"):
            out = model(x)
            loss = crit(out, y)
        loss.backward()
        optimizer.step()
    """
    (finding,) = run(code, "TL109")
    assert (finding.line, finding.column) == (7, 5)
    assert "without a GradScaler" in finding.message
    assert finding.related[0].line == 4


def test_tl109_scaler_passed_in_from_elsewhere_is_not_reported() -> None:
    code = """
    import torch
    def train_step(model, x, loss_scaler):
        with torch.autocast("cuda"):
            loss = model(x)
        loss = loss_scaler.scale(loss)
        loss.backward()
    """
    assert run(code, "TL109") == []


# ---------------------------------------------------------------------------------------------------
# The shared accumulation-condition helper (lint/model/training.py)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("test", "expected"),
    [
        ("(i + 1) % accum == 0", True),
        ("step % args.gradient_accumulation_steps == 0 or step == len(loader) - 1", True),
        ("accelerator.sync_gradients", True),
        ("not accelerator.sync_gradients", True),
        ("not (i + 1) % k", True),
        ("i % n == n - 1", True),
        ("is_update_step", True),
        ("i % 2 == 0", False),
        ("epoch > 3", False),
        ("'%d' % x == '1'", False),
        ("maybe_flag", False),
    ],
)
def test_accumulation_condition_forms(test: str, expected: bool) -> None:
    from trainlint.model import FileModel

    source = (
        f"is_update_step = (i + 1) % accum == 0\nmaybe_flag = (i + 1) % accum == 0\nmaybe_flag = False\n"
        f"if {test}:\n    pass\n"
    )
    model = FileModel.from_source(source)
    node = model.module.body[-1]
    assert model.training.accumulation_condition(node.test, model.module_scope) is expected


def test_accumulation_condition_counter_reset_needs_the_frame() -> None:
    from trainlint.model import FileModel, Frame

    model = FileModel.from_source("if count == accum:\n    step()\n    count = 0\n")
    node = model.module.body[0]
    training = model.training
    assert training.accumulation_condition(Frame("if", node, "body"), model.module_scope)
    assert not training.accumulation_condition(node.test, model.module_scope)
    site = next(s for s in model.calls if "step" in model.code(s.node))
    assert training.under_accumulation(site) is not None


def test_tl109_a_comment_or_name_mentioning_scaler_does_not_hide_the_bug(lint) -> None:
    code = """
    import torch

    def train_without_scaler(model, loader, opt):  # no GradScaler: "we don't need a scaler"
        for x in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).mean()
            loss.backward()
            opt.step()
    """
    assert [(f.rule, f.line) for f in lint(code, "TL109")] == [("TL109", 8)]


def test_tl109_a_scaler_variable_from_elsewhere_suppresses(lint) -> None:
    code = """
    import torch

    def train(model, loader, opt, loss_scaler):
        for x in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).mean()
            loss.backward()
            loss_scaler.step(opt)
    """
    assert lint(code, "TL109") == []


def test_tl101_an_unscale_before_the_scaled_backward_does_not_count(lint) -> None:
    code = """
    import torch
    scaler = torch.amp.GradScaler("cuda")
    scaler.unscale_(opt)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    """
    assert [(f.rule, f.line) for f in lint(code, "TL101")] == [("TL101", 6)]


def test_tl101_no_fix_when_the_clip_shares_a_line_with_the_backward(lint) -> None:
    code = """
    import torch
    scaler = torch.amp.GradScaler("cuda")
    scaler.scale(loss).backward(); torch.nn.utils.clip_grad_norm_(params, 1.0)
    scaler.step(opt)
    scaler.update()
    """
    (finding,) = lint(code, "TL101")
    assert finding.fix is None
