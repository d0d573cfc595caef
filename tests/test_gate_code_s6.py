"""The gate's conditions on how a rule's names are used in the code (``Rule.gate``: a call, a reference
to an imported object, a name bound to one, a call in a loop or an ``if``), read in the same walk of
CPython's tree that measures its depth for the nesting guard. A file whose names occur only in other
roles (``save_checkpoint``, ``self.checkpoint_dir``, ``def backward``) never reaches libcst, and no
finding changes: every example in several layouts and spellings is compared with and without it."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest
from conftest import FIXTURES, TORCH_PACKAGE

from trainlint.engine import _tree_depth, lint_text
from trainlint.gates import code_atom, code_facts, code_text, gates
from trainlint.gates import occurs as occurs_in
from trainlint.results import LintOptions
from trainlint.rule import Invalid, registry

ALL = tuple(registry().ids())
GATED = [r for r in registry() if r.gate]


def _same(code: str, ids: tuple[str, ...] = ALL, name: str = "x.py") -> bool:
    """Whether the file was handed to libcst, after checking that the gate changed no finding."""
    on = lint_text(code, name, LintOptions(ids))
    off = lint_text(code, name, LintOptions(ids, prefilter=False))
    assert (on.findings, on.errors) == (off.findings, off.errors), code
    return on.parsed


# -- one walk --------------------------------------------------------------------------------------------
DEEP = [
    "x = " + " and ".join(f"a{i}" for i in range(60)) + "\n",
    "x = " + "[" * 40 + "]" * 40 + "\n",
    '"""doc"""\ndef f():\n    """doc"""\n    if a:\n        for b in c:\n            g(h(i(j)))\n',
    "class C:\n    x: int = 1\n    def f(self):\n        return self.y.z[0].w(*a, **k)\n",
    "match p:\n    case {'a': [1, *rest]} if rest:\n        pass\n",
]


def _sources() -> list[str]:
    out = list(DEEP)
    for rule in registry():
        out += [*rule.valid, *(example.code for example in rule.invalid)]
    out += [p.read_text(encoding="utf-8") for p in sorted(FIXTURES.rglob("*.py"))]
    if TORCH_PACKAGE.is_dir():
        out += [p.read_text(encoding="utf-8") for p in sorted(TORCH_PACKAGE.rglob("*.py"))[::40]]
    return out


def test_one_walk_gives_the_nesting_guards_depth_and_line() -> None:
    checked = 0
    for text in _sources():
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        facts = code_facts(tree)
        assert (facts.depth, facts.depth_line) == _tree_depth(tree), text[:300]
        assert facts.text == code_text(tree)
        checked += 1
    assert checked > 300


# -- what the walk records -------------------------------------------------------------------------------
CHECKPOINT_CALL = r"call~^(?!save_|load_|resume_)\w*checkpoint"  # TL204's wrapper call
MARKS = [
    # (code, atom, whether it occurs)
    ("checkpoint(f, x)", "call:checkpoint", True),
    ("cp.checkpoint(f, x)", "call:checkpoint", True),
    ("fn = cp.checkpoint", "call:checkpoint", False),
    ("save_checkpoint(f)", "call:checkpoint", False),
    ("fn = cp.checkpoint", "ref:checkpoint", True),
    ("self.checkpoint(f, x)", "ref:checkpoint", False),
    ("checkpoint = torch.load(p)", "ref:checkpoint", False),
    ("from torch.utils.checkpoint import checkpoint as c", "ref:checkpoint", True),
    ("import torch.utils.checkpoint", "ref:checkpoint", True),
    ("x = self.checkpoint_dir", "ref:checkpoint", False),
    ("# cp.checkpoint(f, x)\n'''cp.checkpoint(f, x)'''", "ref:checkpoint", False),
    ("from torch.nn.parallel import DistributedDataParallel as DDP", "alias:DistributedDataParallel", True),
    ("from torch.nn.parallel import DistributedDataParallel", "alias:DistributedDataParallel", False),
    ("import torch.nn.parallel.DistributedDataParallel as D", "alias:DistributedDataParallel", True),
    ("W = torch.nn.parallel.DistributedDataParallel", "alias:DistributedDataParallel", True),
    ("W: type = DistributedDataParallel", "alias:DistributedDataParallel", True),
    ("W = DistributedDataParallel(m)", "alias:DistributedDataParallel", False),
    ("import time", "import:time", True),
    ("from time import perf_counter", "import:time", True),
    ("from .time import perf_counter", "import:time", False),
    ("for b in d:\n    total += loss", "loop:+=", True),
    ("for b in d:\n    total -= loss", "loop:+=", False),
    ("total += loss", "loop:+=", False),
    ("while x:\n    total = total + loss", "loop:+=", True),
    ("while x:\n    total = loss + total", "loop:+=", True),
    ("while x:\n    self.t = self.t + loss", "loop:+=", True),
    ("while x:\n    total = a + loss", "loop:+=", False),
    ("for b in d:\n    if c:\n        losses.append(loss)", "loop:append", True),
    ("losses.append(loss)", "loop:append", False),
    ("if n % k == 0:\n    opt.step()", "if:step", True),
    ("if n % k == 0:\n    pass\nelse:\n    opt.step()", "if:step", True),
    ("for b in d:\n    opt.step()", "if:step", False),
    ("def step(self):\n    pass", "call:step", False),
    ("def step(self):\n    pass", "name:step", True),
    ("def forward(self, x):\n    pass", "def:forward", True),
    ("async def forward(self, x):\n    pass", "def:forward", True),
    ("y = model.forward(x)", "def:forward", False),
    ("def compute_Loss(batch):\n    pass", "def~(?i:loss)", True),
    ("loss = f(x)\ndef step():\n    pass", "def~(?i:loss)", False),
    ("checkpoint_layer(block, x)", CHECKPOINT_CALL, True),
    ("self._save_checkpoint(path)", CHECKPOINT_CALL, True),
    ("trainer.save_checkpoint(path)", CHECKPOINT_CALL, False),
    ("model.load_checkpoint(path)", CHECKPOINT_CALL, False),
    ("fn = checkpoint_layer", CHECKPOINT_CALL, False),
    ("cb = ModelCheckpoint(dirpath=d)", CHECKPOINT_CALL, False),
    ("# checkpoint_layer(block, x)\n'''checkpoint_layer(block, x)'''", CHECKPOINT_CALL, False),
    ("to_half(self)", "bare:self", True),
    ("to_half(module=self)", "bare:self", True),
    ("self = load(path)", "bare:self", True),
    ("a, self = load(path)", "bare:self", True),
    ("opt = SGD(self.net.parameters())\nself.log(x)", "bare:self", False),
    ("opt = SGD(self.parameters())", "ref:parameters", False),
    ("opt = SGD(self.net.parameters())", "ref:parameters", True),
]


@pytest.mark.parametrize(("code", "atom", "expected"), MARKS)
def test_the_walk_records_how_a_name_is_used(code: str, atom: str, expected: bool) -> None:
    assert occurs_in(code_atom(atom), code_text(ast.parse(code))) is expected


def test_an_atom_is_checked_when_the_data_is_made() -> None:
    bad_atoms = ("checkpoint", "call:a.b", "calls:x", "loop:-=", "ref:", "bare:model", "name~x", "bare~s")
    bad_patterns = ("call~a.b", "call~^a^b", "call~(?i:a", "def~a\\sb", "def~[a]", "call~")
    for bad in (*bad_atoms, *bad_patterns):
        with pytest.raises(ValueError):
            code_atom(bad)
    for rule in registry():
        for group in (*rule.gate, *rule.project_gate):
            assert group and all(code_atom(atom) for atom in group), rule.id


# -- findings: unchanged ---------------------------------------------------------------------------------
# Other spellings and layouts of each example that the rule still reports (a rewrite that breaks it, or
# makes it another program the rule does not report, is skipped; one the rule reports must pass the gate).
_SPELLINGS = (
    (r"\.(\w+)\(", r". \1 ("),
    (r"\.(\w+)\(", ".\\1 \\\\\n("),
    (r"(\w+)\(", r"(\1)("),
    (r"^from ([\w.]+) import (\w+)$", r"from \1 import \2 as _\2\n\2 = _\2"),
    (r"^import ([\w.]+)$", r"import \1 as _m\n\1 = _m"),
    (r"^(\s*)(\w+) = (\w+)\((.*)\)$", r"\1_f = \3\n\1\2 = _f(\4)"),
)


def _rewrites(example: Invalid) -> list[str]:
    out = [example.code]
    for pattern, replacement in _SPELLINGS:
        code = re.sub(pattern, replacement, example.code, flags=re.MULTILINE)
        if code == example.code:
            continue
        try:
            ast.parse(code)
        except SyntaxError:
            continue
        out.append(code)
    return out


@pytest.mark.parametrize("rule", GATED, ids=lambda r: r.id)
def test_the_gate_keeps_every_finding_of_the_examples_in_other_spellings(rule) -> None:
    reported = 0
    for example in rule.invalid:
        for code in _rewrites(example):
            for ids in ((rule.id,), ALL):
                on = lint_text(code, "example.py", LintOptions(ids))
                off = lint_text(code, "example.py", LintOptions(ids, prefilter=False))
                assert (on.findings, on.errors) == (off.findings, off.errors), code
                reported += any(f.rule == rule.id for f in off.findings)
    assert reported >= len(rule.invalid)


# -- what no longer reaches libcst -----------------------------------------------------------------------
NOT_TORCH_CHECKPOINT = """\
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader


