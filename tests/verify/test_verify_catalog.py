"""The runtime check (``--verify``) for the rest of the catalog: TL204, TL302, TL303, TL501 and TL502
(the loss-scaling rules TL102-TL104 are in ``test_verify_catalog_amp.py``).

As in ``test_verify.py``, every snippet is linted and all findings are verified in one batch (one child
process; the two data-parallel ranks are started once). Expected values follow from the mechanism of
each hazard: a direct step applies gradients multiplied by the loss scale, ``update()`` without a
recorded step raises, a DDP backward outside ``no_sync`` all-reduces once per bucket, and so on.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
from conftest import Snippets, gloo_or_skip, planted_mistakes

from trainlint.engine import lint_source
from trainlint.verify import torch_available, verify_findings
from trainlint.verify.context import TextEdit, apply_text_edits, minimal_edit

pytestmark = pytest.mark.skipif(not torch_available(), reason="--verify needs torch")

VERIFY_RULES = ("TL204", "TL302", "TL303", "TL501", "TL502")


SNIPPETS = Snippets()
snippet = SNIPPETS.add


# TL204 ---------------------------------------------------------------------------------------------
snippet(
    "tl204_dropout_module",
    "TL204",
    """
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint


    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.fc = nn.Linear(dim, dim)
            self.drop = nn.Dropout(0.1)

        def inner(self, x):
            return self.drop(torch.relu(self.fc(x)))

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False, preserve_rng_state=False)
    """,
)
snippet(
    "tl204_functional_dropout",
    "TL204",
    """
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint


    def noisy(x, w):
        return F.dropout(x @ w, 0.2, training=True)


    def run(x, w):
        return checkpoint(noisy, x, w, use_reentrant=False, preserve_rng_state=False)
    """,
)
snippet(
    "tl204_dropout_zero",
    "TL204",
    """
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.checkpoint import checkpoint


    class MLP(nn.Module):
        def __init__(self, dim, dropout=0.0):
            super().__init__()
            self.fc = nn.Linear(dim, 4 * dim)
            self.proj = nn.Linear(4 * dim, dim)
            self.drop = nn.Dropout(dropout)

        def _ff(self, x):
            return self.drop(self.proj(F.gelu(self.fc(x))))

        def forward(self, x):
            return checkpoint(self._ff, x, use_reentrant=False, preserve_rng_state=False)
    """,
)
snippet(
    "tl204_unbindable",
    "TL204",
    """
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint


    def block(x):
        return F.dropout(project(x), 0.1)


    def run(x):
        return checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)
    """,
)

# TL302 ---------------------------------------------------------------------------------------------
snippet(
    "tl302_running_total",
    "TL302",
    """
    import torch.nn.functional as F


    def epoch(model, loader, optimizer):
        total_loss = 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total_loss += loss
        return total_loss / len(loader)
    """,
)
snippet(
    "tl302_history_list",
    "TL302",
    """
    import torch
    import torch.nn.functional as F


    def train(model, loader, optimizer, scaler):
        hist = []
        for x, y in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            hist.append(loss.float().cpu())
        return hist
    """,
)
snippet(
    "tl302_accelerate_output_loss",
    "TL302",
    """
    def train(model, loader, accelerator, optimizer):
        tr_loss = 0.0
        for batch in loader:
            outputs = model(**batch)
            accelerator.backward(outputs.loss)
            optimizer.step()
            optimizer.zero_grad()
            tr_loss += outputs.loss
        return tr_loss / len(loader)
    """,
)
snippet(
    "tl302_unbindable",
    "TL302",
    """
    import torch.nn.functional as F


    def train(model, loader, optimizer):
        stats = {"loss": 0}
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            stats["loss"] += loss * class_weights[0]
    """,
)

# TL303 ---------------------------------------------------------------------------------------------
snippet(
    "tl303_zero_grad_first",
    "TL303",
    """
    import torch
    import torch.nn.functional as F


    def train(model, loader, accum_steps=4):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for i, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            x, y = x.cuda(), y.cuda()
            logits = model(x)
            loss = F.cross_entropy(logits, y) / accum_steps
            loss.backward()
            if (i + 1) % accum_steps == 0:
                optimizer.step()
    """,
)
snippet(
    "tl303_model_zero_grad",
    "TL303",
    """
    import torch


    def train(model, loader, accum=8):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        for i, b in enumerate(loader):
            model.zero_grad()
            model(b).loss.backward()
            if (i + 1) % accum == 0:
                opt.step()
    """,
)
snippet(
    "tl303_cleared_before_step",
    "TL303",
    """
    def train(model, loader, optimizer, lr_scheduler, accelerator, accum=4):
        model.train()
        for step, batch in enumerate(loader):
            outputs = model(**batch)
            accelerator.backward(outputs.loss / accum)
            optimizer.zero_grad()
            if step % accum == 0:
                optimizer.step()
                lr_scheduler.step()
            if step % 100 == 0:
                accelerator.print(f"step {step}: {outputs.loss.item():.3f}")
    """,
)
snippet(
    "tl303_accumulation_off_by_default",
    "TL303",
    """
    import argparse

    import torch


    def train(args, model, loader):
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        for step, batch in enumerate(loader):
            optimizer.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            (loss / args.grad_accum).backward()
            if (step + 1) % args.grad_accum == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
                optimizer.step()


    if __name__ == "__main__":
        parser = argparse.ArgumentParser()
        parser.add_argument("--lr", type=float, default=3e-4)
        parser.add_argument("--grad-accum", type=int, default=1)
        parser.add_argument("--max-norm", type=float, default=1.0)
        train(parser.parse_args(), None, None)
    """,
)
snippet(
    "tl303_unbindable",
    "TL303",
    """
    def train(model, loader, optimizer):
        for step, batch in enumerate(loader):
            optimizer.zero_grad()
            loss = model(**batch).loss * loss_weight
            loss.backward()
            if (step + 1) % 4 == 0:
                optimizer.step()
    """,
)

# TL501 ---------------------------------------------------------------------------------------------
snippet(
    "tl501_modulo_window",
    "TL501",
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP


    def train(net, loader, rank, accum=4):
        model = DDP(net, device_ids=[rank])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for i, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y) / accum
            loss.backward()
            if (i + 1) % accum == 0:
                opt.step()
                opt.zero_grad()
    """,
)
snippet(
    "tl501_micro_step_loop",
    "TL501",
    """
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP


    def train(net, get_batch, gradient_accumulation_steps=3):
        model = DDP(net)
        optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4)
        scaler = torch.amp.GradScaler(enabled=False)
        X, Y = get_batch("train")
        while True:
            for micro_step in range(gradient_accumulation_steps):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits, loss = model(X, Y)
                    loss = loss / gradient_accumulation_steps
                X, Y = get_batch("train")
                scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    """,
)
snippet(
    "tl501_accumulation_off_by_default",
    "TL501",
    """
    import argparse

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP


    def train(net, loader, args):
        model = DDP(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i, (x, y) in enumerate(loader):
            model(x).sum().backward()
            if (i + 1) % args.grad_accum == 0:
                opt.step()
                opt.zero_grad()


    if __name__ == "__main__":
        parser = argparse.ArgumentParser()
        parser.add_argument("--grad-accum", type=int, default=1)
    """,
)
snippet(
    "tl501_unbindable",
    "TL501",
    """
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP


    def train(net, loader, accum=4):
        model = DDP(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i, (x, y) in enumerate(loader):
            loss = model(x).pow(2).mean() * curriculum_weight(i)
            loss.backward()
            if (i + 1) % accum == 0:
                opt.step()
                opt.zero_grad()
    """,
)

