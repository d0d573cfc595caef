"""``--verify`` of the token probes on recipe-style training classes (TL301, TL502): the loss computed in
a helper method of the class, ``self.`` members built in ``__init__`` (a loss from a config, a cached
tensor, a context manager), a division under the accumulation condition that reads totals the loop
body builds. Each pair differs only in what flips the verdict: uneven valid-token counts (the labels
as padded) vs equal ones (every position a label)."""

from __future__ import annotations

import pytest
from conftest import Snippets, gloo_or_skip

from trainlint.verify import torch_available

pytestmark = pytest.mark.skipif(not torch_available(), reason="--verify needs torch")

VERIFY_RULES = ("TL301", "TL302", "TL303", "TL502")
VERIFY_FIXTURES = ()
VERIFY_TIMEOUT = 90

SNIPPETS = Snippets()
pair = SNIPPETS.pair

# a recipe whose loop calls a loss-step method of its own class; the model call is inside it
pair(
    "tl301_helper_method",
    "TL301",
    """
    import torch


    class Recipe:
        def __init__(self, cfg, model):
            self._model = model
            self._loss_fn = torch.nn.CrossEntropyLoss(ignore_index=-100)
            self._accum = 4

        def _loss_step(self, batch: dict) -> torch.Tensor:
            labels = batch.pop("labels")
            logits = self._model(**batch)
            return self._loss_fn(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))

        def train(self, loader, optimizer):
            for idx, batch in enumerate(loader):
                loss = self._loss_step(batch)
                loss = loss / self._accum
                loss.backward()
                if (idx + 1) % self._accum == 0:
                    optimizer.step()
                    optimizer.zero_grad()
    """,
    'labels = batch.pop("labels")',
    'labels = batch.pop("labels").clamp(min=0)',
)

# the members the loop reads are built in __init__: a cached tensor of ignore labels (sized by the
# config's batch size), a context manager, a loss from a config
pair(
    "tl301_init_members",
    "TL301",
    """
    import contextlib

    import torch


    class Recipe:
        def __init__(self, cfg, model):
            self._model = model
            self._loss_fn = instantiate(cfg.loss, ignore_index=-100)
            self.offload_ctx = contextlib.nullcontext()
            self.ignore_cache = torch.full((cfg.batch_size, 1), self._loss_fn.ignore_index)

        def train(self, loader, optimizer, accum_steps=4):
            for idx, batch in enumerate(loader):
                labels = batch.pop("labels")
                with self.offload_ctx:
                    logits = self._model(**batch)
                labels = torch.hstack((labels[..., 1:], self.ignore_cache[: labels.shape[0]]))
                loss = self._loss_fn(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
                loss = loss / accum_steps
                loss.backward()
                if (idx + 1) % accum_steps == 0:
                    optimizer.step()
                    optimizer.zero_grad()
    """,
    'labels = batch.pop("labels")',
    'labels = batch.pop("labels").clamp(min=0)',
)

# TL502: the division sits under the accumulation condition; the loop body builds the totals
pair(
    "tl502_totals_in_the_loop_body",
    "TL502",
    """
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")


    class Recipe:
        def __init__(self, cfg, model):
            self._model = model
            self._loss_fn = instantiate(cfg.loss)

        def train(self, loader, optimizer, accum_steps=2):
            running_loss = 0
            num_tokens = 0
            for idx, batch in enumerate(loader):
                labels = batch.pop("labels")
                current = (labels != self._loss_fn.ignore_index).sum()
                num_tokens += current
                logits = self._model(**batch)
                running_loss += self._loss_fn(logits.reshape(-1, logits.size(-1)), labels.reshape(-1)) * current
                if (idx + 1) % accum_steps == 0:
                    loss = running_loss / num_tokens
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    running_loss = 0
                    num_tokens = 0
    """,
    'labels = batch.pop("labels")',
    'labels = batch.pop("labels").clamp(min=0)',
)


def test_every_snippet_is_reported_by_its_rule(verified):
    verified.assert_each_snippet_reported_once(SNIPPETS)


def test_tl301_climbs_into_the_loss_step_method_of_the_class(verified):
    uneven, equal = verified.pair("tl301_helper_method")
    assert uneven["status"] == "confirmed", uneven["detail"]
    assert equal["status"] == "not-reproduced", equal["detail"]
    assert len(set(equal["evidence"]["valid_tokens_per_microbatch"])) == 1
    for v in (uneven, equal):
        assert "`self._loss_step(...)` (a method of this class) runs as written" in v["detail"]
        assert (
            "`self._loss_fn` built as the class builds it (`torch.nn.CrossEntropyLoss(ignore_index=-100)`)"
            in v["detail"]
        )


