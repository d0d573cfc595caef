"""A lookup reads the definition it asks for, not the whole file (issue 20: the index's share of a cold
run): ``definitions.definition`` gives ``summarize``'s entries for that name, equal as data, or None
where it cannot be sure to (the caller summarises the whole file then)."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest
from conftest import counting

from trainlint.model import index_imports
from trainlint.model import project as project_module
from trainlint.model.definitions import definition
from trainlint.model.project import Project, forget_indexes
from trainlint.model.summary import summarize

ROOT = Path(__file__).resolve().parents[2]


def _entries(text: str, name: str, full: dict | None = None) -> dict:
    """What ``definition`` must give: the whole summary's entries of ``name`` (``full``: the text's
    summary, where made already)."""
    full = full or summarize(text)
    assert full is not None
    functions = {k: v for k, v in full["functions"].items() if k == name or k.startswith(f"{name}.")}
    classes = {k: v for k, v in full["classes"].items() if k == name}
    if functions or classes:
        return {"functions": functions, "classes": classes}
    imports = {name: full["imports"][name]} if name in full["imports"] else {}
    return {"imports": imports, "functions": {}, "classes": {}}


def _sources() -> list[Path]:
    # the bundled fixtures, and trainlint's own code: rule modules whose docstrings and examples hold
    # code at the start of a line, inside strings
    return sorted(
        [*(ROOT / "fixtures").rglob("*.py"), *(ROOT / "rules").rglob("*.py"), *(ROOT / "lint").rglob("*.py")]
    )


def test_every_name_of_real_files_reads_as_in_the_whole_summary() -> None:
    answered = 0
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        defined = {
            n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        }
        full = summarize(text)
        for name in sorted(defined | set(full["imports"]) | {"no_such_name"}):
            found = definition(text, name)
            if found is not None:
                answered += 1
                wanted = _entries(text, name, full)
                assert found == wanted, (path, name)
                assert list(found["functions"]) == list(wanted["functions"]), (path, name)
    assert answered > 2000  # (nearly all: a None is the whole file parsed, never a wrong answer)


TRICKY = textwrap.dedent(
    '''
    """The module's docstring shows an example at the start of its lines:

    class Example:
        def __init__(self):
            self.x = x.half()
    """
    import torch
    from .convert import to_half, helper as other

    def spaced(
        model,
        dtype=torch.float16,
    ) -> None:
        model.half()
        text = """
    def example(): a string's line at the start of a line does not end the function
    """

    @decorated
    class Model(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net
            to_half(self.net)
            self.drop = torch.nn.Dropout(0.1)

        def forward(self, x):  # a comment with a quote: it's
            return self.net(x)

    def spaced(model):  # defined again: this one counts
        return model.float()
    '''
)


@pytest.mark.parametrize("name", ["spaced", "Model", "to_half", "other", "torch", "missing"])
def test_definitions_beside_strings_and_headers_over_lines(name: str) -> None:
    assert definition(TRICKY, name) == _entries(TRICKY, name)


@pytest.mark.parametrize(
    "text",
    [
        # a definition line inside a string (the whole file has no such definition)
        'x = """\ndef f(m):\n    m.half()\n"""\n',
        # a bracket continued at the start of a line inside the body: not one statement alone
        "def f(m):\n    x = [\n1, 2]\n    m.half()\n",
        # a header continued with a backslash, a form feed, Windows line ends, a byte order mark
        "def \\\n f(m):\n    m.half()\n",
        "\x0cdef f(m):\n    m.half()\n",
        "def f(m):\r\n    m.half()\r\n",
        "\ufeffdef f(m):\n    m.half()\n",
        # an ``apply`` callback the module defines beside the function
        "def cast(t):\n    t.half()\ndef f(m):\n    m.apply(cast)\n",
        # a name bound by two imports with different targets (the tree's order decides)
        "import a as f\ndef g():\n    import b as f\n",
        # a constructor's call of a plain name where an import cannot be read in place
        "if x: import y\nclass f:\n    def __init__(self):\n        y(self.net)\n",
    ],
)
def test_what_cannot_be_read_alone_is_left_to_the_whole_summary(text: str) -> None:
    assert definition(text, "f") is None


def test_an_apply_callback_the_module_does_not_define_is_read_alone() -> None:
    text = "class F(Function):\n    pass\ndef f(m, x):\n    F.apply(x)\n    m.apply(x)\n"
    assert definition(text, "f") == _entries(text, "f")


def test_a_lookup_parses_the_definition_only(tmp_path: Path, monkeypatch) -> None:
    forget_indexes()
    (tmp_path / "pyproject.toml").write_text("")
    body = "".join(f"def unused_{i}(m):\n    return m.float()\n\n" for i in range(50))
    helpers = tmp_path / "helpers.py"
    helpers.write_text(f"import torch\n\n{body}def convert(m):\n    m.half()\n\n{body}")
    (tmp_path / "train.py").write_text("from helpers import convert\n")
    parsed: list[int] = []
    real_parse = ast.parse
    monkeypatch.setattr(
        ast, "parse", lambda source, *a, **k: parsed.append(len(source)) or real_parse(source, *a, **k)
    )
    project = Project.for_file(str(tmp_path / "train.py"))
    assert project is not None
    fact = project.lookup("helpers.convert")
    monkeypatch.setattr(ast, "parse", real_parse)
    whole = summarize(helpers.read_text())
    assert fact is not None and fact.kind == "function" and fact.facts == whole["functions"]["convert"]
    # (its line numbers are the file's: the statement parsed alone keeps them)
    assert fact.facts["half"]["m"][0] == helpers.read_text().splitlines().index("    m.half()") + 1
    assert parsed and max(parsed) < len(helpers.read_text()) / 2  # not the whole file


def test_a_name_resolved_in_another_file_reads_its_import_alone(tmp_path: Path, monkeypatch) -> None:
    forget_indexes()
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "helpers.py").write_text("from torch.nn import Linear as Dense\n\nclass Net:\n    pass\n")
    (tmp_path / "train.py").write_text("from helpers import Net\n")
    whole: list[str] = []
    monkeypatch.setattr(project_module, "summarize", lambda text, tree=None: whole.append(text))
    project = Project.for_file(str(tmp_path / "train.py"))
    assert project is not None
    fact = project.lookup("helpers.Net")
    assert fact is not None and fact.kind == "class"
    assert project.resolve_in(fact, "Dense.weight") == "torch.nn.Linear.weight"
    assert project.resolve_in(fact, "missing") is None
    assert whole == []  # (neither the class nor the import needed the whole file)


def test_the_import_statements_of_a_text_are_read_once_for_its_names(monkeypatch) -> None:
    # (a name beyond ASCII: the parser normalises it, so the statement is not read in place)
    text = "import a\nfrom b import (c,\n    d)\nimport e.f as g\nfrom h import na\u00efve\n"
    read = counting(monkeypatch, index_imports, "_statement")
    answers = [index_imports.imports_name(text, name) for name in ("a", "d", "g", "x", "h")]
    # ``x`` is bound by no statement read, and the unread one does not mention it; ``h`` it does
    assert answers == [True, True, True, False, None]
    assert len(read) == 4  # (one per statement, not per name)


def test_a_text_half_parsed_for_other_names_is_left_to_the_whole_summary() -> None:
    text = (
        "def big(m):\n"
        + "    m.float()\n" * 40
        + "\ndef small(m):\n    m.half()\n\ndef other(m):\n    pass\n"
    )
    assert definition(text, "big", "digest-of-the-text") == _entries(text, "big")
    # (the whole summary answers every later name at once: cheaper than reading the rest piecewise)
    assert definition(text, "small", "digest-of-the-text") is None
    assert definition(text, "small") == _entries(text, "small")  # (a question of its own: read alone)


def test_a_name_no_import_statement_reads_in_place_is_parsed_for_once(monkeypatch) -> None:
    from trainlint.model import summary

    # (a name beyond ASCII: the statement is not read in place, so its tree decides)
    text = "from h import na\u00efve, helper\nfrom k import other\n"
    outlines = counting(monkeypatch, summary, "outline")
    answers = [index_imports.binds_name(text, name) for name in ("helper", "h", "other", "missing")]
    assert answers == [True, False, True, False]
    assert len(outlines) == 1
