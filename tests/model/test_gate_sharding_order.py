"""TL503's condition on CPython's tree (``Rule.gate_check``): in one scope, an optimizer call over a
module's parameters not after that module's sharding call. Files that shard in one method and build the
optimizer in another, build it after the wrap, or over another module never reach libcst for TL503, and
no finding changes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import gate_check_keeps_findings

from trainlint.engine import lint_text
from trainlint.gates import gates, pass_tree_checks
from trainlint.model import gate_sharding_order
from trainlint.model.gate_sharding_order import optimizer_may_precede_sharding
from trainlint.results import LintOptions

HEAD = (
    "import torch\nimport torch.nn as nn\n"
    "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, fully_shard\n"
)
OPT = "opt = torch.optim.AdamW(model.parameters(), lr=1e-4)\n"

# The rule reports each of these (checked below): the check must keep them.
REPORTED = [
    OPT + "model = FSDP(model)",
    OPT + "fully_shard(model)",
    OPT + "fully_shard(module=model)",
    OPT + "model = FSDP(model, use_orig_params=False)",
    OPT + "model: nn.Module = FSDP(model)",
    OPT + "if use_fsdp:\n    model = FSDP(model)",
    "if a:\n    " + OPT + "elif b:\n    pass\nfully_shard(model)",
    "if a:\n    " + OPT + "    fully_shard(model)",
    # the wrapper's and the optimizer's names, spelled through imports and assignments
    "import torch.distributed.fsdp as dist_fsdp\n"
    + OPT
    + "model = dist_fsdp.FullyShardedDataParallel(model)",
    "from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel as F\n"
    + OPT
    + "model = F(model)",
    "Wrap = FSDP\nW2 = Wrap\n" + OPT + "model = W2(model)",
    "(W := FSDP)\n" + OPT + "model = W(model)",
    "from torch.distributed._composable.fsdp import fully_shard as shard\n" + OPT + "shard(model)",
    "from torch import optim as O\nopt = O.SGD(model.parameters(), lr=0.1)\nfully_shard(model)",
    "Opt = torch.optim.AdamW\nopt = Opt(model.parameters())\nfully_shard(model)",
    "import bitsandbytes as bnb\nopt = bnb.optim.AdamW8bit(model.parameters())\nfully_shard(model)",
    "opt = torch.optim.AdamW([p for n, p in model.named_parameters() if p.requires_grad])\nfully_shard(model)",
    # an optimizer a model method or a factory builds, bound to an optimizer's name
    "optimizer = model.configure_optimizers(0.1, 6e-4)\nmodel = FSDP(model)",
    "optimizer = build_optimizer(model, cfg)\nmodel = FSDP(model)",
    "class Trainer:\n    def setup(self):\n        self.opt = self.make_optimizer(self.model)\n"
    "        fully_shard(self.model)",
    # scopes: nested functions, methods, lambdas, comprehensions, loops, class bodies, decorators
    "def outer():\n    def inner(model):\n        " + OPT + "        fully_shard(model)\n    return inner",
    "class T:\n    def setup(self):\n        self.optimizer = torch.optim.AdamW(self.model.parameters())\n"
    "        fully_shard(self.model, mesh=self.mesh)",
    "setup = lambda m: (torch.optim.SGD(m.parameters(), lr=1), fully_shard(m))",
    "opts = [torch.optim.SGD(m.parameters(), lr=1) for m in parts]\nfor m in parts:\n    fully_shard(m)",
    "async def f(stream):\n    async for m in stream:\n        opt = torch.optim.SGD(m.parameters())\n"
    "        fully_shard(m)",
    "while True:\n    " + OPT + "    fully_shard(model)",
    "class C:\n    " + OPT + "    fully_shard(model)",
    "@register(torch.optim.SGD(model.parameters(), lr=1), fully_shard(model))\ndef f():\n    pass",
    "print(f'{torch.optim.SGD(model.parameters(), lr=1)}')\nfully_shard(model)",
    # accelerate, in a file that mentions FSDP (a comment is enough)
    "# fsdp\n" + OPT + "model = accelerator.prepare(model)",
    "# FSDP\n" + OPT + "model = self.accelerator.prepare(model, loader)",
    "# fsdp\nopt = accelerator.prepare(model)",  # the same call counts as both
]
# The check keeps these though the rule may not report them: it cannot see comments, nor the project.
KEPT_UNREPORTED = [
    OPT + "model = accelerator.prepare(model)",  # no "fsdp" in the text
    "from mypkg.optim import FusedLamb\nopt = FusedLamb(model.parameters())\nfully_shard(model)",
    # a call inside an f-string: CPython < 3.12 may misplace it, so order is not asked
    "fully_shard(model)\nprint(f'{torch.optim.SGD(model.parameters(), lr=1)}')",
]
# Like the corpus files the rule sent to libcst for nothing: the check rules them out.
REJECTED = [
    "model = FSDP(model)\n" + OPT,
    "fully_shard(model)\n" + OPT,
    "opt = torch.optim.AdamW(disc.parameters())\nmodel = FSDP(model)",
    OPT + "model = FSDP(model, use_orig_params=True)",
    OPT + "model = FSDP(model.module)",
    OPT + "return_value = [FSDP(model)]",  # not bound to a name: no wrap the rule follows
    "def build(model):\n    return FSDP(model)\ndef make_opt(model):\n    return torch.optim.SGD(model.parameters())",
    "if args.fsdp:\n    model = FSDP(model)\nelse:\n    " + OPT,
    "if not args.fsdp:\n    " + OPT + "else:\n    fully_shard(model)",
    "if a:\n    " + OPT + "elif b:\n    fully_shard(model)",
    "model = model.to(device)\nmodel = FSDP(model)",
    "sched = torch.optim.lr_scheduler.StepLR(model.parameters())\nfully_shard(model)",
    "groups = [p for p in model.parameters()]\nopt = torch.optim.AdamW(groups)\nfully_shard(model)",
    "make = lambda: torch.optim.SGD(model.parameters(), lr=1)\nfully_shard(model)",
    "def f():\n    " + OPT + "fully_shard(model)",
    "optimizer = make_optimizer()\nmodel = FSDP(model)",
    "result = build_optimizer(model, cfg)\nmodel = FSDP(model)",
    # Lightning's strategies: the wrap in one method, the optimizers in another
    "class Strategy:\n    def setup_module(self, module):\n        return FSDP(module)\n"
    "    def setup_optimizer(self, optimizer):\n        return torch.optim.AdamW(self.model.parameters())",
    "class Model:\n    def configure_model(self):\n        fully_shard(self.model)\n"
    "    def configure_optimizers(self):\n        return torch.optim.AdamW(self.model.parameters())",
    # accelerate: the optimizer prepared with the model, or built after; a `prepare` of another object
    "# fsdp\n" + OPT + "model, opt = accelerator.prepare(model, opt)",
    "# fsdp\nmodel = accelerator.prepare(model)\n" + OPT,
    "# fsdp\n" + OPT + "model = self.prepare(model)",
    "# fsdp\n" + OPT + "model = accelerator.prepare(*parts)",
    # names that are not the wrapper
    "from mylib import FullyShardedDataParallel\n" + OPT + "model = FullyShardedDataParallel(model)",
    "from torch.distributed.fsdp import *\n" + OPT + "model = FullyShardedDataParallel(model)",
]


def _text(code: str) -> str:
    return HEAD + code + "\n"


def _reported(text: str) -> bool:
    off = lint_text(text, "x.py", LintOptions(("TL503",), prefilter=False))
    return any(f.rule == "TL503" for f in off.findings)


@pytest.mark.parametrize("code", REPORTED)
def test_a_reported_spelling_keeps_the_file(code: str) -> None:
    text = _text(code)
    assert _reported(text), "not a finding of the rule: the case tests nothing"
    assert optimizer_may_precede_sharding(ast.parse(text))


@pytest.mark.parametrize("code", KEPT_UNREPORTED)
def test_what_the_tree_cannot_tell_keeps_the_file(code: str) -> None:
    assert optimizer_may_precede_sharding(ast.parse(_text(code)))


@pytest.mark.parametrize("code", REJECTED)
def test_a_file_without_such_a_pair_is_ruled_out(code: str) -> None:
    text = _text(code)
    assert not optimizer_may_precede_sharding(ast.parse(text))
    assert not pass_tree_checks([gates()["TL503"]], ast.parse(text))
    assert not _reported(text), "the check ruled out a file the rule reports"


def test_every_reported_text_passes_the_check_and_the_findings_do_not_change() -> None:
    extra = [_text(code) for code in REPORTED + KEPT_UNREPORTED + REJECTED]
    assert gate_check_keeps_findings("TL503", optimizer_may_precede_sharding, extra) >= len(REPORTED)


def test_the_check_does_not_load_libcst() -> None:
    tree = ast.parse(Path(gate_sharding_order.__file__).read_text(encoding="utf-8"))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {
        "__future__",
        "ast",
        "re",
        "collections.abc",
        "dataclasses",
        "trainlint.model.pyast",
        "trainlint.model.summary",
        "trainlint.model.gate_calls",
        "trainlint.model.vocab",
    }
