"""The conditions on CPython's tree (``Rule.gate_check``) of TL405 (attention written out by hand, in a
file without the fused kernel), TL204 (a ``preserve_rng_state=`` that may be False) and TL205 (a Hugging
Face checkpointing switch without its kwargs, in a file naming no input-grad fix). Every text the rule
reports passes its check; files like the corpus's that the rule silently parsed are ruled out. TL204's
cross-file condition (``Rule.project_gate_check``): a call of another file's wrapper given something
that may draw random numbers."""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import gate_check_keeps_findings, lint_project

from trainlint.engine import lint_text
from trainlint.gates import gates, pass_tree_checks
from trainlint.model.gate_attention_scores import hand_written_attention
from trainlint.model.gate_checkpoint_misc import (
    hf_checkpointing_may_lack_kwargs,
    rng_flag_may_be_off,
    wrapper_may_leave_rng_off,
)
from trainlint.results import LintOptions

Check = Callable[[ast.Module], bool]

ATTN = "import math\nimport torch\nimport torch.nn.functional as F\nfrom torch import nn\n\nclass Attn(nn.Module):\n"
# (TL405) reported by the rule: the check must keep them
ATTENTION_REPORTED = [
    ATTN
    + "    def forward(self, q, k, v):\n        return F.softmax(q @ k.transpose(-1, -2) / 8, dim=-1) @ v",
    # a function nested in a method sees the method's class
    ATTN + "    def forward(self, q, k, v):\n        def inner(q):\n"
    "            w = torch.softmax(q @ k.mT, dim=-1)\n            return w @ v\n        return inner(q)",
    # the values product through a name bound to torch.matmul
    "import torch\nfrom torch import nn\nmm = torch.matmul\n\nclass A(nn.Module):\n"
    "    def forward(self, q, k, v):\n        s = torch.matmul(q, k.transpose(2, 3))\n"
    "        p = s.softmax(-1)\n        return mm(p, v)",
    # the values product inside a lambda of the method's statements
    ATTN + "    def forward(self, q, k, v):\n        p = F.softmax(q @ k.swapaxes(-2, -1), dim=-1)\n"
    "        return (lambda: p @ v)()",
    # the fused kernel called through a name the model cannot resolve surely: not ruled out
    ATTN
    + "    def forward(self, q, k, v):\n        return F.softmax(q @ k.transpose(-2, -1), dim=-1) @ v\n\n"
    "def fast(q, k, v, F):\n    return F.scaled_dot_product_attention(q, k, v)",
    # normalised keys only; a `normalize` of the file's own; one token in another function's name
    ATTN + "    def forward(self, q, k, v):\n        attn = q @ F.normalize(k, dim=-1).transpose(-2, -1)\n"
    "        return attn.softmax(dim=-1) @ v",
    "import torch\nfrom torch import nn\n\ndef normalize(x):\n    return x\n\nclass A(nn.Module):\n"
    "    def forward(self, q, k, v):\n        attn = normalize(q) @ normalize(k).transpose(-2, -1)\n"
    "        return attn.softmax(dim=-1) @ v",
    ATTN + "    def forward(self, x, q):\n        attn = (q @ self.k(x).transpose(-2, -1)).softmax(dim=-1)\n"
    "        return attn @ self.v(x)\n\n    def other(self, x):\n        q = x[:, 0:1]\n        return q",
    "import torch\nimport pytorch_lightning as pl\n\nclass Block(pl.LightningModule):\n"
    "    def attend(self, q, k, v):\n        p = (q @ k.transpose(-2, -1)).softmax(-1)\n        return p @ v",
]
# (TL405) files the rule parses for nothing
ATTENTION_SILENT = [
    # nanoGPT: the fused kernel next to the fallback
    "import math\nimport torch\nimport torch.nn as nn\nfrom torch.nn import functional as F\n\n"
    "class CausalSelfAttention(nn.Module):\n    def forward(self, q, k, v):\n        if self.flash:\n"
    "            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
    "        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))\n"
    "        att = F.softmax(att, dim=-1)\n        return att @ v",
    ATTN + "    def forward(self, q, k, v):\n        a = F.softmax(q @ k.transpose(-2, -1), dim=-1)\n"
    "        return a @ v\n\n    def fast(self, q, k, v):\n        return F.scaled_dot_product_attention(q, k, v)",
    "from torch.nn.functional import scaled_dot_product_attention, softmax\nfrom torch import nn\n\n"
    "class A(nn.Module):\n    def forward(self, q, k, v):\n"
    "        if self.fused:\n            return scaled_dot_product_attention(q, k, v)\n"
    "        return softmax(q @ k.transpose(-2, -1), -1) @ v",
    # GAT: `.mT` outside a product, scores from two matmuls added
    ATTN
    + "    def forward(self, h):\n        s = torch.matmul(h, self.a)\n        t = torch.matmul(h, self.b)\n"
    "        e = s + t.mT\n        attention = F.softmax(e, dim=-1)\n        return torch.matmul(attention, h)",
    # a free function, a class that is no module, the product in another method than the softmax
    "import torch\n\ndef reference(q, k, v):\n    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v",
    "import torch\n\nclass Ref:\n    def forward(self, q, k, v):\n"
    "        return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v",
    ATTN + "    def scores(self, q, k):\n        return q @ k.transpose(-2, -1)\n\n"
    "    def forward(self, q, k, v):\n        return F.softmax(self.scores(q, k), -1) @ v",
    # LeViT: the only transposed product multiplies the probabilities, after the softmax
    ATTN + "    def forward(self, q, k, v):\n        attn = (q.transpose(-2, -1) @ k) * self.scale\n"
    "        attn = attn.softmax(dim=-1)\n        return (v @ attn.transpose(-2, -1)).reshape(-1)",
    # the values product before the softmax
    ATTN + "    def forward(self, q, k, v):\n        out = self.p @ v\n"
    "        w = F.softmax(q @ k.transpose(-2, -1), dim=-1)\n        return out, w",
    # cross-covariance attention (EdgeNeXt, Swin V2) and class-token attention (CrossViT)
    ATTN + "    def forward(self, q, k, v):\n"
    "        attn = (F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)) * self.t\n"
    "        return attn.softmax(dim=-1) @ v",
    ATTN + "    def forward(self, q, k, v):\n        q = torch.nn.functional.normalize(q, dim=-1)\n"
    "        attn = q @ F.normalize(k, dim=-1).transpose(-2, -1)\n        return attn.softmax(dim=-1) @ v",
    ATTN
    + "    def forward(self, x):\n        q = self.wq(x[:, 0:1, ...]).reshape(1, 1)\n        k, v = self.wk(x), self.wv(x)\n"
    "        attn = (q @ k.transpose(-2, -1)) * self.scale\n        return attn.softmax(dim=-1) @ v",
    # no product with the values; axes that are no key transpose; the product only in a lambda
    ATTN + "    def forward(self, q, k):\n        return F.softmax(q @ k.transpose(-2, -1), dim=-1)",
    ATTN + "    def forward(self, q, k, v):\n        return F.softmax(q @ k.transpose(1, 2), dim=-1) @ v",
    ATTN + "    def forward(self, q, k, v):\n        f = lambda: q @ k.transpose(-2, -1)\n"
    "        return F.softmax(f(), dim=-1) @ v",
]

