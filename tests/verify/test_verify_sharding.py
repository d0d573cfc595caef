"""``--verify`` for the sharding rules TL503, TL506 and TL110: the user's statements run with FSDP on a
real two-process gloo group on the CPU. Each probe confirms its hazard and clears a look-alike.

All snippets are verified in one batch (one child, the two ranks started once). Where the rule no
longer reports the look-alike (``use_orig_params=True``, ``NO_SHARD``; cleared by these probes), the
look-alike is given to the probe as the text behind the finding of its flagged twin: the same lines,
one keyword more, so that the probe judges the code it was handed.
"""

from __future__ import annotations

import textwrap

import pytest
from conftest import gloo_or_skip

from trainlint.engine import lint_source
from trainlint.verify import torch_available, verify_findings

pytestmark = pytest.mark.skipif(not torch_available(), reason="--verify needs torch")

TL503_CODE = """
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

def setup(net):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = FSDP(net)
    return model, opt
"""
TL503_FSDP2 = """
import torch
from torch.distributed.fsdp import fully_shard

def setup(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fully_shard(model)
    return optimizer
"""
TL503_BLOCKS = """
import torch
from torch.distributed.fsdp import fully_shard
optimizer = torch.optim.AdamW(model.parameters())
for block in model.blocks:
    fully_shard(block)
fully_shard(model)
"""
TL506_CODE = """
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
MAX_NORM = 1.0
model = FSDP(net)
gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
"""
TL110_CODE = """
import torch
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy
fsdp1 = MixedPrecision(param_dtype=torch.bfloat16)
fsdp2 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
"""

# path -> (rule, code the rule is run on, code the probe is handed or None for the same)
CASES = {
    "tl503.py": ("TL503", TL503_CODE, None),
    "tl503_fsdp2.py": ("TL503", TL503_FSDP2, None),
    "tl503_blocks.py": ("TL503", TL503_BLOCKS, None),
    "tl503_orig.py": (
        "TL503",
        TL503_CODE,
        TL503_CODE.replace("FSDP(net)", "FSDP(net, use_orig_params=True)"),
    ),
    "tl506.py": ("TL506", TL506_CODE, None),
    "tl506_noshard.py": (
        "TL506",
        TL506_CODE,
        TL506_CODE.replace("FSDP(net)", "FSDP(net, sharding_strategy=ShardingStrategy.NO_SHARD)"),
    ),
    "tl110.py": ("TL110", TL110_CODE, None),
    "tl110_float32.py": ("TL110", TL110_CODE, TL110_CODE.replace("torch.bfloat16", "torch.float32 ")),
}


@pytest.fixture(scope="module")
def verdicts() -> dict[str, list[dict]]:
    findings, texts = [], {}
    for path, (rule, code, handed) in CASES.items():
        text = textwrap.dedent(code).lstrip("\n")
        found = lint_source(text, path, [rule])
        assert found, path
        findings.extend(found)
        texts[path] = textwrap.dedent(handed).lstrip("\n") if handed else text
    out: dict[str, list[dict]] = {}
    for finding in verify_findings(findings, texts, device="cpu", timeout=90):
        assert finding.verify is not None
        out.setdefault(finding.path, []).append(gloo_or_skip(finding.verify))
    return out


def test_tl503_optimizer_built_before_the_wrap_never_moves_the_model(verdicts) -> None:
    for path in ("tl503.py", "tl503_fsdp2.py", "tl503_blocks.py"):
        (verdict,) = verdicts[path]
        assert verdict["status"] == "confirmed", verdict
        assert verdict["evidence"]["max_parameter_change"]["as_written"] == 0
        assert verdict["evidence"]["max_parameter_change"]["fixed"] > 0


def test_tl503_use_orig_params_takes_the_same_step(verdicts) -> None:
    (verdict,) = verdicts["tl503_orig.py"]
    assert verdict["status"] == "not-reproduced", verdict
    assert verdict["evidence"]["max_parameter_change"]["as_written"] > 0
    assert verdict["evidence"]["step_as_written_vs_fixed_max_abs"] == 0


def test_tl506_local_clip_differs_from_fsdp_clip_unless_unsharded(verdicts) -> None:
    (sharded,) = verdicts["tl506.py"]
    assert sharded["status"] == "confirmed", sharded
    assert sharded["evidence"]["clipped_gradient_max_rel"] > 0.01
    (whole,) = verdicts["tl506_noshard.py"]
    assert whole["status"] == "not-reproduced", whole
    assert whole["evidence"]["clipped_gradient_max_rel"] == 0


def test_tl110_reduce_scatter_runs_in_the_parameter_dtype(verdicts) -> None:
    assert [v["status"] for v in verdicts["tl110.py"]] == ["confirmed", "confirmed"]
    for verdict in verdicts["tl110.py"]:
        assert verdict["evidence"]["reduce_scatter_dtype"] == {
            "as_written": ["bfloat16"],
            "with_float32_reduce": ["float32"],
        }
    for verdict in verdicts["tl110_float32.py"]:
        assert verdict["status"] == "not-reproduced", verdict
        assert verdict["evidence"]["reduce_scatter_dtype"]["as_written"] == ["float32"]
