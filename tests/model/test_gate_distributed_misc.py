"""TL502's, TL505's and TL506's conditions on CPython's tree (``Rule.gate_check``, one function each in
``trainlint.model.gate_distributed_misc``): a data-parallel file dividing a loss by a local token count,
a shuffling DistributedSampler in a file that loops over epochs, torch's norm clipping of an FSDP1
model's parameters. Files that only name those things (Lightning's and accelerate's sources and tests,
the Fabric examples) never reach libcst for these rules, and no finding changes."""

from __future__ import annotations

import ast
from collections.abc import Callable

import pytest
from conftest import gate_check_keeps_findings

from trainlint.engine import lint_text
from trainlint.gates import gates
from trainlint.model.gate_distributed_misc import (
    fsdp_model_clipped_by_torch,
    shuffling_sampler_and_epoch_loop,
    token_count_division_under_data_parallel,
)
from trainlint.results import LintOptions

Check = Callable[[ast.Module], bool]

# -- TL502 ---------------------------------------------------------------------------------------------
DP = "import torch\nimport torch.nn.functional as F\nimport torch.distributed as dist\ndist.init_process_group('nccl')\n"
CE_SUM = "s = F.cross_entropy(x, y, reduction='sum')\n"
TL502_REPORTED = [
    DP + CE_SUM + "n = (y != -100).sum()\nloss = s / n\nloss.backward()",
    # the data-parallel call and the loss under other names
    "import torch.distributed as d\nfrom torch.nn import functional as G\nd.init_process_group('nccl')\n"
    "s = G.cross_entropy(x, y, reduction='sum')\n(s / (y != -100).sum()).backward()",
    "from torch.nn.parallel import DistributedDataParallel as D\nimport torch.nn.functional as F\n"
    "model = D(net)\n" + CE_SUM + "(s / (y != -100).sum()).backward()",
    # the count through `.float()`, through `+=`, through a second name
    DP + CE_SUM + "n = mask.sum()\n(s / n.float()).backward()",
    DP + CE_SUM + "n = 0\nfor m in masks:\n    n += m.sum()\nloss = s / n\nloss.backward()",
    DP + CE_SUM + "k = mask.sum()\nn = k\nloss = s / n\nloss.backward()",
    # a criterion built with `reduction=`, as a name and as an attribute of self
    DP + "crit = torch.nn.CrossEntropyLoss(reduction='sum')\nloss = crit(x, y) / mask.sum()\nloss.backward()",
    DP
    + "class T:\n    def __init__(self):\n        self.crit = torch.nn.CrossEntropyLoss(reduction='none')\n"
    "    def step(self, x, y, m):\n        loss = (self.crit(x, y) * m).sum() / m.sum()\n        loss.backward()",
    DP + "crit = torch.nn.NLLLoss(size_average=False)\nloss = crit(x, y) / mask.sum()\nloss.backward()",
    # a reciprocal, Lightning's manual backward, a helper whose result is backpropagated
    DP + CE_SUM + "loss = s * (1.0 / mask.sum())\nloss.backward()",
    DP + CE_SUM + "loss = s / mask.sum()\nself.manual_backward(loss)",
    DP
    + "def compute(x, y):\n    s = F.cross_entropy(x, y, reduction='sum')\n    return s / (y != -100).sum()\n"
    "loss = compute(x, y)\nloss.backward()",
]
TL502_REJECTED = [
    # a single process
    "import torch.nn.functional as F\n" + CE_SUM + "(s / (y != -100).sum()).backward()",
    # divided by the batch size, not a token count
    DP + CE_SUM + "(s / x.size(0)).backward()",
    # nothing backpropagated
    DP + CE_SUM + "ppl = (s / (y != -100).sum()).exp().item()",
    # a KL divergence, not a cross-entropy, summed per token
    DP + "kl = F.kl_div(a, b, reduction='none')\nloss = kl.sum() / mask.sum()\nloss.backward()",
    DP + "loss = torch.nn.MSELoss(reduction='sum')(a, b) / mask.sum()\nloss.backward()",
    # a mean loss (no reduction) and an accuracy over counts, as in the Fabric examples
    "import lightning as L\nimport torch.nn.functional as F\nfabric = L.Fabric()\n"
    "for x, y in loader:\n    loss = F.nll_loss(model(x), y)\n    fabric.backward(loss)\n"
    "test_loss, correct = 0, 0\nfor x, y in test_loader:\n    out = model(x)\n"
    "    test_loss += F.nll_loss(out, y, reduction='sum').item()\n"
    "    correct += out.argmax(1).eq(y).sum().item()\n"
    "test_loss = fabric.all_gather(test_loss).sum() / len(test_loader.dataset)\n"
    "acc = 100.0 * correct / len(test_loader.dataset)",
    DP + "def accuracy(p, t):\n    return (p == t).sum().float() / t.size(0)\n"
    "loss = torch.nn.CrossEntropyLoss(reduction='mean')(x, y)\nloss.backward()",
]

