"""What the mixed-precision rule tests share: the TL1xx ids and linting or fixing dedented code."""

from __future__ import annotations

import textwrap

from trainlint.engine import lint_source
from trainlint.fix import fix_text
from trainlint.rule import registry

AMP_RULES = tuple(i for i in registry().ids() if i.startswith("TL1"))


def run(code: str, *rule_ids: str):
    return lint_source(textwrap.dedent(code), "train.py", rule_ids or AMP_RULES)


def fixed(code: str, *rule_ids: str) -> str:
    text = textwrap.dedent(code)
    return fix_text(text, lambda t: lint_source(t, "train.py", rule_ids), unsafe=False).text
