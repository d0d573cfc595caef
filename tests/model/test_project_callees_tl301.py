"""``Rule.project_callees`` for TL301 (``gate_mean_of_means.token_mean_callees``): of the definitions a file
imports, only those reached through what the divided loss's origin may call (a helper, a base class's
method, an instance's method, a language model's builder) or through the loss class of an instance called
where a backward runs can take part in a cross-file finding. A trainer that imports a token-mean helper
but divides another loss is not parsed for the rule; every cross-file finding stays."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest
from test_gate_code_s6 import CROSS_FILE as GATE_CODE_CASES
from test_gate_mean_of_means import ACCUM_LOSS, BUILDER_PROJECT, TOKEN_MEAN
from test_gate_mean_of_means import CROSS_FILE as GATE_CASES
from test_project_shapes_s5 import BASE_TRAINER_PROJECT, BUILDERS, LOOP, MASKED_MEAN_HELPER

from trainlint import engine
from trainlint.engine import lint_text
from trainlint.gates import gates
from trainlint.model import gate_mean_of_means
from trainlint.model.gate_mean_of_means import token_mean_callees
from trainlint.model.project import Project
from trainlint.model.pyast import reached_through
from trainlint.results import LintOptions
from trainlint.rule import registry

RULE = registry().get("TL301")
ON = LintOptions(("TL301",))


def _callees(code: str) -> frozenset[str]:
    return token_mean_callees(ast.parse(textwrap.dedent(code)))


def _write(root: Path, files: dict[str, str], target: str) -> tuple[str, str]:
    (root / "pyproject.toml").write_text("")
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return (root / target).read_text(), str(root / target)


# -- (a) every cross-file finding of the other tests' projects comes through a callee named ---------------
# (the project's files, the linted file, its name): test_gate_mean_of_means's kinds, test_gate_code_s6's
# TL301 cases, test_project_shapes_s5's (a package's base class, a builder, a loss class, a helper)
PROJECTS = [({**files, "train.py": text}, "train.py") for files, text, _ in GATE_CASES]
PROJECTS += [
    ({"helpers.py": other, "train.py": code}, "train.py")
    for other, code, found, _ in GATE_CODE_CASES
    if found and found[0][0] == "TL301"
]
PROJECTS += [
    ({"builders.py": BUILDERS, "train.py": LOOP.format(builder="build_lm")}, "train.py"),
    (BASE_TRAINER_PROJECT, "engine/trainer.py"),
    (
        {
            "helpers.py": MASKED_MEAN_HELPER,
            "train.py": """
                from helpers import token_loss


                def train_step(model, optimizer, micro_batches):
                    n_micro = len(micro_batches)
                    for batch in micro_batches:
                        loss = token_loss(model, batch)
                        loss = loss / n_micro
                        loss.backward()
                    optimizer.step()
                """,
        },
        "train.py",
    ),
    (BUILDER_PROJECT, "pkg/train.py"),
]


@pytest.mark.parametrize(("files", "target"), PROJECTS)
def test_every_cross_file_finding_is_reached_through_a_callee(tmp_path, monkeypatch, files, target) -> None:
    text, path = _write(tmp_path, files, target)
    callees = token_mean_callees(ast.parse(text))
    imported = Project.for_file(path).imported_facts_by_target(text)
    wanted = {t for t, fact in imported if RULE.wants_fact(fact.kind, fact.facts)}
    assert wanted and all(reached_through(t, callees) for t in wanted)
    checked = lint_text(text, path, ON)
    assert checked.parsed and [f.rule for f in checked.findings] == ["TL301"]
    monkeypatch.setattr(engine, "callees_asked", lambda name, tree: None)
    assert lint_text(text, path, ON).findings == checked.findings


# -- (b) a candidate whose imports no callee reaches is not parsed for the rule ---------------------------
UNREACHED = [
    # the helper is imported for evaluation; the divided loss is the file's own function's
    """
    from helpers import token_loss


    def compute(model, batch):
        return model(batch["input_ids"]).mean()


    def train(model, loader, accum_steps):
        for batch in loader:
            loss = compute(model, batch)
            (loss / accum_steps).backward()


    def evaluate(model, batch):
        return token_loss(model, batch).item()
    """,
    # padded batches, a model of a library's class (accelerate's examples), the project's loss class and
    # helper imported but never what the divided loss comes from
    """
    from transformers import AutoModelForSequenceClassification
    from helpers import AccumLoss, token_loss

    model = AutoModelForSequenceClassification.from_pretrained("bert-base-cased")
    for step, batch in enumerate(loader):
        batch = tokenizer.pad(batch, padding=True)
        loss = model(**batch).loss
        loss = loss / gradient_accumulation_steps
        loss.backward()
    print(token_loss, AccumLoss(gradient_accumulation_steps))
    """,
]


@pytest.mark.parametrize("code", UNREACHED)
def test_a_candidate_whose_imports_no_callee_reaches_is_not_parsed(tmp_path, monkeypatch, code: str) -> None:
    helpers = textwrap.dedent(TOKEN_MEAN) + textwrap.dedent(ACCUM_LOSS)
    text, path = _write(tmp_path, {"helpers.py": helpers, "train.py": code}, "train.py")
    assert [g.id for g in engine._code_gate(text, ON)[1]] == ["TL301"]  # a cross-file candidate
    imported = Project.for_file(path).imported_facts_by_target(text)
    assert any(RULE.wants_fact(f.kind, f.facts) for _, f in imported)  # (any import would do)
    assert not any(reached_through(t, token_mean_callees(ast.parse(text))) for t, _ in imported)
    checked = lint_text(text, path, ON)
    assert checked.findings == [] and not checked.parsed
    monkeypatch.setattr(engine, "callees_asked", lambda name, tree: None)
    unchecked = lint_text(text, path, ON)
    assert unchecked.findings == [] and unchecked.parsed


# -- (c) the names, per path ---------------------------------------------------------------------------
LOOP_OF = """
{imports}

