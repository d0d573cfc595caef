"""TL204 checkpoint-rng-not-preserved."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

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
from trainlint.model.targets import Target, called_functions
from trainlint.rules.checkpoint._shared import checkpoint_sites, constant_value, self_attr_callee


class CheckpointRngNotPreserved(Rule):
    id = "TL204"
    name = "checkpoint-rng-not-preserved"
    severity = Severity.ERROR
    probe = True
    summary = "preserve_rng_state=False on a checkpointed function that draws random numbers."
    # Every finding needs torch's checkpoint (see TL201), a `False`, and randomness: `rand*`/`random`,
    # `bernoulli`, `multinomial`, `normal`, `poisson` or a dropout (`dropout*`, `Dropout`, `AlphaDropout`).
    tokens = ("preserve_rng_state",)
    requires = (
        ("False",),
        ("rand", "bernoulli", "multinomial", "normal", "poisson", "ropout"),
        ("utils",),
        ("torch",),
        tuple(a + "utils" for a in ".\t\n\r\f (,"),
    )
    doc = RuleDoc(
        what=(
            "Reports a checkpoint call with `preserve_rng_state=False` whose function (resolved as for "
            "TL203) uses randomness: dropout modules or functions, `torch.rand*`, `torch.bernoulli`, "
            "`torch.multinomial`, `torch.normal`, `random.*`, `numpy.random.*`."
        ),
        why=(
            "Recomputation during backward draws new random numbers unless the RNG state is restored. "
            "The gradient is then computed for a different dropout mask than the one that produced "
            "the loss: with p = 0.1 on 4096 features, about 2 x 4096 x 0.1 x 0.9 = 737 positions differ "
            "between the two masks, and their gradients flow through units that were zero in the "
            "forward pass. Training still runs, on gradients of a function that was never evaluated."
        ),
        example="y = checkpoint(block_with_dropout, x, use_reentrant=False, preserve_rng_state=False)",
        use_instead="y = checkpoint(block_with_dropout, x, use_reentrant=False)",
        references=("https://pytorch.org/docs/stable/checkpoint.html",),
    )
    valid = (
        """
        import torch
        from torch.utils.checkpoint import checkpoint

        def block(x):
            return torch.nn.functional.dropout(x, 0.1)

        y = checkpoint(block, x, use_reentrant=False)
        """,
        """
        import torch
        from torch.utils.checkpoint import checkpoint

        def block(x):
            return torch.relu(x)

        y = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)
        """,
        """
        import torch
        from torch.utils.checkpoint import checkpoint

        def block(x):
            return torch.nn.functional.dropout(x, 0.1)

        y = checkpoint(block, x, use_reentrant=False, preserve_rng_state=True)
        """,
        """
        import torch

        def checkpoint(fn, x, preserve_rng_state):
            return fn(x)

        def block(x):
            return x * torch.rand_like(x)

        y = checkpoint(block, x, preserve_rng_state=False)
        """,
        """
        import torch
        from torch.utils.checkpoint import checkpoint

        y = checkpoint(layer, x, use_reentrant=False, preserve_rng_state=False)
        """,
        """
        import torch
        from torch import nn
        from torch.utils.checkpoint import checkpoint

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.ln = nn.LayerNorm(8)

            def inner(self, x):
                return self.ln(x)

            def forward(self, x):
                return checkpoint(self.inner, x, use_reentrant=False, preserve_rng_state=False)
        """,
    )
    invalid = (
        Invalid(
            """
            import torch
            from torch.utils.checkpoint import checkpoint

            def block(x):
                return torch.nn.functional.dropout(x, 0.1)

            y = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)
            """,
            line=7,
        ),
        Invalid(
            """
            import torch.nn.functional as F
            from torch.utils.checkpoint import checkpoint

            def block(x):
                return F.dropout(x, 0.1, training=True)

            y = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)
            """,
            line=7,
        ),
        Invalid(
            """
            import torch
            from torch import nn
            from torch.utils.checkpoint import checkpoint

            class M(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.drop = nn.Dropout(0.1)

                def inner(self, x):
                    return self.drop(x)

                def forward(self, x):
                    return checkpoint(self.inner, x, use_reentrant=False, preserve_rng_state=False)
            """,
            line=14,
        ),
        Invalid(
            """
            import torch
            from torch.utils.checkpoint import checkpoint

            def block(x):
                return x * torch.rand_like(x)

            y = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)
            """,
        ),
        Invalid(
            """
            import random
            from torch.utils.checkpoint import checkpoint

            def block(x):
                return x * random.random()

            y = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)
            """,
        ),
        Invalid(
            """
            import numpy as np
            import torch
            from torch.utils.checkpoint import checkpoint

            def block(x):
                return x + torch.from_numpy(np.random.randn(4))

            y = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)
            """,
        ),
        Invalid(
            """
            import torch
            from torch.utils.checkpoint import checkpoint

            y = checkpoint(lambda t: torch.bernoulli(t), x, use_reentrant=False, preserve_rng_state=False)
            """,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        for site, call, target in checkpoint_sites(model):
            arg = keyword(call, "preserve_rng_state")
            if arg is None or constant_value(model, arg.value, site) is not False:
                continue
            bodies = [target, *(t for _, t in called_functions(model, target))]
            for body in bodies:
                source = _randomness(model, body)
                if source is not None:
                    yield Diagnostic(
                        call,
                        f"preserve_rng_state=False, but `{target.via}` draws random numbers "
                        f"(`{source}`): recomputation uses different ones, so the gradients do not match "
                        "the forward pass; drop the argument.",
                        related=((arg, "RNG state not preserved here"),),
                    )
                    break


RANDOM_FUNCTIONS = frozenset(
    {
        "torch.rand",
        "torch.randn",
        "torch.randint",
        "torch.rand_like",
        "torch.randn_like",
        "torch.randint_like",
        "torch.randperm",
        "torch.bernoulli",
        "torch.multinomial",
        "torch.normal",
        "torch.poisson",
        "torch.nn.functional.dropout",
        "torch.nn.functional.dropout1d",
        "torch.nn.functional.dropout2d",
        "torch.nn.functional.dropout3d",
        "torch.nn.functional.alpha_dropout",
        "torch.nn.functional.feature_alpha_dropout",
        "torch.dropout",
    }
)


DROPOUT_MODULES = frozenset(
    f"torch.nn.{name}" for name in ("Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout")
)


RANDOM_PREFIXES = ("random.", "numpy.random.")


def _randomness(model: FileModel, target: Target) -> str | None:
    for site in model.calls_in(target.scope):
        call = site.node
        assert isinstance(call, cst.Call)
        callee = model.callee(site)
        if callee and (callee in RANDOM_FUNCTIONS or callee.startswith(RANDOM_PREFIXES)):
            return model.code(call.func)
        if any(c in DROPOUT_MODULES for c in self_attr_callee(model, call, target.scope)):
            return model.code(call.func)
    return None
