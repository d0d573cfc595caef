"""TL110's condition on CPython's tree (``Rule.gate_check``): a policy call that may lack ``reduce_dtype``.
Files that build the policy with an explicit ``reduce_dtype``, from a splat or without a 16-bit
``param_dtype`` never reach libcst for TL110, and no finding changes."""

from __future__ import annotations

import ast
import textwrap

import pytest
from conftest import gate_check_keeps_findings

from trainlint.engine import lint_text
from trainlint.gates import gates, pass_tree_checks
from trainlint.model.gate_mixed_precision import policy_may_lack_reduce_dtype
from trainlint.results import LintOptions

IMPORTS = "import torch\nfrom torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy\n"

KEPT = [
    "MixedPrecision(param_dtype=torch.bfloat16)",
    "MixedPrecision(torch.float16)",
    "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=None)",
    "fsdp.MixedPrecision(param_dtype=torch.half, buffer_dtype=torch.float32)",
    "MixedPrecision(param_dtype=dtype)",  # a name may be bound to a 16-bit dtype
    "MP = MixedPrecision\npolicy = MP(param_dtype=torch.bfloat16)",
    "A = MixedPrecision\nB = A\npolicy = B(param_dtype=torch.bfloat16)",
    "from torch.distributed.fsdp import MixedPrecision as MP\nMP(param_dtype=torch.bfloat16)",
    "def f():\n    return [MixedPrecision(param_dtype=torch.bfloat16) for _ in range(2)]",
]
REJECTED = [
    "MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)",
    "MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)",  # a choice, not a slip
    "MixedPrecision(**kwargs)",
    "MixedPrecision(param_dtype=torch.bfloat16, **extra)",
    "MixedPrecision(param_dtype=torch.float32)",
    "MixedPrecision(buffer_dtype=torch.bfloat16)",
    "MixedPrecision(param_dtype=dtypes[0])",  # resolves to no name
    "MixedPrecision",  # named, never called
    "policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)",
    "other(param_dtype=torch.bfloat16)",
]


@pytest.mark.parametrize("code", KEPT)
def test_a_call_that_may_lack_reduce_dtype_keeps_the_file(code: str) -> None:
    assert policy_may_lack_reduce_dtype(ast.parse(IMPORTS + code))


@pytest.mark.parametrize("code", REJECTED)
def test_a_file_without_such_a_call_is_ruled_out(code: str) -> None:
    text = IMPORTS + code + "\n"
    assert not policy_may_lack_reduce_dtype(ast.parse(text))
    assert not pass_tree_checks([gates()["TL110"]], ast.parse(text))
    off = lint_text(text, "x.py", LintOptions(("TL110",), prefilter=False))
    assert not off.findings, "the check ruled out a file the rule reports"


def test_every_reported_text_passes_the_check_and_the_findings_do_not_change() -> None:
    extra = [textwrap.dedent(IMPORTS + code) for code in KEPT + REJECTED]
    gate_check_keeps_findings("TL110", policy_may_lack_reduce_dtype, extra)


def test_a_check_that_fails_keeps_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainlint.gates as gates_module

    def broken(tree: ast.Module) -> bool:
        raise TypeError("a bug in a gate check")

    monkeypatch.setattr(gates_module, "_tree_check", lambda name: broken)
    text = IMPORTS + "MixedPrecision(param_dtype=torch.bfloat16)\n"
    assert pass_tree_checks([gates()["TL110"]], ast.parse(text)) == [gates()["TL110"]]
    assert [f.rule for f in lint_text(text, "x.py", LintOptions(("TL110",))).findings] == ["TL110"]