TL502_KEPT_UNSURE = [
    # a count divides a loss that is no sum: the dividend's origin is not traced
    DP + CE_SUM + "acc = correct / mask.sum()\nloss = F.cross_entropy(x, y)\nloss.backward()",
]

# -- TL505 ---------------------------------------------------------------------------------------------
HEAD = "from torch.utils.data import DataLoader, DistributedSampler\n"
LOOP = "for epoch in range(10):\n    for b in loader:\n        step(b)\n"
TL505_REPORTED = [
    HEAD + "sampler = DistributedSampler(ds)\nloader = DataLoader(ds, sampler=sampler)\n" + LOOP,
    # the class under other names
    "from torch.utils.data import DistributedSampler as DS\nsampler = DS(ds)\n" + LOOP,
    "import torch\nS = torch.utils.data.distributed.DistributedSampler\nsampler = S(ds)\n" + LOOP,
    "import torch.utils.data as tud\nsampler = tud.DistributedSampler(ds, shuffle=True)\n" + LOOP,
    # loops that name an epoch elsewhere: a while test, an attribute, a keyword, the loop's head only
    HEAD + "sampler = DistributedSampler(ds)\nwhile self.epoch < cfg.max_epochs:\n    run(sampler)",
    HEAD + "sampler = DistributedSampler(ds)\nfor i in range(start, cfg.train.num_epochs):\n    run(sampler)",
    HEAD + "sampler = DistributedSampler(ds)\nfor i in trange(n, desc_epochs=True):\n    run(sampler)",
    HEAD + "async def main():\n    sampler = DistributedSampler(ds)\n    async for epoch in epochs():\n"
    "        run(sampler)",
    # seeded, but not built anew in the loop; built in the loop's head
    HEAD + "sampler = DistributedSampler(ds, seed=0)\n" + LOOP,
    HEAD + "for epoch in make(DistributedSampler(ds, seed=1)):\n    run(epoch)",
    # a helper the evaluation calls, but the module too; one whose only call in an evaluation function
    # is of a parameter of its name (the rule finds no caller); one called from a lambda
    HEAD + "def make_loader(ds):\n    return DataLoader(ds, sampler=DistributedSampler(ds))\n"
    "def run_validation(ds):\n    return make_loader(ds)\nloader = make_loader(ds)\n" + LOOP,
    HEAD + "def make_loader(ds):\n    return DataLoader(ds, sampler=DistributedSampler(ds))\n"
    "def run_validation(make_loader):\n    return make_loader(ds)\nfor epoch in range(3):\n    fit()",
    HEAD + "def make_loader(ds):\n    return DataLoader(ds, sampler=DistributedSampler(ds))\n"
    "def run_validation(ds):\n    return (lambda: make_loader(ds))()\nfor epoch in range(3):\n    fit()",
]
# Where the check answers True though the rule reports nothing: it does not follow what it cannot
# follow cheaply (each must stay True: a False here would need the rule's reasoning, checked first).
TL505_KEPT_UNSURE = [
    # a method only the evaluation calls through `self.` (``local_callee`` follows it, the check does not)
    HEAD + "class T:\n    def loader(self, ds):\n        return DistributedSampler(ds)\n"
    "    def run_validation(self):\n        return self.loader(ds)\n    def fit(self):\n"
    "        for epoch in range(3):\n            run()",
    # the sampler's own name says evaluation
    HEAD + "eval_sampler = DistributedSampler(ds)\n" + LOOP,
]
TL505_REJECTED = [
    # no loop over epochs (an epoch in a string, a keyword of a call, a method's name)
    HEAD + "print('epoch')\nsampler = DistributedSampler(ds)\nfor b in DataLoader(ds, sampler=sampler):\n"
    "    step(b)",
    HEAD + "def on_train_epoch_end(self):\n    pass\ntrainer = Trainer(max_epochs=1)\n"
    "def _get_distributed_sampler(loader, **kwargs):\n    return DistributedSampler(loader.dataset, **kwargs)",
    # no shuffling, an evaluation dataset, a sampler built anew each epoch with its seed
    HEAD + "sampler = DistributedSampler(ds, shuffle=False)\n" + LOOP,
    HEAD + "sampler = DistributedSampler(val_dataset)\n" + LOOP,
    HEAD + "sampler = DistributedSampler(dataset=args.eval_set)\n" + LOOP,
    HEAD + "for epoch in range(10):\n    sampler = DistributedSampler(ds, seed=epoch)\n    run(sampler)",
    HEAD + "for epoch in range(10):\n    run()\nelse:\n    sampler = DistributedSampler(ds, seed=7)",
    # a helper only the evaluation calls
    HEAD + "def get_loader(ds):\n    return DataLoader(ds, sampler=DistributedSampler(ds))\n"
    "def pretrain_validation(ds):\n    return get_loader(ds)\nfor epoch in range(3):\n    fit()",
    # another library's sampler of the same name
    "import torch\nfrom mylib.samplers import DistributedSampler\nsampler = DistributedSampler(ds)\n" + LOOP,
]

