"""``Rule.project_callees`` of TL204 (``rng_wrapper_callees``): of the definitions a file imports, only
those its cross-file findings may rest on count towards parsing it for the rule: the wrapper a call
reaches and the class of the instance it is given, or, for torch's ``checkpoint_wrapper`` on a module
whose class is not known, every import. Each cross-file finding of the other tests' projects is reached
through a callee named, and stays; a file that calls an imported wrapper on a parameter only is not
parsed, though it imports the wrapper (a fact the rule wants)."""

from __future__ import annotations

import ast
import importlib.util
import re
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
from test_gate_attention_scores import BLOCKS, CROSS_FILE_204, UTILS, WRAPPER_IMPOSSIBLE, WRAPPER_POSSIBLE
from test_gate_code_s6 import DROPOUT_BLOCK, WRAPPED, WRAPPED_CLASS

from trainlint import engine
from trainlint.engine import lint_text
from trainlint.gates import gates
from trainlint.model.gate_checkpoint_misc import rng_wrapper_callees, wrapper_may_leave_rng_off
from trainlint.model.pyast import reached_through
from trainlint.results import LintOptions

TESTS = Path(__file__).resolve().parent.parent
FIXTURE = TESTS.parent / "fixtures" / "project" / "ckpt_rng"
OPTIONS = LintOptions(("TL204",))


def _module(relative: str) -> ModuleType:
    """A test module of another folder (not on the path when this file runs alone), loaded privately."""
    path = TESTS / relative
    spec = importlib.util.spec_from_file_location(f"_tl204_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cases(test) -> list[tuple]:  # (a test's ``parametrize`` values)
    (mark,) = [m for m in test.pytestmark if m.name == "parametrize"]
    return list(mark.args[1])


CHECKPOINT_S6 = _module("rules/test_checkpoint_s6.py")
MISSES_F2 = _module("rules/test_misses_s5_F2.py")


def _callees(text: str) -> frozenset[str]:
    return rng_wrapper_callees(ast.parse(textwrap.dedent(text)))


def _import_targets(text: str) -> list[str]:
    tree = ast.parse(textwrap.dedent(text))
    return [
        f"{'.' * n.level}{n.module or ''}.{a.name}" if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    ]


# -- (a) every cross-file finding of the other tests is reached through a callee named ---------------------
def _reported() -> list[tuple[str, tuple[str, ...]]]:
    """The linted file of each project of the other tests where TL204 reports, with the import targets
    of the definitions its finding rests on (the wrapper called, the class of the module given)."""
    out = [
        (CROSS_FILE_204[0][0]["main.py"], ("utils.checkpointed",)),  # the file's function with dropout
        (CROSS_FILE_204[1][0]["main.py"], ("utils.checkpointed", "blocks.Block")),  # ... an instance
        (CROSS_FILE_204[2][0]["main.py"], ("blocks.Block",)),  # torch's checkpoint_wrapper on the class
        (WRAPPED, ("helpers.Block",)),
        (WRAPPED_CLASS, ("helpers.Block",)),
        (MISSES_F2.MODEL, (".block.Block",)),  # the model's own blocks, of a relative import
        *(((FIXTURE / name).read_text(), ("utils.checkpointing.checkpoint_layer",)) for name in FIXTURE_BAD),
    ]
    # a wrapper with keyword-only flags; torch's wrapper on the blocks of a loop (the class named first
    # in the message: `Dropped`, or `Nested` whose submodule has the dropout)
    out += [
        (CHECKPOINT_S6.MAIN_204 % call, ("utils.ckpt.checkpointed",))
        for _, call, expected in _cases(CHECKPOINT_S6.test_tl204_wrapper_keyword_only_flag)
        if expected
    ]
    out += [
        (CHECKPOINT_S6.MODEL_204 % (imported, built, guard), (_named_class(expected),))
        for imported, built, guard, expected in _cases(
            CHECKPOINT_S6.test_tl204_checkpoint_wrapper_on_the_models_blocks
        )
        if expected is not None
    ]
    return out


def _named_class(message: str) -> str:
    """``blocks.Dropped`` for a message that names `Dropped` first (``Nested.stream``: ``Nested``)."""
    found = re.match(r"`(\w+)", message)
    assert found is not None
    return f"blocks.{found[1]}"


FIXTURE_BAD = ("bad_blocks.py", "bad_sequential.py")
REPORTED = _reported()


@pytest.mark.parametrize(("text", "targets"), REPORTED)
def test_every_cross_file_finding_rests_on_definitions_reached_through_a_callee(
    text: str, targets: tuple[str, ...]
) -> None:
    assert set(targets) <= set(_import_targets(text))  # (the targets are the file's own imports)
    callees = _callees(text)
    assert all(reached_through(target, callees) for target in targets), callees


# (the whole projects at hand: the other file's text, the linted file's)
PROJECTS = [
    ({"utils.py": UTILS}, CROSS_FILE_204[0][0]["main.py"]),
    ({"utils.py": UTILS, "blocks.py": BLOCKS}, CROSS_FILE_204[1][0]["main.py"]),
    ({"blocks.py": BLOCKS}, CROSS_FILE_204[2][0]["main.py"]),
    ({"helpers.py": DROPOUT_BLOCK}, WRAPPED),
    ({"helpers.py": DROPOUT_BLOCK}, WRAPPED_CLASS),
    *(
        (
            {
                "utils/__init__.py": "",
                "utils/checkpointing.py": (FIXTURE / "utils/checkpointing.py").read_text(),
            },
            (FIXTURE / name).read_text(),
        )
        for name in FIXTURE_BAD
    ),
]


def _write(root: Path, files: dict[str, str], code: str, name: str = "main.py") -> tuple[Path, str]:
    (root / "pyproject.toml").write_text("")
    for relative, text in {**files, name: code}.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    path = root / name
    return path, path.read_text()


@pytest.mark.parametrize(("files", "code"), PROJECTS)
def test_the_findings_of_a_cross_file_candidate_stay_with_its_callees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, str], code: str
) -> None:
    path, text = _write(tmp_path, files, code)
    assert [g.id for g in engine._code_gate(text, OPTIONS)[1]] == ["TL204"]  # (the callees are asked)
    checked = lint_text(text, str(path), OPTIONS)
    assert checked.parsed and [f.rule for f in checked.findings] == ["TL204"]
    monkeypatch.setattr(engine, "callees_asked", lambda name, tree: None)  # any import
    assert lint_text(text, str(path), OPTIONS).findings == checked.findings