CKPT = "import torch\nfrom functools import partial\nfrom torch.utils.checkpoint import checkpoint\n\n"
DROP = "def block(x):\n    return torch.nn.functional.dropout(x, 0.1)\n\n"
# (TL204) reported by the rule
RNG_REPORTED = [
    CKPT + DROP + "y = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)",
    CKPT + DROP + "keep = False\ny = checkpoint(block, x, use_reentrant=False, preserve_rng_state=keep)",
    CKPT
    + DROP
    + "keep: bool = False\ny = checkpoint(block, x, use_reentrant=False, preserve_rng_state=keep)",
    CKPT
    + "def make(cfg):\n    return partial(checkpoint, preserve_rng_state=not cfg.dropout, use_reentrant=False)",
    CKPT + "def make(cfg):\n    keep = cfg.dropout == 0 or cfg.attn_dropout == 0.0\n"
    "    return partial(checkpoint, preserve_rng_state=keep, use_reentrant=False)",
]
# (TL204) files the rule parses for nothing
RNG_SILENT = [
    CKPT + DROP + "y = checkpoint(block, x, use_reentrant=False, preserve_rng_state=True)",
    # a parameter's default is no value of the name to the model
    CKPT + DROP + "def run(x, preserve_rng_state=False):\n"
    "    return checkpoint(block, x, use_reentrant=False, preserve_rng_state=preserve_rng_state)",
    CKPT + DROP + "y = checkpoint(block, x, use_reentrant=False, preserve_rng_state=self.preserve)",
    CKPT + DROP + "keep = True\ny = checkpoint(block, x, use_reentrant=False, preserve_rng_state=keep)",
    CKPT + DROP + 'kwargs = {"preserve_rng_state": False}\ny = checkpoint(block, x, **kwargs)',
    CKPT + DROP + "y = checkpoint(block, x, use_reentrant=False)  # preserve_rng_state=False",
]

