"""TL506 sharded-clip-local-norm."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import libcst as cst

from trainlint.api import Diagnostic, Invalid, Rule, RuleDoc, Severity
from trainlint.model import FileModel, dotted, first_arg
from trainlint.model.training import mentions_parameters_of
from trainlint.model.vocab import FSDP_CLASSES
from trainlint.rules.distributed._sharding import keyword_is, on_other_path, same_owner, wraps

# The clipping functions that compute a norm over the parameters they are given (clip_grad_value_
# clips each element by itself, which is correct on a shard).
NORM_CLIPS = ("clip_grad_norm_", "clip_grad_norm")


class ShardedClipLocalNorm(Rule):
    id = "TL506"
    name = "sharded-clip-local-norm"
    severity = Severity.ERROR
    probe = True
    WRAP = "wrap"
    summary = (
        "torch.nn.utils.clip_grad_norm_ on an FSDP1 model: each rank clips by the norm of its own shard."
    )
    # A finding needs `FullyShardedDataParallel(...)` and a `clip_grad_norm` call.
    tokens = ("FullyShardedDataParallel",)
    requires = (("clip_grad_norm",),)
    # In the tree: torch's clip_grad_norm_ over `<name>.parameters()` where <name> is an FSDP1 wrap's
    # target (not NO_SHARD) in the same scope (or class, for `self.` names).
    gate_check = "gate_distributed_misc.fsdp_model_clipped_by_torch"
    doc = RuleDoc(
        what=(
            "Reports `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` where `model` is bound "
            "to `FullyShardedDataParallel(...)` in the file. `model.clip_grad_norm_(...)` (FSDP's own "
            "method), FSDP2's `fully_shard` (its DTensor parameters make the torch function compute "
            "the global norm), `sharding_strategy=ShardingStrategy.NO_SHARD` (every rank holds the whole "
            "parameters) and `clip_grad_value_` are not reported, nor a torch clip on the other path "
            "of a branch that calls FSDP's method (`if self.fsdp: return "
            "self.model.clip_grad_norm_(1.0)` before it, or the `else:` of such an `if`). The "
            "tensor-parallel and "
            "pipeline-stage forms of the mistake (a local norm clipped without a reduction over the "
            "group) are not detected."
        ),
        why=(
            "Under FSDP1 each rank holds a shard of the flattened parameters, and the torch function "
            "computes the norm of what it is given: the local shard. Every rank then clips with a "
            "different, too small norm. With 8 ranks and gradients spread evenly, each local norm is "
            "about 1/sqrt(8) = 0.35 of the true one: with max_norm=1.0 and a true norm of 2.0, no "
            "rank clips (local 0.71) although the update should have been halved, and ranks whose "
            "shards differ clip by different factors, so the update is no longer a scaled gradient "
            "(torchtitan issue 596 for the tensor-parallel form)."
        ),
        example=(
            "model = FSDP(model)\n"
            "loss.backward()\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
            "opt.step()"
        ),
        use_instead=("model = FSDP(model)\nloss.backward()\nmodel.clip_grad_norm_(1.0)\nopt.step()"),
        references=(
            "https://pytorch.org/docs/stable/fsdp.html#torch.distributed.fsdp.FullyShardedDataParallel.clip_grad_norm_",
        ),
    )
    _HEAD = "import torch\nfrom torch.distributed.fsdp import FullyShardedDataParallel as FSDP\nmodel = FSDP(net)\n"
    valid = (
        # FSDP's own method
        _HEAD + "loss.backward()\nmodel.clip_grad_norm_(1.0)\nopt.step()",
        # a DDP model: replicated parameters, the local norm is the global one
        "import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
        "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
        # FSDP2: DTensor parameters, the torch function reduces over the mesh
        "import torch\nfrom torch.distributed.fsdp import fully_shard\nfully_shard(model)\n"
        "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
        # NO_SHARD: whole parameters on every rank, the local norm is the global one
        "import torch\nfrom torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy\n"
        "model = FSDP(net, sharding_strategy=ShardingStrategy.NO_SHARD)\n"
        "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
        # elementwise clipping is correct on a shard
        _HEAD + "torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)",
        # another module's parameters
        _HEAD + "torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)",
        # the FSDP model is another function's `model`
        _HEAD.replace("model = FSDP(net)", "def build(net):\n    model = FSDP(net)\n    return model")
        + "def train(model):\n    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
        # accelerate's clip_grad_norm_ dispatches to FSDP's method
        _HEAD + "accelerator.clip_grad_norm_(model.parameters(), 1.0)",
        # the FSDP case returns through FSDP's method: the torch function clips the plain model
        _HEAD + "def clip(use_fsdp):\n    if use_fsdp:\n        return model.clip_grad_norm_(1.0)\n"
        "    return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
    )
    invalid = (
        Invalid(_HEAD + "loss.backward()\ntorch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)", line=5),
        Invalid(
            "from torch.nn.utils import clip_grad_norm_\n"
            "from torch.distributed.fsdp import FullyShardedDataParallel\n"
            "sharded = FullyShardedDataParallel(net, use_orig_params=True)\n"
            "clip_grad_norm_(sharded.parameters(), max_norm=args.clip)",
            line=4,
        ),
        Invalid(
            """
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            class Trainer:
                def __init__(self, net):
                    self.model = FSDP(net)

                def step(self, loss):
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
                    self.opt.step()
            """,
            line=10,
        ),
        Invalid(
            _HEAD + "for b in loader:\n    scaler.scale(model(b)).backward()\n    scaler.unscale_(opt)\n"
            "    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n    scaler.step(opt)",
            line=7,
        ),
        Invalid(
            "import torch.nn as nn\nimport torch.distributed.fsdp as fsdp\nm = fsdp.FullyShardedDataParallel(net)\n"
            "nn.utils.clip_grad_norm_([p for p in m.parameters() if p.grad is not None], 1.0)",
            line=4,
        ),
        Invalid(
            _HEAD + "torch.nn.utils.clip_grad.clip_grad_norm_(model.parameters(), max_norm=0.5, norm_type=2)",
            line=4,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        # NO_SHARD keeps every parameter whole on every rank (DDP-like): the local norm is the global one
        wrapped = [
            w
            for w in wraps(model, FSDP_CLASSES)
            if not keyword_is(w.site.node, "sharding_strategy", "NO_SHARD")
        ]
        if not wrapped:
            return
        for event in model.training.of_kind("clip"):
            callee = model.callee(event.site) or ""
            if callee.rsplit(".", 1)[-1] not in NORM_CLIPS:
                continue
            params = first_arg(event.call, "parameters")
            if params is None:
                continue
            for wrap in wrapped:
                if (
                    same_owner(event.site.scope, wrap)
                    and mentions_parameters_of(params, wrap.outer)
                    and not on_other_path(model, event.site, _own_clip_of(wrap.outer))
                ):
                    yield Diagnostic(
                        event.call,
                        f"`{wrap.outer}` is wrapped in FSDP: this clips each rank's shard by its own "
                        f"norm, not the global one; call `{wrap.outer}.clip_grad_norm_(max_norm)`.",
                        related=((wrap.site.node, "wrapped in FSDP here", ShardedClipLocalNorm.WRAP),),
                    )
                    break


def _own_clip_of(outer: str) -> Callable[[cst.Call], bool]:
    """Accepts ``<outer>.clip_grad_norm_(...)``: FSDP's own method, whose branch is the FSDP path, so
    a torch clip on the other path runs on the plain model (``if self.fsdp: return
    self.policy.clip_grad_norm_(...)`` then ``torch.nn.utils.clip_grad_norm_(...)``)."""
    names = {f"{outer}.{clip}" for clip in NORM_CLIPS}
    return lambda call: isinstance(call, cst.Call) and dotted(call.func) in names
