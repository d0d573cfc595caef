"""``Rule.project_callees`` (TL105's ``trained_callees``): of the definitions a file imports whose facts
a rule wants, only those reached through a callee the rule may report at send the file to libcst for
the rule. A file that builds an imported class able to convert itself but never trains the instance
(accelerate's examples and ``Accelerator()``) is not parsed; every cross-file finding stays."""

from __future__ import annotations

import ast
import textwrap

import pytest
from test_gate_half_params import NETS, PROJECTS, _fp16_init

from trainlint import engine
from trainlint.engine import lint_text
from trainlint.model.gate_half_params import trained_callees
from trainlint.model.pyast import reached_through
from trainlint.model.stamps import text_digest
from trainlint.results import LintOptions
from trainlint.rule import registry

RULE = registry().get("TL105")
OPTIONS = LintOptions(("TL105",))

# a class whose constructor converts the module (``init_may_convert``), built but never trained here
BUILT_NOT_TRAINED = """
import torch
from nets import Net
from transformers import AutoModel

def main():
    runner = Net()
    model = AutoModel.from_pretrained("x")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    runner.log(model)
"""


def _project(root, files: dict[str, str], code: str):
    (root / "pyproject.toml").write_text("")
    for name, text in files.items():
        (root / name).write_text(textwrap.dedent(text).lstrip())
    path = root / "train.py"
    path.write_text(textwrap.dedent(code).lstrip())
    return path, path.read_text()


def test_a_class_built_but_never_trained_is_not_parsed_for_the_rule(tmp_path, monkeypatch) -> None:
    path, text = _project(tmp_path, {"nets.py": NETS}, BUILT_NOT_TRAINED)
    assert [g.id for g in engine._code_gate(text, OPTIONS)[1]] == ["TL105"]  # a cross-file candidate
    checked = lint_text(text, str(path), OPTIONS)
    assert checked.findings == [] and not checked.parsed
    monkeypatch.setattr(engine, "callees_asked", lambda name, tree: None)  # any import: `Net` is wanted
    unchecked = lint_text(text, str(path), OPTIONS)
    assert unchecked.findings == [] and unchecked.parsed


def test_the_same_class_trained_is_parsed_and_reported(tmp_path) -> None:
    code = BUILT_NOT_TRAINED.replace("runner = Net()", "model = Net()").replace(
        '    model = AutoModel.from_pretrained("x")\n', ""
    )
    path, text = _project(tmp_path, {"nets.py": NETS}, code)
    checked = lint_text(text, str(path), OPTIONS)
    assert checked.parsed and [f.rule for f in checked.findings] == ["TL105"]


@pytest.mark.parametrize(("files", "code"), [(f, c) for f, c, _ in PROJECTS] + [(_fp16_init(), None)])
def test_every_cross_file_finding_is_reached_through_a_trained_callee(
    files: dict[str, str], code: str | None
) -> None:
    # (the findings themselves, with the engine asking the callees: test_gate_half_params's
    # ``test_every_kind_of_cross_file_finding_is_still_reported``)
    tree = ast.parse(textwrap.dedent(code if code is not None else files["bad_train.py"]))
    imports = [
        f"{'.' * n.level}{n.module or ''}.{a.name}" if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    ]
    callees = trained_callees(tree)
    assert any(reached_through(target, callees) for target in imports)


@pytest.mark.parametrize(
    ("code", "callee"),
    [
        # a helper of a module imported whole
        (
            "import torch, helpers\nm = Net()\nhelpers.to_half(m)\nopt = torch.optim.SGD(m.parameters())\n",
            "helpers.to_half",
        ),
        # through an alias of the helper
        (
            "import torch\nfrom helpers import to_half\nh = to_half\nm = Net()\nh(m)\n"
            "opt = torch.optim.SGD(m.parameters())\n",
            "helpers.to_half",
        ),
        # a loader's classmethod: the assigned name is trained
        (
            "import torch\nfrom nets import Net as N\nm = N.from_pretrained('x')\n"
            "opt = torch.optim.SGD(m.parameters())\n",
            "nets.Net.from_pretrained",
        ),
    ],
)
def test_the_callee_of_a_trained_name_is_named_as_its_import_resolves(code: str, callee: str) -> None:
    assert callee in trained_callees(ast.parse(code))


def test_a_callee_whose_result_and_arguments_are_never_trained_is_not_named() -> None:
    callees = trained_callees(ast.parse(textwrap.dedent(BUILT_NOT_TRAINED)))
    assert "nets.Net" not in callees and "transformers.AutoModel.from_pretrained" in callees


def test_no_optimizer_names_no_callee() -> None:
    assert trained_callees(ast.parse("from nets import Net\nm = Net()\nm.parameters()\n")) == frozenset()


@pytest.mark.parametrize(
    ("target", "callees", "reached"),
    [
        ("nets.Net", {"nets.Net"}, True),
        ("nets.Net", {"nets.Net.from_pretrained"}, True),
        ("helpers", {"helpers.to_half"}, True),  # a module imported whole
        (".helpers", {"..helpers.to_half"}, True),  # ``from . import helpers``, spelled two ways
        ("nets.Net", {"nets.Network"}, False),
        ("nets.Net", {"transformers.AutoModel"}, False),
        ("nets", set(), False),
    ],
)
def test_a_definition_is_reached_through_its_import_or_a_name_under_it(
    target: str, callees: set[str], reached: bool
) -> None:
    assert reached_through(target, frozenset(callees)) is reached


def test_the_result_caches_verdict_carries_the_callees(tmp_path, monkeypatch) -> None:
    """A cold run with a cache gates each file when it looks it up and keeps no tree: the lint that
    follows takes the callees from the verdict, without parsing the text again."""
    path, text = _project(tmp_path, {"nets.py": NETS}, BUILT_NOT_TRAINED)
    assert not engine.outcome_needs_no_project(text, OPTIONS)  # (kept: a cross-file candidate)
    verdict = engine._VERDICTS[(text_digest(text), OPTIONS)]
    assert verdict.callees["TL105"] is not None and "nets.Net" not in verdict.callees["TL105"]
    monkeypatch.setattr(engine, "_cpython_parse", lambda text: pytest.fail("parsed again"))
    checked = lint_text(text, str(path), OPTIONS)
    assert checked.findings == [] and not checked.parsed


def test_the_checks_share_one_walk_per_tree_and_never_another_trees() -> None:
    from trainlint.model import gate_half_params

    first, second = ast.parse(textwrap.dedent(BUILT_NOT_TRAINED)), ast.parse("import torch\n")
    facts = gate_half_params._facts_of(first)
    assert gate_half_params._facts_of(first) is facts  # (asked again: the same walk)
    assert gate_half_params._facts_of(second) is not facts
    assert gate_half_params._facts_of(first) is not facts and trained_callees(first) == trained_callees(
        ast.parse(textwrap.dedent(BUILT_NOT_TRAINED))
    )