PEFT = "from transformers import TrainingArguments\nfrom peft import LoraConfig, get_peft_model\n"
# (TL205) reported by the rule
HF_REPORTED = [
    PEFT + "model = get_peft_model(model, LoraConfig(r=8))\nmodel.gradient_checkpointing_enable()",
    PEFT + "args = TrainingArguments(output_dir='out', gradient_checkpointing=True)",
    PEFT + "args = TrainingArguments(output_dir='out', gradient_checkpointing=cfg.checkpointing)",
    "import transformers\nfrom transformers import TrainingArguments as TA\nfrom peft import LoraConfig\n"
    "args = TA(output_dir='out', gradient_checkpointing=True)",
    "import transformers\nfrom peft import LoraConfig\nArgs = transformers.Seq2SeqTrainingArguments\n"
    "args = Args(output_dir='out', gradient_checkpointing=True)",
    # get_peft_model before the switch, or after it in another scope
    PEFT
    + "def build(model, cfg):\n    model = get_peft_model(model, cfg)\n    model.gradient_checkpointing_enable()",
    PEFT
    + "def a(m):\n    m.gradient_checkpointing_enable()\n\ndef b(m, cfg):\n    return get_peft_model(m, cfg)",
    "class Trainer:\n    def setup(self):\n        self.model.get_input_embeddings().requires_grad_(False)\n"
    "        self.model.gradient_checkpointing_enable()",
]
# (TL205) files the rule parses for nothing
HF_SILENT = [
    # accelerate's TPU example: TRL's config with checkpointing off
    "from peft import LoraConfig\nfrom trl import SFTConfig\n"
    "cfg = SFTConfig(gradient_checkpointing=False, max_length=1024)",
    PEFT + "args = TrainingArguments(out, gradient_checkpointing=True,\n"
    "                         gradient_checkpointing_kwargs={'use_reentrant': False})",
    PEFT + "args = TrainingArguments(out, gradient_checkpointing=None)",
    PEFT + "args = TrainingArguments(out, gradient_checkpointing=True, **extra)",
    PEFT + "args = TrainingArguments(out, gradient_checkpointing=True)\n"
    "args.gradient_checkpointing_kwargs = {'use_reentrant': False}",
    PEFT + "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})",
    PEFT + "model = get_peft_model(model, LoraConfig(r=8))\nmodel.enable_input_require_grads()\n"
    "model.gradient_checkpointing_enable()",
    "from peft import LoraConfig, prepare_model_for_kbit_training as prep\nmodel = prep(model)\n"
    "model.gradient_checkpointing_enable()",
    PEFT + "args = SomeConfig(out, gradient_checkpointing=True)",
    # PEFT's tests: get_peft_model after the switch, in the same function
    PEFT + "def test(model_id, cfg):\n    base = Auto.from_pretrained(model_id)\n"
    "    base.gradient_checkpointing_enable()\n    model = get_peft_model(base, cfg)",
    # an override that forwards to the wrapped model
    "import torch\nfrom peft import LoraConfig\n\nclass W(torch.nn.Module):\n"
    "    def gradient_checkpointing_enable(self):\n        self.lora_model.gradient_checkpointing_enable()",
]