def test_the_relative_import_of_the_models_blocks_keeps_its_finding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dropout = "nn.Dropout(dropout) if dropout > 0.0 else nn.Identity()"
    files = {"pkg/__init__.py": "", "pkg/block.py": MISSES_F2.BLOCK.format(dropout=dropout)}
    path, text = _write(tmp_path, files, MISSES_F2.MODEL, "pkg/model.py")
    assert [g.id for g in engine._code_gate(text, OPTIONS)[1]] == ["TL204"]
    checked = lint_text(text, str(path), OPTIONS)
    assert [f.rule for f in checked.findings] == ["TL204"]
    monkeypatch.setattr(engine, "callees_asked", lambda name, tree: None)
    assert lint_text(text, str(path), OPTIONS).findings == checked.findings


# -- (b) a candidate whose imports no callee reaches is not parsed for the rule ----------------------------
PLAIN = """
    from torch import nn


    class Plain(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.proj = nn.Linear(width, width)
    """
# the wrapper is imported (a fact the rule wants) but given a parameter only; the one call given an
# imported instance is torch's, given a class without dropout
UNREACHED = """
    import torch
    from blocks import Plain
    from utils import checkpointed

    model = torch.compile(Plain(8))


    def step(fn, x):
        return checkpointed(fn, x)
    """


