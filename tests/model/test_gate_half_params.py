"""TL105's condition on CPython's tree (``Rule.gate_check``): a module converted to 16-bit by a statement
of its own whose ``.parameters()`` are taken where the rule looks for its optimizer, and a call that may
build an optimizer. Files without one never reach libcst for TL105, and no finding changes."""

from __future__ import annotations

import ast
import textwrap

import pytest
from conftest import FIXTURES, gate_check_keeps_findings, lint_project

from trainlint import engine
from trainlint import gates as gates_module
from trainlint.engine import lint_text
from trainlint.gates import code_facts, gates, pass_tree_checks
from trainlint.model.gate_half_params import (
    may_train_half_parameters,
    may_train_parameters_converted_elsewhere,
)
from trainlint.results import LintOptions
from trainlint.rule import registry

RULE = registry().get("TL105")
OPTIONS = LintOptions(("TL105",), prefilter=False)

# Spellings of the invalid examples the rule reports: the check must keep each.
KEPT = [
    # the module, the dtype and the optimizer under aliases
    """
    import torch as T
    from torch import bfloat16 as bf
    from torch.optim import AdamW as Opt
    net = Net().to(bf)
    opt = Opt(net.parameters())
    """,
    # the dtype through two names, given positionally after the device
    """
    import torch
    from torch import optim
    DT = torch.float16
    dtype = DT
    def main():
        model = Net()
        model.to(device, dtype)
        opt = optim.SGD(model.parameters(), lr=0.1)
    """,
    # the optimizer built by a helper of the file the model is passed to
    """
    import torch
    def make_optimizer(args, net):
        return torch.optim.SGD(net.parameters(), lr=args.lr)
    def main(args):
        model = Net().cuda().half()
        optimizer = make_optimizer(args, model)
    """,
    # a builder returns the converted model, its caller trains it
    """
    import torch
    def build(name):
        model = load(name)
        model.bfloat16()
        return tokenizer, model
    def main():
        tok, lm = build("gpt2")
        opt = torch.optim.AdamW(lm.parameters(), lr=1e-5)
    """,
    # self.net converted in an async method, trained in a function nested in another method
    """
    import torch
    class Trainer:
        async def setup(self):
            self.net = self.net.to(dtype=torch.half)
        def optimizer(self):
            def make():
                return torch.optim.Adam(self.net.parameters())
            return make()
    """,
    # param groups from a comprehension over named_parameters, in a while loop
    """
    import torch
    while True:
        model = model.to(dtype=torch.float16)
        params = [p for n, p in model.named_parameters() if "bias" not in n]
        opt = torch.optim.SGD([{"params": params}], lr=0.1)
        break
    """,
    # the builder called through an alias
    """
    import torch
    def build(name):
        model = load(name)
        model.half()
        return model
    make = build
    def main():
        lm = make("gpt2")
        opt = torch.optim.AdamW(lm.parameters())
    """,
    # a dtype name that is fp32 in another function, bf16 in this one
    """
    import torch
    def evaluate():
        dtype = torch.float32
    def main():
        dtype = torch.bfloat16
        model = Net().to(dtype=dtype)
        opt = torch.optim.AdamW(model.parameters())
    """,
    # an `initialize` that is no master-weight machinery
    """
    import torch
    from mylib import initialize
    initialize(cfg)
    model = Net().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    """,
    # param groups through a name, a dict, `list(itertools.chain(...))` and `+`
    """
    import itertools, torch
    model = model.half()
    groups = [{"params": list(itertools.chain(model.parameters(), head.parameters()))}]
    opt = torch.optim.AdamW(groups + extra)
    """,
    # a module-level model trained in a function, its parameters filtered by a lambda, in a for loop
    """
    import torch
    model = Net().half()
    def train(loader):
        for batch in loader:
            opt = torch.optim.SGD(filter(lambda p: p.requires_grad, model.parameters()), lr=0.1)
    """,
]

