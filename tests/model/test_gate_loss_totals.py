"""TL302's condition on CPython's tree (``Rule.gate_check``): an addition to a running total in a loop
that adds, not detached, a loss a backward call of its scope differentiates, one of the two in the
other's innermost loop. Files without one never reach libcst for TL302, and no finding changes. Its
cross-file condition (``Rule.project_gate_check``): the added call, or the call the added key holds,
may resolve to another file's function; files without one are not handed to the project index."""

from __future__ import annotations

import ast
import dataclasses
import textwrap
from pathlib import Path

import pytest
from conftest import gate_check_keeps_findings, lint_project

from trainlint.engine import lint_text
from trainlint.gates import gates, pass_tree_checks
from trainlint.model.gate_loss_totals import returned_loss_may_be_kept, total_may_hold_loss_graph
from trainlint.results import LintOptions
from trainlint.rule import registry

RULE = registry().get("TL302")
OFF = LintOptions(("TL302",), prefilter=False)

KEPT = [
    # the rule's own spellings, each through another door
    "total = 0\nfor x, y in loader:\n    loss = crit(model(x), y)\n    accelerator.backward(loss)\n    total += loss\n",
    "hist = []\nfor x in loader:\n    loss = crit(model(x))\n    scaler.scale(loss / 2).backward()\n    hist.append(loss)\n",
    "class M:\n    def fit(self, loader):\n        for b in loader:\n            loss = self(b).loss\n            self.manual_backward(loss)\n            self.total = self.total + loss\n",
    "async def f(loader):\n    async for b in loader:\n        out = model(b)\n        out.loss.backward()\n        total += out.loss\n",
    "while True:\n    loss = model(x)\n    loss.backward()\n    stats['loss'] += loss\n",
    "while True:\n    loss = model(x)\n    loss.backward()\n    stats['loss'] = stats['loss'] + loss\n",
    # the key as an attribute's name (``model(x).loss.backward()`` differentiates ``loss``)
    "for b in loader:\n    out = model(b)\n    model(b).loss.backward()\n    total += out.loss\n",
    # a helper of this file runs the backward of the loss it is passed
    "def step(loss):\n    loss.backward()\n\nfor b in loader:\n    loss = model(b)\n    step(loss)\n    total = total + loss\n",
    # the addition in a comprehension (no scope of its own) of the loop
    "for b in loader:\n    loss = model(b)\n    loss.backward()\n    [history.append(loss) for _ in loggers]\n",
    # the backward in the addition's loop, in a function defined in the loop body
    "for epoch in range(3):\n    def run():\n        loss = model(x)\n        loss.backward()\n        losses.append(loss)\n    run()\n",
    # a dict of losses walked by ``.items()``
    "for b in loader:\n    parts = model(b)\n    sum(parts.values()).backward()\n    for name, part in parts.items():\n        sums[name] += part\n",
    # ... or by a plain iteration of the differentiated list (TL302's ``_unpacked`` takes it too)
    "for b in loader:\n    parts = model(b)\n    sum(parts).backward()\n    for part in parts:\n        total += part\n",
    # ``float`` is the file's own function here: no longer a detaching builtin
    "def float(x):\n    return x\n\nfor b in loader:\n    loss = model(b)\n    loss.backward()\n    total += float(loss)\n",
    # ``.item()`` around one use, not the other
    "for b in loader:\n    loss = model(b)\n    loss.backward()\n    total += loss.item() + loss\n",
    # two nested loops: the addition in the backward's innermost loop
    "for e in range(3):\n    for b in loader:\n        loss = model(b)\n        for _ in range(2):\n            total += loss\n        loss.backward()\n",
]
# with a project, a method of this file that backpropagates the loss it returns (``own_method``)
METHOD = (
    "class T:\n    def step(self, b):\n        loss = self.model(b)\n        loss.backward()\n        return loss\n\n"
    "    def fit(self, loader):\n        for b in loader:\n            {line}\n"
)
KEPT_WITH_PROJECT = [
    METHOD.format(line="total += self.step(b)"),
    METHOD.format(line="loss = self.step(b)\n            total += loss"),
]
REJECTED = [
    "for b in loader:\n    loss = model(b)\n    loss.backward()\n    total += loss.item()\n",
    "for b in loader:\n    loss = model(b)\n    loss.backward()\n    total += loss.detach()\n    losses.append(loss.data)\n",
    "for b in loader:\n    loss = model(b)\n    loss.backward()\n    total += float(loss)\n    hist.append(round(loss, 2))\n",
    "for b in loader:\n    loss = model(b)\n    loss.backward()\n    step += 1\n    seen = seen + len(b)\n",
    # the addition and the backward in different functions
    "def train():\n    for b in loader:\n        loss = model(b)\n        loss.backward()\n\n"
    "def evaluate():\n    for b in loader:\n        loss = model(b)\n        total += loss\n",
    # the backward outside the addition's loop (an eval loop after the training loop)
    "for b in train:\n    loss = model(b)\n    loss.backward()\nfor b in val:\n    losses.append(model(b))\n",
    # the one micro-step loop of a window
    "for _ in range(args.gradient_accumulation_steps):\n    loss = model(b)\n    loss.backward()\n    losses.append(loss)\n",
    # the total is what gets backpropagated
    "for c in chunks:\n    total = total + model(c).loss\n    total.backward()\n",
    "for b in loader:\n    loss = crit(model(b))\n    loss += 0.01 * aux\n    loss.backward()\n",
    # a predicate whose name ends in backward is no backward
    "for x in outputs:\n    if _must_be_in_backward(x):\n        continue\n    values.append(x)\n",
    # a backward in a lambda: another scope than the addition's
    "for b in loader:\n    loss = model(b)\n    run = lambda: loss.backward()\n    total += loss\n",
    # the helper is called without a loss-named argument; the method path needs ``self.``
    "def step(x):\n    x.backward()\n\nfor b in loader:\n    out = model(b)\n    step(out)\n    total += out\n",
    # no loop around the addition
    "loss = model(b)\nloss.backward()\ntotal += loss\n",
]