# TL502 ---------------------------------------------------------------------------------------------
snippet(
    "tl502_label_count",
    "TL502",
    """
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("nccl")


    def train(model, loader, optimizer):
        model = DDP(model)
        for batch in loader:
            input_ids = batch["input_ids"]
            labels = batch["labels"]
            logits = model(input_ids)
            loss_sum = F.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
            )
            n_tokens = (labels != -100).sum()
            loss = loss_sum / n_tokens
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    """,
)
snippet(
    "tl502_attention_mask",
    "TL502",
    """
    import torch.distributed as dist
    import torch.nn.functional as F

    dist.init_process_group("nccl")


    def train(model, loader):
        for batch in loader:
            logits = model(batch["input_ids"])
            per_tok = F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none", ignore_index=-100)
            mask = batch["attention_mask"]
            loss = (per_tok * mask).sum() / mask.sum()
            loss.backward()
    """,
)
snippet(
    "tl502_packed_equal_counts",
    "TL502",
    """
    import torch.distributed as dist
    import torch.nn.functional as F

    dist.init_process_group("nccl")


    def train(model, loader):
        for batch in loader:
            input_ids = batch["input_ids"]
            logits = model(input_ids)[:, :-1]
            targets = input_ids[:, 1:]
            s = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")
            n = (targets != -100).sum()
            (s / n).backward()
    """,
)
snippet(
    "tl502_unbindable",
    "TL502",
    """
    import torch.distributed as dist
    import torch.nn.functional as F

    dist.init_process_group("nccl")


    def train(model, loader):
        for batch in loader:
            logits = model(batch["input_ids"])
            s = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
            n = (batch["labels"] != -100).sum()
            (s * loss_scale_factor / n).backward()
    """,
)