CASES: list[tuple[str, Check, list[str], list[str]]] = [
    ("TL405", hand_written_attention, ATTENTION_REPORTED, ATTENTION_SILENT),
    ("TL204", rng_flag_may_be_off, RNG_REPORTED, RNG_SILENT),
    ("TL205", hf_checkpointing_may_lack_kwargs, HF_REPORTED, HF_SILENT),
]


def _findings(rule_id: str, text: str, prefilter: bool = False) -> list[str]:
    result = lint_text(text, "x.py", LintOptions((rule_id,), prefilter=prefilter))
    return [f.rule for f in result.findings if f.rule == rule_id]


@pytest.mark.parametrize(
    ("rule_id", "check", "text"),
    [(rule_id, check, text) for rule_id, check, reported, _ in CASES for text in reported],
)
def test_a_file_the_rule_reports_passes_the_check(rule_id: str, check: Check, text: str) -> None:
    assert _findings(rule_id, text), "the case is no finding of the rule"
    assert check(ast.parse(text))
    assert _findings(rule_id, text, prefilter=True)


@pytest.mark.parametrize(
    ("rule_id", "check", "text"),
    [(rule_id, check, text) for rule_id, check, _, silent in CASES for text in silent],
)
def test_a_file_the_rule_parses_for_nothing_is_ruled_out(rule_id: str, check: Check, text: str) -> None:
    assert not check(ast.parse(text))
    assert not pass_tree_checks([gates()[rule_id]], ast.parse(text))
    assert not _findings(rule_id, text), "the check ruled out a file the rule reports"


@pytest.mark.parametrize(("rule_id", "check", "reported", "silent"), CASES, ids=[c[0] for c in CASES])
def test_every_reported_text_passes_the_check_and_the_findings_do_not_change(
    rule_id: str, check: Check, reported: list[str], silent: list[str]
) -> None:
    gate_check_keeps_findings(rule_id, check, reported + silent)


def test_the_rules_name_their_checks() -> None:
    assert gates()["TL405"].check == "gate_attention_scores.hand_written_attention"
    assert gates()["TL204"].check == "gate_checkpoint_misc.rng_flag_may_be_off"
    assert gates()["TL205"].check == "gate_checkpoint_misc.hf_checkpointing_may_lack_kwargs"