# a loop over a bare ``values()`` (TL302's ``_unpacked`` once failed on it)
BARE_VALUES = (
    "for b in loader:\n    loss = model(b)\n    loss.backward()\n    total += loss.item()\n"
    "    for v in values():\n        pass\n"
)


def _reported(text: str, path: str = "x.py", options: LintOptions = OFF) -> list[int]:
    return [f.line for f in lint_text(text, path, options).findings if f.rule == "TL302"]


@pytest.mark.parametrize("code", KEPT)
def test_a_loss_kept_in_a_total_keeps_the_file(code: str) -> None:
    assert total_may_hold_loss_graph(ast.parse(code))
    assert _reported(code), "a kept case the rule does not report tests nothing"


@pytest.mark.parametrize("code", REJECTED)
def test_a_file_without_such_an_addition_is_ruled_out(code: str) -> None:
    assert not total_may_hold_loss_graph(ast.parse(code))
    assert not pass_tree_checks([gates()["TL302"]], ast.parse(code))
    assert not _reported(code), "the check ruled out a file the rule reports"


@pytest.mark.parametrize("code", KEPT_WITH_PROJECT)
def test_a_method_of_the_file_that_returns_its_loss_keeps_the_file(code: str, tmp_path: Path) -> None:
    """With a project, the file's own summary says the method returns the loss it backpropagated: no
    other file's fact is asked, so the check must keep the file (the project path would not run it)."""
    (tmp_path / "pyproject.toml").write_text("")
    path = tmp_path / "trainer.py"
    path.write_text(code)
    assert total_may_hold_loss_graph(ast.parse(code))
    on = _reported(code, str(path), LintOptions(("TL302",)))
    assert on == _reported(code, str(path)) and on


def test_every_reported_text_passes_the_check_and_the_findings_do_not_change() -> None:
    reported = gate_check_keeps_findings(
        "TL302", total_may_hold_loss_graph, [*KEPT, *REJECTED, *KEPT_WITH_PROJECT, BARE_VALUES]
    )
    assert reported >= len(RULE.invalid) + len(KEPT)


def test_code_outside_loops_is_not_walked_but_what_loops_call_is_read() -> None:
    """Only loops are walked to the leaves: a helper defined (and a float rebound) outside any loop is
    still found when a loop calls it."""
    helper = "def step(loss):\n    if True:\n        loss.backward()\n\n"
    loop = "for b in loader:\n    loss = model(b)\n    step(loss)\n    total += {}\n"
    assert total_may_hold_loss_graph(ast.parse(helper + loop.format("loss")))
    assert not total_may_hold_loss_graph(ast.parse(helper + loop.format("float(loss)")))
    rebound = "from numpy import float64 as float\n"
    assert total_may_hold_loss_graph(ast.parse(rebound + helper + loop.format("float(loss)")))
    assert _reported(rebound + helper + loop.format("float(loss)"))