PLANTED = planted_mistakes(VERIFY_RULES)
VERIFY_FIXTURES = sorted({path for path, _, _ in PLANTED})
VERIFY_TIMEOUT = 90


def test_every_snippet_is_reported_by_its_rule(verified):
    verified.assert_each_snippet_reported_once(SNIPPETS)


def test_each_rule_has_a_true_bug_and_an_unbindable_snippet(verified):
    verified.assert_each_rule_confirms_and_names_what_it_cannot_bind(SNIPPETS, VERIFY_RULES)


# TL204 -------------------------------------------------------------------------------------------------


def test_tl204_dropout_recomputed_with_a_new_mask(verified):
    v = verified.one("tl204_dropout_module").verify
    assert v["status"] == "confirmed"
    # the forward is the same; only the recomputation in backward draws a new mask
    assert v["evidence"]["outputs_vs_reference"]["max_rel"] == 0.0
    assert v["evidence"]["as_written_vs_reference"]["max_rel"] > 0.01
    assert v["evidence"]["fixed_vs_reference"]["max_rel"] == 0.0


def test_tl204_functional_dropout_on_a_weight_argument(verified):
    v = verified.one("tl204_functional_dropout").verify
    assert v["status"] == "confirmed"
    assert "grad of input w" in v["detail"]


def test_tl204_zero_dropout_is_not_reproduced(verified):
    v = verified.one("tl204_dropout_zero").verify
    assert v["status"] == "not-reproduced"
    assert v["evidence"]["gradients_compared"] == 4


def test_tl204_unbindable_name(verified):
    v = verified.one("tl204_unbindable").verify
    assert v["status"] == "not-executable"
    assert "`project`" in v["detail"]


# TL302 -------------------------------------------------------------------------------------------------


def test_tl302_running_total_keeps_graphs_alive(verified):
    v = verified.one("tl302_running_total").verify
    assert v["status"] == "confirmed"
    growth = v["evidence"]["growth_per_iteration"]
    assert growth["reference"] == 0
    assert growth["as_written"] > 0
    nodes = v["evidence"]["live_autograd_nodes"]["as_written"]
    assert nodes == sorted(nodes) and len(set(nodes[1:])) == len(nodes) - 1  # grows every iteration


def test_tl302_list_of_losses(verified):
    v = verified.one("tl302_history_list").verify
    assert v["status"] == "confirmed"
    assert v["evidence"]["growth_per_iteration"]["reference"] == 0


