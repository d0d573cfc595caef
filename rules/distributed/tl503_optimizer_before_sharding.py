"""TL503 optimizer-before-sharding."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from trainlint.api import Diagnostic, Invalid, Rule, RuleDoc, Severity
from trainlint.model import FileModel, Site, attr_name, dotted, exclusive, positional
from trainlint.model.training import OPTIMIZER_NAME, accelerate_prepare_calls, mentions_parameters_of
from trainlint.model.vocab import FSDP_CLASSES, FULLY_SHARD
from trainlint.rules.distributed._sharding import assigned_names, keyword_is, sharded_in_place, wraps


class OptimizerBeforeSharding(Rule):
    id = "TL503"
    name = "optimizer-before-sharding"
    severity = Severity.ERROR
    probe = True
    SHARD = "shard"
    summary = "An optimizer is built over a model's parameters before the model is sharded (FSDP)."
    # A finding needs an FSDP wrap (`FullyShardedDataParallel`, `fully_shard`) or an accelerate
    # `prepare` in an FSDP file, and an optimizer over `.parameters()` (or `named_parameters()`), or one
    # bound to an optimizer's name that a model method or factory builds (`opt`, `optimizer`...).
    tokens = ("FullyShardedDataParallel", "fully_shard", "prepare")
    requires = (("FullyShardedDataParallel", "fully_shard", "FSDP", "fsdp"), ("parameters", "opt"))
    # In the code: a call of the FSDP class or of `fully_shard` (by its name, or a name bound to it), or
    # of `prepare`.
    gate = (
        (
            "call:FullyShardedDataParallel",
            "alias:FullyShardedDataParallel",
            "call:fully_shard",
            "alias:fully_shard",
            "call:prepare",
        ),
    )
    # And, in one scope, an optimizer call over the sharded module's parameters not after that shard
    # and not in the other branch of an `if`.
    gate_check = "gate_sharding_order.optimizer_may_precede_sharding"
    doc = RuleDoc(
        what=(
            "Reports an optimizer (a `torch.optim` class and the other known optimizer packages) built "
            "over `model.parameters()` before, in the same function, `FullyShardedDataParallel(model)` "
            "or `fully_shard(model)` shards that model; and in a file that mentions FSDP, an optimizer "
            "built before `accelerator.prepare(model)` when the optimizer is not passed to that same "
            "`prepare` call. An optimizer that the model builds (`optimizer = "
            "model.configure_optimizers(...)`) or a factory is given the model for (`opt = "
            "build_optimizer(model, cfg)`) counts as one over its parameters when its result is bound to "
            "an optimizer's name. An optimizer over a parameter list built earlier (`decay = [p for n, p in "
            "model.named_parameters() ...]`) is not traced and not reported, nor one before "
            "`FullyShardedDataParallel(model, use_orig_params=True)`, which keeps the module's own "
            "parameter objects (their data becomes a view of the shard), so the optimizer built before "
            "takes the same step as one built after (torch 2.13, two CPU ranks)."
        ),
        why=(
            "FSDP replaces the module's parameters: FSDP1 flattens them into sharded `FlatParameter`s, "
            "FSDP2's `fully_shard` swaps each for a DTensor shard. An optimizer built before holds "
            "the old tensors, which the forward no longer uses: their `.grad` stays None, "
            "`optimizer.step()` skips them, and the model never changes while the loss is computed "
            "and logged as usual (accelerate issue 3256, pytorch issue 149205). With 8 GPUs the old "
            "tensors also keep a full unsharded copy of the model on every rank."
        ),
        example=(
            "model = Net().cuda()\n"
            "opt = torch.optim.AdamW(model.parameters(), lr=1e-4)\n"
            "model = FSDP(model)\n"
            "for batch in loader:\n"
            "    model(batch).loss.backward()\n"
            "    opt.step()"
        ),
        use_instead=(
            "model = Net().cuda()\n"
            "model = FSDP(model)\n"
            "opt = torch.optim.AdamW(model.parameters(), lr=1e-4)\n"
            "for batch in loader:\n"
            "    model(batch).loss.backward()\n"
            "    opt.step()"
        ),
        references=(
            "https://pytorch.org/docs/stable/fsdp.html",
            "https://huggingface.co/docs/accelerate/usage_guides/fsdp",
        ),
    )
    _HEAD = "import torch\nfrom torch.distributed.fsdp import FullyShardedDataParallel as FSDP, fully_shard\n"
    valid = (
        # optimizer built after wrapping
        _HEAD + "model = FSDP(model)\nopt = torch.optim.AdamW(model.parameters())",
        _HEAD + "for layer in model.layers:\n    fully_shard(layer)\nfully_shard(model)\n"
        "opt = torch.optim.AdamW(model.parameters(), lr=1e-3)",
        # the optimizer over another module's parameters
        _HEAD + "opt_d = torch.optim.Adam(disc.parameters())\ngen = FSDP(gen)",
        # the model's own optimizer method called on the sharded model
        _HEAD + "model = FSDP(model)\noptimizer = model.configure_optimizers(0.1, 6e-4)",
        # accelerate: model and optimizer prepared together
        """
        import torch
        from accelerate import Accelerator, FullyShardedDataParallelPlugin
        accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
        opt = torch.optim.AdamW(model.parameters())
        model, opt = accelerator.prepare(model, opt)
        """,
        # accelerate: model prepared first, optimizer built after
        """
        import torch
        # fsdp is configured by `accelerate config`
        model = accelerator.prepare(model)
        opt = torch.optim.AdamW(model.parameters())
        opt = accelerator.prepare(opt)
        """,
        # FSDP1 keeping the original parameter objects: the earlier optimizer still holds them
        _HEAD + "opt = torch.optim.AdamW(model.parameters())\nmodel = FSDP(model, use_orig_params=True)",
        # the two branches of one `if`: never both
        _HEAD
        + "if args.fsdp:\n    model = FSDP(model)\nelse:\n    opt = torch.optim.AdamW(model.parameters())",
        _HEAD
        + "if not args.fsdp:\n    opt = torch.optim.AdamW(model.parameters())\nelse:\n    model = FSDP(model)",
        # FSDP in another function, optimizer in this one
        _HEAD + "def build():\n    return FSDP(Net())\n"
        "def make_opt(model):\n    return torch.optim.SGD(model.parameters(), lr=0.1)",
    )
    invalid = (
        Invalid(
            _HEAD
            + "model = Net()\nopt = torch.optim.AdamW(model.parameters(), lr=1e-4)\nmodel = FSDP(model)",
            line=4,
        ),
        Invalid(
            _HEAD + "optimizer = torch.optim.AdamW(model.parameters())\n"
            "for block in model.blocks:\n    fully_shard(block)\nfully_shard(model)",
            line=3,
        ),
        Invalid(
            """
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel

            def setup(net, rank):
                opt = torch.optim.SGD(
                    net.parameters(),
                    lr=0.1,
                )
                sharded = FullyShardedDataParallel(net, device_id=rank)
                return sharded, opt
            """,
            line=5,
        ),
        Invalid(
            """
            import torch
            from torch.distributed._composable.fsdp import fully_shard

            class Trainer:
                def setup(self):
                    self.optimizer = torch.optim.AdamW(self.model.parameters())
                    fully_shard(self.model, mesh=self.mesh)
            """,
            line=6,
        ),
        Invalid(
            """
            import torch
            from accelerate import Accelerator
            accelerator = Accelerator()  # launched with an FSDP config
            optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
            model = accelerator.prepare(model)
            optimizer = accelerator.prepare(optimizer)
            """,
            line=4,
        ),
        Invalid(
            _HEAD + "decay = [p for n, p in model.named_parameters() if 'bias' not in n]\n"
            "opt = torch.optim.AdamW([{'params': decay}], lr=1e-4)\nopt2 = torch.optim.AdamW(model.parameters())\n"
            "model = FSDP(model, limit_all_gathers=True)",
            line=5,
        ),
        Invalid(
            _HEAD + "model = GPT(cfg).to(device)\noptimizer = model.configure_optimizers(0.1, 6e-4)\n"
            "if use_fsdp:\n    model = FSDP(model, device_id=rank)",
            line=4,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        shards: list[tuple[Site, str]] = [
            (w.site, w.inner)
            for w in wraps(model, FSDP_CLASSES)
            # use_orig_params=True keeps the module's own Parameter objects (their data becomes a view of
            # the shard): an optimizer built before takes the same step (measured by the probe)
            if w.inner is not None and not keyword_is(w.site.node, "use_orig_params", "True")
        ]
        shards.extend(sharded_in_place(model, FULLY_SHARD))
        if "fsdp" in model.source.lower():
            shards.extend(_prepared_alone(model))
        optimizers = [e.site for e in model.training.of_kind("optimizer")]
        optimizers.extend(_optimizers_from_models(model))
        reported: set[int] = set()
        for shard, inner in sorted(shards, key=lambda s: s[0].order):
            for site in optimizers:
                if (
                    id(site.node) in reported
                    or site.scope is not shard.scope
                    or site.order > shard.order
                    or not (mentions_parameters_of(site.node, inner) or inner in _models_of(site))
                    or _prepared_with(shard, site)
                    or exclusive(site.frames, shard.frames)
                ):
                    continue
                reported.add(id(site.node))
                yield Diagnostic(
                    site.node,
                    f"This optimizer is built over `{inner}`'s parameters before `{inner}` is sharded: "
                    "sharding replaces the parameters, so the optimizer updates tensors the model no "
                    "longer uses; build the optimizer after the wrap.",
                    related=((shard.node, "the model is sharded here", OptimizerBeforeSharding.SHARD),),
                )


def _prepared_alone(model: FileModel) -> Iterator[tuple[Site, str]]:
    """``accelerator.prepare(model, ...)`` calls, with the model's name (the first argument)."""
    for site in accelerate_prepare_calls(model):
        assert isinstance(site.node, cst.Call)
        args = positional(site.node)
        inner = dotted(args[0]) if args else None
        if inner:
            yield site, inner