# Files like those the prefilter and the gate send to libcst for TL105 today, where it reports nothing.
REJECTED = [
    # the model moved to a device, autocast to bf16 (accelerate's examples)
    """
    import torch
    model = model.to(device)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=lr)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(batch).loss
    """,
    # a model converted in one test, another trained in another test
    """
    import torch
    def test_inference():
        model = Net().to(torch.bfloat16)
        assert model(x).dtype == torch.bfloat16
    def test_training():
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    """,
    # tensors converted, the model's parameters elsewhere; a dtype chosen at run time
    """
    import torch
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = batch["x"].to(torch.bfloat16)
    weight_dtype = get_dtype(args.mixed_precision)
    model.to(weight_dtype)
    """,
    # back to fp32 in the chain, or 16-bit only under a call that is no module's method
    """
    import torch
    model = Net().half().float()
    head = torch.nn.Linear(8, 2).bfloat16().requires_grad_(False)
    logits = model(x).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    """,
    # converted, but no optimizer is built (the trainer's own, a framework's prepare)
    """
    import torch
    model.to(torch.float16)
    params = list(model.parameters())
    optimizer = accelerator.prepare(optimizer)
    """,
    # a dtype that is fp16 only under a flag (diffusers' training scripts): no conversion event
    """
    import torch
    def main(args):
        weight_dtype = torch.float32
        if args.mixed_precision == "fp16":
            weight_dtype = torch.float16
        vae.to(device, dtype=weight_dtype)
        unet.to(device, dtype=weight_dtype)
        optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    """,
    # the converted model's parameters only iterated and counted; the optimizer takes another's
    # (Megatron's tests)
    """
    import torch
    def test_reload():
        model = Net().bfloat16().cuda()
        for param in model.parameters():
            param.data.fill_(1.0)
        n = sum(p.numel() for p in model.parameters())
        optim = get_megatron_optimizer(config, [model])
        other = torch.optim.SGD(head.parameters(), lr=0.1)
    """,
    # converted and trained, with the conversion in an expression (an argument, a condition)
    """
    import torch
    wrapped = wrap(model.half())
    if model.bfloat16():
        pass
    opt = torch.optim.AdamW(model.parameters())
    """,
]


def _reported(text: str) -> bool:
    return bool(lint_text(text, "x.py", OPTIONS).findings)


@pytest.mark.parametrize("code", [e.code for e in RULE.invalid] + KEPT)
def test_a_reported_conversion_keeps_the_file(code: str) -> None:
    text = textwrap.dedent(code)
    assert _reported(text), "not a finding of TL105: the case tests nothing"
    assert may_train_half_parameters(ast.parse(text))


@pytest.mark.parametrize("code", REJECTED)
def test_a_file_without_a_trained_16_bit_module_is_ruled_out(code: str) -> None:
    text = textwrap.dedent(code)
    assert not _reported(text)
    assert not may_train_half_parameters(ast.parse(text))


def test_the_valid_examples_without_a_trained_conversion_are_ruled_out() -> None:
    # all but a rebinding (peft), a conversion after the optimizer (export) and an inference decorator,
    # which need the model's finer tests: no optimizer, tensors, fp32 parameters, a frozen backbone
    # whose parameters no optimizer takes, master-weight machinery (apex, DeepSpeed, Megatron-FSDP
    # twice), a copy of the parameters, a chain back to fp32, a dtype not known to be 16-bit
    kept = [i for i, code in enumerate(RULE.valid) if may_train_half_parameters(ast.parse(code))]
    assert kept == [9, 10, 13]


def test_the_engine_asks_the_check() -> None:
    gate = gates()["TL105"]
    assert gate.check == "gate_half_params.may_train_half_parameters"
    assert not pass_tree_checks([gate], ast.parse(textwrap.dedent(REJECTED[0])))
    assert pass_tree_checks([gate], ast.parse(textwrap.dedent(KEPT[0])))


# Where the conversion and the optimizer may sit, and how the conversion may be spelled.
PLACES = [
    "{conversion}\nopt = torch.optim.SGD({params}, lr=0.1)",
    "def main():\n    {conversion}\n    opt = torch.optim.SGD({params}, lr=0.1)",
    "{conversion}\ndef train():\n    opt = torch.optim.SGD({params}, lr=0.1)",
    "def outer():\n    def main():\n        {conversion}\n        opt = torch.optim.SGD({params}, lr=0.1)",
    "class T:\n    def fit(self):\n        {conversion}\n        opt = torch.optim.SGD({params}, lr=0.1)",
    "def make(net):\n    return torch.optim.SGD(net.parameters())\ndef main():\n    {conversion}\n    make(model)",
]
CONVERSIONS = [
    "model = Net().cuda().half()",
    "model.to(device, DT)",
    "model: Net = model.to(dtype=D2)",
    "model = Net().float().to(device).bfloat16()",
]
PARAMS = [
    "model.parameters()",
    "[p for n, p in model.named_parameters()]",
    "list(model.parameters()) + extra",
]
HEADER = "import torch\nDT = torch.bfloat16\nD2 = DT\n"