def test_tl302_output_loss_through_accelerator_backward(verified):
    v = verified.one("tl302_accelerate_output_loss").verify
    assert v["status"] == "confirmed"


def test_tl302_unbindable_name(verified):
    v = verified.one("tl302_unbindable").verify
    assert v["status"] == "not-executable"
    assert "class_weights" in v["detail"]


# TL303 -------------------------------------------------------------------------------------------------


def test_tl303_zero_grad_first_keeps_only_the_last_microbatch(verified):
    v = verified.one("tl303_zero_grad_first").verify
    ev = v["evidence"]
    assert v["status"] == "confirmed"
    assert ev["optimizer_steps"] == {"as_written": 2, "reference": 2}
    assert all(rel > 0.1 for rel in ev["applied_gradient_max_rel"])
    assert ev["iterations"] == 8  # two windows of accum_steps=4


def test_tl303_model_zero_grad(verified):
    v = verified.one("tl303_model_zero_grad").verify
    assert v["status"] == "confirmed"
    assert v["evidence"]["iterations"] == 16


def test_tl303_gradients_cleared_right_before_the_step(verified):
    v = verified.one("tl303_cleared_before_step").verify
    assert v["status"] == "confirmed"
    assert "no gradient was left for the step" in v["detail"]
    assert "`lr_scheduler.step()` does nothing" in v["detail"]


def test_tl303_accumulation_count_one_is_not_reproduced(verified):
    v = verified.one("tl303_accumulation_off_by_default").verify
    assert v["status"] == "not-reproduced"
    assert "`args.grad_accum` = 1 (argparse default)" in v["detail"]


def test_tl303_unbindable_name(verified):
    v = verified.one("tl303_unbindable").verify
    assert v["status"] == "not-executable"
    assert "loss_weight" in v["detail"]


# TL501 -------------------------------------------------------------------------------------------------


def test_tl501_all_reduce_on_every_microbatch(verified):
    v = gloo_or_skip(verified.one("tl501_modulo_window").verify)
    ev = v["evidence"]
    assert v["status"] == "confirmed"
    assert ev["world_size"] == 2 and ev["backend"] == "gloo"
    # one all-reduce per synchronised backward (the tiny model fits in one bucket)
    assert ev["allreduces_per_step"] == {"as_written": [4, 4], "with_no_sync": [1, 1]}
    assert max(ev["applied_gradient_max_rel"]) < 1e-4  # the result is the same, only the traffic differs


def test_tl501_micro_step_loop(verified):
    v = gloo_or_skip(verified.one("tl501_micro_step_loop").verify)
    assert v["status"] == "confirmed"
    assert v["evidence"]["allreduces_per_step"] == {"as_written": [3, 3], "with_no_sync": [1, 1]}


def test_tl501_accumulation_count_one_is_not_reproduced(verified):
    v = gloo_or_skip(verified.one("tl501_accumulation_off_by_default").verify)
    assert v["status"] == "not-reproduced"
    assert (
        v["evidence"]["allreduces_per_step"]["as_written"]
        == v["evidence"]["allreduces_per_step"]["with_no_sync"]
    )


def test_tl501_unbindable_name(verified):
    v = gloo_or_skip(verified.one("tl501_unbindable").verify)
    assert v["status"] == "not-executable"
    assert "curriculum_weight" in v["detail"]


# TL502 -------------------------------------------------------------------------------------------------


def test_tl502_local_token_count_is_confirmed_and_the_global_count_matches(verified):
    v = gloo_or_skip(verified.one("tl502_label_count").verify)
    ev = v["evidence"]
    assert v["status"] == "confirmed"
    tokens = ev["valid_tokens_per_rank"]
    assert len(tokens) == 2 and tokens[0] != tokens[1]
    assert ev["as_written_vs_reference"]["max_rel"] > 0.1
    assert ev["fixed_vs_reference"]["max_rel"] < 1e-4