def test_tl301_members_built_in_init_are_built_or_stood_in_and_named(verified):
    uneven, equal = verified.pair("tl301_init_members")
    assert uneven["status"] == "confirmed", uneven["detail"]
    assert equal["status"] == "not-reproduced", equal["detail"]
    detail = uneven["detail"]
    assert "`self.offload_ctx` (set to `contextlib.nullcontext()`) entered as a no-op context" in detail
    assert "`self.ignore_cache` built as the class builds it" in detail
    assert "`cfg.batch_size` = 64 (room for every batch of the probe)" in detail
    assert (
        "`self._loss_fn` (set to `instantiate(cfg.loss, ignore_index=-100)`) stood in by CrossEntropyLoss()"
        in detail
    )


def test_tl502_division_under_the_accumulation_condition_reads_the_loop_bodys_totals(verified):
    uneven, equal = verified.pair("tl502_totals_in_the_loop_body")
    uneven, equal = gloo_or_skip(uneven), gloo_or_skip(equal)
    assert uneven["status"] == "confirmed", uneven["detail"]
    assert equal["status"] == "not-reproduced", equal["detail"]
    tokens = uneven["evidence"]["valid_tokens_per_rank"]
    assert tokens[0] != tokens[1]
    assert "(matches)" in uneven["detail"]  # the all-reduced count is the documented fix
    for v in (uneven, equal):
        assert "`running_loss` starts at 0, as before the loop" in v["detail"]
        assert "`num_tokens` starts at 0, as before the loop" in v["detail"]


# TL303 in a Lightning step function under manual optimization: `self.manual_backward`, the
# optimizers from `self.optimizers()`, `batch_idx` counting the batches; the count from __init__
LIGHTNING_STEP = """
import pytorch_lightning as pl
import torch


class Module(pl.LightningModule):
    def __init__(self, net, accumulate_grad_batches: int = 4):
        super().__init__()
        self.net = net
        self.automatic_optimization = False
        self.accumulate_grad_batches = accumulate_grad_batches

    def training_step(self, batch, batch_idx):
        g_opt, d_opt = self.optimizers()
        g_sch, d_sch = self.lr_schedulers()
        loss = torch.nn.functional.mse_loss(self.net(batch), batch)
        self.log("loss", loss)
        g_opt.zero_grad()
        self.manual_backward(loss)
        if (batch_idx + 1) % self.accumulate_grad_batches == 0:
            self.clip_gradients(g_opt, gradient_clip_val=self.clip_val, gradient_clip_algorithm="norm")
            g_opt.step()
            g_sch.step()
        d_loss = self.disc_loss(batch)
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
"""
pair(
    "tl303_lightning_step",
    "TL303",
    LIGHTNING_STEP,
    "accumulate_grad_batches: int = 4",
    "accumulate_grad_batches: int = 1",
)
# the class's default is not what runs when the file builds the class with a computed value
pair(
    "tl303_lightning_built_with",
    "TL303",
    LIGHTNING_STEP.replace("accumulate_grad_batches: int = 4", "accumulate_grad_batches: int = 1")
    + "\n\ndef main(net, total, micro):\n    return Module(net, accumulate_grad_batches=1)\n",
    "accumulate_grad_batches=1)",
    "accumulate_grad_batches=total // micro)",
)


def test_tl303_lightning_step_function_with_manual_backward(verified):
    four, one = verified.pair("tl303_lightning_step")
    assert four["status"] == "confirmed", four["detail"]
    assert one["status"] == "not-reproduced", one["detail"]
    for v in (four, one):
        assert (
            "`batch_idx` counts the probe's iterations (`training_step` runs once per batch)" in v["detail"]
        )
        assert "`self.manual_backward(loss)` (Lightning) runs `loss.backward()`" in v["detail"]
        assert "`g_sch.step()` does nothing" in v["detail"]
    assert "`self.accumulate_grad_batches` = 4 (set in `Module.__init__`" in four["detail"]


def test_tl303_class_default_unused_when_the_file_builds_the_class_with_a_computed_count(verified):
    literal, computed = verified.pair("tl303_lightning_built_with")
    assert literal["status"] == "not-reproduced", literal["detail"]
    assert computed["status"] == "confirmed", computed["detail"]
    assert "`self.accumulate_grad_batches` taken as 4 (its value is not in the file)" in computed["detail"]


# TL302: the loss is read from the output dict the step returns (`output["loss"]`), and the whole
# dict is kept; a list started afresh on every iteration keeps one iteration's graph only
pair(
    "tl302_output_dict",
    "TL302",
    """
    def train(module, loader, optimizer):
        outputs = []
        for i, batch in enumerate(loader):
            optimizer.zero_grad()
            output = module.training_step(batch, i)
            output["loss"].backward()
            optimizer.step()
            outputs.append(output)
            print(i)
        return outputs
    """,
    "print(i)",
    "outputs = []",
)


