"""``free_names.analyse`` (CPython's ``ast``) answers what ``source.analyse_names_cst`` (libcst's scope
analysis, which probes were built with before) answers: on hand-written corners of libcst's rules, on
every snippet the probes of fixtures/ build, and on the snippets the verify tests' probes build (stored
in tests/verify/data/free_names_snippets.json.gz: every snippet ``analyse_names`` was asked about while
tests/verify ran in session 6, less those of fixtures/). Probes built from the same answers are the
same probes."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import libcst as cst
import pytest

from trainlint.engine import lint_source
from trainlint.model import FileModel
from trainlint.verify import free_names, harness, source
from trainlint.verify.source import NotExecutable, Tree, analyse_names, analyse_names_cst

ROOT = Path(__file__).resolve().parents[2]
STORED = Path(__file__).with_name("data") / "free_names_snippets.json.gz"

# corners where libcst's analysis is not Python's: each must come out as libcst says
CORNERS = [
    "f(x=1)\n",  # a keyword is not a read
    "from torch import nn\ntorch\n",  # the module of a from-import binds nothing
    "import a.b.c\nq = a.b.c.d\n",
    "import os.path as p\n",
    "class C(metaclass=M):\n    y = 1\n    def f(self):\n        return y + z\n",  # the class body binds y
    "[x for x in data]\nz = [w for w in w]\n",  # the first iterable is read outside
    "lambda q=dflt: q + r\n",
    "try:\n    pass\nexcept E as e:\n    e\n",
    "x: T = 1\n",
    "print(f'{v!r:>{w}} {a.b} {c if d else e.f}')\n",
    "del k\nk\n",
    "n += 1\n",
    "for i in range(3): j = i\nj\n",
    "with a as b, b as c: pass\n",
    "(y := y + 1)\n",
    "def f(a: A = d) -> R:\n    return a\n",
    "@dec\ndef f(): pass\n",
    "import torch\ntorch.nn.Linear(1, 2).weight\n",
    "a.b[c.d].e = f.g\n",
    "from . import mod\nfrom .m import n as o\n",
    "__name__\n__file__\n__builtins__\n",
    "class A:\n    x = 1\n    y = [x for _ in range(3)]\n",
    "x = os.sep; import os\n",  # the import binds from the start of its line
    "from torch.cuda import amp\ntorch.foo.bar()\n",  # a from-import's module path is an attribute read
    "import a.b.c\na.q\n",
    "if c:\n    import foo\nfoo.bar()\n",  # only a top-level import binds at the top level
    "def f():\n    del x\n    return x\n",
    "def f():\n    x += 1\n",
    "[y := f(x) for x in data]\ny\n",  # the walrus binds in the comprehension for libcst
    "def f():\n    import numpy as np\n    return np.zeros(n)\n",
    "for i, (a, *b) in enumerate(items):\n    total = total + a.v\n",
    "x = 1 if cond.a else other.b\nd = {k.a: v.b for k, v in m.items()}\n",
    "async def f():\n    async with lock as l:\n        await l.x\n    async for q in it: pass\n",
    "try:\n    import apex\nexcept ImportError:\n    apex = None\napex.amp\n",
    "def outer():\n    v = 1\n    class I:\n        v = 2\n        def m(self):\n            return v + w\n",
    "loss = loss / n\nx.y += 1\nx.z\n",
    "print(*args, **kw)\ndef f(*a, b=q, **k): return a, b, k, z\n",
    "with open(p) as fh, fh2 as (u, v):\n    fh.read(u)\n",
    "x = (1 +\n     os.sep); import os\n",
    "s = 'é'; t = f'{é2}{s}'\n",
]
# constructs the ast version leaves to libcst
UNSUPPORTED = [
    "def g():\n    global zz\n    zz = 1\n",
    "def g():\n    x = 1\n    def h():\n        nonlocal x\n        x = 2\n",
    "match p:\n    case Point(x=q) as r:\n        print(q, r)\n",
    "from typing import TypeVar\nT = TypeVar(name)\n",
    "x = 1\r\ny = x\r\n",
]


def same(code: str) -> None:
    got = free_names.analyse(code)
    assert got is not None, code
    want = analyse_names_cst(code)
    assert (got.free, got.assigned, got.attrs) == (want.free, want.assigned, want.attrs), code


@pytest.mark.parametrize("code", CORNERS)
def test_corners_answer_as_libcst(code: str) -> None:
    same(code)


def test_corners_say_what_libcst_says() -> None:
    """A few of the answers written out: libcst's rules, not Python's."""
    assert free_names.analyse("x = os.sep; import os\n").free == []
    assert free_names.analyse("if c:\n    import foo\nfoo.bar()\n").free == ["c", "foo"]
    assert free_names.analyse("from torch.cuda import amp\ntorch.foo.bar()\n").attrs == [
        "torch.cuda",
        "torch.foo.bar",
        "torch.foo",
    ]
    assert free_names.analyse("class C:\n    y = 1\n    def f(self):\n        return y\n").free == []
    assert free_names.analyse("[y := f(x) for x in data]\ny\n").free == ["f", "data", "y"]
    assert free_names.analyse("loss = loss / n\n").free == ["loss", "n"]


@pytest.mark.parametrize("code", UNSUPPORTED)
def test_what_ast_cannot_mirror_goes_to_libcst(code: str) -> None:
    assert free_names.analyse(code) is None
    got, want = analyse_names(code), analyse_names_cst(code)
    assert (got.free, got.assigned, got.attrs) == (want.free, want.assigned, want.attrs)


def fixture_snippets() -> list[str]:
    """Every snippet ``analyse_names`` is asked about while the probes of fixtures/' findings are
    built (one file at a time, as ``lint_source`` finds them)."""
    seen: list[str] = []
    real = free_names.analyse

    def record(code: str) -> free_names.Names | None:
        seen.append(code)
        return real(code)

    source.analyse_names.cache_clear()
    free_names.analyse = record  # type: ignore[assignment]
    try:
        for path in sorted((ROOT / "fixtures").rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            findings = [f for f in lint_source(text, str(path)) if harness.probe_for(f.rule) is not None]
            if not findings:
                continue
            model = FileModel(cst.parse_module(text), str(path), text)
            tree = Tree(model)
            for finding in findings:
                try:
                    harness.build_probe(finding, model, tree)
                except (NotExecutable, LookupError):
                    pass
    finally:
        free_names.analyse = real  # type: ignore[assignment]
        source.analyse_names.cache_clear()
    return list(dict.fromkeys(seen))


@pytest.mark.slow
def test_every_snippet_of_the_fixtures_probes_answers_as_libcst() -> None:
    snippets = fixture_snippets()
    assert len(snippets) > 60  # the probes of fixtures/ ask about this many, or the hook missed them
    for code in snippets:
        same(code)


@pytest.mark.slow
def test_the_stored_snippets_of_the_verify_tests_answer_as_libcst() -> None:
    snippets = json.loads(gzip.decompress(STORED.read_bytes()))
    assert len(snippets) > 100
    for code in snippets:
        got = free_names.analyse(code)
        if got is None:  # a construct left to libcst
            continue
        want = analyse_names_cst(code)
        assert (got.free, got.assigned, got.attrs) == (want.free, want.assigned, want.attrs), code