def train(model, loader, accum_steps):
    for batch in loader:
        loss = {loss}
        (loss / accum_steps).backward()
"""


@pytest.mark.parametrize(
    ("imports", "loss", "callee"),
    [
        ("from helpers import token_loss", "token_loss(model, batch)", "helpers.token_loss"),
        ("from helpers import token_loss as tl", "tl(model, batch)", "helpers.token_loss"),
        ("from helpers import token_loss\nf = token_loss", "f(model, batch)", "helpers.token_loss"),
        ("import helpers", "helpers.token_loss(model, batch)", "helpers.token_loss"),  # imported whole
        ("import pkg.helpers as h", "h.token_loss(model, batch)", "pkg.helpers.token_loss"),
        ("import pkg.helpers", "pkg.helpers.token_loss(model, batch)", "pkg.helpers.token_loss"),
        ("from .helpers import token_loss", "token_loss(model, batch)", ".helpers.token_loss"),  # relative
        ("from . import helpers", "helpers.token_loss(model, batch)", ".helpers.token_loss"),
        ("from ..lib import helpers", "helpers.token_loss(model, batch)", "..lib.helpers.token_loss"),
        # through arithmetic, a method of the result and a tuple's element
        ("from helpers import token_loss", "2 * token_loss(model, batch).mean()", "helpers.token_loss"),
        ("from helpers import token_loss", "(token_loss(model, batch), 0)[0]", "helpers.token_loss"),
        # a method of an instance of an imported class (``project_method``'s ``constructed_class``)
        ("from scorers import Scorer\nscorer = Scorer()", "scorer.token_loss(batch)", "scorers.Scorer"),
        ("import scorers", "scorers.Scorer.make().token_loss(batch)", "scorers.Scorer.make"),
    ],
)
def test_the_helper_a_divided_loss_comes_from_is_named_as_its_import_resolves(
    imports: str, loss: str, callee: str
) -> None:
    callees = _callees(LOOP_OF.format(imports=imports, loss=loss))
    assert callee in callees
    target = callee.rpartition(".")[0] if imports.startswith("import") else None
    assert target is None or reached_through(target, callees)


def test_a_name_traced_through_assignments_additions_and_a_local_function() -> None:
    code = """
    from helpers import token_loss, other_loss
    from models import Scorer

    def compute(model, batch):
        inner = token_loss(model, batch)
        return inner


    def train(model, loader, accum_steps):
        for batch in loader:
            total = 0.0
            total += other_loss(model, batch)
            loss = compute(model, batch) + total
            (loss / accum_steps).backward()
            Scorer().log(loss)
    """
    assert _callees(code) == {"helpers.token_loss", "helpers.other_loss"}


def test_the_method_of_a_base_class_of_another_file() -> None:
    code = """
    from base import BaseTrainer
    from data import Loader


    class Trainer(BaseTrainer):
        def step(self, batch):
            loss = self.compute_loss(batch)
            (loss / self.grad_accum_steps).backward()
            Loader().next()
    """
    assert _callees(code) == {"base.BaseTrainer.compute_loss"}


# the model's `.loss` (padding shown): its builder of another file, through a wrapper, a loader, an alias
BUILT = """
import builders
from builders import build_lm
{model}
for step, batch in enumerate(loader):
    batch = tokenizer.pad(batch, padding=True)
    loss = model(**batch).loss
    loss = loss / gradient_accumulation_steps
    loss.backward()