def _prepared_with(shard: Site, optimizer: Site) -> bool:
    """The optimizer's bound name is an argument of the accelerate ``prepare`` call itself."""
    call = shard.node
    assert isinstance(call, cst.Call)
    if attr_name(call) != "prepare":
        return False
    statement = optimizer.statement
    names: set[str] = set()
    if isinstance(statement, cst.SimpleStatementLine):
        for small in statement.body:
            if isinstance(small, cst.Assign) and small.value is optimizer.node:
                names.update(n for n in (dotted(t.target) for t in small.targets) if n)
    return any(dotted(arg) in names for arg in positional(call))


def _models_of(site: Site) -> set[str]:
    """For an optimizer a model builds (``model.configure_optimizers(...)``) or a factory is given
    (``build_optimizer(model, cfg)``, ``self.make_optimizer(self.model)``), the names it may be built
    over: the receiver and the first argument."""
    call = site.node
    assert isinstance(call, cst.Call)
    args = positional(call)
    names = {dotted(call.func.value) if isinstance(call.func, cst.Attribute) else None}
    names.add(dotted(args[0]) if args else None)
    return {n for n in names if n}


def _optimizers_from_models(model: FileModel) -> Iterator[Site]:
    """Calls whose result is bound to an optimizer's name (``optimizer``, ``self.opt``) and that are
    given a model to build it over: the construction is in a method or a factory out of sight."""
    for site in model.calls:
        if _models_of(site) and any(
            OPTIMIZER_NAME.match(name.rsplit(".", 1)[-1]) for name in assigned_names(site)
        ):
            yield site