def test_a_wrapper_imported_but_never_given_randomness_is_not_parsed_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, text = _write(tmp_path, {"utils.py": UTILS, "blocks.py": PLAIN}, UNREACHED)
    assert [g.id for g in engine._code_gate(text, OPTIONS)[1]] == ["TL204"]
    assert wrapper_may_leave_rng_off(ast.parse(text))  # (the project check keeps it: `Plain(8)` given)
    callees = _callees(text)
    assert not reached_through("utils.checkpointed", callees) and reached_through("blocks.Plain", callees)
    checked = lint_text(text, str(path), OPTIONS)
    assert checked.findings == [] and not checked.parsed
    monkeypatch.setattr(engine, "callees_asked", lambda name, tree: None)  # any import: the wrapper counts
    unchecked = lint_text(text, str(path), OPTIONS)
    assert unchecked.findings == [] and unchecked.parsed


def test_the_same_wrapper_given_the_imported_instance_is_parsed_and_reported(tmp_path: Path) -> None:
    code = UNREACHED.replace("torch.compile(Plain(8))", "checkpointed(Block(8), x)").replace("Plain", "Block")
    path, text = _write(tmp_path, {"utils.py": UTILS, "blocks.py": BLOCKS}, code)
    checked = lint_text(text, str(path), OPTIONS)
    assert checked.parsed and [f.rule for f in checked.findings] == ["TL204"]


# -- (c) the names, path by path ---------------------------------------------------------------------------
DROP = "import random\n"
LAMBDA = "lambda t: t * random.random()"


@pytest.mark.parametrize(
    ("code", "target"),
    [
        # an imported wrapper given this file's randomness: under an alias, through a name bound to it,
        # of a module imported whole, of a package's module, of relative imports
        (f"{DROP}from utils import checkpointed as cp\ny = cp({LAMBDA}, x)\n", "utils.checkpointed"),
        (f"{DROP}import utils\nwrap = utils.ckpt\ny = wrap({LAMBDA}, x)\n", "utils.ckpt"),
        (f"{DROP}import utils as u\ny = u.ckpt({LAMBDA}, x)\n", "utils.ckpt"),
        (f"{DROP}import pkg.utils\ny = pkg.utils.ckpt({LAMBDA}, x)\n", "pkg.utils.ckpt"),
        (f"{DROP}from .utils import ckpt\ny = ckpt({LAMBDA}, x)\n", ".utils.ckpt"),
        (f"{DROP}from . import utils\ny = utils.ckpt({LAMBDA}, x)\n", ".utils"),
        # the class of an instance given (to an imported wrapper or, the file giving the keyword, its own)
        (
            "from blocks import Block\nfrom utils import ckpt\nclass N:\n    def __init__(self):\n"
            "        self.b = Block(8)\n    def forward(self, x):\n        return ckpt(self.b, x)\n",
            "blocks.Block",
        ),
        (
            "from blocks import Block as B\nfrom utils import ckpt\ny = ckpt(B.from_pretrained('b'), x)\n",
            "blocks.Block",
        ),
        (
            "import blocks as b\nfrom utils import ckpt\nmake = b.Block\nm = make(8)\ny = ckpt(m, x)\n",
            "blocks.Block",
        ),
        (
            "from ..nets.blocks import Block\nfrom .utils import ckpt\ny = ckpt(Block(8), x)\n",
            "..nets.blocks.Block",
        ),
        (
            "import torch.utils.checkpoint as cp\nfrom blocks import Block\n\ndef ckpt(fn, x, keep=False):\n"
            "    return cp.checkpoint(fn, x, preserve_rng_state=keep)\n\ny = ckpt(Block(8), x)\n",
            "blocks.Block",
        ),
    ],
)
def test_a_callee_is_named_as_its_import_resolves(code: str, target: str) -> None:
    assert reached_through(target, _callees(code))  # (the import ``target`` reached through a callee)


def test_the_files_own_wrapper_is_not_named() -> None:
    code = (
        "import torch.utils.checkpoint as cp\nfrom blocks import Block\n\ndef ckpt(fn, x, keep=False):\n"
        "    return cp.checkpoint(fn, x, preserve_rng_state=keep)\n\ny = ckpt(Block(8), x)\n"
    )
    assert _callees(code) == {"blocks.Block"}  # (``cp.checkpoint`` is given parameters only)


RANDOM_STEP = "import random\nfrom functools import partial\nfrom utils import ckpt\n\ndef block(x):\n    return x * random.random()\n\n"


