"""``Rule.project_callees`` for TL302 (``gate_loss_totals.kept_loss_callees``): a cross-file finding
rests on what a call the file adds to a running total (or whose result it adds) resolves to: an
imported helper, a method of an imported class's instance, a method of an imported base class. Of the
definitions a file imports, only those reached through such a call's names send the file to libcst
for the rule: a file that imports a helper returning its backpropagated loss but adds another call's
result is not parsed; every cross-file finding stays."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest
import test_project_shapes_s5 as shapes
from test_gate_code_s6 import CALLER, HELPER
from test_gate_loss_totals import BASE, CROSS_FILE, STEPS

from trainlint import engine
from trainlint.engine import lint_text
from trainlint.model import gate_loss_totals
from trainlint.model.gate_loss_totals import kept_loss_callees, returned_loss_may_be_kept
from trainlint.model.pyast import reached_through
from trainlint.model.summary import outline
from trainlint.results import LintOptions

OPTIONS = LintOptions(("TL302",))
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "project"


def _parameters(test, name: str) -> list:
    """The values a ``pytest.mark.parametrize`` of another test module gives ``name``."""
    for mark in test.pytestmark:
        names = (
            [n.strip() for n in mark.args[0].split(",")] if isinstance(mark.args[0], str) else mark.args[0]
        )
        if name in names:
            return [values[names.index(name)] for values in mark.args[1]]
    raise LookupError(name)


def _write(root: Path, files: dict[str, str]) -> None:
    (root / "pyproject.toml").write_text("")
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())


# (the project's files, the file linted): each TL302 cross-file finding of the other tests' projects
FINDINGS = [
    *(({"steps.py": STEPS, "base.py": BASE, "train.py": code}, "train.py") for code, _ in CROSS_FILE),
    *(
        ({"engine/__init__.py": "", **files}, target)
        for files, target in zip(
            _parameters(shapes.test_tl302_returned_loss_added_directly, "files"),
            _parameters(shapes.test_tl302_returned_loss_added_directly, "target"),
            strict=True,
        )
    ),
    (
        {name: (FIXTURES / "step_helper" / name).read_text() for name in ("steps.py", "bad_loop.py")},
        "bad_loop.py",
    ),
    (
        {
            "helpers.py": HELPER,
            "main.py": CALLER.format(
                body="    total = 0\n    for b in data:\n        total += train_step(model, b)\n"
            ),
        },
        "main.py",
    ),
]


@pytest.mark.parametrize(("files", "target"), FINDINGS)
def test_every_cross_file_finding_is_reached_through_a_kept_callee(
    tmp_path: Path, monkeypatch, files: dict[str, str], target: str
) -> None:
    _write(tmp_path, files)
    path = tmp_path / target
    text = path.read_text()
    tree = ast.parse(text)
    assert engine._code_gate(text, OPTIONS)[1]  # a cross-file candidate
    callees = kept_loss_callees(tree)
    assert any(reached_through(t, callees) for t in outline(text, tree)["imports"].values())  # type: ignore[index]
    found = lint_text(text, str(path), OPTIONS).findings
    assert [f.rule for f in found] == ["TL302"]
    assert any(Path(r.path).name != path.name for r in found[0].related)  # (the other file's backward)
    monkeypatch.setattr(engine, "callees_asked", lambda name, tree: None)  # any import counts
    assert lint_text(text, str(path), OPTIONS).findings == found


# ``steps.train_step`` and ``Stepper.step`` return the loss they backpropagated, ``Meter.score`` a number
STEPS_AND_METERS = (
    STEPS
    + """

    def accuracy(model, batch):
        return (model(batch).argmax(-1) == batch.y).float().mean()


    class Meter:
        def score(self, batch):
            return 0.0
