"""TL2xx: activation checkpointing (``torch.utils.checkpoint``)."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from trainlint.events import CHECKPOINT_FUNCTIONS
from trainlint.model import FileModel, Site, has_star_kwargs, keyword, positional
from trainlint.rule import (
    Applicability,
    Diagnostic,
    FixSpec,
    Invalid,
    Rule,
    RuleDoc,
    Severity,
    TextEditSpec,
)

PARTIALS = ("functools.partial",)


def checkpoint_calls(model: FileModel) -> Iterator[tuple[Site, cst.Call]]:
    """Direct calls of torch's checkpoint functions, and ``functools.partial(checkpoint, ...)``.

    For a partial, the keywords bound at the partial count: its later calls are not reported again.
    """
    for site in model.calls_to(*CHECKPOINT_FUNCTIONS):
        assert isinstance(site.node, cst.Call)
        yield site, site.node
    for site in model.calls_to(*PARTIALS):
        call = site.node
        assert isinstance(call, cst.Call)
        args = positional(call)
        if args and model.resolves_to(args[0], site.scope, *CHECKPOINT_FUNCTIONS):
            yield site, call


def constant_value(model: FileModel, expr: cst.BaseExpression, site: Site) -> bool | None:
    """``True``/``False`` for a literal or a name bound once to one; None when unknown."""
    if isinstance(expr, cst.Name) and expr.value in ("True", "False"):
        return expr.value == "True"
    if isinstance(expr, cst.Name):
        values = model.values_of(expr, site.scope)
        if len(values) == 1:
            value = values[0]
            if isinstance(value, cst.Name) and value.value in ("True", "False"):
                return value.value == "True"
    return None


class CheckpointUseReentrant(Rule):
    id = "TL201"
    name = "checkpoint-use-reentrant"
    severity = Severity.WARNING
    summary = "torch.utils.checkpoint called without an explicit use_reentrant= argument."
    tokens = ("checkpoint",)
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
        "import torch.utils.checkpoint\ny = torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False)",
        "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x, use_reentrant=True)",
        # the user's own function called checkpoint
        "def checkpoint(model, path):\n    torch.save(model.state_dict(), path)\n\ncheckpoint(model, 'a.pt')",
        # use_reentrant passed through a kwargs dict
        "from torch.utils.checkpoint import checkpoint\nkw = {'use_reentrant': False}\ny = checkpoint(f, x, **kw)",
        # use_reentrant through a module constant
        "from torch.utils.checkpoint import checkpoint\nREENTRANT = False\ny = checkpoint(f, x, use_reentrant=REENTRANT)",
        # a partial that binds the keyword
        "import functools\nfrom torch.utils.checkpoint import checkpoint\n"
        "ckpt = functools.partial(checkpoint, use_reentrant=False)\ny = ckpt(f, x)",
        # other libraries' checkpoint functions
        "import deepspeed\ny = deepspeed.checkpointing.checkpoint(f, x)",
        "from timm.models._manipulate import checkpoint\ny = checkpoint(block, x)",
        "from megatron.core import tensor_parallel\ny = tensor_parallel.checkpoint(f, False, x)",
        # a reference, not a call
        "from torch.utils.checkpoint import checkpoint\nself.ckpt_fn = checkpoint",
        # shadowed by a local def inside a class body method's module
        "from torch.utils.checkpoint import checkpoint\n\ndef checkpoint(state):\n    save(state)\n\ncheckpoint(s)",
    )
    invalid = (
        Invalid("from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x)", line=2),
        Invalid("import torch\ny = torch.utils.checkpoint.checkpoint(f, x)", line=2),
        Invalid("import torch.utils.checkpoint as cp\ny = cp.checkpoint(f, x)", line=2),
        Invalid("from torch.utils import checkpoint\ny = checkpoint.checkpoint(f, x)", line=2),
        Invalid(
            "from torch.utils.checkpoint import checkpoint_sequential\ny = checkpoint_sequential(seq, 2, x)"
        ),
        Invalid(
            "from torch.utils.checkpoint import checkpoint as ckpt\n\ndef f(self, x):\n    return ckpt(self.block, x)",
            line=4,
        ),
        Invalid(
            "import functools\nfrom torch.utils.checkpoint import checkpoint\n"
            "ckpt = functools.partial(checkpoint, preserve_rng_state=True)\ny = ckpt(f, x)",
            line=3,
        ),
        Invalid(
            "import torch\n\nclass Block(torch.nn.Module):\n    def forward(self, x):\n"
            "        from torch.utils.checkpoint import checkpoint\n        return checkpoint(self.inner, x)",
            line=6,
        ),
        Invalid(
            "import torch.utils.checkpoint\nimport torch\nfor blk in blocks:\n    x = torch.utils.checkpoint.checkpoint(\n        blk,\n        x,\n    )",
            line=4,
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


class CheckpointReentrantExplicit(Rule):
    id = "TL202"
    name = "checkpoint-reentrant-explicit"
    severity = Severity.INFO
    summary = "use_reentrant=True passed to torch.utils.checkpoint explicitly."
    tokens = ("use_reentrant",)
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
        "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x, use_reentrant=False)",
        "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x, use_reentrant=flag)",
        "def checkpoint(f, x, use_reentrant):\n    pass\ncheckpoint(f, x, use_reentrant=True)",
        "import deepspeed\ny = deepspeed.checkpointing.checkpoint(f, x, use_reentrant=True)",
        "from torch.utils.checkpoint import checkpoint\nREENTRANT = False\ny = checkpoint(f, x, use_reentrant=REENTRANT)",
        "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x)",
    )
    invalid = (
        Invalid(
            "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x, use_reentrant=True)", line=2
        ),
        Invalid("import torch\ny = torch.utils.checkpoint.checkpoint(f, x, use_reentrant=True)", line=2),
        Invalid(
            "import torch.utils.checkpoint as cp\nREENTRANT = True\ny = cp.checkpoint(f, x, use_reentrant=REENTRANT)",
            line=3,
        ),
        Invalid(
            "import functools\nimport torch.utils.checkpoint\n"
            "ckpt = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)",
            line=3,
        ),
        Invalid(
            "from torch.utils.checkpoint import checkpoint_sequential\ny = checkpoint_sequential(m, 2, x, use_reentrant=True)"
        ),
        Invalid("from torch.utils import checkpoint\ny = checkpoint.checkpoint(f, x, use_reentrant=True)"),
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