"""


@pytest.mark.parametrize(
    ("model", "callee"),
    [
        ("model = build_lm(cfg)", "builders.build_lm"),
        ("model = accelerator.prepare(build_lm(cfg))", "builders.build_lm"),
        (
            "net = build_lm(cfg)\nmodel, opt = accelerator.prepare(net, opt)\nmodel = DDP(net)",
            "builders.build_lm",
        ),
        ("model = build_lm(cfg).to(device)", "builders.build_lm"),
        ("model = builders.Net.from_pretrained(name)", "builders.Net"),
        ("make = builders.make_model\nmodel = make(cfg)", "builders.make_model"),
    ],
)
def test_the_builder_of_a_model_whose_loss_is_divided(model: str, callee: str) -> None:
    assert callee in _callees(BUILT.format(model=model))


def test_a_local_model_class_names_what_its_methods_call() -> None:
    code = BUILT.format(
        model="class GPT:\n    def forward(self, x):\n        return helpers.token_loss(self, x)\n\nmodel = GPT()"
    )
    assert "helpers.token_loss" in _callees("import helpers\n" + code)


@pytest.mark.parametrize("padding", [True, False])
def test_the_builder_is_named_only_where_the_file_shows_padding(padding: bool) -> None:
    """A model's ``.loss`` is a token mean only where the file shows padding (``check``): without it the
    builder's facts count for nothing (here no instance is called either: the model is built inline)."""
    code = BUILT.format(model="").replace("model(**batch)", "build_lm(cfg)(**batch)")
    if not padding:
        code = code.replace("    batch = tokenizer.pad(batch, padding=True)\n", "")
    assert ("builders.build_lm" in _callees(code)) is padding


@pytest.mark.parametrize(
    ("code", "callee"),
    [
        (
            "from losses import AccumLoss\nc = AccumLoss(4)\nfor b in loader:\n    c(b).backward()\n",
            "losses.AccumLoss",
        ),
        (
            "import losses\nclass T:\n    def __init__(self):\n        self.c = losses.AccumLoss(4)\n"
            "    def step(self, b):\n        self.c(b).backward()\n",
            "losses.AccumLoss",
        ),
        (
            "import losses\nL = losses.AccumLoss\nc = L.make(4)\nrun = lambda b: c(b).backward()\n",
            "losses.AccumLoss.make",
        ),
    ],
)
def test_the_loss_class_of_an_instance_called_where_a_backward_runs(code: str, callee: str) -> None:
    assert callee in _callees(code)


@pytest.mark.parametrize(
    "code",
    [
        # the division never reaches a backward
        "from helpers import token_loss\nfor b in loader:\n    print(token_loss(b) / accum_steps)\n",
        # the instance is called where nothing backpropagates
        "from losses import AccumLoss\nc = AccumLoss(4)\ndef log(x):\n    print(c(x))\ndef train(loss):\n    loss.backward()\n",
        # divided by what is not a step count
        "from helpers import token_loss\n(token_loss(b) / temperature).backward()\n",
    ],
)
def test_no_possible_cross_file_finding_names_no_callee(code: str) -> None:
    assert _callees(code) == frozenset()


def test_the_engine_asks_the_callees_and_the_checks_share_one_walk() -> None:
    assert gates()["TL301"].project_callees == "gate_mean_of_means.token_mean_callees"
    first, second = ast.parse(textwrap.dedent(UNREACHED[0])), ast.parse("import torch\n")
    facts = gate_mean_of_means._facts_of(first)
    assert gate_mean_of_means._facts_of(first) is facts  # (asked again: the same walk)
    assert gate_mean_of_means._facts_of(second) is not facts
    assert gate_mean_of_means._facts_of(first) is not facts  # (another tree came between)
