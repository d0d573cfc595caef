"""TL507's condition on CPython's tree (``Rule.gate_check``): the wrapped module (or the wrapper's
``.module``) called in a loop of a scope that runs a backward, after the wrap, in no loop that calls the
wrapper. Files that only wrap (``model = DDP(model)``, ``return DDP(module)``), call the wrapper, or call
the inner module where nothing trains never reach libcst for TL507, and no finding changes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import gate_check_keeps_findings

from trainlint.engine import lint_text
from trainlint.gates import gates, pass_tree_checks
from trainlint.model import gate_wrapped_model
from trainlint.model.gate_wrapped_model import wrapped_module_may_be_called
from trainlint.results import LintOptions

HEAD = "import torch\nimport torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
LOOP = "for x in loader:\n    model(x).sum().backward()\n"

# The rule reports each of these (checked below): the check must keep them.
REPORTED = [
    "ddp = DDP(model)\n" + LOOP,
    "ddp = DDP(module=model)\n" + LOOP,
    "ddp: nn.Module = DDP(model, device_ids=[0])\n" + LOOP,
    "ddp = other = DDP(model)\n" + LOOP,
    "if distributed:\n    ddp = DDP(model)\n" + LOOP,
    # the wrapper's name, spelled through imports and assignments
    "W = DDP\nW2 = W\nddp = W2(model)\n" + LOOP,
    "W = torch.nn.parallel.DistributedDataParallel\nddp = W(model)\n" + LOOP,
    "import torch.nn.parallel as par\nddp = par.DistributedDataParallel(model)\n" + LOOP,
    "from torch.nn.parallel import DistributedDataParallel\nddp = DistributedDataParallel(model)\n" + LOOP,
    "from torch.nn import parallel\nddp = parallel.DistributedDataParallel(model)\n" + LOOP,
    # loops: while, nested, a loop's else inside another loop, async for, one-line bodies
    "ddp = DDP(model)\nwhile True:\n    loss = model(x)\n    loss.backward()",
    "ddp = DDP(model)\nfor e in range(3):\n    for x in loader:\n        pass\n    else:\n"
    "        model(x).sum().backward()",
    "async def train(stream):\n    ddp = DDP(model)\n    async for x in stream:\n"
    "        model(x).sum().backward()",
    "ddp = DDP(model)\nfor x in loader: model(x).sum().backward()",
    # comprehensions belong to their scope; an f-string's call counts
    "ddp = DDP(model)\nfor x in loader:\n    outs = [model(b) for b in x]\n    torch.stack(outs).sum().backward()",
    "ddp = DDP(model)\nfor x in loader:\n    print(f'{model(x)}')\n    loss.backward()",
    "ddp = DDP(model)\nfor x in loader:\n    with torch.autocast('cuda'):\n        y = model(x)\n    y.sum().backward()",
    # methods: `self.` names seen from another method of the class
    "class T:\n    def __init__(self, m):\n        self.net = m\n        self.ddp = DDP(self.net)\n"
    "    def fit(self, loader):\n        for x in loader:\n            self.net(x).sum().backward()",
    "class T:\n    def setup(self):\n        self.ddp = DDP(self.net)\n        self.raw = self.ddp.module\n"
    "    def fit(self, loader):\n        for x in loader:\n            self.raw(x).sum().backward()",
    "class T:\n    def fit(self, loader):\n        self.ddp = DDP(self.net)\n        for x in loader:\n"
    "            self.ddp.module(x).sum().backward()",
    "class T:\n    def __init__(self, m):\n        self.ddp = DDP(self.net)\n    def fit(self, loader):\n"
    "        for x in loader:\n            def step():\n                self.net(x).sum().backward()\n"
    "            step()",
    # the inner module through `.module`, a conditional or `getattr`, also from a global wrap
    "model = DDP(net)\nfor x in loader:\n    model.module(x).sum().backward()",
    "model = DDP(net)\nraw = model.module if isinstance(model, DDP) else model\nfor x in loader:\n"
    "    raw(x).sum().backward()",
    "model = DDP(net)\nraw = model if not ddp else model.module\nfor x in loader:\n    raw(x).sum().backward()",
    "model = DDP(net)\nraw = getattr(model, 'module', model)\nfor x in loader:\n    raw(x).sum().backward()",
    "model = DDP(net)\nraw = getattr(model, 'module')\nfor x in loader:\n    raw(x).sum().backward()",
    "def train(loader):\n    for x in loader:\n        model.module(x).sum().backward()\n"
    "if __name__ == '__main__':\n    model = DDP(net)\n    train(loader)",
    "def train(loader):\n    raw = getattr(model, 'module', model)\n    for x in loader:\n"
    "        raw(x).sum().backward()\nmodel = DDP(net)",
    # a function or lambda defined in the loop: the loop around it counts, as in the model
    "model = DDP(net)\nfor x in loader:\n    def step():\n        model.module(x).sum().backward()\n    step()",
    "model = DDP(net)\nfor x in loader:\n    run = lambda: model.module(x).sum().backward()",
    "raw = None\nmodel = DDP(net)\nraw = model.module\nfor x in loader:\n    def step():\n"
    "        raw(x).sum().backward()\n    step()",
    # the wrapper called in another loop only
    "ddp = DDP(model)\nfor x in warmup:\n    ddp(x)\nfor x in loader:\n    model(x).sum().backward()",
    # inner module of a nanoGPT-like script
    "model = DDP(model, device_ids=[rank])\nraw_model = model.module if ddp else model\n"
    "while True:\n    logits, loss = raw_model(X, Y)\n    scaler.scale(loss).backward()\n    scaler.step(opt)",
]
# The check keeps these though the rule does not report them: it does not ask for `no_grad`, nor resolve
# a name through its scopes or its imports.
KEPT_UNREPORTED = [
    "ddp = DDP(model)\nwith torch.no_grad():\n    for x in loader:\n        model(x)\n"
    "for x in loader:\n    ddp(x).sum().backward()",
    "from mylib import DistributedDataParallel\nddp = DistributedDataParallel(model)\n" + LOOP,
    "model = DDP(net)\ndef train(loader, model):\n    for x in loader:\n        model.module(x).sum().backward()",
]
# Like the corpus files the rule sent to libcst for nothing: the check rules them out.
REJECTED = [
    "model = DDP(model)\n" + LOOP,  # one name for both
    "ddp = DDP(model)\nfor x in loader:\n    ddp(x).sum().backward()",
    "ddp = DDP(model)\nfor x in loader:\n    ref = model(x)\n    (ddp(x) - ref).sum().backward()",
    "ddp = DDP(model)\nfor x in loader:\n    model(x)\n    for y in x:\n        ddp(y).sum().backward()",
    LOOP + "ddp = DDP(model)",  # before the wrap
    "for x in warmup:\n    model(x)\nddp = DDP(model)\nfor x in loader:\n    ddp(x).sum().backward()",
    "ddp = DDP(model)\nfor x in loader:\n    model(x)",  # nothing trains in that scope
    "ddp = DDP(model)\ndef evaluate(model, loader):\n    for x in loader:\n        model(x)\n"
    "for x in loader:\n    ddp(x).sum().backward()",
    "ddp = DDP(model)\nmodel(x).sum().backward()",  # not in a loop
    "ddp = DDP(model)\nfor x in loader:\n    pass\nelse:\n    model(x).sum().backward()",
    "ddp = DDP(model)\nouts = [model(b) for b in loader]\nloss.backward()",  # no loop frame
    "ddp = DDP(model)\nfor x in loader:\n    loss = step(x)\n    loss.backward()\ndef step(x):\n    return model(x)",
    "ddp = DDP(model)\nwhile model(x):\n    loss.backward()",  # the test is not in the body
    "ddp = DDP(model)\nfor x in model(data):\n    loss.backward()",
    "def wrap(model):\n    ddp = DDP(model)\n    return ddp\nfor x in loader:\n    model(x).sum().backward()",
    # the wrap is not bound to a name (Lightning's and accelerate's strategies)
    "def setup(model):\n    return DDP(model, device_ids=[0])\nfor x in loader:\n    model(x).sum().backward()",
    "wrapped = [DDP(model)]\n" + LOOP,
    "ddp, = DDP(model),\n" + LOOP,
    # the wrapper's `.module`, read in a scope the wrap does not reach, or no inner module at all
    "def main():\n    model = DDP(net)\ndef train():\n    for x in loader:\n        model.module(x).sum().backward()",
    "model = DDP(net)\nraw = getattr(model, 'config', model)\nfor x in loader:\n    raw(x).sum().backward()",
    "model = DDP(net)\nraw = model.module.encoder\nfor x in loader:\n    raw(x).sum().backward()",
    "model = DDP(net)\nfor x in loader:\n    model.module.encoder(x).sum().backward()",
    "model = DDP(net)\nraw = model.module if ddp else model\nfor x in loader:\n"
    "    model(x).sum().backward()\n    raw.estimate_mfu(x)",
    # another class's `self.`
    "class A:\n    def setup(self):\n        self.ddp = DDP(self.net)\nclass B:\n    def fit(self, loader):\n"
    "        for x in loader:\n            self.net(x).sum().backward()",
    # not the DDP class
    "ddp = MyWrapper(model)  # DistributedDataParallel\n" + LOOP,
    "ddp = DistributedDataParallelKwargs(model)\n" + LOOP,
    "DDP\n" + LOOP,
]


def _text(code: str) -> str:
    return HEAD + code + "\n"


def _reported(text: str) -> bool:
    off = lint_text(text, "x.py", LintOptions(("TL507",), prefilter=False))
    return any(f.rule == "TL507" for f in off.findings)


@pytest.mark.parametrize("code", REPORTED)
def test_a_reported_spelling_keeps_the_file(code: str) -> None:
    text = _text(code)
    assert _reported(text), "not a finding of the rule: the case tests nothing"
    assert wrapped_module_may_be_called(ast.parse(text))


@pytest.mark.parametrize("code", KEPT_UNREPORTED)
def test_what_the_check_does_not_tell_keeps_the_file(code: str) -> None:
    assert wrapped_module_may_be_called(ast.parse(_text(code)))


@pytest.mark.parametrize("code", REJECTED)
def test_a_file_without_such_a_call_is_ruled_out(code: str) -> None:
    text = _text(code)
    assert not wrapped_module_may_be_called(ast.parse(text))
    assert not pass_tree_checks([gates()["TL507"]], ast.parse(text))
    assert not _reported(text), "the check ruled out a file the rule reports"


def test_every_reported_text_passes_the_check_and_the_findings_do_not_change() -> None:
    extra = [_text(code) for code in REPORTED + KEPT_UNREPORTED + REJECTED]
    assert gate_check_keeps_findings("TL507", wrapped_module_may_be_called, extra) >= len(REPORTED)


def test_the_check_does_not_load_libcst() -> None:
    tree = ast.parse(Path(gate_wrapped_model.__file__).read_text(encoding="utf-8"))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {
        "__future__",
        "ast",
        "trainlint.model.gate_calls",
        "trainlint.model.pyast",
        "trainlint.model.summary",
        "trainlint.model.vocab",
    }
