"""TL204 checkpoint-rng-not-preserved."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import libcst as cst

from trainlint.api import (
    Diagnostic,
    Invalid,
    Rule,
    RuleDoc,
    Severity,
    called_word,
)
from trainlint.model import (
    FileModel,
    Scope,
    Site,
    dotted,
    keyword,
    positional,
)
from trainlint.model.crossfile import (
    Elsewhere,
    checkpoint_wrapper,
    class_randomness,
    constructed_class,
    related_elsewhere,
)
from trainlint.model.module_classes import candidate_classes, container_modules, submodule_classes
from trainlint.model.targets import Target, called_functions, resolve_callable
from trainlint.model.vocab import CHECKPOINT_FUNCTIONS, CHECKPOINT_WRAPPERS, DROPOUT_MODULES
from trainlint.rules.checkpoint._shared import (
    checkpoint_calls,
    checkpoint_sites,
    constant_value,
    self_attr_callee,
)


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
        ("utils", "_checkpoint"),
        ("torch",),
        # torch.utils.checkpoint, or torch.distributed.algorithms._checkpoint's checkpoint_wrapper
        (*(a + "utils" for a in ".\t\n\r\f (,"), "._checkpoint"),
    )
    # A wrapper of another file holds the `False` (a parameter default) and the checkpoint call, maybe
    # the dropout too; what is left here is a call of the wrapper, whose name says "checkpoint" (not
    # one that saves or loads a checkpoint).
    project_requires = (called_word("checkpoint", unless=("save_", "load_", "resume_")),)
    # The same in the code, not in comments and docstrings: that wrapper's call (its callee's last
    # name), or the `preserve_rng_state=` keyword that torch's `checkpoint_wrapper(...)` is given here.
    project_gate = (("call~^(?!save_|load_|resume_)\\w*checkpoint", "name:preserve_rng_state"),)
    # A finding made from this file alone needs a `preserve_rng_state=` keyword given False, a dropout
    # test, or a name the file assigns one of those.
    gate_check = "gate_checkpoint_misc.rng_flag_may_be_off"
    # Through the project: that keyword, or a call of an imported (or, given the keyword, own) function
    # given something that may draw random numbers: a word of randomness in the file, or an instance
    # of an imported class.
    project_gate_check = "gate_checkpoint_misc.wrapper_may_leave_rng_off"
    # Of the definitions the file imports, only those such a call reaches take part: the wrapper called
    # and the class of an instance given to it; for torch's `checkpoint_wrapper` on a module whose class
    # is not known, any imported class (so every import). A file importing a wrapper it never calls
    # with something random is then not parsed for the rule.
    project_callees = "gate_checkpoint_misc.rng_wrapper_callees"
    # A wanted class makes a dropout submodule; a wanted function passes `preserve_rng_state=`.
    fact_words = ("ropout", "preserve_rng_state")

    @classmethod
    def wants_fact(cls, kind: str, facts: dict[str, Any]) -> bool:
        if kind == "class":  # a block with dropout that torch's checkpoint_wrapper may wrap here
            return any("ropout" in made[0] for made in facts["submodules"].values())
        return kind == "function" and any("preserve_rng_state" in c["keywords"] for c in facts["calls"])

    doc = RuleDoc(
        what=(
            "Reports a checkpoint call with `preserve_rng_state=False` whose function (resolved as for "
            "TL203) uses randomness: dropout modules or functions, `torch.rand*`, `torch.bernoulli`, "
            "`torch.multinomial`, `torch.normal`, `random.*`, `numpy.random.*`; a dropout may also sit "
            "in an `nn.Sequential`/`nn.ModuleList` attribute (given directly or as a list spread into "
            "it) that the function calls or hands to a helper. Also reported at the call of another "
            "file's wrapper whose `preserve_rng_state` parameter defaults to False, and at torch's "
            "`checkpoint_wrapper(module, preserve_rng_state=False)` (its keywords reach the checkpoint) "
            "when the module's class has a dropout (its own, or one of a submodule of another project "
            "class, such as a residual stream's; also `nn.Dropout(p) if p > 0 else nn.Identity()`). For "
            "a loop over the model's own blocks, the classes its container is built from count, or, when "
            "they are not known, the block classes of other project files that the file imports, less "
            "those an `if isinstance(block, C): raise ...` before the call rules out."
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
        # the flag is computed the right way round: preserved whenever a dropout rate is set
        """
        from functools import partial
        from torch.utils.checkpoint import checkpoint

        def make_ckpt(cfg):
            keep_rng = cfg.attn_dropout > 0.0 or cfg.resid_dropout > 0.0
            return partial(checkpoint, preserve_rng_state=keep_rng, use_reentrant=False)
        """,
        """
        from functools import partial
        from torch.utils.checkpoint import checkpoint

        def make_ckpt(cfg):
            keep_rng = not (cfg.attn_dropout == 0.0 and cfg.resid_dropout == 0.0)
            return partial(checkpoint, preserve_rng_state=keep_rng, use_reentrant=False)
        """,
    )
    invalid = (
        # the flag is computed inverted: False exactly when some dropout rate is not zero
        Invalid(
            """
            from functools import partial
            from torch.utils.checkpoint import checkpoint

            def make_ckpt(cfg):
                keep_rng = cfg.attn_dropout == 0.0 and cfg.resid_dropout == 0.0
                return partial(checkpoint, preserve_rng_state=keep_rng, use_reentrant=False)
            """,
            line=6,
        ),
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
        yield from self._in_this_file(model)
        yield from self._off_when_dropout(model)
        yield from self._wrapped_modules(model)
        if model.project is not None:
            yield from self._through_wrappers(model)

    def _off_when_dropout(self, model: FileModel) -> Iterator[Diagnostic]:
        """``preserve_rng_state=flag`` where ``flag`` is computed from tests that a dropout rate is
        zero (``cfg.dropout == 0.0 and ...``): it is False exactly when dropout draws random numbers."""
        for site, call in checkpoint_calls(model):
            arg = keyword(call, "preserve_rng_state")
            values = [arg.value] if arg is not None else []
            if values and isinstance(values[0], cst.Name):
                values = model.values_of(values[0], site.scope)
            test = _dropout_is_zero(values[0]) if len(values) == 1 else None
            if arg is None or len(values) != 1 or test is None:
                continue
            yield Diagnostic(
                arg,
                "preserve_rng_state is computed to be False exactly when dropout is on "
                f"(`{model.code(test)}`): the recomputation then draws other dropout masks than the "
                "forward pass did; preserve the RNG state whenever dropout is active (or always).",
                related=((test, "True only without dropout"),),
            )

    def _through_wrappers(self, model: FileModel) -> Iterator[Diagnostic]:
        """A wrapper in another project file checkpoints what it is given with a parameter whose
        default is ``preserve_rng_state=False``; this call leaves the default and passes a module or
        function that draws random numbers (its dropout in this file or in the class's file)."""
        for site in model.calls:
            found = checkpoint_wrapper(model, site, CHECKPOINT_FUNCTIONS)
            if found is None:
                continue
            passed, where, parameter = found
            target = resolve_callable(model, passed, site.scope)
            source: str | None = None
            if target is not None:
                bodies = [target, *(t for _, t in called_functions(model, target))]
                source = next((s for s in (_randomness(model, b) for b in bodies) if s), None)
            else:
                fact = constructed_class(model, passed, site.scope)
                drawn = class_randomness(model, fact) if fact is not None else None
                source = drawn.what if drawn is not None else None
            if source is None:
                continue
            yield Diagnostic(
                site.node,
                f"`{model.code(site.node.func)}` checkpoints `{model.code(passed)}` with "
                f"preserve_rng_state=False by default ({where.path}, line {where.line}), but it draws "
                f"random numbers (`{source}`): recomputation uses different ones; pass "
                f"`{parameter}=True` or change the wrapper's default.",
                elsewhere=(where.related(None),),
            )

    def _wrapped_modules(self, model: FileModel) -> Iterator[Diagnostic]:
        """torch's ``checkpoint_wrapper(module, preserve_rng_state=False)`` (its keywords go to the
        checkpoint) on a module with dropout: its class's, or one of the blocks this file imports when
        the module is one of the model's own (``for block in self.blocks.values()``)."""
        for site in model.calls_to(*CHECKPOINT_WRAPPERS):
            call = site.node
            assert isinstance(call, cst.Call)
            arg, args = keyword(call, "preserve_rng_state"), positional(call)
            if arg is None or not args or constant_value(model, arg.value, site) is not False:
                continue
            found = _module_randomness(model, args[0], site)
            if found is None:
                continue
            what, where = found
            flag = arg.value
            values = model.values_of(flag, site.scope) if isinstance(flag, cst.Name) else []
            yield Diagnostic(
                call,
                f"preserve_rng_state=False, but the wrapped module draws random numbers ({what}): "
                "recomputation uses different ones, so the gradients do not match the forward pass; "
                "drop the argument.",
                related=((values[0] if len(values) == 1 else arg, "RNG state not preserved here"),),
                elsewhere=related_elsewhere(where),
            )

    def _in_this_file(self, model: FileModel) -> Iterator[Diagnostic]:
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


RANDOM_PREFIXES = ("random.", "numpy.random.")


def _module_randomness(
    model: FileModel, passed: cst.BaseExpression, site: Site
) -> tuple[str, Elsewhere | None] | None:
    """What draws random numbers in a wrapped module: the body it resolves to, else the first of the
    classes it may be an instance of (``candidate_classes``) with a dropout of its own or in a
    submodule of another project class."""
    target = resolve_callable(model, passed, site.scope)
    if target is not None:
        bodies = [target, *(t for _, t in called_functions(model, target))]
        source = next((s for s in (_randomness(model, b) for b in bodies) if s), None)
        return (f"`{source}`", None) if source is not None else None
    for candidate in candidate_classes(model, passed, site):
        drawn = class_randomness(model, candidate)
        if drawn is not None:
            return f"the dropout of `{candidate.name}`, {drawn.path} line {drawn.line}", drawn
        # one level down: a submodule of another project class (a residual stream with its dropout)
        for label, inner in submodule_classes(model, candidate):
            drawn = class_randomness(model, inner)
            if drawn is not None:
                what = f"the dropout of `{candidate.name}.{label}`, a `{inner.name}`"
                return f"{what}, {drawn.path} line {drawn.line}", drawn
    return None


def _dropout_is_zero(expr: cst.BaseExpression, negated: bool = False) -> cst.BaseExpression | None:
    """The test in ``expr`` that makes it True only without dropout: ``x.dropout == 0`` (either side,
    ``0.0`` too) or ``not x.dropout``, combined with ``and``/``or`` and under an even number of
    ``not`` (``not (cfg.dropout == 0.0)`` is the right way round), for a name mentioning dropout."""
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Not):
        if not negated and "dropout" in (dotted(expr.expression) or "").lower():
            return expr
        return _dropout_is_zero(expr.expression, not negated)
    if isinstance(expr, cst.BooleanOperation):
        return _dropout_is_zero(expr.left, negated) or _dropout_is_zero(expr.right, negated)
    if negated or not isinstance(expr, cst.Comparison) or len(expr.comparisons) != 1:
        return None
    if not isinstance(expr.comparisons[0].operator, cst.Equal):
        return None
    sides = (expr.left, expr.comparisons[0].comparator)
    zero = any(isinstance(x, cst.Integer | cst.Float) and float(x.evaluated_value) == 0.0 for x in sides)
    return expr if zero and any("dropout" in (dotted(x) or "").lower() for x in sides) else None


def _randomness(model: FileModel, target: Target) -> str | None:
    for site in model.calls_in(target.scope):
        call = site.node
        assert isinstance(call, cst.Call)
        callee = model.callee(site)
        if callee and (callee in RANDOM_FUNCTIONS or callee.startswith(RANDOM_PREFIXES)):
            return model.code(call.func)
        if any(c in DROPOUT_MODULES for c in self_attr_callee(model, call, target.scope)):
            return model.code(call.func)
        # a container attribute called here or handed to a helper that runs it (``run(self.layers, h)``)
        for used in (call.func, *(a.value for a in call.args)):
            if _container_with_dropout(model, used, target.scope):
                return model.code(used)
    return None


def _container_with_dropout(model: FileModel, expr: cst.BaseExpression, scope: Scope) -> bool:
    """``self.layers`` built as ``nn.Sequential(...)``/``nn.ModuleList([...])`` with a dropout among its
    parts: given directly, or in a list spread into it (``nn.Sequential(*layers)``)."""
    return any(kind in DROPOUT_MODULES for kind in container_modules(model, expr, scope))
