"""TL201 checkpoint-use-reentrant."""

from __future__ import annotations

from collections.abc import Iterator

from trainlint.api import (
    Applicability,
    Diagnostic,
    FixSpec,
    Invalid,
    Rule,
    RuleDoc,
    Severity,
    TextEditSpec,
)
from trainlint.model import (
    FileModel,
    has_star_kwargs,
    keyword,
)
from trainlint.rules.checkpoint._shared import checkpoint_calls, factory_checkpoint_calls


class CheckpointUseReentrant(Rule):
    id = "TL201"
    name = "checkpoint-use-reentrant"
    severity = Severity.WARNING
    probe = True
    FACTORY = "factory"  # the related location: the factory's return of torch's checkpoint
    summary = "torch.utils.checkpoint called without an explicit use_reentrant= argument."
    # Every finding needs a name that resolves to torch.utils.checkpoint.checkpoint[_sequential]: its
    # parts `torch`, `utils` and `checkpoint` are all written in the file (call, import or assignment),
    # and `utils` after `.`, whitespace, `(` or `,` (in `torch.utils`, `from torch import (nn, utils)`).
    tokens = ("checkpoint",)
    requires = (("utils",), ("torch",), tuple(a + "utils" for a in ".\t\n\r\f (,"))
    # The code must name torch's checkpoint function: the last part of ``torch.utils.checkpoint.checkpoint``
    # is imported or read as an attribute (of anything but ``self``), from a ``torch`` import.
    gate = (("ref:checkpoint", "ref:checkpoint_sequential"), ("import:torch",))
    has_fix = True
    doc = RuleDoc(
        what=(
            "Reports calls of `torch.utils.checkpoint.checkpoint` and `checkpoint_sequential` (under any "
            "import alias, and `functools.partial` of them) that do not pass `use_reentrant=`. A call "
            "with a `**kwargs` splat is not reported, since the keyword may be inside it. A function of "
            "your own that happens to be called `checkpoint` is never reported."
        ),
        why=(
            "Without the keyword, PyTorch falls back to the old *reentrant* implementation and prints a "
            "deprecation warning. The reentrant variant only computes gradients for the tensor inputs "
            "that require grad: checkpoint a block whose input is the output of a frozen embedding (or "
            "raw token features) and none of the block's parameters get a gradient. With 24 "
            "checkpointed layers over a frozen embedding, all 24 layers receive `None` gradients and "
            "the optimizer silently skips them; the loss still goes down thanks to the head, so "
            "nothing looks broken. The reentrant variant also ignores keyword arguments to the "
            "function and does not support `torch.autograd.grad`."
        ),
        example=(
            "from torch.utils.checkpoint import checkpoint\n\n"
            "def forward(self, x):\n"
            "    for block in self.blocks:\n"
            "        x = checkpoint(block, x)\n"
            "    return x"
        ),
        use_instead=(
            "from torch.utils.checkpoint import checkpoint\n\n"
            "def forward(self, x):\n"
            "    for block in self.blocks:\n"
            "        x = checkpoint(block, x, use_reentrant=False)\n"
            "    return x"
        ),
        fix_safety=(
            "The fix adds `use_reentrant=False`. It is unsafe: the non-reentrant variant is the "
            "recommended one and fixes the missing-gradient case above, but it differs in corner cases "
            "(for example code that relies on the reentrant variant's detaching of inputs). Apply it "
            "with `--unsafe-fixes`, or let `--verify` show that the gradients match."
        ),
        references=("https://pytorch.org/docs/stable/checkpoint.html",),
    )
    valid = (
        """
        import torch.utils.checkpoint
        y = torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False)
        """,
        """
        from torch.utils.checkpoint import checkpoint
        y = checkpoint(f, x, use_reentrant=True)
        """,
        # the user's own function called checkpoint
        """
        def checkpoint(model, path):
            torch.save(model.state_dict(), path)

        checkpoint(model, 'a.pt')
        """,
        # use_reentrant passed through a kwargs dict
        """
        from torch.utils.checkpoint import checkpoint
        kw = {'use_reentrant': False}
        y = checkpoint(f, x, **kw)
        """,
        # use_reentrant through a module constant
        """
        from torch.utils.checkpoint import checkpoint
        REENTRANT = False
        y = checkpoint(f, x, use_reentrant=REENTRANT)
        """,
        # a partial that binds the keyword
        """
        import functools
        from torch.utils.checkpoint import checkpoint
        ckpt = functools.partial(checkpoint, use_reentrant=False)
        y = ckpt(f, x)
        """,
        # other libraries' checkpoint functions
        """
        import deepspeed
        y = deepspeed.checkpointing.checkpoint(f, x)
        """,
        """
        from timm.models._manipulate import checkpoint
        y = checkpoint(block, x)
        """,
        """
        from megatron.core import tensor_parallel
        y = tensor_parallel.checkpoint(f, False, x)
        """,
        # a factory that only ever returns another library's checkpoint
        """
        import deepspeed

        def get_ckpt():
            fn = deepspeed.checkpointing.checkpoint
            return fn

        def run(blocks, x):
            ckpt = get_ckpt()
            return ckpt(blocks, x)
        """,
        # a reference, not a call
        """
        from torch.utils.checkpoint import checkpoint
        self.ckpt_fn = checkpoint
        """,
        # shadowed by a local def inside a class body method's module
        """
        from torch.utils.checkpoint import checkpoint

        def checkpoint(state):
            save(state)

        checkpoint(s)
        """,
    )
    invalid = (
        Invalid(
            """
            from torch.utils.checkpoint import checkpoint
            y = checkpoint(f, x)
            """,
            line=2,
        ),
        Invalid(
            """
            import torch
            y = torch.utils.checkpoint.checkpoint(f, x)
            """,
            line=2,
        ),
        Invalid(
            """
            import torch.utils.checkpoint as cp
            y = cp.checkpoint(f, x)
            """,
            line=2,
        ),
        Invalid(
            """
            from torch.utils import checkpoint
            y = checkpoint.checkpoint(f, x)
            """,
            line=2,
        ),
        # a factory of this file that returns torch's checkpoint unless DeepSpeed is set up
        Invalid(
            """
            import deepspeed
            import torch.utils.checkpoint

            def get_ckpt():
                if deepspeed.checkpointing.is_configured():
                    fn = deepspeed.checkpointing.checkpoint
                else:
                    fn = torch.utils.checkpoint.checkpoint
                return fn

            def run(blocks, x):
                ckpt = get_ckpt()
                for block in blocks:
                    x = ckpt(block, x)
                return x
            """,
            line=14,
        ),
        Invalid(
            """
            from torch.utils.checkpoint import checkpoint_sequential
            y = checkpoint_sequential(seq, 2, x)
            """
        ),
        Invalid(
            """
            from torch.utils.checkpoint import checkpoint as ckpt

            def f(self, x):
                return ckpt(self.block, x)
            """,
            line=4,
        ),
        Invalid(
            """
            import functools
            from torch.utils.checkpoint import checkpoint
            ckpt = functools.partial(checkpoint, preserve_rng_state=True)
            y = ckpt(f, x)
            """,
            line=3,
        ),
        Invalid(
            """
            import torch

            class Block(torch.nn.Module):
                def forward(self, x):
                    from torch.utils.checkpoint import checkpoint
                    return checkpoint(self.inner, x)
            """,
            line=6,
        ),
        Invalid(
            """
            import torch.utils.checkpoint
            import torch
            for blk in blocks:
                x = torch.utils.checkpoint.checkpoint(
                    blk,
                    x,
                )
            """,
            line=4,
        ),
        # unsafe fix: use reentrant
        Invalid(
            """
            import torch.utils.checkpoint as cp

            def forward(blocks, x):
                for block in blocks:
                    # recompute in backward
                    x = cp.checkpoint(block, x)  # saves memory
                return x
            """,
            unsafe_fix="""
            import torch.utils.checkpoint as cp

            def forward(blocks, x):
                for block in blocks:
                    # recompute in backward
                    x = cp.checkpoint(block, x, use_reentrant=False)  # saves memory
                return x
            """,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        for _site, call in checkpoint_calls(model):
            if keyword(call, "use_reentrant") is not None or has_star_kwargs(call):
                continue
            fix = None
            if call.args:
                fix = FixSpec(
                    Applicability.UNSAFE,
                    "Pass use_reentrant=False",
                    (TextEditSpec(call.args[-1].value, "after", ", use_reentrant=False"),),
                )
            yield Diagnostic(
                call,
                "checkpoint() without `use_reentrant=`: the implicit default is the deprecated reentrant "
                "variant, which drops parameter gradients when no input requires grad; pass "
                "`use_reentrant=False`.",
                fix=fix,
            )
        for _site, call, returned in factory_checkpoint_calls(model):
            if keyword(call, "use_reentrant") is not None or has_star_kwargs(call):
                continue
            # no fix: the factory may hand back another implementation (DeepSpeed's) without the keyword
            yield Diagnostic(
                call,
                f"`{model.code(call.func)}` can be torch's checkpoint (the factory returns it here) and is "
                "called without `use_reentrant=`: the implicit default is the deprecated reentrant "
                "variant, which drops parameter gradients when no input requires grad; pass "
                "`use_reentrant=False` when it is torch's.",
                related=(
                    (returned, "the factory returns torch's checkpoint here", CheckpointUseReentrant.FACTORY),
                ),
            )