# -- TL204 through the project (``wrapper_may_leave_rng_off``) --------------------------------------------
WRAP = "import torch\nfrom utils import checkpointed\n"
BLOCK_DEF = "def block(x):\n    return torch.nn.functional.dropout(x, 0.1)\n"
# the file may hold a finding resting on another file's facts
WRAPPER_POSSIBLE = [
    # an imported wrapper given this file's function, whose call names a word of randomness
    WRAP + BLOCK_DEF + "y = checkpointed(block, x)",
    "import random\nfrom utils import checkpointed\ny = checkpointed(lambda t: t * random.random(), x)",
    "from torch.nn import Dropout as D\nimport utils\n\nclass M:\n    def __init__(self):\n"
    "        self.drop = D(0.1)\n\n    def forward(self, x):\n        return utils.ckpt(self.drop, x)",
    # an instance of an imported class (its dropout in its file): built in the call, or assigned
    "from blocks import Block\nfrom utils import ckpt\ny = ckpt(Block(8), x)",
    "from blocks import Block\nfrom utils import ckpt\ny = ckpt(Block.from_pretrained('b'), x)",
    "import blocks\nfrom utils import ckpt\nb = blocks.Block(8)\ny = ckpt(module=b)",
    "from blocks import Block\nfrom utils import ckpt\n\nclass Net:\n    def __init__(self):\n"
    "        self.block = Block(8)\n\n    def forward(self, x):\n        return ckpt(self.block, x)",
    # the wrapper and the class reached through names bound to dotted names of imports
    "import utils\nimport blocks as b\nwrap = utils.ckpt\nmake = b.Block\nm = make(8)\ny = wrap(m, x)",
    # the file's own wrapper (its summary has the keyword): called by a name bound to a def
    "import torch.utils.checkpoint as cp\nfrom blocks import Block\n\n"
    "def ckpt(fn, x, keep=False):\n    return cp.checkpoint(fn, x, preserve_rng_state=keep)\n\n"
    "y = ckpt(Block(8), x)",
    # torch's checkpoint_wrapper with the flag off (the dropout in another file's class)
    "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper\n"
    "from blocks import Block\noff = False\nm = checkpoint_wrapper(Block(8), preserve_rng_state=off)",
]
# no finding can rest on this file, whatever the other files hold
WRAPPER_IMPOSSIBLE = [
    # the arguments are parameters or literals: nothing built here, no randomness named
    "from utils import checkpointed\n\ndef step(fn, x):\n    return checkpointed(fn, x)",
    "from utils import load_checkpoint_file\nstate = load_checkpoint_file('last.pt', 3)",
    # a word of randomness in a local name only (no callee resolves through it)
    "from utils import checkpointed\n\ndef step(fn, x, dropout):\n    return checkpointed(fn, x)",
    # a call of an imported class, given to a method of something not imported
    "from blocks import Block\n\nclass T:\n    def run(self, x):\n"
    "        trainer = self.trainer\n        return trainer.checkpoint(Block(8), x)",
    # the call made from an import is not the argument (its result assigned to another name)
    "from blocks import Block\nfrom utils import ckpt\nb = Block(8)\ny = ckpt(block, x)",
    # a call of the file's own def, and no preserve_rng_state= keyword: not a wrapper of the project
    "import torch\nfrom blocks import Block\n\ndef ckpt(fn, x):\n    return fn(x)\n\ny = ckpt(Block(8), x)",
    # the only callee that is no import is given the instance
    "import torch\nfrom blocks import Block\nckpt = make_ckpt()\ny = ckpt(Block(8), x)",
    # the keyword is given True
    "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper\n"
    "m = checkpoint_wrapper(block, preserve_rng_state=True)",
]


@pytest.mark.parametrize("text", WRAPPER_POSSIBLE)
def test_a_file_that_may_call_a_wrapper_with_randomness_passes(text: str) -> None:
    assert wrapper_may_leave_rng_off(ast.parse(text))


@pytest.mark.parametrize("text", WRAPPER_IMPOSSIBLE)
def test_a_file_that_cannot_hold_a_cross_file_finding_is_ruled_out(text: str) -> None:
    assert not wrapper_may_leave_rng_off(ast.parse(text))


UTILS = """
    from torch.utils.checkpoint import checkpoint


    def checkpointed(fn, x, preserve=False):
        return checkpoint(fn, x, use_reentrant=False, preserve_rng_state=preserve)
    """
BLOCKS = """
    from torch import nn


    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.drop = nn.Dropout(0.1)

        def forward(self, x):
            return self.drop(x)
    """
# (the files, the linted one, the line of TL204's finding, whether the file is a cross-file candidate:
# not active, its project prefilter passed)
CROSS_FILE_204 = [
    # the wrapper's default drops the RNG state: this file's function with dropout...
    ({"utils.py": UTILS, "main.py": WRAP + BLOCK_DEF + "y = checkpointed(block, x)\n"}, "main.py", 5, True),
    # ... or an instance of the other file's class with dropout, assigned to self.x
    (
        {
            "utils.py": UTILS,
            "blocks.py": BLOCKS,
            "main.py": "from blocks import Block\nfrom utils import checkpointed\n\n\nclass Net:\n"
            "    def __init__(self):\n        self.block = Block(8)\n\n"
            "    def forward(self, x):\n        return checkpointed(self.block, x)\n",
        },
        "main.py",
        10,
        True,
    ),
    # torch's checkpoint_wrapper, its flag a name assigned False, on the other file's class
    (
        {
            "blocks.py": BLOCKS,
            "main.py": "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import "
            "checkpoint_wrapper\nfrom blocks import Block\n\noff = False\n"
            "m = checkpoint_wrapper(Block(8), preserve_rng_state=off)\n",
        },
        "main.py",
        5,
        True,
    ),
    # the file's own wrapper, its parameter defaulting to False: active (``rng_flag_may_be_off``)
    (
        {
            "main.py": "import torch.utils.checkpoint as cp\nfrom torch import nn\n\n\n"
            "def ckpt(fn, x, keep=False):\n    return cp.checkpoint(fn, x, preserve_rng_state=keep)\n\n\n"
            "class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.drop = nn.Dropout(0.1)\n\n    def inner(self, x):\n        return self.drop(x)\n\n"
            "    def forward(self, x):\n        return ckpt(self.inner, x)\n",
        },
        "main.py",
        18,
        False,
    ),
]


