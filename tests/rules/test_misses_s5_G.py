"""Session 5 tuning miss of TL501: gradient accumulation on a model prepared by ``accelerator.prepare``
(DDP on several processes), split over the methods of one trainer class, and its silent look-alikes."""

from __future__ import annotations

import textwrap

from trainlint.engine import lint_source


def lines(code: str) -> list[int]:
    return [f.line for f in lint_source(textwrap.dedent(code).lstrip("\n"), "trainer.py", ["TL501"])]


_TRAINER = """
from accelerate import Accelerator

class Trainer:
    def prepare(self):
        self.accelerator = Accelerator()
        parts = self.accelerator.prepare(self.net, self.opt, self.loader)
        self.model = parts[0]
        self.optimizer = parts[1]

    def batch_loss(self, batch):
        return self.loss_fn(self.model(batch[0]), batch[1])

    def backward_step(self, loss):
        self.accelerator.backward(loss)

    def optimizer_step(self):
        self.optimizer.step()

    def run_epoch(self, loader):
        for step, batch in enumerate(loader):
            loss = self.batch_loss(batch) / self.accum_steps
            self.backward_step(loss)
            if (step + 1) % self.accum_steps == 0:
                self.optimizer_step()
                self.optimizer.zero_grad()
"""


def test_accumulation_split_over_methods_of_a_prepared_model_is_reported_at_the_backward_call() -> None:
    assert lines(_TRAINER) == [22]


def test_unpacked_prepare_in_one_function_is_reported() -> None:
    code = """
    from accelerate import Accelerator
    accelerator = Accelerator()
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for i, b in enumerate(loader):
        accelerator.backward(model(b).loss / accum)
        if (i + 1) % accum == 0:
            opt.step()
            opt.zero_grad()
    """
    assert lines(code) == [5]


def test_accumulate_context_is_silent() -> None:
    code = _TRAINER.replace(
        "            self.backward_step(loss)\n",
        "            with self.accelerator.accumulate(self.model):\n                self.backward_step(loss)\n",
    )
    assert lines(code) == []


def test_no_sync_in_the_backward_method_is_silent() -> None:
    code = _TRAINER.replace(
        "        self.accelerator.backward(loss)\n",
        "        with self.accelerator.no_sync(self.model):\n            self.accelerator.backward(loss)\n",
    )
    assert lines(code) == []


def test_accelerator_with_accumulation_steps_and_accumulate_is_silent() -> None:
    code = """
    from accelerate import Accelerator
    accelerator = Accelerator(gradient_accumulation_steps=4)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for b in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(b).loss)
            opt.step()
            opt.zero_grad()
    """
    assert lines(code) == []


def test_step_every_batch_is_silent() -> None:
    code = _TRAINER.replace("            if (step + 1) % self.accum_steps == 0:\n", "            if True:\n")
    assert lines(code) == []


def test_a_prepare_method_of_something_else_is_silent() -> None:
    code = _TRAINER.replace("self.accelerator.prepare(", "self.data.prepare(")
    assert lines(code) == []


def test_accumulation_handed_to_deepspeed_through_accelerate_is_silent() -> None:
    # Accelerate's test scripts: the count comes from the DeepSpeed config, whose engine owns the window
    code = """
    from accelerate import Accelerator
    accelerator = Accelerator()
    model, opt, loader = accelerator.prepare(model, opt, loader)
    accum = accelerator.state.deepspeed_plugin.deepspeed_config["gradient_accumulation_steps"]
    for i, b in enumerate(loader):
        accelerator.backward(model(b).loss / accum)
        if i % accum == 0:
            opt.step()
    """
    assert lines(code) == []


def test_accumulation_on_an_fsdp_prepared_model_is_silent() -> None:
    # under FSDP, skipping the reduce-scatter keeps unsharded gradients: a memory trade-off
    code = """
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for i, b in enumerate(loader):
        accelerator.backward(model(b).loss / accum)
        if i % accum == 0:
            opt.step()
    """
    assert lines(code) == []
