"""``Rule.fact_words``: a module whose text holds none of a rule's fact words cannot define anything the
rule's ``wants_fact`` asks for, so the project index does not summarise it for that rule's question
(unless a lookup must follow an import of the name there). A file kept only for cross-file
candidates is keyed on what that question read, by stamp: a module changed since is asked again."""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path

import pytest
from conftest import age, touch, write_project

from trainlint import engine
from trainlint.cli import run
from trainlint.gates import gates
from trainlint.model import project as project_module
from trainlint.model.index_imports import imports_name
from trainlint.model.project import forget_indexes, may_hold_facts
from trainlint.model.summary import outline, summarize
from trainlint.rule import load_rule, registry

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
TL204_WORDS = ("preserve_rng_state", "ropout")


def _code_samples() -> list[str]:
    """Python texts of the repository: the fixtures, the rules' examples, and the code embedded as
    strings in the tests (the projects they write)."""
    texts = [p.read_text(encoding="utf-8") for p in sorted((REPO / "fixtures").rglob("*.py"))]
    for rule in registry().rules.values():
        texts += [*rule.valid, *(example.code for example in rule.invalid)]
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" in node.value:
                texts.append(textwrap.dedent(node.value))
    return [t for t in texts if outline(t) is not None]


SAMPLES = _code_samples()


# -- the words are necessary: no definition a rule wants comes from a text without one -------------------
@pytest.mark.parametrize("rule_id", [r for r, rule in registry().rules.items() if rule.fact_words])
def test_every_wanted_definition_is_in_a_text_holding_a_fact_word(rule_id: str) -> None:
    rule = load_rule(rule_id)
    assert rule is not None
    wanted = 0
    for text in SAMPLES:
        summary = summarize(text)
        assert summary is not None
        for kind, group in (("function", summary["functions"]), ("class", summary["classes"])):
            for name, facts in group.items():
                if rule.wants_fact(kind, facts):
                    wanted += 1
                    assert any(word in text for word in rule.fact_words), (rule_id, name, text)
    assert wanted >= 3  # (the samples hold definitions the rule wants: the check above can fail)


def test_the_rules_with_fact_words() -> None:
    """TL204's facts need a dropout or the `preserve_rng_state` keyword, TL302's a `.backward()`; the
    others' facts need no word (TL105's constructor may hand a submodule to any imported function)."""
    with_words = {r: set(rule.fact_words) for r, rule in registry().rules.items() if rule.fact_words}
    assert with_words == {"TL204": set(TL204_WORDS), "TL302": {"backward"}}


# -- may_hold_facts: a text without the words, unless it imports the name a lookup follows ----------------
@pytest.mark.parametrize(
    ("text", "bound", "expected"),
    [
        ("class Block:\n    def __init__(self):\n        self.drop = nn.Dropout(0.1)\n", "Block", True),
        ("def wrap(f, preserve_rng_state=False):\n    return f\n", "wrap", True),
        ("class Block:\n    pass\n", "Block", False),
        ("class Block:\n    pass\n", None, False),
        ("import torch\n\nclass Other:\n    pass\n", "Block", False),
        ("from .layers import Block\n", "Block", True),
        ("from .layers import Thing as Block\n", "Block", True),
        ("from .layers import Block as Thing\n", "Block", False),
        ("import layers.Block as Block\n", "Block", True),
        ("import Block.sub\n", "Block", True),
        ("from .layers import (\n    Other,  # (see x)\n    Block,\n)\n", "Block", True),
        ("from .layers import Other, \\\n    Block\n", "Block", True),
        ("if True: from .layers import Block\n", "Block", True),  # (read by the parser instead)
        ("try:\n    from .a import Block\nexcept ImportError:\n    Block = None\n", "Block", True),
        ("# Dröpout\nclass Block:\n    pass\n", "Block", True),  # (beyond ASCII: any spelling may count)
    ],
)
def test_may_hold_facts(text: str, bound: str | None, expected: bool) -> None:
    assert may_hold_facts(text, TL204_WORDS, bound) is expected


def test_an_import_of_a_name_is_never_missed() -> None:
    """``imports_name`` answers True (or None: unread) for every name the parser sees imported."""
    checked = 0
    for text in SAMPLES:
        for name in outline(text)["imports"]:
            checked += 1
            assert imports_name(text, name) in (True, None), (name, text)
    assert checked > 500


