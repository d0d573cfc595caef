"""The two prefilter patterns that started with no fixed text (TL204's checkpoint-wrapper call, TL302's
call added to a total) are asked of nearly every file and cost more than a parse of it: they are now
found from fixed text (``CalledWord``; branches that start with text, the ``\\b`` looked behind from
after ``append(``), with the very verdicts of the expressions they replace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainlint.gates import gates
from trainlint.rule import CalledWord, group_matches

TL204_BEFORE = re.compile(r"(?<!\w)(?!save_|load_|resume_)\w*checkpoint\w*\s*\(")
TL302_BEFORE = re.compile(r"loss\w*\s*=\s*[\w.]+\(|(\+=|\bappend\()\s*[\w.]+\(")
ROOT = Path(__file__).resolve().parents[1]

CASES = [
    "y = checkpoint(f, x)",
    "y = self.save_checkpoint(x)",
    "load_checkpoint (x)",
    "torch.utils.checkpoint.checkpoint(\n  f)",
    "activation_checkpoint_wrapper(m)",
    "_save_checkpoint(m)",  # (starts with `_`, not with `save_`)
    "resume_from_checkpoint = 1",
    "# checkpoint the block (below)",
    "xcheckpoint(",
    "\u00e9\u0441checkpoint(",  # a word of other scripts: ``\w`` covers them
    "save_checkpoint_and_checkpoint(x)",
    "checkpoint",
    "x.append(f(",
    "xappend(f(",
    "append(f(",
    " append( a.b (",
    "_append(f(",
    "éappend(f(",
    "loss=(f(",
    "total_loss = compute(x)",
    "a+= g.h(",
    "a += 1",
    "",
]


def _texts() -> list[str]:
    """Real text: this repository's own Python files (rules, tests with every example), and the cases."""
    return [p.read_text(encoding="utf-8") for p in sorted(ROOT.glob("[lrt]*/**/*.py"))] + CASES


def _project_group(rule_id: str, kind: type) -> object:
    found = [g for g in gates()[rule_id].project_requires if isinstance(g, kind)]
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize(
    ("rule_id", "before", "kind"), [("TL204", TL204_BEFORE, CalledWord), ("TL302", TL302_BEFORE, re.Pattern)]
)
def test_the_fast_group_gives_the_verdicts_of_the_expression_it_replaces(rule_id, before, kind) -> None:
    group = _project_group(rule_id, kind)
    texts = _texts()
    assert len(texts) > 300
    verdicts = [group_matches(group, t) for t in texts]  # type: ignore[arg-type]
    assert verdicts == [before.search(t) is not None for t in texts]
    assert 0 < sum(verdicts) < len(texts)  # (both answers are given)


def test_a_called_word_without_exclusions_is_any_call_containing_it() -> None:
    group = CalledWord("ckpt")
    assert group.found("self.save_ckpt (x)") and group.found("ckpt(") and not group.found("ckpt = 1")
