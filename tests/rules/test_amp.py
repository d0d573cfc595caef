"""Targeted tests of the mixed-precision rules (TL101, TL105): messages, related locations, fixes, and
PyTorch's own AMP recipes."""

from __future__ import annotations

import textwrap

import pytest
from amp_helpers import AMP_RULES, fixed, run

from trainlint.rule import Applicability

# ---------------------------------------------------------------------------------------------------
# PyTorch's own AMP examples (docs/source/notes/amp_examples.rst), written out: no finding from any
# TL1xx rule.
# ---------------------------------------------------------------------------------------------------

RECIPE_TYPICAL = """
import torch
from torch import autocast

model = Net().cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cuda")

for epoch in epochs:
    for input, target in data:
        optimizer.zero_grad()
        with autocast(device_type="cuda", dtype=torch.float16):
            output = model(input)
            loss = loss_fn(output, target)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
"""

RECIPE_UNSCALED_GRADIENTS = """
import torch
from torch import autocast

scaler = torch.amp.GradScaler("cuda")

for epoch in epochs:
    for input, target in data:
        optimizer.zero_grad()
        with autocast(device_type="cuda", dtype=torch.float16):
            output = model(input)
            loss = loss_fn(output, target)
        scaler.scale(loss).backward()

        # Unscales the gradients of optimizer's assigned params in-place
        scaler.unscale_(optimizer)

        # Since the gradients of optimizer's assigned params are unscaled, clips as usual:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

        scaler.step(optimizer)
        scaler.update()
"""

RECIPE_ACCUMULATION = """
import torch
from torch import autocast

scaler = torch.amp.GradScaler("cuda")

for epoch in epochs:
    for i, (input, target) in enumerate(data):
        with autocast(device_type="cuda", dtype=torch.float16):
            output = model(input)
            loss = loss_fn(output, target)
            loss = loss / iters_to_accumulate

        # Accumulates scaled gradients.
        scaler.scale(loss).backward()

        if (i + 1) % iters_to_accumulate == 0:
            # may unscale_ here if desired (e.g., to allow clipping unscaled gradients)
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
"""

RECIPE_GRADIENT_PENALTY = """
import torch
from torch import autocast

scaler = torch.amp.GradScaler("cuda")

for epoch in epochs:
    for input, target in data:
        optimizer.zero_grad()
        with autocast(device_type="cuda", dtype=torch.float16):
            output = model(input)
            loss = loss_fn(output, target)

        # Scales the loss for autograd.grad's backward pass, producing scaled_grad_params
        scaled_grad_params = torch.autograd.grad(
            outputs=scaler.scale(loss), inputs=model.parameters(), create_graph=True
        )

        # Creates unscaled grad_params before computing the penalty.
        inv_scale = 1.0 / scaler.get_scale()
        grad_params = [p * inv_scale for p in scaled_grad_params]

        with autocast(device_type="cuda", dtype=torch.float16):
            grad_norm = 0
            for grad in grad_params:
                grad_norm += grad.pow(2).sum()
            grad_norm = grad_norm.sqrt()
            loss = loss + grad_norm

        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
"""

RECIPE_MULTIPLE_MODELS = """
import torch
from torch import autocast

scaler = torch.amp.GradScaler("cuda")

for epoch in epochs:
    for input, target in data:
        optimizer0.zero_grad()
        optimizer1.zero_grad()
        with autocast(device_type="cuda", dtype=torch.float16):
            output0 = model0(input)
            output1 = model1(input)
            loss0 = loss_fn(2 * output0 + 3 * output1, target)
            loss1 = loss_fn(3 * output0 - 5 * output1, target)

        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()

        scaler.unscale_(optimizer0)

        scaler.step(optimizer0)
        scaler.step(optimizer1)

        scaler.update()
"""


@pytest.mark.parametrize(
    "code",
    [
        RECIPE_TYPICAL,
        RECIPE_UNSCALED_GRADIENTS,
        RECIPE_ACCUMULATION,
        RECIPE_GRADIENT_PENALTY,
        RECIPE_MULTIPLE_MODELS,
    ],
    ids=["typical", "unscaled-gradients", "accumulation", "gradient-penalty", "multiple-models"],
)
def test_pytorch_amp_recipes_have_no_findings(code: str) -> None:
    assert AMP_RULES  # the family is registered
    assert run(code) == []