def test_every_placement_and_spelling_the_rule_reports_is_kept() -> None:
    reported = 0
    for place in PLACES:
        for conversion in CONVERSIONS:
            for params in PARAMS:
                text = HEADER + place.format(conversion=conversion, params=params)
                if _reported(text):
                    reported += 1
                    assert may_train_half_parameters(ast.parse(text)), text
    # (all but a bare `model.to(...)` at module level trained in a function: no module binding)
    assert reported == len(PLACES) * len(CONVERSIONS) * len(PARAMS) - len(PARAMS)


def test_every_reported_text_passes_the_check_and_the_findings_do_not_change() -> None:
    reported = gate_check_keeps_findings(
        "TL105", may_train_half_parameters, [textwrap.dedent(code) for code in KEPT + REJECTED]
    )
    assert reported >= len(RULE.invalid) + len(KEPT)


# -- across files (``Rule.project_gate_check``): a call of an imported name standing for the conversion --
# Spellings the cross-file findings rest on: the check must keep each.
KEPT_ELSEWHERE = [
    # a helper converts its argument, given by keyword; the optimizer under an alias
    """
    from torch.optim import AdamW as Opt
    from .convert import convert_weights
    def main(net):
        convert_weights(model=net)
        opt = Opt(net.parameters())
    """,
    # the helper converts `self`
    """
    import torch
    import helpers as h
    class Trainer:
        def configure(self):
            h.to_half(self)
            return torch.optim.AdamW(self.parameters(), lr=1e-4)
    """,
    # a loader returns the converted module in a tuple; param groups through a name
    """
    import torch
    from loader import load_unet
    def train(data):
        unet, _config = load_unet("ckpt.pt", use_fp16=True)
        groups = [{"params": [p for n, p in unet.named_parameters()]}]
        optimizer = torch.optim.AdamW(groups, lr=1e-5)
    """,
    # a class converting itself when built, an alias of it; module-level model trained in a function
    """
    import torch
    from nets import Net
    Model = Net
    model = Model()
    def train():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    """,
    # `self.model` assigned in `__init__`, trained in another method
    """
    import torch
    from loader import load
    class Trainer:
        def __init__(self):
            self.model = load("ckpt")
        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters())
    """,
    # built by a classmethod in a builder, trained by the caller through a helper, a project optimizer
    """
    from nets.model import Retrieval
    from nets.optim import BertAdam
    def init_model(width):
        model = Retrieval.from_pretrained(width)
        return model
    def prep_optimizer(args, model):
        return BertAdam(list(model.named_parameters()), lr=args.lr)
    def main(args):
        model = init_model(args.width)
        optimizer = prep_optimizer(args, model)
    """,
]

# Files the rule had as cross-file candidates (the parameters' words and an optimizer, no 16-bit word).
REJECTED_ELSEWHERE = [
    # the imported helpers get the loss and a tensor; the model is a parameter nothing imported is given
    """
    import torch
    from helpers import log_stats, cast_inputs
    def train(model, loader):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in loader:
            loss = model(cast_inputs(x)).sum()
            log_stats(loss)
    """,
    # the helper converts the backbone; the optimizer trains the head
    """
    import torch
    from helpers import to_half
    def main(backbone, head):
        to_half(backbone)
        opt = torch.optim.SGD(head.parameters(), lr=0.1)
    """,
    # the model is built by the file's own class; `self.net` of another function is no `self.x` trained
    """
    import torch
    from helpers import describe
    class Net(torch.nn.Module):
        pass
    def main():
        model = Net()
        describe(model.parameters())
        opt = torch.optim.Adam(model.parameters())
    """,
    # the imported model is trained in another test function; the parameters only counted
    """
    import torch
    from models import Net
    def test_build():
        model = Net()
        assert sum(p.numel() for p in model.parameters())
    def test_train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    """,
    # no optimizer is built (the framework's own), or DeepSpeed owns the precision
    """
    from models import Net
    model = Net()
    params = list(model.parameters())
    optimizer = accelerator.prepare(optimizer)
    """,
    """
    import deepspeed, torch
    from models import Net
    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    engine, opt, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    """,
]


@pytest.mark.parametrize("code", KEPT_ELSEWHERE)
def test_a_call_of_an_imported_name_that_may_convert_a_trained_module_keeps_the_file(code: str) -> None:
    assert may_train_parameters_converted_elsewhere(ast.parse(textwrap.dedent(code)))


@pytest.mark.parametrize("code", REJECTED_ELSEWHERE)
def test_a_file_no_other_file_can_make_train_16_bit_parameters_is_ruled_out(code: str) -> None:
    text = textwrap.dedent(code)
    assert _a_cross_file_candidate(text)
    assert not may_train_parameters_converted_elsewhere(ast.parse(text))