def save_checkpoint(model, path):
    checkpoint = {"state": model.state_dict()}
    torch.save(checkpoint, path)


class Trainer:
    def fit(self, model):
        self.checkpoint_dir = "ckpt"
        cb = ModelCheckpoint(dirpath=self.checkpoint_dir)
        self.checkpoint(model)
        return DataLoader([]), cb
"""

NOT_A_TRAINING_LOOP = """\
import torch


class Scale(torch.autograd.Function):
    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def run(model, batches, opt):
    for batch in batches:
        loss = model(batch)
        loss.backward()
    opt.step()
    opt.zero_grad()
    steps = len(batches) + 1
    with torch.no_grad():
        total = sum(model(b) for b in batches)
    return total
"""

SAMPLER_SET_EPOCH = """\
import torch
from torch.utils.data import DataLoader, DistributedSampler

sampler = DistributedSampler(dataset)
loader = DataLoader(dataset, sampler=sampler)
for epoch in range(10):
    # sampler.set_epoch(epoch) is called by the framework's loop
    for batch in loader:
        step(batch)
"""


@pytest.mark.parametrize("code", [NOT_TORCH_CHECKPOINT, NOT_A_TRAINING_LOOP, SAMPLER_SET_EPOCH])
def test_names_in_other_roles_do_not_reach_libcst(code: str) -> None:
    assert any(g.can_fire(code.replace("set_epoch", "")) for g in gates().values())
    assert not _same(code)


def test_the_same_files_with_the_use_a_finding_needs_reach_libcst() -> None:
    ckpt = NOT_TORCH_CHECKPOINT + "\nfrom torch.utils import checkpoint as cp\ny = cp.checkpoint(f, x)\n"
    assert _same(ckpt) and _findings(ckpt) == ["TL201"]
    loop = NOT_A_TRAINING_LOOP.replace(
        "        loss.backward()", "        loss.backward()\n        s += loss"
    )
    assert _same(loop) and "TL302" in _findings(loop)
    sampler = SAMPLER_SET_EPOCH.replace("sampler.set_epoch(epoch) is called", "the epoch is not set")
    assert _same(sampler) and _findings(sampler) == ["TL505"]


def _findings(code: str) -> list[str]:
    return [f.rule for f in lint_text(code, "x.py", LintOptions(ALL)).findings]


def test_a_name_bound_to_the_class_keeps_the_file() -> None:
    """``W = torch.nn.parallel.DistributedDataParallel`` then ``W(model)``: the call's qualified name
    ends with a name the callee does not have."""
    code = (
        "import torch\nW = torch.nn.parallel.DistributedDataParallel\nmodel = W(net)\n"
        "for x, y in loader:\n    net(x).sum().backward()\n    opt.step()\n"
    )
    assert _same(code) and _findings(code) == ["TL507"]


# -- cross-file findings ---------------------------------------------------------------------------------
PROJECTS = FIXTURES / "project"


@pytest.mark.parametrize("project", sorted(p.name for p in PROJECTS.iterdir() if p.is_dir()))
def test_the_gates_keep_the_fixture_projects_cross_file_findings(project: str) -> None:
    found = 0
    for path in sorted((PROJECTS / project).rglob("*.py")):
        on = lint_text(path.read_text(encoding="utf-8"), str(path), LintOptions(ALL))
        off = lint_text(path.read_text(encoding="utf-8"), str(path), LintOptions(ALL, prefilter=False))
        assert (on.findings, on.errors) == (off.findings, off.errors), path
        found += len(on.findings)
    assert found or project in ("layers_by_name",)


HELPER = "def train_step(model, batch):\n    loss = model(batch)\n    loss.backward()\n    return loss\n"
CALLER = "import torch\nfrom helpers import train_step\n\n\ndef fit(model, data):\n{body}"


@pytest.mark.parametrize(
    ("body", "reported"),
    [
        ("    total = 0\n    for b in data:\n        total += train_step(model, b)\n", True),
        (
            "    for b in data:\n        loss = train_step(model, b)\n    total = 0\n    total += loss\n",
            False,
        ),
    ],
)
def test_a_cross_file_finding_needs_its_addition_in_a_loop(tmp_path: Path, body: str, reported: bool) -> None:
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    (tmp_path / "helpers.py").write_text(HELPER)
    main = tmp_path / "main.py"
    main.write_text(CALLER.format(body=body) + "    return total + 1\n")
    text = main.read_text()
    assert gates()["TL302"].can_fire_in_project(text)
    on = lint_text(text, str(main), LintOptions(ALL))
    off = lint_text(text, str(main), LintOptions(ALL, prefilter=False))
    assert (on.findings, on.errors) == (off.findings, off.errors)
    assert [f.rule for f in on.findings] == (["TL302"] if reported else [])
    assert on.parsed is reported  # the project index is not asked when the code rules the finding out


# -- cross-file findings of TL105, TL204 and TL301: the project gate keeps each, and no more ----------------
TO_HALF = """
    def to_half(module):
        module.half()
    """
TRAINER = """
    import torch
    from helpers import to_half


    class Trainer:
        def configure(self):
            to_half(self)
            return torch.optim.AdamW(self.parameters(), lr=1e-4)
    """
TOKEN_MEAN = """
    import torch.nn.functional as F


    def token_loss(model, batch):
        logits = model(batch["input_ids"])
        labels = batch["labels"]
        mask = (labels != -100).float()
        loss_sum = (F.cross_entropy(logits.transpose(1, 2), labels, reduction="none") * mask).sum()
        return loss_sum / mask.sum()
    """
LOSS_FUNCTION = '''
    """The caller runs loss.backward() on what compute_loss returns."""
    from helpers import token_loss


    def compute_loss(model, batch, accum_steps):
        loss = token_loss(model, batch)
        return loss / accum_steps
    '''
ACCUM_LOSS = """
    import torch.nn.functional as F


    class AccumLoss:
        def __init__(self, accum_steps):
            self.accum_steps = accum_steps

        def __call__(self, logits, labels):
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            return loss / self.accum_steps
    """
CRITERION = """
    from helpers import AccumLoss


    def train(model, loader, accum_steps):
        criterion = AccumLoss(accum_steps)
        for batch in loader:
            loss = criterion(model(batch["input_ids"]), batch["labels"])
            loss.backward()
    """
DROPOUT_BLOCK = """
    import torch.nn as nn


    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.proj = nn.Linear(dim, dim)
            self.drop = nn.Dropout(0.1)

        def forward(self, x):
            return x + self.drop(self.proj(x))
    """
WRAPPED = """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from helpers import Block


    def build(dim):
        return checkpoint_wrapper(Block(dim), preserve_rng_state=False)
    """
WRAPPED_CLASS = WRAPPED.replace("import checkpoint_wrapper", "import CheckpointWrapper").replace(
    "return checkpoint_wrapper(",
    "# not checkpoint_wrapper(...) but its class\n        return CheckpointWrapper(",
)
CHECKPOINT_IN_PROSE = '"""Run through checkpoint(block, x) elsewhere."""\nfrom helpers import Block\n'

CROSS_FILE = [
    # (the other file, the linted one, the findings (rule, line), whether the linted file reaches libcst)
    # TL105: the helper converts `self`, the optimizer trains `self.parameters()`
    (TO_HALF, TRAINER, [("TL105", 9)], True),
    (TO_HALF, TRAINER.replace("to_half(self)", "to_half(self.net)"), [], False),
    (TO_HALF, TRAINER.replace("            to_half(self)\n", ""), [], False),
    # TL301: a loss function returns the token mean divided by the steps (its callers run the backward)
    (TOKEN_MEAN, LOSS_FUNCTION, [("TL301", 8)], True),
    (TOKEN_MEAN, LOSS_FUNCTION.replace("compute_loss", "compute"), [], False),
    # TL301: the loss class of the other file divides; the backward is here
    (ACCUM_LOSS, CRITERION, [("TL301", 8)], True),
    (ACCUM_LOSS, CRITERION.replace("loss.backward()", "report(loss)  # then loss.backward()"), [], False),
    # TL204: torch's wrapper (or its class) on a block of the other file that has dropout
    (DROPOUT_BLOCK, WRAPPED, [("TL204", 8)], True),
    (DROPOUT_BLOCK, WRAPPED_CLASS, [("TL204", 9)], True),
    (DROPOUT_BLOCK, CHECKPOINT_IN_PROSE, [], False),
]


@pytest.mark.parametrize(("helpers", "code", "expected", "parsed"), CROSS_FILE)
def test_the_project_gates_keep_the_cross_file_findings(
    tmp_path: Path, helpers: str, code: str, expected: list[tuple[str, int]], parsed: bool
) -> None:
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    (tmp_path / "helpers.py").write_text(textwrap.dedent(helpers))
    main = tmp_path / "main.py"
    main.write_text(textwrap.dedent(code))
    text = main.read_text()
    on = lint_text(text, str(main), LintOptions(ALL))
    off = lint_text(text, str(main), LintOptions(ALL, prefilter=False))
    assert (on.findings, on.errors) == (off.findings, off.errors)
    assert [(f.rule, f.line) for f in on.findings] == expected
    # ruled out by the file's code: the project index is not asked, and libcst not given the file
    assert on.parsed is parsed
