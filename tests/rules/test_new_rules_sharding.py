"""The wrapping and sharding rules (TL205, TL503-TL507, TL110) on the shapes met in public training
code: the true findings they must keep and the look-alikes that were false positives at first."""

from __future__ import annotations

import textwrap

import pytest

from trainlint.engine import lint_source
from trainlint.fix import fix_text
from trainlint.verify import torch_available, verify_findings


def lines(rule: str, code: str) -> list[int]:
    return [f.line for f in lint_source(textwrap.dedent(code).lstrip("\n"), "train.py", [rule])]


def test_tl505_reports_the_train_sampler_and_not_its_eval_twin() -> None:
    # DeepSpeed-Chat's step1 main.py: both samplers shuffle, only training order matters
    code = """
    from torch.utils.data import DataLoader, DistributedSampler
    train_sampler = DistributedSampler(train_dataset)
    eval_sampler = DistributedSampler(eval_dataset)
    train_dataloader = DataLoader(train_dataset, sampler=train_sampler)
    for epoch in range(args.num_train_epochs):
        for step, batch in enumerate(train_dataloader):
            model.backward(model(**batch).loss)
    """
    assert lines("TL505", code) == [2]


def test_tl505_counts_any_set_epoch_call_in_the_file() -> None:
    code = """
    from torch.utils.data import DistributedSampler
    sampler = DistributedSampler(ds)
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
    """
    assert lines("TL505", code) == []
    assert lines("TL505", code.replace("loader.sampler.set_epoch(epoch)", "run(loader)")) == [2]


def test_tl505_sampler_of_a_helper_that_only_validation_calls() -> None:
    # bing_bert's deepspeed_train.py: a loader helper builds `train_sampler`, but only the validation
    # pass (called once per epoch) ever calls the helper
    code = """
    from torch.utils.data import DataLoader, DistributedSampler

    def build_loader(args, ds, for_eval=False):
        train_sampler = DistributedSampler(ds)
        return DataLoader(ds, batch_size=args.bs, sampler=train_sampler)

    def epoch_validation(args, net):
        net.eval()
        return sum(net(b) for b in build_loader(args, held_out, for_eval=True))

    for epoch in range(args.epochs):
        train(args, net)
        epoch_validation(args, net)
    """
    assert lines("TL505", code) == []
    # the same helper also feeding the training pass is the real mistake
    trained = code.replace(
        "        train(args, net)", "        for b in build_loader(args, ds):\n            step(b)"
    )
    assert lines("TL505", trained) == [4]


def test_tl504_engine_count_copied_into_args_then_divided() -> None:
    # BingBertSquad's nvidia_run_squad_deepspeed.py: the engine's own count, divided under a guard
    code = """
    import deepspeed
    model, optimizer, _, _ = deepspeed.initialize(args=args, model=model)
    args.gradient_accumulation_steps = model.gradient_accumulation_steps()
    for step, batch in enumerate(loader):
        loss = model(*batch)
        if args.gradient_accumulation_steps > 1:
            loss = loss / args.gradient_accumulation_steps
        model.backward(loss)
    """
    assert lines("TL504", code) == [8]
    assert (
        lines("TL504", code.replace("model.backward(loss)", "model.backward(loss, scale_wrt_gas=False)"))
        == []
    )


def test_tl507_inner_module_rebound_from_dot_module_is_still_bypassing() -> None:
    # RAE's train_stage1.py: `discriminator = ddp_disc.module`, then the discriminator step calls it
    code = """
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp_disc = DDP(discriminator, device_ids=[0])
    discriminator = ddp_disc.module
    for images in loader:
        logits = discriminator(images)
        disc_loss(logits).backward()
        disc_optimizer.step()
    """
    assert lines("TL507", code) == [5]


def test_tl503_accelerate_prepare_alone_needs_fsdp_in_the_file() -> None:
    code = """
    import torch
    optimizer = torch.optim.AdamW(model.parameters())
    model = accelerator.prepare(model)
    optimizer = accelerator.prepare(optimizer)
    """
    # under DDP the wrapped model keeps its parameters: nothing to report
    assert lines("TL503", code) == []
    assert lines("TL503", "# FSDP run\n" + textwrap.dedent(code).lstrip("\n")) == [3]


def test_tl506_only_in_the_scope_that_wrapped_the_model() -> None:
    code = """
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def main(net):
        model = FSDP(net)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    def baseline(model):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    """
    assert lines("TL506", code) == [6]


def test_tl205_fix_adds_the_keyword_and_the_rule_then_stays_silent() -> None:
    code = "from peft import get_peft_model\nmodel = get_peft_model(model, cfg)\nmodel.gradient_checkpointing_enable()\n"
    outcome = fix_text(code, lambda text: lint_source(text, "train.py", ["TL205"]), unsafe=False)
    assert outcome.fixed == 1
    assert outcome.text.splitlines()[2] == (
        'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})'
    )
    assert lint_source(outcome.text, "train.py", ["TL205"]) == []


def test_tl205_no_fix_when_a_comment_sits_inside_the_parentheses() -> None:
    code = "import peft\nmodel.gradient_checkpointing_enable(  # memory\n)\n"
    (finding,) = lint_source(code, "train.py", ["TL205"])
    assert finding.fix is None


def test_tl205_look_alikes_from_public_code_stay_silent() -> None:
    # peft's tests enable checkpointing before get_peft_model; diffusers-style DreamBooth scripts
    # checkpoint a fully trained text encoder only when LoRA is off; `colorama` contains "lora"
    assert (
        lines("TL205", "import peft\nm.gradient_checkpointing_enable()\nm = peft.get_peft_model(m, c)\n")
        == []
    )
    assert (
        lines("TL205", "import peft\nif not (args.use_lora or x):\n    te.gradient_checkpointing_enable()\n")
        == []
    )
    assert lines("TL205", "import colorama\nte.gradient_checkpointing_enable()\n") == []
    assert lines("TL205", "import peft\nte.gradient_checkpointing_enable()\n") == [2]


PROBED = {
    # TL505: the seeded sampler repeats its order; the constant no-shuffle one is fixed by design (the
    # rule cannot read the constant, the probe can)
    "seeded.py": "from torch.utils.data import DataLoader, DistributedSampler\n"
    "sampler = DistributedSampler(ds, seed=3)\n"
    "for epoch in range(10):\n    for b in DataLoader(ds, sampler=sampler):\n        step(b)\n",
    "constant.py": "from torch.utils.data import DataLoader, DistributedSampler\n"
    "SHUFFLE = False\nsampler = DistributedSampler(ds, shuffle=SHUFFLE)\n"
    "for epoch in range(10):\n    for b in DataLoader(ds, sampler=sampler):\n        step(b)\n",
}


@pytest.mark.skipif(not torch_available(), reason="--verify needs torch")
def test_probes_confirm_the_hazard_and_clear_the_look_alike() -> None:
    findings = [f for path, text in PROBED.items() for f in lint_source(text, path, ["TL505"])]
    assert sorted(f.path for f in findings) == ["constant.py", "seeded.py"]
    verdicts = {f.path: f.verify for f in verify_findings(findings, PROBED, device="cpu", timeout=60)}
    seeded = verdicts["seeded.py"]
    assert seeded is not None and seeded["status"] == "confirmed", seeded
    first, second = seeded["evidence"]["as_written"]
    assert first == second and sorted(first) != first  # shuffled, and the same both epochs
    fixed_first, fixed_second = seeded["evidence"]["with_set_epoch"]
    assert fixed_first == first and fixed_second != first
    assert verdicts["constant.py"] is not None and verdicts["constant.py"]["status"] == "not-reproduced"