def test_tl302_loss_read_from_an_output_dict_kept_whole(verified):
    kept, reset = verified.pair("tl302_output_dict")
    assert kept["status"] == "confirmed", kept["detail"]
    assert reset["status"] == "not-reproduced", reset["detail"]
    assert "`outputs.append(output)`" in kept["detail"]


# TL303: the loss read by key from what a call returns (`f(...)["loss"].mean()`), autocast given
# keyword arguments the probe cannot build (`**autocast_kwargs`), a clip threshold set at run time
pair(
    "tl303_keyed_loss_runtime_settings",
    "TL303",
    """
    import torch
    from torch import autocast

    from mylib import get_setup


    def train(model, loader, optimizer, transport, args, grad_accum_steps=4):
        autocast_kwargs = get_setup(args)
        clip_grad = args.clip if args.clip > 0 else None
        global_step = 0
        for step, (x, y) in enumerate(loader):
            optimizer.zero_grad(set_to_none=True)
            with autocast(**autocast_kwargs):
                loss = transport.training_losses(model, x, y)["loss"].mean()
            (loss / grad_accum_steps).backward()
            if clip_grad:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
            global_step += 1
            if global_step % grad_accum_steps == 0:
                optimizer.step()
    """,
    "grad_accum_steps=4",
    "grad_accum_steps=1",
)


def test_tl303_keyed_loss_and_settings_known_only_at_run_time(verified):
    four, one = verified.pair("tl303_keyed_loss_runtime_settings")
    assert four["status"] == "confirmed", four["detail"]
    # a count of 1: every iteration steps, as with the zero_grad moved after the step
    assert one["status"] == "not-reproduced", one["detail"]
    for v in (four, one):
        assert "`autocast_kwargs` (keyword arguments the probe cannot build) passed empty" in v["detail"]
        assert "`clip_grad` (the clip threshold, set at run time) taken as 1.0" in v["detail"]


# TL302: the flagged addition sits in a loop nested in the training loop (over the output's
# entries); the window is the body of the loop that also holds the backward
pair(
    "tl302_nested_loop",
    "TL302",
    """
    from collections import defaultdict


    def train(model, loader, optimizer):
        totals = defaultdict(float)
        for x, y in loader:
            optimizer.zero_grad()
            output = model(x, y)
            output["loss"].backward()
            optimizer.step()
            for name, value in output.items():
                totals[name] += value
            print(len(totals))
    """,
    "print(len(totals))",
    "totals = defaultdict(float)",
)


def test_tl302_addition_in_a_loop_nested_in_the_training_loop(verified):
    kept, reset = verified.pair("tl302_nested_loop")
    assert kept["status"] == "confirmed", kept["detail"]
    assert reset["status"] == "not-reproduced", reset["detail"]


# TL303: the counter the accumulation condition reads is advanced at the end of the loop body, after
# statements the window leaves out; an EMA update of the weights in the step branch
pair(
    "tl303_counter_at_the_end",
    "TL303",
    """
    import torch

    from mylib import update_ema


    def train(model, ema_model, loader, optimizer, grad_accum_steps=4, log_every=100):
        global_step = 0
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / grad_accum_steps).backward()
            if global_step % grad_accum_steps == 0:
                optimizer.step()
                update_ema(ema_model, model, decay=0.999)
            if global_step % log_every == 0:
                print(loss.item())
            global_step += 1
    """,
    "grad_accum_steps=4",
    "grad_accum_steps=1",
)


def test_tl303_counter_advanced_at_the_end_of_the_loop_body(verified):
    four, one = verified.pair("tl303_counter_at_the_end")
    assert four["status"] == "confirmed", four["detail"]
    assert one["status"] == "not-reproduced", one["detail"]
    for v in (four, one):
        assert "`update_ema(...)` (a moving average of the weights) left out" in v["detail"]


# the same without the EMA: only the counter at the end of the body decides (as written before, the
# window left it out, the count stayed 0 and every iteration stepped: a wrong not-reproduced)
pair(
    "tl303_counter_only",
    "TL303",
    """
    import torch


    def train(model, loader, optimizer, grad_accum_steps=4, log_every=100):
        global_step = 0
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / grad_accum_steps).backward()
            if global_step % grad_accum_steps == 0:
                optimizer.step()
            if global_step % log_every == 0:
                print(loss.item())
            global_step += 1
    """,
    "grad_accum_steps=4",
    "grad_accum_steps=1",
)


def test_tl303_counter_at_the_end_of_the_body_moves(verified):
    four, one = verified.pair("tl303_counter_only")
    assert four["status"] == "confirmed", four["detail"]
    assert one["status"] == "not-reproduced", one["detail"]