# -- TL506 ---------------------------------------------------------------------------------------------
FSDP = "import torch\nfrom torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
TL506_REPORTED = [
    FSDP + "model = FSDP(net)\ntorch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
    # the clip function and the wrapper under other names
    "from torch.nn.utils import clip_grad_norm_ as clip\nimport torch.distributed.fsdp as fsdp\n"
    "m = fsdp.FullyShardedDataParallel(net)\nclip(m.parameters(), 1.0)",
    "import torch\nfrom torch.distributed import fsdp\nclip = torch.nn.utils.clip_grad_norm\n"
    "m = fsdp.FullyShardedDataParallel(net)\nclip(m.parameters(), 1.0)",
    # keyword and named parameters, an annotated assignment, a dotted target
    FSDP + "model = FSDP(net)\ntorch.nn.utils.clip_grad_norm_(parameters=model.parameters(), max_norm=1.0)",
    FSDP + "model = FSDP(net)\ntorch.nn.utils.clip_grad_norm_([p for _, p in model.named_parameters()], 1)",
    FSDP + "model: torch.nn.Module = FSDP(net)\ntorch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
    FSDP
    + "def train(net):\n    model = FSDP(net)\n    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
    # `self.` names in another method, and in a function nested in one
    FSDP + "class T:\n    def __init__(self, net):\n        self.model = FSDP(net)\n"
    "    def step(self):\n        def clip():\n            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1)\n"
    "        clip()",
]
TL506_REJECTED = [
    # accelerate's way: the wrap and a clip of whatever parameters it is given
    FSDP + "model = FSDP(model)\ndef clip(parameters, max_norm):\n"
    "    return torch.nn.utils.clip_grad_norm_(parameters, max_norm)",
    # the wrapped name is another function's
    FSDP + "def build(net):\n    model = FSDP(net)\n    return model\n"
    "def train(model):\n    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
    # NO_SHARD, FSDP's own method, element-wise clipping, another module's parameters
    FSDP + "from torch.distributed.fsdp import ShardingStrategy\n"
    "model = FSDP(net, sharding_strategy=ShardingStrategy.NO_SHARD)\n"
    "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
    FSDP + "model = FSDP(net)\nmodel.clip_grad_norm_(1.0)",
    FSDP + "model = FSDP(net)\ntorch.nn.utils.clip_grad_value_(model.parameters(), 0.5)",
    FSDP + "model = FSDP(net)\ntorch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)",
    # the wrap is returned, not assigned; a `self.` name of another class; FSDP2
    FSDP
    + "def wrap(module):\n    return FSDP(module)\ntorch.nn.utils.clip_grad_norm_(module.parameters(), 1)",
    FSDP + "class A:\n    def setup(self, net):\n        self.model = FSDP(net)\n"
    "class B:\n    def step(self):\n        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1)",
    "import torch\nfrom torch.distributed.fsdp import fully_shard, FullyShardedDataParallel\nfully_shard(model)\n"
    "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
]

