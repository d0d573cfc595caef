"""TL501 says what the model is: a DistributedDataParallel one, or one prepared by Accelerate."""

from __future__ import annotations

import textwrap

from trainlint.engine import lint_source

LOOP = """
for i, b in enumerate(loader):
    loss = model(b).loss / accum
    {backward}
    if (i + 1) % accum == 0:
        opt.step()
        opt.zero_grad()
"""

ACCELERATE = (
    "from accelerate import Accelerator\naccelerator = Accelerator()\n"
    "model, opt, loader = accelerator.prepare(model, opt, loader)\n"
)
DDP = "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net, device_ids=[rank])\n"


def message(head: str, backward: str) -> str:
    code = head + textwrap.dedent(LOOP).format(backward=backward)
    (finding,) = lint_source(code, "train.py", ["TL501"])
    return finding.message


def test_a_model_prepared_by_accelerate_is_named_so_with_accelerates_remedy() -> None:
    text = message(ACCELERATE, "accelerator.backward(loss)")
    assert "prepared by `accelerator.prepare(...)`" in text
    assert "DistributedDataParallel model" not in text
    assert "`accelerator.accumulate(model)`" in text


def test_a_ddp_model_keeps_its_name_and_no_sync() -> None:
    text = message(DDP, "loss.backward()")
    assert "DistributedDataParallel model" in text and "`model.no_sync()`" in text
    assert "accelerator" not in text
