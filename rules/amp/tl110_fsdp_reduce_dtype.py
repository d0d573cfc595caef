"""TL110 fsdp-reduce-dtype."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from trainlint.api import Diagnostic, Invalid, Rule, RuleDoc, Severity
from trainlint.model import FileModel, first_arg, has_star_kwargs, keyword
from trainlint.model.vocab import FSDP_MIXED_PRECISION


class FsdpReduceDtype(Rule):
    id = "TL110"
    name = "fsdp-reduce-dtype"
    severity = Severity.WARNING
    probe = True
    summary = (
        "FSDP mixed precision with a 16-bit param_dtype and no reduce_dtype: gradients are reduced in 16 bit."
    )
    # A finding needs FSDP's `MixedPrecision` or `MixedPrecisionPolicy` and a 16-bit dtype, which is
    # spelled `float16`, `bfloat16` or `half` wherever it resolves to one.
    tokens = ("MixedPrecision",)
    requires = (("float16", "half"),)
    # In the code: a call of the policy class (by its name, or a name bound to it), and torch's 16-bit
    # dtype of `param_dtype` (the last part of its name imported or read as an attribute).
    gate = (
        (
            "call:MixedPrecision",
            "call:MixedPrecisionPolicy",
            "alias:MixedPrecision",
            "alias:MixedPrecisionPolicy",
        ),
        ("import:torch",),
        ("ref:float16", "ref:half", "ref:bfloat16"),
    )
    # And one such call with a `param_dtype` that may be 16-bit, no `reduce_dtype` but None, no `**`.
    gate_check = "gate_mixed_precision.policy_may_lack_reduce_dtype"
    doc = RuleDoc(
        what=(
            "Reports FSDP's `MixedPrecision(...)` (FSDP1) or `MixedPrecisionPolicy(...)` (FSDP2) whose "
            "`param_dtype` is `torch.bfloat16`/`torch.float16` (or a name bound only to one) and that "
            "sets no `reduce_dtype` (or sets it to None). An explicit 16-bit `reduce_dtype` is a "
            "choice and is not reported; a `**` splat may hold the keyword and is not reported."
        ),
        why=(
            "Without `reduce_dtype` FSDP reduce-scatters gradients in `param_dtype`. Summing in bf16 "
            "keeps 8 significant bits: over 64 ranks, a gradient element of 1.0 plus 63 elements of "
            "0.003 sums to 1.0 in bf16 (each 0.003 is below half a unit in the last place of the "
            "running sum) instead of 1.189, and with 0.01 it sums to 1.49 instead of 1.63. Small "
            "contributions of most ranks are lost and the averaged gradient is biased towards the "
            "ranks with large values. torchtune made fp32 reduction its default for this reason "
            "(torchtune issue 2267)."
        ),
        example=(
            "policy = MixedPrecision(param_dtype=torch.bfloat16)\nmodel = FSDP(model, mixed_precision=policy)"
        ),
        use_instead=(
            "policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)\n"
            "model = FSDP(model, mixed_precision=policy)"
        ),
        references=(
            "https://pytorch.org/docs/stable/fsdp.html#torch.distributed.fsdp.MixedPrecision",
            "https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html",
        ),
    )
    _HEAD = "import torch\nfrom torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy\n"
    valid = (
        _HEAD + "p = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)",
        _HEAD + "p = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)",
        # an explicit 16-bit reduction is a deliberate choice
        _HEAD + "p = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)",
        # full-precision parameters
        _HEAD + "p = MixedPrecision(param_dtype=torch.float32)",
        # a splat may carry reduce_dtype
        _HEAD + "kw = dict(reduce_dtype=torch.float32)\np = MixedPrecision(param_dtype=torch.float16, **kw)",
        # a dtype only known at run time
        _HEAD + "p = MixedPrecisionPolicy(param_dtype=getattr(torch, cfg.dtype))",
        # another library's class of the same name
        "import torch\nfrom apex.amp import MixedPrecision\np = MixedPrecision(param_dtype=torch.bfloat16)",
    )
    invalid = (
        Invalid(_HEAD + "p = MixedPrecision(param_dtype=torch.bfloat16)", line=3),
        Invalid(
            _HEAD + "p = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)", line=3
        ),
        Invalid(_HEAD + "p = MixedPrecision(torch.float16, buffer_dtype=torch.float16)", line=3),
        Invalid(_HEAD + "p = MixedPrecision(param_dtype=torch.half, reduce_dtype=None)", line=3),
        Invalid(
            """
            import torch
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
            dtype = torch.bfloat16
            for layer in model.layers:
                fully_shard(layer, mp_policy=MixedPrecisionPolicy(param_dtype=dtype))
            """,
            line=5,
        ),
        Invalid(
            """
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.fully_sharded_data_parallel import MixedPrecision

            bf16 = MixedPrecision(
                param_dtype=torch.bfloat16,
                buffer_dtype=torch.bfloat16,
            )
            model = FSDP(model, mixed_precision=bf16)
            """,
            line=5,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        for site in model.calls_to(*FSDP_MIXED_PRECISION):
            call = site.node
            assert isinstance(call, cst.Call)
            if has_star_kwargs(call):
                continue
            param_dtype = first_arg(call, "param_dtype")
            if param_dtype is None or not training.is_low_precision_dtype(param_dtype, site.scope):
                continue
            reduce = keyword(call, "reduce_dtype")
            if reduce is not None and not (
                isinstance(reduce.value, cst.Name) and reduce.value.value == "None"
            ):
                continue
            yield Diagnostic(
                call,
                "FSDP mixed precision with a 16-bit `param_dtype` and no `reduce_dtype`: gradients are "
                "reduce-scattered in 16 bit, which loses the small contributions of many ranks; pass "
                "`reduce_dtype=torch.float32`.",
            )
