"""TL504's condition on CPython's tree (``Rule.gate_check``): an engine's ``.backward(loss)`` and a division
by an accumulation count in the same file. DeepSpeed files that scale nothing by hand (Lightning's and
accelerate's integrations, tests) never reach libcst for TL504, and no finding changes."""

from __future__ import annotations

import ast

import pytest
from conftest import gate_check_keeps_findings

from trainlint.engine import lint_text
from trainlint.model.gate_deepspeed import backward_and_step_count_division
from trainlint.results import LintOptions

HEAD = "import deepspeed\nengine, opt, _, _ = deepspeed.initialize(model=m, config=c)\n"
KEPT = [
    "loss = loss / args.gradient_accumulation_steps\nengine.backward(loss)",
    "loss /= grad_accum\nengine.backward(loss)",
    "engine.backward(loss / cfg['gradient_accumulation_steps'])",
    "engine.backward(loss=loss / engine.gradient_accumulation_steps())",
    "engine.backward(loss / get_num_microbatches())",
    "def fwd(b):\n    return model(b) / accum_steps\ndef bwd(loss):\n    engine.backward(loss)",
]
REJECTED = [
    "engine.backward(loss)",  # nothing divided
    "engine.backward(loss / accum, scale_wrt_gas=False)",
    "loss = loss / num_tokens\nengine.backward(loss)",  # not a step count
    "loss = loss / accum_loss\nengine.backward(loss)",  # a running total, not a count
    "loss = loss * grad_accum\nengine.backward(loss)",
    "x = y / grad_accum\nengine.backward()",  # no loss passed
    "x = y / grad_accum",
]


@pytest.mark.parametrize("code", KEPT)
def test_a_backward_and_a_division_by_the_count_keep_the_file(code: str) -> None:
    assert backward_and_step_count_division(ast.parse(HEAD + code))


@pytest.mark.parametrize("code", REJECTED)
def test_a_file_without_them_is_ruled_out(code: str) -> None:
    text = HEAD + code + "\n"
    assert not backward_and_step_count_division(ast.parse(text))
    assert not lint_text(text, "x.py", LintOptions(("TL504",), prefilter=False)).findings


def test_every_reported_text_passes_the_check_and_the_findings_do_not_change() -> None:
    gate_check_keeps_findings("TL504", backward_and_step_count_division, [HEAD + c for c in KEPT + REJECTED])