def test_a_loop_over_a_bare_values_call_is_no_rule_error() -> None:
    off = lint_text(BARE_VALUES, "x.py", LintOptions(("TL302",), prefilter=False))
    assert (off.findings, off.errors) == ([], [])
    assert not total_may_hold_loss_graph(ast.parse(BARE_VALUES))


# -- cross-file findings (``Rule.project_gate_check``): a call that may resolve to another file's function ---
PROJECT_KEPT = [
    # an imported function, added directly, under another name, through a module, not detached
    "from steps import train_step\nfor b in loader:\n    total += train_step(b)\n",
    "from steps import train_step as step\nrun = step\nfor b in loader:\n    total += 2 * run(b)\n",
    "import engine.steps\nfor b in loader:\n    losses.append(engine.steps.train_step(b))\n",
    # the key of ``key = call(...)``, in the addition's loop, around it, or unpacked by ``.items()``
    "from steps import train_step\nfor b in loader:\n    loss = train_step(b)\n    total += loss\n",
    "from steps import train_step\nfor e in range(3):\n    loss = train_step(b)\n    for _ in loggers:\n        history.append(loss)\n",
    "from steps import step\nfor b in loader:\n    parts = step(b)\n    for name, value in parts.items():\n        sums[name] += value\n",
    "from steps import step\nfor b in loader:\n    parts = step(b)\n    for part in parts:\n        total += part\n",
    # an instance of an imported class: a name, ``self.x``, the call itself, a classmethod's product
    "from steps import Stepper\nstepper = Stepper()\nfor b in loader:\n    total += stepper.step(b)\n",
    "from steps import Stepper\n\nclass R:\n    def __init__(self):\n        self.stepper = Stepper.build()\n\n"
    "    def fit(self, loader):\n        for b in loader:\n            losses.append(self.stepper.step(b))\n",
    "import steps\nfor b in loader:\n    total += steps.Stepper().step(b)\n",
    # a method of this class's imported base (``own_method``'s inherited facts)
    "from base import Base\n\nclass T(Base):\n    def fit(self, loader):\n        for b in loader:\n            total += self.train_step(b)\n",
    # ``:=`` outside any loop binds the name (the walk reads the whole tree then)
    "import steps\nif (run := steps.train_step) is not None:\n    pass\nfor b in loader:\n    total += run(b)\n",
    "import steps\nprint(stepper := steps.Stepper())\nfor b in loader:\n    total += stepper.step(b)\n",
    *KEPT_WITH_PROJECT,
]
PROJECT_REJECTED = [
    # detached where it is added
    "from steps import train_step\nfor b in loader:\n    total += train_step(b).item()\n",
    "from steps import train_step\nfor b in loader:\n    loss = train_step(b)\n    total += float(loss)\n",
    # callees no other file defines: a builtin, a parameter, the file's own function and class
    "for b in loader:\n    total += len(b)\n",
    "def fit(model, loader):\n    for b in loader:\n        loss = model(b)\n        total += loss\n",
    "def step(b):\n    return b\n\nfor b in loader:\n    total += step(b)\n",
    "class S:\n    pass\n\ns = S()\nfor b in loader:\n    total += s.step(b)\n",
    # a method of this class without a backward, the class's base not imported
    "class T:\n    def step(self, b):\n        return b\n\n    def fit(self, loader):\n        for b in loader:\n            total += self.step(b)\n",
    # the call and the addition share no loop, or the addition is in none
    "from steps import train_step\nfor b in loader:\n    loss = train_step(b)\nfor b in val:\n    total += loss\n",
    "from steps import train_step\nloss = train_step(b)\ntotal += loss\n",
    # the one micro-step loop of a window; the total is what gets backpropagated
    "from steps import step\nfor _ in range(accumulation_steps):\n    total += step(b)\n",
    "from steps import step\nfor b in loader:\n    total = total + step(b)\n    total.backward()\n",
    # the call and the addition in different functions
    "from steps import step\n\ndef a(loader):\n    for b in loader:\n        loss = step(b)\n\n"
    "def b(loader):\n    for x in loader:\n        total += loss\n",
]


@pytest.mark.parametrize("code", PROJECT_KEPT)
def test_a_call_that_may_name_another_files_function_keeps_the_file(code: str) -> None:
    assert returned_loss_may_be_kept(ast.parse(code))


@pytest.mark.parametrize("code", PROJECT_REJECTED)
def test_a_file_without_such_a_call_is_no_cross_file_candidate(code: str) -> None:
    tree = ast.parse(code)
    assert not returned_loss_may_be_kept(tree)
    assert not pass_tree_checks([gates()["TL302"]], tree, project=True)