# -- the engine asks each import only for the words of the candidates reached through it -----------------
def test_words_by_target_of_several_candidates() -> None:
    by_id = gates()
    crossfile = [by_id["TL101"], by_id["TL105"], by_id["TL204"]]
    callees = {"TL105": frozenset({"nets.Net"}), "TL204": frozenset({"helpers.wrap", "nets.Net"})}
    words = engine._words_by_target(crossfile, callees)
    assert words("helpers.wrap") == TL204_WORDS  # (TL204's alone: TL101 asks for no import)
    assert words("nets.Net") == ()  # (TL105 has no words: any file may hold its facts)
    assert words("data.Loader") is None  # (no candidate reaches it: not asked at all)
    assert engine._words_by_target(crossfile, {"TL105": None, "TL204": frozenset()})("x.y") == ()


# -- a file kept for TL204 alone: its imports without the words are read, not summarised -------------------
TRAIN = """\
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from helpers import Block


def build(dim):
    return checkpoint_wrapper(Block(dim), preserve_rng_state=False)
"""
HELPERS = "from layers import Block  # (re-exported by a plain module, not a package)\n"
LAYERS = """\
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return self.proj(x)
"""
DROPPED = LAYERS.replace(
    "nn.Linear(dim, dim)\n", "nn.Linear(dim, dim)\n        self.drop = nn.Dropout(0.1)\n"
)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = write_project(tmp_path / "p", {"train.py": TRAIN, "helpers.py": HELPERS, "layers.py": LAYERS})
    age(root)
    return root


def _lint(root: Path, capsys, monkeypatch) -> tuple[list[str], list[str]]:
    """TL204's findings on train.py with the cache (a new process each time), and the files the index
    summarised for it (whole, or the definition of one name: ``definitions.definition``)."""
    forget_indexes()
    engine._VERDICTS.clear()
    summarised: list[str] = []
    summary_of, definition = project_module.ProjectIndex.summary_of, project_module.definition

    def named(text: str) -> str:
        return next(n for n in ("train.py", "helpers.py", "layers.py") if (root / n).read_text() == text)

    def noted(self, text, tree=None):
        summarised.append(named(text))
        return summary_of(self, text, tree)

    def noted_definition(text, name, digest=None):
        summarised.append(named(text))
        return definition(text, name, digest)

    monkeypatch.setattr(project_module.ProjectIndex, "summary_of", noted)
    monkeypatch.setattr(project_module, "definition", noted_definition)
    capsys.readouterr()
    argv = ["--jobs", "1", "--select", "TL204", "--format", "json", "--cache-dir", str(root.parent / "c")]
    assert run([*argv, "train.py"]) in (0, 1)
    monkeypatch.setattr(project_module.ProjectIndex, "summary_of", summary_of)
    monkeypatch.setattr(project_module, "definition", definition)
    found = json.loads(capsys.readouterr().out)["findings"]
    return [f["rule"] for f in found], summarised


def test_a_module_without_the_words_is_not_summarised(project, capsys, monkeypatch) -> None:
    monkeypatch.chdir(project)
    monkeypatch.setattr(engine, "_lint_parsed", lambda *a, **k: pytest.fail("linted"))
    findings, summarised = _lint(project, capsys, monkeypatch)
    # helpers.py imports the name looked up (followed); layers.py defines it, without a dropout
    assert findings == [] and summarised == ["helpers.py"]


def test_a_module_without_the_words_is_summarised_for_a_rule_without_any(
    project, capsys, monkeypatch
) -> None:
    monkeypatch.chdir(project)
    monkeypatch.setattr(load_rule("TL204"), "fact_words", ())
    findings, summarised = _lint(project, capsys, monkeypatch)
    assert findings == [] and sorted(summarised) == ["helpers.py", "layers.py"]


def test_a_module_that_gains_the_words_is_asked_again(project, capsys, monkeypatch) -> None:
    """The no-finding outcome rested on layers.py as it was read (a plain module's re-export, which a
    key of the imports' facts through package ``__init__`` modules alone would not have followed)."""
    monkeypatch.chdir(project)
    assert _lint(project, capsys, monkeypatch)[0] == []
    monkeypatch.setattr(engine, "_code_gate", lambda *a: pytest.fail("gated again"))
    assert _lint(project, capsys, monkeypatch) == ([], [])  # (warm: answered from the record)
    monkeypatch.undo()
    monkeypatch.chdir(project)
    (project / "layers.py").write_text(DROPPED)
    touch(project / "layers.py", 10)
    assert _lint(project, capsys, monkeypatch)[0] == ["TL204"]
    assert _lint(project, capsys, monkeypatch)[0] == ["TL204"]
