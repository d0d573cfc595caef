"""TL202 checkpoint-reentrant-explicit."""

from __future__ import annotations

from collections.abc import Iterator

from trainlint.api import (
    Diagnostic,
    Invalid,
    Rule,
    RuleDoc,
    Severity,
)
from trainlint.model import (
    FileModel,
    keyword,
)
from trainlint.rules.checkpoint._shared import checkpoint_calls, constant_value


class CheckpointReentrantExplicit(Rule):
    id = "TL202"
    name = "checkpoint-reentrant-explicit"
    severity = Severity.INFO
    probe = True
    summary = "use_reentrant=True passed to torch.utils.checkpoint explicitly."
    # Every finding needs torch's checkpoint (see TL201) and a `True` (the literal or a constant's value).
    tokens = ("use_reentrant",)
    requires = (("True",), ("utils",), ("torch",), tuple(a + "utils" for a in ".\t\n\r\f (,"))
    # The code must name torch's checkpoint function: the last part of ``torch.utils.checkpoint.checkpoint``
    # is imported or read as an attribute (of anything but ``self``), from a ``torch`` import.
    gate = (("ref:checkpoint", "ref:checkpoint_sequential"), ("import:torch",))
    doc = RuleDoc(
        what="Reports `use_reentrant=True` passed to torch's checkpoint functions (a literal or a module constant).",
        why=(
            "The reentrant variant is a deliberate choice in some codebases, so this is only "
            "information. Keep in mind what it costs: if none of the tensor inputs requires grad "
            "(say the block's input comes from a frozen embedding), the block's parameters receive no "
            "gradient at all; keyword arguments to the checkpointed function are not supported; and "
            "the check that recomputation reproduced the forward pass is skipped."
        ),
        example="y = checkpoint(block, x, use_reentrant=True)",
        use_instead="y = checkpoint(block, x, use_reentrant=False)",
        references=("https://pytorch.org/docs/stable/checkpoint.html",),
    )
    valid = (
        """
        from torch.utils.checkpoint import checkpoint
        y = checkpoint(f, x, use_reentrant=False)
        """,
        """
        from torch.utils.checkpoint import checkpoint
        y = checkpoint(f, x, use_reentrant=flag)
        """,
        """
        def checkpoint(f, x, use_reentrant):
            pass
        checkpoint(f, x, use_reentrant=True)
        """,
        """
        import deepspeed
        y = deepspeed.checkpointing.checkpoint(f, x, use_reentrant=True)
        """,
        """
        from torch.utils.checkpoint import checkpoint
        REENTRANT = False
        y = checkpoint(f, x, use_reentrant=REENTRANT)
        """,
        """
        from torch.utils.checkpoint import checkpoint
        y = checkpoint(f, x)
        """,
    )
    invalid = (
        Invalid(
            """
            from torch.utils.checkpoint import checkpoint
            y = checkpoint(f, x, use_reentrant=True)
            """,
            line=2,
        ),
        Invalid(
            """
            import torch
            y = torch.utils.checkpoint.checkpoint(f, x, use_reentrant=True)
            """,
            line=2,
        ),
        Invalid(
            """
            import torch.utils.checkpoint as cp
            REENTRANT = True
            y = cp.checkpoint(f, x, use_reentrant=REENTRANT)
            """,
            line=3,
        ),
        Invalid(
            """
            import functools
            import torch.utils.checkpoint
            ckpt = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
            """,
            line=3,
        ),
        Invalid(
            """
            from torch.utils.checkpoint import checkpoint_sequential
            y = checkpoint_sequential(m, 2, x, use_reentrant=True)
            """
        ),
        Invalid("""
            from torch.utils import checkpoint
            y = checkpoint.checkpoint(f, x, use_reentrant=True)
            """),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        for site, call in checkpoint_calls(model):
            arg = keyword(call, "use_reentrant")
            if arg is not None and constant_value(model, arg.value, site) is True:
                yield Diagnostic(
                    arg,
                    "use_reentrant=True selects the reentrant checkpoint: parameters get no gradient when "
                    "no input requires grad, and keyword arguments are not supported; prefer "
                    "`use_reentrant=False` unless you rely on it.",
                )