STEPS = """
    import torch


    def train_step(model, batch):
        loss = model(batch)
        loss.backward()
        return loss


    def step_parts(model, batch):
        total, parts = model(batch)
        total.backward()
        return parts


    class Stepper:
        def step(self, batch):
            loss = self.model(batch)
            loss.backward()
            return loss
"""
BASE = """
    class BaseTrainer:
        def train_step(self, batch):
            loss = self.model(batch)
            torch.cuda.amp.GradScaler().scale(loss).backward()
            return loss
"""
CROSS_FILE = [
    # (the target file, the line of the finding): each kind of TL302's cross-file findings
    (
        "from steps import train_step\n\ndef fit(model, loader):\n    total = 0\n    for b in loader:\n"
        "        total += train_step(model, b)\n    return total\n",
        6,
    ),
    (
        "import steps\n\ndef fit(model, loader):\n    losses = []\n    for b in loader:\n"
        "        loss = steps.train_step(model, b)\n        losses.append(loss)\n    return losses\n",
        7,
    ),
    (
        "from steps import step_parts\n\ndef fit(model, loader):\n    for b in loader:\n"
        "        loss_parts = step_parts(model, b)\n        for name, value in loss_parts.items():\n"
        "            sums[name] += value\n",
        7,
    ),
    (
        "from steps import step_parts\n\ndef fit(model, loader):\n    for b in loader:\n"
        "        loss_parts = step_parts(model, b)\n        for part in loss_parts:\n            total += part\n",
        7,
    ),
    (
        "from steps import Stepper\n\nclass Runner:\n    def __init__(self):\n        self.stepper = Stepper()\n\n"
        "    def fit(self, loader):\n        for b in loader:\n            self.total += self.stepper.step(b)\n",
        9,
    ),
    (
        "from steps import Stepper\n\ndef fit(loader):\n    stepper = Stepper()\n    for b in loader:\n"
        "        loss = stepper.step(b)\n        total = total + loss\n",
        7,
    ),
    (
        "from base import BaseTrainer\n\nclass Trainer(BaseTrainer):\n    def fit(self, loader):\n"
        "        for b in loader:\n            self.losses.append(self.train_step(b))\n",
        6,
    ),
    (
        "import steps\n\nif (run := steps.train_step):\n    pass\n\ndef fit(model, loader):\n    for b in loader:\n"
        "        total += run(model, b)\n",
        8,
    ),
]


@pytest.mark.parametrize(("code", "line"), CROSS_FILE)
def test_the_cross_file_findings_are_kept(tmp_path: Path, monkeypatch, capsys, code: str, line: int) -> None:
    """No backward in the target file: TL302 runs on it only through the cross-file path, which the
    check must let through."""
    assert "backward" not in code and returned_loss_may_be_kept(ast.parse(code))
    files = {"steps.py": STEPS, "base.py": BASE, "train.py": code}
    found = [
        f for f in lint_project(tmp_path, files, "train.py", monkeypatch, capsys) if f["rule"] == "TL302"
    ]
    assert [f["line"] for f in found] == [line]
    assert {"steps.py", "base.py"} & {r["path"] for r in found[0]["related"]}  # (the other file's backward)


def test_a_candidate_without_such_an_addition_is_neither_indexed_nor_parsed(
    tmp_path: Path, monkeypatch
) -> None:
    """The file passes TL302's project prefilter and imports a function that returns its backpropagated
    loss (the index would choose the rule, and libcst parse the file), but adds only a number: the check
    rules the file out first, and the findings are those of a run without it."""
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "steps.py").write_text(textwrap.dedent(STEPS))
    text = (
        "from steps import train_step\n\ndef fit(model, loader):\n    total = 0\n    for b in loader:\n"
        "        loss = train_step(model, b)\n        total += loss.item()\n    return total\n"
    )
    path = tmp_path / "train.py"
    path.write_text(text)
    gate = gates()["TL302"]
    assert gate.can_fire_in_project(text) and not gate.can_fire(text)  # a cross-file candidate only
    assert not returned_loss_may_be_kept(ast.parse(text))
    options = LintOptions(("TL302",))
    on = lint_text(text, str(path), options)
    monkeypatch.setitem(gates(), "TL302", dataclasses.replace(gate, project_check="", project_callees=""))
    off = lint_text(text, str(path), options)
    assert (on.findings, on.errors) == (off.findings, off.errors) == ([], [])
    assert (on.parsed, off.parsed) == (False, True)  # without the check the index sends it to libcst
