"""TL5xx: data parallelism."""

from __future__ import annotations

import textwrap

from trainlint.engine import lint_source
from trainlint.rule import registry


def run(rule: str, code: str):
    return lint_source(textwrap.dedent(code), "snippet.py", [rule])


DDP_LOOP = """
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    def train(rank, net, loader, optimizer, accum_steps):
        model = DDP(net.to(rank), device_ids=[rank])
        for i, batch in enumerate(loader):
            loss = model(batch).loss / accum_steps
            loss.backward()
            if (i + 1) % accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
    """


def test_tl501_reported_at_the_backward_with_the_step_as_related() -> None:
    (finding,) = run("TL501", DDP_LOOP)
    assert finding.line == 9
    assert "no_sync()" in finding.message
    assert [r.line for r in finding.related] == [11]


def test_tl501_no_sync_fixes_it() -> None:
    fixed = DDP_LOOP.replace(
        "            loss = model(batch).loss / accum_steps\n            loss.backward()",
        "            sync = (i + 1) % accum_steps == 0\n"
        "            with contextlib.nullcontext() if sync else model.no_sync():\n"
        "                loss = model(batch).loss / accum_steps\n                loss.backward()",
    )
    assert fixed != DDP_LOOP
    assert run("TL501", fixed) == []


def test_tl501_nanogpt_require_backward_grad_sync_is_not_reported() -> None:
    code = """
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, device_ids=[ddp_local_rank])
        while True:
            for micro_step in range(gradient_accumulation_steps):
                if ddp:
                    model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
                with ctx:
                    logits, loss = model(X, Y)
                    loss = loss / gradient_accumulation_steps
                X, Y = get_batch('train')
                scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        """
    assert run("TL501", code) == []
    # without the toggle the same loop is reported (the micro-step loop shape)
    without = code.replace(
        "model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)", "pass"
    )
    assert [f.line for f in run("TL501", without)] == [12]


def test_tl501_without_ddp_is_not_reported() -> None:
    code = DDP_LOOP.replace("model = DDP(net.to(rank), device_ids=[rank])", "model = net.to(rank)")
    assert run("TL501", code) == []


def test_tl501_step_every_iteration_is_not_accumulation() -> None:
    code = DDP_LOOP.replace(
        "            if (i + 1) % accum_steps == 0:\n                optimizer.step()",
        "            if True:\n                optimizer.step()",
    )
    assert run("TL501", code) == []


# -- TL502 ------------------------------------------------------------------------------------------------

LOCAL_MEAN = """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    def step(model, batch):
        logits = model(batch["input_ids"])
        per_token = F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
        mask = batch["labels"] != -100
        n_tokens = mask.sum()
        loss = (per_token * mask).sum() / n_tokens
        loss.backward()

    dist.init_process_group("nccl")
    """


def test_tl502_reported_at_the_division_by_the_local_count() -> None:
    (finding,) = run("TL502", LOCAL_MEAN)
    assert finding.line == 11
    assert "`n_tokens`" in finding.message and "all-reduce" in finding.message
    assert [r.line for r in finding.related] == [8]


def test_tl502_all_reduced_count_is_not_reported() -> None:
    fixed = LOCAL_MEAN.replace(
        "        n_tokens = mask.sum()\n",
        "        n_tokens = mask.sum()\n        dist.all_reduce(n_tokens)\n",
    )
    assert fixed != LOCAL_MEAN
    assert run("TL502", fixed) == []


def test_tl502_single_process_is_not_reported() -> None:
    assert run("TL502", LOCAL_MEAN.replace('dist.init_process_group("nccl")', "")) == []


def test_tl502_gathered_with_accelerate_is_not_reported() -> None:
    code = """
        from accelerate import Accelerator
        import torch.nn.functional as F
        accelerator = Accelerator()
        for batch in loader:
            labels = batch["labels"]
            s = F.cross_entropy(model(batch).flatten(0, 1), labels.flatten(), reduction="sum")
            n = accelerator.gather((labels != -100).sum()).sum()
            accelerator.backward(s * accelerator.num_processes / n)
        """
    assert run("TL502", code) == []


def test_distributed_docs_carry_a_numeric_illustration() -> None:
    tl501 = registry().get("TL501")
    tl502 = registry().get("TL502")
    assert tl501 is not None and tl502 is not None
    assert "32 GB" in tl501.explain() and "4 GB" in tl501.explain()
    assert "0.005" in tl502.explain() and "1/1000" in tl502.explain()
    for rule in (tl501, tl502):
        assert len(rule.valid) >= 6 and len(rule.invalid) >= 6