# ---------------------------------------------------------------------------------------------------
# TL101
# ---------------------------------------------------------------------------------------------------

MINGPT_DDP = """
import torch

class Trainer:
    def __init__(self, config, model, optimizer):
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler(enabled=config.use_amp)

    def _run_batch(self, source, targets, train: bool = True) -> float:
        with torch.set_grad_enabled(train), torch.amp.autocast(device_type="cuda", dtype=torch.float16):
            _, loss = self.model(source, targets)

        if train:
            self.optimizer.zero_grad(set_to_none=True)
            if self.config.use_amp:
                self.scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_norm_clip)
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_norm_clip)
                self.optimizer.step()
        return loss.item()
"""


def test_tl101_mingpt_ddp_message_related_and_fix() -> None:
    findings = run(MINGPT_DDP, "TL101")
    assert [(f.line, f.column) for f in findings] == [(19, 17)]
    finding = findings[0]
    assert "still multiplied by the GradScaler's loss scale" in finding.message
    assert "`self.scaler.unscale_(self.optimizer)`" in finding.message
    assert [(r.line, r.column, r.message) for r in finding.related] == [(18, 17, "scaled backward here")]
    assert finding.fix is not None and finding.fix.applicability is Applicability.SAFE
    (edit,) = finding.fix.edits
    assert (edit.line, edit.column, edit.end_line, edit.end_column) == (19, 17, 19, 17)
    assert edit.content == "self.scaler.unscale_(self.optimizer)\n                "


def test_tl101_fix_inserts_unscale_in_the_same_block() -> None:
    before = """
    import torch
    scaler = torch.amp.GradScaler()
    for x, y in data:
        scaler.scale(loss_fn(model(x), y)).backward()
        if max_norm:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(opt)
        scaler.update()
    """
    after = """
    import torch
    scaler = torch.amp.GradScaler()
    for x, y in data:
        scaler.scale(loss_fn(model(x), y)).backward()
        if max_norm:
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(opt)
        scaler.update()
    """
    assert fixed(before, "TL101") == textwrap.dedent(after)
    assert run(after, "TL101") == []


def test_tl101_fix_moves_a_late_unscale_before_the_clip() -> None:
    before = """
    import torch
    def step(model, opt, scaler, loss):
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(
            model.parameters(), 1.0
        )
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    """
    after = """
    import torch
    def step(model, opt, scaler, loss):
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(
            model.parameters(), 1.0
        )
        scaler.step(opt)
        scaler.update()
    """
    (finding,) = run(before, "TL101")
    assert "before `scaler.unscale_(...)` on line 8" in finding.message
    assert "move the `unscale_` call before the clip" in finding.message
    assert fixed(before, "TL101") == textwrap.dedent(after)


def test_tl101_no_fix_when_the_optimizer_is_unknown() -> None:
    (finding,) = run(
        """
        import torch
        scaler = torch.amp.GradScaler()
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(optimizers[0])
        scaler.update()
        """,
        "TL101",
    )
    assert finding.fix is None
    assert "`scaler.unscale_(optimizer)`" in finding.message


def test_tl101_no_fix_when_the_clip_runs_every_micro_step() -> None:
    # an unscale_ on every micro-step would raise the second time before update()
    (finding,) = run(
        """
        import torch
        scaler = torch.amp.GradScaler()
        for i, batch in enumerate(loader):
            scaler.scale(model(batch)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if (i + 1) % accum == 0:
                scaler.step(opt)
                scaler.update()
        """,
        "TL101",
    )
    assert finding.line == 6
    assert finding.fix is None


def test_tl101_no_fix_for_a_one_line_if() -> None:
    (finding,) = run(
        """
        import torch
        scaler = torch.amp.GradScaler()
        scaler.scale(loss).backward()
        if max_norm: torch.nn.utils.clip_grad_norm_(params, max_norm)
        scaler.step(opt)
        scaler.update()
        """,
        "TL101",
    )
    assert finding.fix is None


