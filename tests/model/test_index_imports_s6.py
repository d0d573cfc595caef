"""A cache key reads the file's imports in place (``index_imports``), not from a parse of the whole
file: never fewer targets than the parse gives, None (the parse) wherever a statement cannot be read
for certain, and a finding that rests on a module imported in any of these ways still follows that
module's facts through the cache."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from trainlint.cache import ResultCache
from trainlint.engine import lint_text
from trainlint.model import index_imports
from trainlint.model.index_imports import import_targets, may_receive_scaler
from trainlint.model.project import forget_indexes
from trainlint.model.summary import outline
from trainlint.results import LintOptions
from trainlint.rule import registry

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = LintOptions(tuple(registry().ids()))
PAST = time.time() - 3600


def parsed(text: str) -> set[str]:
    found = outline(text)
    assert found is not None
    return set(found["imports"].values())


@pytest.mark.parametrize(
    "text",
    [
        "import os\nimport a.b.c\nimport a.b as ab, d\n",
        "from . import x\nfrom .m import f as g\nfrom ..pkg.mod import (h,\n    i as j,  # import k\n)\n",
        "from.m import f\nfrom .. import g\nfrom __future__ import annotations\n",
        "from .import f\nfrom ..import g\nx = 1\n",
        "from a import \\\n    b, c\n",
        "def f():\n    from lazy import thing\n    return thing\n",
        '"""Example:\n\n>>> from pkg import not_code\n...     import more\n"""\nimport real\n',
        "# import commented\nx = 1  # we import nothing here\nimport real\n",
        "from a import b  # avoid a circular import\n",
        "try:\n    import fast\nexcept ImportError:\n    import slow as fast\n",
        '"""\nimport fake_module\n"""\nimport real\n',
    ],
)
def test_the_targets_read_in_place_hold_every_parsed_one(text: str) -> None:
    found = import_targets(text)
    assert found is not None
    assert parsed(text) <= set(found)


@pytest.mark.parametrize(
    "text",
    [
        "if TYPE_CHECKING: from helpers import convert\n",
        "import os; import helpers\n",
        "from helpers \\\n    import convert\n",
        "from \\\n    helpers import convert\n",
        "x = 1; from helpers import convert\n",
        '"""Then import the helpers and go."""\n',
        "from pkg import a.b\n",
        "from . m import g\n",  # (read as ``.m.g`` by the parser; rare enough to leave to it)
        'x = """a\n#"""; import helpers\n',  # (the ``#`` is inside the string: a statement follows)
        "from ｈelpers import convert\n",  # (normalised by the parser to ``helpers``)  # noqa: RUF001
    ],
)
def test_a_statement_that_cannot_be_read_for_certain_asks_for_the_parse(text: str) -> None:
    assert import_targets(text) is None


def test_a_doctest_line_is_never_a_statement() -> None:
    # (``... import x`` and ``>>> from a import b`` are not Python outside a string)
    assert import_targets(">>> import a\n... from b import c\n") == []
    assert import_targets("... ;import os\n") is None  # (this one is Python: an Ellipsis, then an import)


@pytest.mark.parametrize(
    "path",
    sorted(p for p in (ROOT / "fixtures").rglob("*.py") if outline(p.read_text(encoding="utf-8"))),
    ids=lambda p: str(p.relative_to(ROOT / "fixtures")),
)
def test_on_every_fixture_the_targets_hold_the_parsed_ones(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    found = import_targets(text)
    if found is not None:
        assert parsed(text) <= set(found)


def test_a_scaler_parameter_is_seen_in_the_text() -> None:
    assert may_receive_scaler("def step(loss, grad_scaler):\n    pass\n")
    assert may_receive_scaler("def step(loss, s: GradScaler):\n    pass\n")
    assert may_receive_scaler("def step(loss, ｓcaler):\n    pass\n")  # noqa: RUF001
    assert not may_receive_scaler("def step(loss, s):\n    pass\n")


# -- the cache follows a module imported in each of these ways ---------------------------------------------
PLAIN = "def convert_weights(model):\n    return model\n"
HALF = "def convert_weights(model):\n    model.half()\n"
TRAIN = (
    "import torch\n{imports}\n\ndef main(model, loader):\n    convert_weights(model)\n"
    "    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)\n"
    "    for x in loader:\n        model(x).sum().backward()\n        optimizer.step()\n"
)


def lint_cached(root: Path, cache: Path) -> list[str]:
    """The rules of train.py's findings in a new process's run with the result cache."""
    forget_indexes()
    results = ResultCache(cache)
    job = (str(root / "train.py"), "train.py", OPTIONS)
    hit = results.get(job)
    if hit is not None:
        return sorted(f.rule for f in hit[0].findings)
    text = (root / "train.py").read_text(encoding="utf-8")
    result = lint_text(text, str(root / "train.py"), OPTIONS)
    results.store(job, text, result)
    return sorted(f.rule for f in result.findings)


@pytest.mark.parametrize(
    "imports",
    [
        "from helpers import (  # import it first\n    convert_weights,\n)",
        "from helpers \\\n    import convert_weights",
        "import os\ntry:\n    from helpers import convert_weights  # import it first\nexcept ImportError:\n    raise",
        "from helpers import convert_weights; import os",
        '"""Use:\n\n>>> from other import convert_weights\n"""\nfrom helpers import convert_weights as convert_weights',
    ],
    ids=["parenthesised", "continued", "in-try", "before-semicolon", "after-doctest"],
)
def test_a_helper_that_gains_the_fact_brings_the_finding(tmp_path: Path, imports: str) -> None:
    root = tmp_path / "p"
    root.mkdir()
    (root / "pyproject.toml").write_text("")
    (root / "helpers.py").write_text(PLAIN)
    (root / "train.py").write_text(TRAIN.format(imports=imports))
    for path in [root, *root.rglob("*")]:
        os.utime(path, (PAST, PAST))
    cache = tmp_path / "cache"
    assert lint_cached(root, cache) == []
    assert lint_cached(root, cache) == []  # (a hit)
    (root / "helpers.py").write_text(HALF)  # the helper now converts its argument to fp16
    os.utime(root / "helpers.py", (PAST + 10, PAST + 10))
    assert lint_cached(root, cache) == ["TL105"]
    (root / "helpers.py").write_text(PLAIN)
    os.utime(root / "helpers.py", (PAST + 20, PAST + 20))
    assert lint_cached(root, cache) == []


def test_the_module_keeps_no_parse_of_the_whole_file(monkeypatch) -> None:
    """The statements are read one at a time: a file whose imports all take the one-line forms is
    never handed to CPython's parser."""
    monkeypatch.setattr(index_imports.ast, "parse", lambda *_: pytest.fail("parsed"))
    text = (ROOT / "fixtures" / "project" / "fp16_helper" / "src" / "trainer" / "bad_train.py").read_text()
    assert import_targets(text) == [".convert.convert_weights", "torch", "torch.nn"]