"""
)
# each file imports a definition whose facts TL302 wants, but adds the result of another call only
NOT_REACHED = [
    # the helper warms up once, outside the loop; the loop adds another helper's result
    """
    from steps import accuracy, train_step

    def fit(model, loader, first):
        train_step(model, first)
        total = 0
        for b in loader:
            total += accuracy(model, b)
        return total
    """,
    # an instance of the class whose method returns its loss is built; another instance's method is added
    """
    from steps import Meter, Stepper

    def fit(loader):
        stepper = Stepper()
        meter = Meter()
        total = 0
        for b in loader:
            total += meter.score(b)
        return total
    """,
    # the helper's loss is assigned in the loop but only its number is added; the added call is another
    """
    from steps import accuracy, train_step

    def fit(model, loader):
        total = 0
        for b in loader:
            loss = train_step(model, b)
            total += accuracy(model, b) + loss.item()
        return total
    """,
]


@pytest.mark.parametrize("code", NOT_REACHED)
def test_a_candidate_reaching_no_wanted_definition_is_not_parsed_for_the_rule(
    tmp_path: Path, monkeypatch, code: str
) -> None:
    _write(tmp_path, {"steps.py": STEPS_AND_METERS, "train.py": code})
    path = tmp_path / "train.py"
    text = path.read_text()
    assert [g.id for g in engine._code_gate(text, OPTIONS)[1]] == ["TL302"]  # a cross-file candidate
    assert returned_loss_may_be_kept(ast.parse(text))  # (its project check holds)
    checked = lint_text(text, str(path), OPTIONS)
    assert checked.findings == [] and not checked.parsed
    monkeypatch.setattr(engine, "callees_asked", lambda name, tree: None)  # any import: a wanted one too
    unchecked = lint_text(text, str(path), OPTIONS)
    assert unchecked.findings == [] and unchecked.parsed


def _callees(code: str) -> frozenset[str]:
    return kept_loss_callees(ast.parse(textwrap.dedent(code)))


@pytest.mark.parametrize(
    ("code", "callee"),
    [
        # an imported helper, added directly, inside an expression, its key added
        ("from steps import train_step\nfor b in loader:\n    total += train_step(b)\n", "steps.train_step"),
        ("from steps import f\nfor b in loader:\n    total = total + 2 * f(b)\n", "steps.f"),
        ("from steps import f\nfor b in loader:\n    loss = f(b)\n    losses.append(loss)\n", "steps.f"),
        # a value unpacked from the key by ``.items()``
        (
            "from steps import parts\nfor b in loader:\n    p = parts(b)\n    for k, v in p.items():\n"
            "        sums[k] += v\n",
            "steps.parts",
        ),
        # under another name: ``as``, an alias, an alias of an alias, ``:=`` outside any loop
        ("from steps import train_step as s\nfor b in loader:\n    total += s(b)\n", "steps.train_step"),
        ("from steps import f\nrun = f\nfor b in loader:\n    total += run(b)\n", "steps.f"),
        ("import steps\nm = steps\nrun = m.f\nfor b in loader:\n    total += run(b)\n", "steps.f"),
        ("import steps\nif (run := steps.f):\n    pass\nfor b in loader:\n    total += run(b)\n", "steps.f"),
        # every binding of the name, a ``:=`` outside loops too where an import already resolves it
        (
            "from steps import f\nimport o\nif (f := o.g):\n    pass\nfor b in loader:\n    total += f(b)\n",
            "o.g",
        ),
        (
            "from steps import f\nimport o\nif (f := o.g):\n    pass\nfor b in loader:\n    total += f(b)\n",
            "steps.f",
        ),
        # a module imported whole, a dotted module, a module under another name
        ("import steps\nfor b in loader:\n    total += steps.f(b)\n", "steps.f"),
        ("import engine.steps\nfor b in loader:\n    total += engine.steps.f(b)\n", "engine.steps.f"),
        ("import engine.steps as es\nfor b in loader:\n    total += es.f(b)\n", "engine.steps.f"),
        # an instance of an imported class: the call itself, a name, ``self.x``, a classmethod's product
        ("from steps import S\nfor b in loader:\n    total += S().step(b)\n", "steps.S"),
        ("from steps import S as T\ns = T()\nfor b in loader:\n    total += s.step(b)\n", "steps.S"),
        (
            "import steps\n\nclass R:\n    def __init__(self):\n        self.s = steps.S.build()\n\n"
            "    def fit(self, loader):\n        for b in loader:\n            losses.append(self.s.step(b))\n",
            "steps.S.build",
        ),
        # a method of the class's imported base, imported by name or through its module
        (
            "from base import Base\n\nclass T(Base):\n    def fit(self, loader):\n        for b in loader:\n"
            "            total += self.train_step(b)\n",
            "base.Base.train_step",
        ),
        (
            "import base\n\nclass T(base.Base):\n    def fit(self, loader):\n        for b in loader:\n"
            "            total += self.train_step(b)\n",
            "base.Base.train_step",
        ),
    ],
)
def test_the_callee_is_named_as_its_import_resolves(code: str, callee: str) -> None:
    assert callee in _callees(code)


@pytest.mark.parametrize(
    ("code", "target"),
    [
        ("from . import steps\nfor b in loader:\n    total += steps.f(b)\n", ".steps"),
        ("from .steps import f\nfor b in loader:\n    total += f(b)\n", ".steps.f"),
        (
            "from ..engine.steps import S\ns = S()\nfor b in loader:\n    total += s.step(b)\n",
            "..engine.steps.S",
        ),
        (
            "from .. import base\n\nclass T(base.Base):\n    def fit(self, l):\n        for b in l:\n"
            "            total += self.step(b)\n",
            "..base",
        ),
    ],
)
def test_a_relative_import_is_reached_through_its_callee(code: str, target: str) -> None:
    tree = ast.parse(code)
    assert target in outline(code, tree)["imports"].values()  # type: ignore[index]
    assert reached_through(target, kept_loss_callees(tree))


def test_every_added_call_is_named_and_no_other() -> None:
    code = """
        import torch
        from steps import a, b, c, d

        def fit(loader):
            for x in loader:
                loss = c(x)
                d(x)
                total += a(x) * torch.exp(b(x))
    """
    assert _callees(code) == {"steps.a", "steps.b", "torch.exp"}


@pytest.mark.parametrize(
    "code",
    [
        # detached where it is added; a number made of it
        "from steps import f\nfor b in loader:\n    total += f(b).item()\n",
        "from steps import f\nfor b in loader:\n    loss = f(b)\n    total += float(loss)\n",
        # added outside any loop; the call and the addition share no loop
        "from steps import f\nloss = f(b)\ntotal += loss\n",
        "from steps import f\nfor b in loader:\n    loss = f(b)\nfor b in val:\n    total += loss\n",
        # the micro-step loop of one window; the total is what gets backpropagated
        "from steps import f\nfor _ in range(accumulation_steps):\n    total += f(b)\n",
        "from steps import f\nfor b in loader:\n    total = total + f(b)\n    total.backward()\n",
        # a callee no import names: a builtin, the file's own function, a class of its own (no base)
        "import steps\nfor b in loader:\n    total += len(b)\n",
        "import steps\ndef g(b):\n    return b\n\nfor b in loader:\n    total += g(b)\n",
        "import steps\nclass S:\n    pass\n\ns = S()\nfor b in loader:\n    total += s.step(b)\n",
    ],
)
def test_no_kept_addition_names_no_callee(code: str) -> None:
    assert _callees(code) == frozenset()


def test_the_checks_share_one_walk_per_tree_and_never_another_trees() -> None:
    code = "from steps import f\nimport o\nif (f := o.g):\n    pass\nfor b in loader:\n    total += f(b)\n"
    asked_first = kept_loss_callees(ast.parse(code))  # (nothing else read of its walk before)
    tree = ast.parse(code)
    walk = gate_loss_totals._walk_of(tree)
    assert gate_loss_totals._walk_of(tree) is walk  # (asked again: the same walk)
    assert not gate_loss_totals.total_may_hold_loss_graph(tree) and returned_loss_may_be_kept(tree)
    assert kept_loss_callees(tree) == asked_first == {"steps.f", "o.g"}
    assert gate_loss_totals._walk_of(tree) is walk and gate_loss_totals._walk_of(ast.parse(code)) is not walk