def test_tl502_attention_mask_count(verified):
    v = gloo_or_skip(verified.one("tl502_attention_mask").verify)
    assert v["status"] == "confirmed"


def test_tl502_equal_counts_on_every_rank_are_not_reproduced(verified):
    v = gloo_or_skip(verified.one("tl502_packed_equal_counts").verify)
    assert v["status"] == "not-reproduced"
    tokens = v["evidence"]["valid_tokens_per_rank"]
    assert tokens[0] == tokens[1]


def test_tl502_unbindable_name(verified):
    v = gloo_or_skip(verified.one("tl502_unbindable").verify)
    assert v["status"] == "not-executable"
    assert "loss_scale_factor" in v["detail"]


# fixtures ----------------------------------------------------------------------------------------------


def test_planted_fixture_mistakes_with_a_probe_are_found():
    assert {rule for _, rule, _ in PLANTED} == set(VERIFY_RULES)


@pytest.mark.parametrize(("path", "rule", "line"), PLANTED)
def test_planted_fixture_mistakes_are_confirmed(verified, path, rule, line):
    verified.assert_confirmed(path, rule, line)


# pieces -------------------------------------------------------------------------------------------------


def test_minimal_edit_keeps_the_change_and_drops_the_unchanged_text():
    text = "for x in data:\n    a()\n    b()\n    c()\n"
    whole = TextEdit(2, 5, 4, 8, "a()\n    c()")
    narrow = minimal_edit(text, whole)
    assert apply_text_edits(text, [narrow]) == apply_text_edits(text, [whole])
    assert (narrow.line, narrow.end_line) == (3, 4) and narrow.content == ""


@pytest.mark.cuda
def test_cuda_path():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    names = [
        "tl102_sgd_scaled_gradients",
        "tl103_counter_reset",
        "tl204_dropout_module",
        "tl303_zero_grad_first",
    ]
    findings, sources = SNIPPETS.findings(names)
    out = verify_findings(findings, sources, device="cuda", timeout=90)
    for finding in out:
        assert finding.verify["device"] == "cuda", finding.verify
        assert finding.verify["status"] == "confirmed", finding.verify["detail"]


# containment -------------------------------------------------------------------------------------------

DIST_RUNAWAY = textwrap.dedent(
    """
    import torch.distributed as dist
    import torch.nn.functional as F

    dist.init_process_group("nccl")


    def preprocess(ids):
        while True:
            pass


    def fine(model, loader):
        for batch in loader:
            logits = model(batch["input_ids"])
            s = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
            n = (batch["labels"] != -100).sum()
            (s / n).backward()


    def spins(model, loader):
        for batch in loader:
            input_ids = preprocess(batch["input_ids"])
            labels = batch["labels"]
            logits = model(input_ids)
            s = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
            n = (labels != -100).sum()
            (s / n).backward()
    """
)


@pytest.mark.slow
def test_data_parallel_snippet_that_never_returns_is_killed():
    findings = lint_source(DIST_RUNAWAY, "runaway_ddp.py", ["TL502"])
    assert len(findings) == 2
    budget = _two_process_budget()
    out = {
        f.line: f.verify
        for f in verify_findings(findings, {"runaway_ddp.py": DIST_RUNAWAY}, device="cpu", timeout=budget)
    }
    fine, spins = (gloo_or_skip(out[line]) for line in sorted(out))
    assert fine["status"] == "confirmed"
    assert spins["status"] == "not-executable"
    assert f"did not finish within {budget:g}s" in spins["detail"]


def _two_process_budget() -> float:
    """The time a 2-process probe may take, scaled by this machine's start-up time as measured now (a
    fixed 15 s failed on a busy machine): two processes each start Python, import torch and meet over
    gloo, plus the probe's own work."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch.distributed"], check=True, timeout=600)
    startup = time.perf_counter() - started
    return float(round(10 + 6 * startup))
