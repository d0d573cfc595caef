"""The index's own walks keep ``ast.walk``'s order (issue 20 replaced it for speed): the facts that
keep the first or last occurrence depend on it."""

from __future__ import annotations

import ast
import textwrap

from trainlint.model import summary
from trainlint.model.summary import summarize

NESTED = textwrap.dedent(
    """
    import a as x
    try:
        import b as x
    except ImportError:
        from c import d as x
    else:
        import e
    finally:
        import f
    match y:
        case 1:
            import g as x
    def h():
        import i as x
        with w:
            from . import j
    class K:
        if z:
            import k as e
    """
)


def test_statements_are_the_walks_statements_in_its_order() -> None:
    tree = ast.parse(NESTED)
    wanted = [n for n in ast.walk(tree) if isinstance(n, ast.stmt)]
    assert [n for n in summary._statements(tree) if isinstance(n, ast.stmt)] == wanted


def test_walk_is_ast_walk_less_contexts() -> None:
    tree = ast.parse(NESTED + "print(a.b[c](d, e=f), *g)\nlambda q: [r for r in q if r]\n")
    wanted = [n for n in ast.walk(tree) if not isinstance(n, ast.expr_context)]
    assert summary._walk(tree) == wanted


def test_the_last_import_of_a_name_in_walk_order_wins() -> None:
    # breadth-first: the match case's import is deeper than ``h``'s, so it comes later and wins (in
    # source order, ``h``'s would)
    assert summarize(NESTED)["imports"]["x"] == "g"
    assert summarize(NESTED)["imports"]["e"] == "k"


def test_a_given_tree_gives_the_summary_of_the_text() -> None:
    text = "import torch\ndef f(m, half):\n    if half:\n        m.half()\n    return m\n"
    assert summarize(text, ast.parse(text)) == summarize(text)
