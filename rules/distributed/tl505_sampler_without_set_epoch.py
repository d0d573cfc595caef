"""TL505 sampler-without-set-epoch."""

from __future__ import annotations

import re
from collections.abc import Iterator

import libcst as cst

from trainlint.api import Diagnostic, Invalid, Rule, RuleDoc, Severity
from trainlint.model import FileModel, Site, dotted, first_arg, keyword, literal_false, walk
from trainlint.model.vocab import DISTRIBUTED_SAMPLERS

EPOCH_WORDS = ("epoch", "Epoch", "EPOCH")
EVALUATION_WORDS = frozenset({"eval", "val", "valid", "validation", "test", "dev", "evaluation"})


class SamplerWithoutSetEpoch(Rule):
    id = "TL505"
    name = "sampler-without-set-epoch"
    severity = Severity.WARNING
    probe = True
    EPOCH_LOOP = "epoch-loop"
    summary = "A shuffling DistributedSampler feeds a loop over epochs, but set_epoch() is never called."
    # A finding needs the sampler class (its imported name contains `DistributedSampler`) and a loop
    # whose target or iterable names an epoch.
    tokens = ("DistributedSampler",)
    requires = (EPOCH_WORDS,)
    # In the code: a call of torch's sampler class (called by that name, or under a name bound to it).
    # A file that says `set_epoch` anywhere gets no finding (``check`` returns first).
    gate = (("call:DistributedSampler", "alias:DistributedSampler"), ("import:torch",))
    # In the tree: a loop over epochs, and torch's sampler built without `shuffle=False` for data not
    # named for evaluation.
    gate_check = "gate_distributed_misc.shuffling_sampler_and_epoch_loop"
    excludes = ("set_epoch",)
    doc = RuleDoc(
        what=(
            "Reports a `torch.utils.data.DistributedSampler(...)` that shuffles (no `shuffle=False`) in "
            "a file with a loop over epochs (its variable or iterable names an epoch) when the file "
            "never calls `set_epoch` (on the sampler, the loader's `.sampler`, or anything else). A "
            "sampler built anew inside the epoch loop with `seed=`, and one whose name or dataset's "
            "name says evaluation (`eval_sampler`, `val_dataset`), are not reported, nor one built in a "
            "helper function whose every caller in the file is named for evaluation (`get_loader` "
            "called only from `run_validation`). A training-named sampler passed to a validation "
            "helper is still reported."
        ),
        why=(
            "DistributedSampler shuffles with the seed `seed + epoch`, and its epoch stays 0 until "
            "`set_epoch` changes it. Without the call every epoch draws the same permutation: with "
            "10 epochs over 50,000 examples on 8 ranks, each rank sees the same 6,250 examples in the "
            "same order ten times, the batches never mix differently, and the loss curve shows the "
            "same per-batch pattern each epoch. Nothing fails; generalisation is a little worse and "
            "runs with different epoch counts are not comparable."
        ),
        example=(
            "sampler = DistributedSampler(dataset)\n"
            "loader = DataLoader(dataset, batch_size=32, sampler=sampler)\n"
            "for epoch in range(epochs):\n"
            "    for batch in loader:\n"
            "        train_step(batch)"
        ),
        use_instead=(
            "sampler = DistributedSampler(dataset)\n"
            "loader = DataLoader(dataset, batch_size=32, sampler=sampler)\n"
            "for epoch in range(epochs):\n"
            "    sampler.set_epoch(epoch)\n"
            "    for batch in loader:\n"
            "        train_step(batch)"
        ),
        references=(
            "https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler",
        ),
    )
    _HEAD = "from torch.utils.data import DataLoader, DistributedSampler\n"
    valid = (
        # set_epoch present
        _HEAD + "sampler = DistributedSampler(ds)\nloader = DataLoader(ds, sampler=sampler)\n"
        "for epoch in range(10):\n    sampler.set_epoch(epoch)\n    for b in loader:\n        step(b)",
        # through the loader
        _HEAD + "loader = DataLoader(ds, sampler=DistributedSampler(ds))\n"
        "for epoch in range(10):\n    loader.sampler.set_epoch(epoch)\n    for b in loader:\n        step(b)",
        # no shuffling: the order is meant to be fixed
        _HEAD + "sampler = DistributedSampler(ds, shuffle=False)\nloader = DataLoader(ds, sampler=sampler)\n"
        "for epoch in range(10):\n    for b in loader:\n        step(b)",
        # one pass, no loop over epochs
        _HEAD + "sampler = DistributedSampler(ds)\nfor b in DataLoader(ds, sampler=sampler):\n    step(b)",
        # a new sampler each epoch, seeded by the epoch
        _HEAD + "for epoch in range(10):\n    sampler = DistributedSampler(ds, seed=epoch)\n"
        "    for b in DataLoader(ds, sampler=sampler):\n        step(b)",
        # an evaluation sampler: its order does not matter
        _HEAD + "train_sampler = DistributedSampler(train_ds)\neval_sampler = DistributedSampler(eval_ds)\n"
        "for epoch in range(3):\n    train_sampler.set_epoch(epoch)\n    run(train_sampler)\n    evaluate(eval_sampler)",
        _HEAD + "sampler = DistributedSampler(val_dataset)\nfor epoch in range(3):\n    evaluate(sampler)",
        # built in a loader helper that only the validation pass calls
        _HEAD + "def make_loader(ds, bs):\n    picker = DistributedSampler(ds)\n"
        "    return DataLoader(ds, batch_size=bs, sampler=picker)\n"
        "def run_validation(net, holdout):\n    for b in make_loader(holdout, 4):\n        score(net, b)\n"
        "for epoch in range(5):\n    fit(net)\n    run_validation(net, holdout)",
        # some other sampler class of the same name
        """
        from mylib.samplers import DistributedSampler
        sampler = DistributedSampler(ds)
        for epoch in range(10):
            run(sampler)
        """,
        # the set_epoch call in a helper
        _HEAD + "def start_epoch(loader, epoch):\n    loader.sampler.set_epoch(epoch)\n"
        "sampler = DistributedSampler(ds)\nfor epoch in range(10):\n    start_epoch(loader, epoch)",
    )
    invalid = (
        Invalid(
            _HEAD + "sampler = DistributedSampler(ds)\nloader = DataLoader(ds, sampler=sampler)\n"
            "for epoch in range(10):\n    for b in loader:\n        step(b)",
            line=2,
        ),
        Invalid(
            _HEAD + "loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, shuffle=True))\n"
            "for epoch in range(args.epochs):\n    train_one_epoch(loader)",
            line=2,
        ),
        Invalid(
            """
            import torch
            sampler = torch.utils.data.distributed.DistributedSampler(train_set, num_replicas=world, rank=rank)
            loader = torch.utils.data.DataLoader(train_set, sampler=sampler)
            for ep in range(num_epochs):
                for x, y in loader:
                    opt.step()
            """,
            line=2,
        ),
        Invalid(
            """
            from torch.utils.data.distributed import DistributedSampler

            class Trainer:
                def __init__(self, ds):
                    self.loader = DataLoader(ds, sampler=DistributedSampler(ds))

                def fit(self, max_epochs):
                    for epoch in range(max_epochs):
                        self._run_epoch(epoch)
            """,
            line=5,
        ),
        Invalid(
            _HEAD + "sampler = DistributedSampler(ds, shuffle=cfg.shuffle)\n"
            "epoch = 0\nwhile epoch < cfg.epochs:\n    run(sampler)\n    epoch += 1",
            line=2,
        ),
        Invalid(
            _HEAD
            + "sampler = DistributedSampler(ds)\nfor i, epoch in enumerate(range(start_epoch, epochs)):\n"
            "    for b in DataLoader(ds, sampler=sampler):\n        step(b)",
            line=2,
        ),
        # the same loader helper, called by the training pass as well
        Invalid(
            _HEAD + "def make_loader(ds, bs):\n    picker = DistributedSampler(ds)\n"
            "    return DataLoader(ds, batch_size=bs, sampler=picker)\n"
            "def run_validation(net, holdout):\n    return [score(net, b) for b in make_loader(holdout, 4)]\n"
            "def fit(net, ds):\n    for b in make_loader(ds, 32):\n        step(net, b)\n"
            "for epoch in range(5):\n    fit(net, ds)\n    run_validation(net, holdout)",
            line=3,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        samplers = model.calls_to(*DISTRIBUTED_SAMPLERS)
        if not samplers or "set_epoch" in model.source:
            return
        loops = [node for node in walk(model.module) if _is_epoch_loop(node)]
        if not loops:
            return
        for site in samplers:
            call = site.node
            assert isinstance(call, cst.Call)
            if (
                literal_false(keyword(call, "shuffle"))
                or _reseeded_per_epoch(site, call, loops)
                or _for_evaluation(site, call)
                or _built_for_evaluation_only(model, site)
            ):
                continue
            yield Diagnostic(
                call,
                "This DistributedSampler shuffles, but `set_epoch` is never called: every epoch gets "
                "the same order; call `sampler.set_epoch(epoch)` at the start of each epoch.",
                related=((loops[0], "the loop over epochs", SamplerWithoutSetEpoch.EPOCH_LOOP),),
            )


def _names_epoch(node: cst.CSTNode) -> bool:
    return any(
        isinstance(n, cst.Name | cst.Attribute) and "epoch" in (dotted(n) or "").lower() for n in walk(node)
    )


def _is_epoch_loop(node: cst.CSTNode) -> bool:
    if isinstance(node, cst.For):
        return _names_epoch(node.target) or _names_epoch(node.iter)
    if isinstance(node, cst.While):
        return _names_epoch(node.test)
    return False


def _for_evaluation(site: Site, call: cst.Call) -> bool:
    """The sampler or its dataset is named for evaluation (``eval_sampler``, ``val_dataset``): the
    order of an evaluation pass does not matter."""
    names = [dotted(first_arg(call, "dataset")) or ""]
    statement = site.statement
    if isinstance(statement, cst.SimpleStatementLine):
        for small in statement.body:
            if isinstance(small, cst.Assign) and small.value is call:
                names.extend(dotted(t.target) or "" for t in small.targets)
    return any(_evaluation_name(name) for name in names)


def _built_for_evaluation_only(model: FileModel, site: Site) -> bool:
    """The sampler is built in a helper whose every caller in the file is named for evaluation
    (``get_loader`` called only from ``pretrain_validation``): an evaluation pass, whatever the
    sampler's own name says. A helper with no caller in the file is not known to be one."""
    scope = site.scope
    if scope.kind != "function" or not isinstance(scope.node, cst.FunctionDef):
        return False
    callers = [s for s in model.calls if model.local_callee(s) is scope.node]
    return bool(callers) and all(_evaluation_name(s.scope.name) for s in callers)


def _evaluation_name(name: str) -> bool:
    return bool({w for w in re.split(r"[._]", name.lower())} & EVALUATION_WORDS)


def _reseeded_per_epoch(site: Site, call: cst.Call, loops: list[cst.CSTNode]) -> bool:
    inside = any(frame.node is loop for frame in site.frames for loop in loops)
    return inside and keyword(call, "seed") is not None