def _crossfile_candidate(text: str) -> bool:
    gate = gates()["TL204"]
    return not gate.can_fire(text) or not pass_tree_checks([gate], ast.parse(text))


@pytest.mark.parametrize(("files", "target", "line", "candidate"), CROSS_FILE_204)
def test_the_cross_file_findings_of_tl204_are_kept(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    files: dict[str, str],
    target: str,
    line: int,
    candidate: bool,
) -> None:
    text = files[target]
    assert _crossfile_candidate(text) is candidate and gates()["TL204"].can_fire_in_project(text)
    assert wrapper_may_leave_rng_off(ast.parse(text))
    found = lint_project(tmp_path, files, target, monkeypatch, capsys)
    assert [(f["rule"], f["line"]) for f in found if f["rule"] == "TL204"] == [("TL204", line)]


def test_a_cross_file_candidate_ruled_out_is_not_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wrapper of the other file is a fact TL204 wants, so without the check (and without its
    callees, ``rng_wrapper_callees``, which name no import here either) the file is parsed for nothing:
    its call passes on a parameter."""
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "utils.py").write_text(textwrap_dedent(UTILS))
    main = tmp_path / "main.py"
    main.write_text("from utils import checkpointed\n\n\ndef step(fn, x):\n    return checkpointed(fn, x)\n")
    text = main.read_text()
    assert _crossfile_candidate(text) and gates()["TL204"].can_fire_in_project(text)
    assert not wrapper_may_leave_rng_off(ast.parse(text))
    on = lint_text(text, str(main), LintOptions(("TL204",)))
    assert (on.findings, on.parsed) == ([], False)
    unchecked = dataclasses.replace(gates()["TL204"], project_check="")
    monkeypatch.setitem(gates(), "TL204", unchecked)
    assert not lint_text(text, str(main), LintOptions(("TL204",))).parsed  # (the callees alone rule it out)
    monkeypatch.setitem(gates(), "TL204", dataclasses.replace(unchecked, project_callees=""))
    off = lint_text(text, str(main), LintOptions(("TL204",)))
    assert (off.findings, off.parsed) == ([], True)


def textwrap_dedent(text: str) -> str:
    import textwrap

    return textwrap.dedent(text).lstrip()


OWN_WRAPPER = (
    CKPT + DROP + "def run(fn, x, keep=False):\n    return checkpoint(fn, x, preserve_rng_state=keep)\n\n"
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # the file's own wrapper, called: ``_through_wrappers`` reports on the file alone
        (OWN_WRAPPER + "y = run(block, x)", True),
        (
            OWN_WRAPPER.replace("x, keep=False", "*args, keep=False").replace("fn, x,", "fn, *args,")
            + "run(block)",
            True,
        ),
        (OWN_WRAPPER.replace("x, keep=False", "x, *, keep=False") + "y = run(block, x)", True),
        # not called by its name, or the parameter's default not the literal False
        (OWN_WRAPPER + "y = other(block, x)", False),
        (OWN_WRAPPER.replace("keep=False", "keep=None") + "y = run(block, x)", False),
        (OWN_WRAPPER.replace("keep=False", "keep=0") + "y = run(block, x)", False),
    ],
)
def test_the_files_own_wrapper_off_by_default_passes_the_gate(text: str, expected: bool) -> None:
    assert rng_flag_may_be_off(ast.parse(text)) is expected
    assert wrapper_may_leave_rng_off(ast.parse(text)) or not expected


def test_tl204_names_its_project_check() -> None:
    assert gates()["TL204"].project_check == "gate_checkpoint_misc.wrapper_may_leave_rng_off"