@pytest.mark.parametrize(
    ("given", "named"),
    [
        # what ``resolve_callable`` may follow to code of the file: a def's name, a partial of it, a
        # call of a plain name (a factory), a lambda, ``self.x``, a name assigned a call
        ("block", True),
        ("partial(block, p=0.1)", True),
        ("make(block)", True),
        ("lambda t: block(t)", True),
        ("self.inner", True),
        ("made", True),
        # what it cannot: a parameter, a dotted name of something else, a literal
        ("fn", False),
        ("cfg.block", False),
        ("3", False),
    ],
)
def test_an_imported_wrapper_is_named_when_given_code_of_a_file_that_names_randomness(
    given: str, named: bool
) -> None:
    code = RANDOM_STEP + f"made = make(block)\n\ndef step(self, fn, cfg, x):\n    return ckpt({given}, x)\n"
    assert reached_through("utils.ckpt", _callees(code)) is named
    # without a word of randomness in the file, none of them draws random numbers (but a partial: a
    # call of an imported name, which may build an instance of an imported class as far as the gate sees)
    calm = code.replace("import random\n", "").replace("random.random()", "2")
    assert reached_through("utils.ckpt", _callees(calm)) is given.startswith("partial(")


def test_the_class_given_to_the_files_own_wrapper_is_named_only_at_a_call_of_a_name() -> None:
    code = (
        "import torch.utils.checkpoint as cp\nfrom blocks import Block\n\ndef ckpt(fn, x, keep=False):\n"
        "    return cp.checkpoint(fn, x, preserve_rng_state=keep)\n\nclass T:\n    def run(self, x):\n"
        "        return self.trainer.ckpt(Block(8), x)\n"
    )
    assert not reached_through("blocks.Block", _callees(code))  # (``self.trainer.ckpt``: no def of the file)
    assert reached_through("blocks.Block", _callees(code.replace("self.trainer.ckpt(", "ckpt(")))


WRAP_MODULE = "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import {name}\n"


@pytest.mark.parametrize(
    "code",
    [
        # the module's class not known (a parameter, a loop's block): any imported class may be it
        WRAP_MODULE.format(name="checkpoint_wrapper")
        + "from other import Thing\nfrom blocks import Block\n\n"
        "def wrap(block):\n    return checkpoint_wrapper(block, preserve_rng_state=False)\n",
        # the flag a name, the class given, the wrapper imported under another name in a method
        "from other import Thing\nfrom blocks import Block\n\nclass M:\n    def wrap(self):\n"
        "        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (\n"
        "            checkpoint_wrapper as ptd,\n        )\n        off = False\n"
        "        self.b = ptd(Block(8), preserve_rng_state=off)\n",
        # its class, through the module imported whole
        "import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as cw\nfrom other import Thing\n"
        "from blocks import Block\nm = cw.CheckpointWrapper(Block(8), preserve_rng_state=False)\n",
    ],
)
def test_torchs_checkpoint_wrapper_with_the_flag_off_names_every_import(code: str) -> None:
    callees = _callees(code)
    assert all(reached_through(target, callees) for target in _import_targets(code))


def test_torchs_checkpoint_wrapper_with_the_flag_on_names_no_import() -> None:
    code = (
        WRAP_MODULE.format(name="checkpoint_wrapper") + "from other import Thing\n"
        "def wrap(block):\n    return checkpoint_wrapper(block, preserve_rng_state=True)\n"
    )
    assert not any(reached_through(target, _callees(code)) for target in _import_targets(code))


@pytest.mark.parametrize("text", WRAPPER_POSSIBLE)
def test_a_file_the_project_check_keeps_names_one_of_its_imports(text: str) -> None:
    callees = _callees(text)
    assert any(reached_through(target, callees) for target in _import_targets(text))


@pytest.mark.parametrize("text", WRAPPER_IMPOSSIBLE)
def test_a_file_the_project_check_rules_out_names_no_callee(text: str) -> None:
    assert _callees(text) == frozenset()


def test_tl204_names_its_callees() -> None:
    assert gates()["TL204"].project_callees == "gate_checkpoint_misc.rng_wrapper_callees"