TL506_KEPT_UNSURE = [
    # FSDP's own method on a branch that returns first (``on_other_path``): not asked
    FSDP + "def clip(net, use_fsdp):\n    model = FSDP(net)\n    if use_fsdp:\n"
    "        return model.clip_grad_norm_(1.0)\n    return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
]

CASES: dict[str, tuple[Check, list[str], list[str]]] = {
    "TL502": (token_count_division_under_data_parallel, TL502_REPORTED, TL502_REJECTED),
    "TL505": (shuffling_sampler_and_epoch_loop, TL505_REPORTED, TL505_REJECTED),
    "TL506": (fsdp_model_clipped_by_torch, TL506_REPORTED, TL506_REJECTED),
}


def _reports(rule_id: str, text: str) -> bool:
    found = lint_text(text, "x.py", LintOptions((rule_id,), prefilter=False)).findings
    return any(f.rule == rule_id for f in found)


@pytest.mark.parametrize(
    ("rule_id", "code"), [(rule, code) for rule, (_, kept, _) in CASES.items() for code in kept]
)
def test_a_file_the_rule_reports_on_passes_its_check(rule_id: str, code: str) -> None:
    check = CASES[rule_id][0]
    assert _reports(rule_id, code + "\n"), "the case must be one the rule reports"
    assert check(ast.parse(code + "\n"))


@pytest.mark.parametrize(
    ("rule_id", "code"), [(rule, code) for rule, (_, _, out) in CASES.items() for code in out]
)
def test_a_file_without_a_finding_is_ruled_out(rule_id: str, code: str) -> None:
    check = CASES[rule_id][0]
    assert not check(ast.parse(code + "\n"))
    assert not _reports(rule_id, code + "\n")


UNSURE = {"TL502": TL502_KEPT_UNSURE, "TL505": TL505_KEPT_UNSURE, "TL506": TL506_KEPT_UNSURE}


@pytest.mark.parametrize(
    ("rule_id", "code"), [(rule, code) for rule, codes in UNSURE.items() for code in codes]
)
def test_what_the_check_does_not_follow_keeps_the_file(rule_id: str, code: str) -> None:
    assert not _reports(rule_id, code + "\n")
    assert CASES[rule_id][0](ast.parse(code + "\n"))


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_every_reported_text_passes_the_check_and_the_findings_do_not_change(rule_id: str) -> None:
    check, kept, out = CASES[rule_id]
    gate_check_keeps_findings(rule_id, check, [c + "\n" for c in kept + out + UNSURE[rule_id]])


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_the_rule_names_its_check(rule_id: str) -> None:
    assert gates()[rule_id].check == f"gate_distributed_misc.{CASES[rule_id][0].__name__}"