def _a_cross_file_candidate(text: str) -> bool:
    """Not active for TL105, but its project prefilter and project gate (atoms) pass."""
    gate = gates()["TL105"]
    active = engine._code_gate(text, LintOptions(("TL105",)))[0]
    in_code = gate.in_project_code(code_facts(ast.parse(text)).text)
    return not active and gate.can_fire_in_project(text) and in_code


def test_a_conversion_statement_of_the_file_keeps_it_too() -> None:
    # (``_converted_here`` runs in the cross-file path as well)
    for code in [e.code for e in RULE.invalid] + KEPT:
        assert may_train_parameters_converted_elsewhere(ast.parse(textwrap.dedent(code)))


CONVERTS = "def convert_weights(model):\n    model.half()\n\ndef to_half(module):\n    module.half()\n"
LOADER = """
def load_unet(path, use_fp16=False):
    unet = build(path)
    if use_fp16:
        unet.convert_to_fp16()
    return unet, path
"""
NETS = """
import torch
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.half()
"""
# (the files, the linted one, the lines of TL105's findings): each kind of cross-file finding
PROJECTS = [
    # a helper converts its argument (by keyword); the optimizer of a same-file helper trains it
    (
        {"convert.py": CONVERTS},
        "import torch\nfrom convert import convert_weights\n\ndef make(m):\n"
        "    return torch.optim.SGD(m.parameters(), lr=0.1)\n\ndef main(net):\n"
        "    convert_weights(model=net)\n    opt = make(net)\n",
        [5],
    ),
    # the helper converts `self`
    (
        {"convert.py": CONVERTS},
        "import torch\nfrom convert import to_half\n\nclass T:\n    def fit(self):\n        to_half(self)\n"
        "        return torch.optim.AdamW(self.parameters())\n",
        [7],
    ),
    # a loader returns the module it converts when its flag is passed; `self.unet` in another method
    (
        {"loader.py": LOADER},
        "import torch\nfrom loader import load_unet\n\nclass T:\n    def __init__(self):\n"
        "        self.unet, _ = load_unet('x', use_fp16=True)\n    def opt(self):\n"
        "        return torch.optim.AdamW(self.unet.parameters())\n",
        [8],
    ),
    # a class converting itself when built; a module-level model trained in a function
    (
        {"nets.py": NETS},
        "import torch\nfrom nets import Net\n\nmodel = Net()\n\ndef train():\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n",
        [7],
    ),
]


def _fp16_init() -> dict[str, str]:
    root = FIXTURES / "project" / "fp16_init"
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*.py"))}


@pytest.mark.parametrize(("files", "code", "lines"), [*PROJECTS, (_fp16_init(), None, [18])])
def test_every_kind_of_cross_file_finding_is_still_reported(
    tmp_path, monkeypatch, capsys, files: dict[str, str], code: str | None, lines: list[int]
) -> None:
    files = dict(files) if code is None else {**files, "train.py": code}
    target = "bad_train.py" if code is None else "train.py"
    found = lint_project(tmp_path, files, target, monkeypatch, capsys)
    assert [f["line"] for f in found if f["rule"] == "TL105"] == lines
    assert may_train_parameters_converted_elsewhere(ast.parse(files[target]))


def test_the_check_spares_the_index_and_the_parse_of_a_candidate(tmp_path, monkeypatch) -> None:
    """A file whose imported helpers convert what they are given (the rule's facts are there) but whose
    optimizer trains nothing they get: without the check the project path parses it for nothing."""
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "helpers.py").write_text(CONVERTS.replace("convert_weights", "log_stats"))
    text = textwrap.dedent(REJECTED_ELSEWHERE[0]).replace(", cast_inputs", "").replace("cast_inputs(x)", "x")
    path = tmp_path / "train.py"
    path.write_text(text)
    options = LintOptions(("TL105",))
    assert _a_cross_file_candidate(text)
    assert [g.id for g in engine._code_gate(text, options)[1]] == []
    checked = lint_text(text, str(path), options)
    assert checked.findings == [] and not checked.parsed
    unchecked = gates_module._tree_check
    monkeypatch.setattr(  # the check left out: it says True
        gates_module, "_tree_check", lambda name: (lambda _: True) if "elsewhere" in name else unchecked(name)
    )
    assert [g.id for g in engine._code_gate(text, options)[1]] == ["TL105"]
    monkeypatch.setattr(
        engine, "callees_asked", lambda name, tree: None
    )  # (the other question that spares it)
    without = lint_text(text, str(path), options)
    assert without.findings == [] and without.parsed  # (the index wanted `log_stats`: libcst parsed it)