def test_tl101_script_style_module_code_with_aliases() -> None:
    code = """
    import torch as T
    from torch.nn import utils as U
    from torch.amp import GradScaler as Scaler

    scaler = Scaler("cuda", enabled=True)
    for batch in loader:
        loss = model(batch)
        scaler.scale(loss).backward()
        U.clip_grad_value_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
    """
    (finding,) = run(code, "TL101")
    assert (finding.line, finding.rule) == (10, "TL101")
    assert finding.message.startswith("`clip_grad_value_` runs on gradients")
    assert finding.related[0].line == 9


def test_tl101_nanogpt_accumulation_order_is_clean() -> None:
    code = """
    import torch
    scaler = torch.cuda.amp.GradScaler(enabled=(dtype == 'float16'))
    while True:
        for micro_step in range(gradient_accumulation_steps):
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            X, Y = get_batch('train')
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    """
    assert run(code) == []


def test_tl101_unscale_in_a_nested_scope_does_not_count() -> None:
    code = """
    import torch
    scaler = torch.amp.GradScaler()
    def later():
        scaler.unscale_(opt)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    scaler.step(opt)
    scaler.update()
    """
    assert [f.line for f in run(code, "TL101")] == [7]


def test_tl101_a_scale_method_that_is_not_a_scaler() -> None:
    code = """
    import torch
    loss = normalizer.scale(loss)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    """
    assert run(code, "TL101") == []


# ---------------------------------------------------------------------------------------------------
# TL105
# ---------------------------------------------------------------------------------------------------


def test_tl105_message_and_related_optimizer() -> None:
    code = """
    import torch
    model = Net().cuda().half()
    x = x.half()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4
    )
    """
    (finding,) = run(code, "TL105")
    assert (finding.line, finding.column) == (3, 9)
    assert "`model` is converted to fp16" in finding.message
    assert "optimizer on line 5" in finding.message
    assert "torch.autocast" in finding.message
    assert [(r.line, r.column) for r in finding.related] == [(5, 13)]
    assert finding.fix is None


def test_tl105_bf16_label_through_a_dtype_constant() -> None:
    code = """
    import torch
    DTYPE = torch.bfloat16
    model.to(device=device, dtype=DTYPE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    """
    (finding,) = run(code, "TL105")
    assert finding.line == 4
    assert "converted to bf16" in finding.message


def test_tl105_only_the_trained_module_is_reported() -> None:
    code = """
    import torch
    vae = Vae().to(torch.float16)
    vae.requires_grad_(False)
    text_encoder = Enc().half()
    unet = UNet().half()
    images = images.half()
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    """
    findings = run(code, "TL105")
    assert [f.line for f in findings] == [6]


def test_tl105_frozen_backbone_by_loop_is_not_reported() -> None:
    code = """
    import torch
    model = Net().half()
    for p in model.parameters():
        p.requires_grad = False
    model.head = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    """
    assert run(code, "TL105") == []


def test_tl105_freeze_that_skips_some_parameters_is_still_reported() -> None:
    # CLIP4Clip's "freeze testing": the top layers `continue` past the freeze and train in fp16
    code = """
    import torch
    model = Net().half()
    for name, p in model.named_parameters():
        if name.startswith("head."):
            continue
        p.requires_grad = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    """
    assert [f.line for f in run(code, "TL105")] == [3]


def test_tl105_inference_only_function_and_eval() -> None:
    code = """
    import torch
    def evaluate(model, loader):
        model.half()
        model.eval()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built but unused here
        return [model(x) for x in loader]

    @torch.inference_mode()
    def predict(model, x):
        model = model.half()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model(x)
    """
    assert run(code, "TL105") == []


def test_tl105_conversion_in_other_branch_of_the_optimizer() -> None:
    code = """
    import torch
    if args.infer:
        model = model.half()
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    """
    assert run(code, "TL105") == []


