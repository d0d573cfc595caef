"""Session 5 tuning misses of the sharding rules (TL503, TL506, TL507): the general shapes of the real
cases, each with a look-alike that stays silent."""

from __future__ import annotations

import textwrap

from trainlint.engine import lint_source


def lines(rule: str, code: str) -> list[int]:
    return [f.line for f in lint_source(textwrap.dedent(code).lstrip("\n"), "train.py", [rule])]


_TL506_GUARD = """
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

class Trainer:
    def __init__(self, policy, fsdp):
        self.fsdp = fsdp
        if fsdp:
            self.policy = FSDP(policy)
        else:
            self.policy = policy

    def clip_gradient(self):
        if self.fsdp:
            return self.policy.clip_grad_norm_(self.max_norm).item()
        return torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_norm).item()
"""


def test_tl506_torch_clip_after_a_guard_that_returns_fsdps_own_clip_is_the_plain_path() -> None:
    # ContextualAI/HALOs trainers.py: the FSDP case returns through FSDP's method first
    assert lines("TL506", _TL506_GUARD) == []


def test_tl506_torch_clip_in_the_else_of_fsdps_own_clip_is_silent() -> None:
    code = _TL506_GUARD.replace(
        "            return self.policy.clip_grad_norm_(self.max_norm).item()\n        return",
        "            norm = self.policy.clip_grad_norm_(self.max_norm)\n        else:\n            norm =",
    )
    assert "else:" in code
    assert lines("TL506", code) == []


def test_tl506_still_reports_when_the_guard_does_not_return() -> None:
    # FSDP's method under the guard, then the torch function on every path: the FSDP case clips twice,
    # the second time by the shard's norm
    code = _TL506_GUARD.replace(
        "return self.policy.clip_grad_norm_(self.max_norm).item()",
        "self.policy.clip_grad_norm_(self.max_norm)",
    )
    assert lines("TL506", code) == [15]
    # and a guard that returns without FSDP's method leaves the torch clip on the FSDP path
    code = _TL506_GUARD.replace("return self.policy.clip_grad_norm_(self.max_norm).item()", "return 0.0")
    assert lines("TL506", code) == [15]


_TL507_UNWRAP = """
import torch
from torch.nn.parallel import DistributedDataParallel

def train_epoch(loader, optimizer):
    actor = actor_model.module if isinstance(actor_model, DistributedDataParallel) else actor_model
    for batch in loader:
        loss = actor(batch).loss
        loss.backward()
        optimizer.step()

if __name__ == "__main__":
    actor_model = build()
    if dist.is_initialized():
        actor_model = DistributedDataParallel(actor_model, device_ids=[rank])
    train_epoch(loader, optimizer)
"""


def test_tl507_reports_the_unwrapped_module_called_in_training_under_another_name() -> None:
    # jingyaogong/minimind train_ppo.py: the DDP model unwrapped through `.module`, then trained
    assert lines("TL507", _TL507_UNWRAP) == [7]
    direct = _TL507_UNWRAP.replace(
        "actor_model.module if isinstance(actor_model, DistributedDataParallel) else actor_model",
        "getattr(actor_model, 'module', actor_model)",
    )
    assert lines("TL507", direct) == [7]


def test_tl507_module_attribute_called_directly_in_training() -> None:
    code = """
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(net)
    for x in loader:
        model.module(x).sum().backward()
    """
    assert lines("TL507", code) == [4]


def test_tl507_unwrapped_module_outside_training_is_silent() -> None:
    # the unwrapped module used for generation without grad, saved, or called where nothing trains
    no_grad = _TL507_UNWRAP.replace(
        "    for batch in loader:", "    with torch.no_grad():\n      for batch in loader:"
    )
    no_grad = no_grad.replace("        loss = actor(batch).loss", "        out = actor(batch)")
    no_grad = no_grad.replace("        loss.backward()\n", "")
    assert lines("TL507", no_grad) == []
    both = _TL507_UNWRAP.replace(
        "loss = actor(batch).loss", "ref = actor(batch)\n        loss = actor_model(batch).loss"
    )
    assert lines("TL507", both) == []
    # a name unwrapped from a model that is not wrapped in DDP
    other = _TL507_UNWRAP.replace(
        "actor_model = DistributedDataParallel(actor_model", "critic = DistributedDataParallel(critic"
    )
    assert lines("TL507", other) == []


_TL503_METHOD = """
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

def main(args):
    model = GPT(args).to(device)
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4)
    if use_fsdp:
        model = FSDP(model, device_id=rank)
    for x, y in loader:
        model(x, y).backward()
        optimizer.step()
"""


def test_tl503_optimizer_from_a_model_method_before_the_wrap() -> None:
    # intelligent-machine-learning/dlrover nanogpt train.py
    assert lines("TL503", _TL503_METHOD) == [6]
    factory = _TL503_METHOD.replace("model.configure_optimizers(", "build_optimizer(model, ")
    assert lines("TL503", factory) == [6]
    method = _TL503_METHOD.replace("model.configure_optimizers(", "self.make_optimizer(model, ")
    assert lines("TL503", method) == [6]


def test_tl503_optimizer_method_after_the_wrap_or_of_another_model_is_silent() -> None:
    after = _TL503_METHOD.replace(
        "    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4)\n", ""
    ).replace("    for x, y", "    optimizer = model.configure_optimizers(weight_decay=0.1)\n    for x, y")
    assert lines("TL503", after) == []
    other = _TL503_METHOD.replace("optimizer = model.configure", "optimizer = critic.configure")
    assert lines("TL503", other) == []
    # a model method whose result is not an optimizer
    not_opt = _TL503_METHOD.replace(
        "optimizer = model.configure_optimizers", "groups = model.param_groups_for"
    )
    assert lines("TL503", not_opt) == []
    kept = _TL503_METHOD.replace("FSDP(model, device_id=rank)", "FSDP(model, use_orig_params=True)")
    assert lines("TL503", kept) == []