def test_tl105_megatron_and_msamp_wrappers_are_master_weights() -> None:
    megatron = """
    import torch
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
    model = model.bfloat16()
    opt = torch.optim.AdamW(model.parameters())
    opt = Float16OptimizerWithFloat16Params(opt, config, grad_scaler, init_state_fn)
    """
    msamp = """
    import torch
    import msamp
    model = model.half()
    opt = torch.optim.AdamW(model.parameters())
    model, opt = msamp.initialize(model, opt)
    """
    assert run(megatron, "TL105") == []
    assert run(msamp, "TL105") == []


def test_tl101_backward_in_another_method_of_the_trainer() -> None:
    code = """
    import torch

    class Trainer:
        def __init__(self):
            self.scaler = torch.cuda.amp.GradScaler()

        def backward(self, loss):
            self.scaler.scale(loss).backward()

        def optimizer_step(self):
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.scaler.step(self.optimizer)
            self.scaler.update()
    """
    (finding,) = run(code, "TL101")
    assert finding.line == 12
    assert [(r.line, r.message) for r in finding.related] == [(9, "scaled backward here")]


def test_tl101_backward_elsewhere_with_an_unscale_elsewhere_is_not_reported() -> None:
    # Accelerate-style: the unscale_ lives in a helper the caller may run first.
    code = """
    import torch

    class Trainer:
        def __init__(self):
            self.scaler = torch.cuda.amp.GradScaler()

        def backward(self, loss):
            self.scaler.scale(loss).backward()

        def unscale_gradients(self):
            self.scaler.unscale_(self.optimizer)

        def optimizer_step(self):
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.scaler.step(self.optimizer)
            self.scaler.update()
    """
    assert run(code, "TL101") == []


def test_tl101_two_clips_only_the_first_gets_the_fix() -> None:
    before = """
    import torch
    scaler = torch.amp.GradScaler()
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(encoder.parameters(), 1.0)
    torch.nn.utils.clip_grad_norm_(decoder.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    """
    findings = run(before, "TL101")
    assert [f.line for f in findings] == [5, 6]
    assert findings[0].fix is not None and findings[1].fix is None
    after = fixed(before, "TL101")
    assert after.count("scaler.unscale_(opt)") == 1
    assert run(after, "TL101") == []


def test_tl105_half_backbone_with_fp32_head_is_not_reported() -> None:
    code = """
    import torch
    model = Classifier().cuda().half()
    model.head.float()
    for p in model.backbone.parameters():
        p.requires_grad = False
    opt = torch.optim.SGD(filter(lambda p: p.requires_grad, model.parameters()), lr=0.1)
    """
    assert run(code, "TL105") == []


def test_tl105_batchnorm_back_to_float_is_still_reported() -> None:
    # vit_finetuning's `--half`: only BatchNorm layers go back to fp32, the rest is trained in fp16
    code = """
    import torch
    def get_model(half):
        model = torch.nn.DataParallel(Net()).cuda()
        model = model.half()
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.float()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, optimizer
    """
    (finding,) = run(code, "TL105")
    assert finding.line == 5
    assert finding.related[0].line == 9


def test_tl105_builder_function_returning_the_converted_model() -> None:
    code = """
    import torch

    def build(name):
        tokenizer = Tok(name)
        model = Model(name)
        model = model.cuda().half()
        return tokenizer, model

    def main(name):
        tokenizer, model = build(name)
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    """
    (finding,) = run(code, "TL105")
    assert finding.line == 7
    assert finding.related[0].line == 12


@pytest.mark.parametrize(
    "builder",
    [
        # rebound before it is returned
        "model = model.half()\n    model = get_peft_model(model, cfg)\n    return tokenizer, model",
        # frozen in the builder
        "model = model.half()\n    model.requires_grad_(False)\n    return tokenizer, model",
        # returned at another position than the caller unpacks
        "model = model.half()\n    return model, tokenizer",
    ],
)
def test_tl105_builder_function_look_alikes(builder: str) -> None:
    code = (
        "import torch\n\ndef build(name):\n    tokenizer = Tok(name)\n    model = Model(name)\n    "
        + builder
        + "\n\ndef main(name):\n    tokenizer, model = build(name)\n"
        "    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)\n"
    )
    assert run(code, "TL105") == []
