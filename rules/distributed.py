"""TL5xx: data parallelism (gradient synchronisation during accumulation, global token normalisation)."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from trainlint.evidence import innermost_loop, is_step_count_name, token_evidence
from trainlint.model import FileModel, Scope, Site, attr_name, dotted, walk, walk_scope
from trainlint.rule import Diagnostic, Invalid, Rule, RuleDoc, Severity, call_pattern
from trainlint.rules.accumulation import division_reaches_backward, divisions, snippet

DDP_CLASSES = frozenset(
    {
        "torch.nn.parallel.DistributedDataParallel",
        "torch.nn.parallel.distributed.DistributedDataParallel",
        "torch.nn.DistributedDataParallel",
    }
)
# Anything in the scope that controls DDP's gradient synchronisation during accumulation.
SYNC_CONTROLS = frozenset(
    {"no_sync", "no_backward_sync", "require_backward_grad_sync", "accumulate", "skip_sync", "sync_gradients"}
)
# Calls that make a count global: collective reductions of torch.distributed, Accelerate, Fabric.
GLOBAL_REDUCTIONS = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "reduce",
        "gather",
        "gather_for_metrics",
        "all_reduce_coalesced",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "sync_across_processes",
    }
)
# Signs that the file trains with more than one process.
DATA_PARALLEL = frozenset(
    {
        "torch.nn.parallel.DistributedDataParallel",
        "torch.nn.parallel.distributed.DistributedDataParallel",
        "torch.distributed.init_process_group",
        "torch.distributed.fsdp.FullyShardedDataParallel",
        "torch.distributed.fsdp.fully_shard",
        "torch.distributed._composable.fsdp.fully_shard",
        "accelerate.Accelerator",
        "deepspeed.initialize",
        "lightning.Fabric",
        "lightning.fabric.Fabric",
        "lightning.fabric.strategies.FSDPStrategy",
        "lightning.fabric.strategies.DDPStrategy",
    }
)


def _ddp_models(model: FileModel) -> set[str]:
    """Dotted names bound to a ``DistributedDataParallel(...)`` anywhere in the file."""
    out = set()
    for site in model.calls_to(*DDP_CLASSES):
        statement = site.statement
        if isinstance(statement, cst.SimpleStatementLine):
            for small in statement.body:
                if isinstance(small, cst.Assign | cst.AnnAssign) and small.value is site.node:
                    targets = (
                        [t.target for t in small.targets] if isinstance(small, cst.Assign) else [small.target]
                    )
                    out.update(k for k in (dotted(t) for t in targets) if k)
    return out


def _mentions_sync_control(scope: Scope) -> bool:
    for node in walk_scope(scope.node):
        if isinstance(node, cst.Attribute) and node.attr.value in SYNC_CONTROLS:
            return True
        if isinstance(node, cst.Name) and node.value in SYNC_CONTROLS:
            return True
    return False


class DdpAccumulationWithoutNoSync(Rule):
    id = "TL501"
    name = "ddp-accumulation-without-no-sync"
    severity = Severity.WARNING
    probe = "tl501"
    summary = "Gradient accumulation on a DistributedDataParallel model without no_sync(): all-reduce on every microbatch."
    # Prefilter: a `DistributedDataParallel(...)` call (its imported name is in the text even when it
    # is called as `DDP`), and backward and step method calls (events).
    tokens = ("DistributedDataParallel", "DDP")
    requires = (
        ("DistributedDataParallel",),
        call_pattern("backward"),
        call_pattern("step"),
    )
    doc = RuleDoc(
        what=(
            "Reports the backward of a gradient-accumulation loop (the optimizer steps only under an "
            "accumulation condition, or after a `for micro_step in range(accum_steps)` loop) on a "
            "model wrapped in `torch.nn.parallel.DistributedDataParallel` in this file, when nothing "
            "in the scope controls gradient synchronisation: no `model.no_sync()` (directly or through "
            "a variable), no `require_backward_grad_sync`, no `accelerator.accumulate` / "
            "`accelerator.no_sync`, no Fabric `no_backward_sync`."
        ),
        why=(
            "DDP all-reduces the gradients during every backward. Inside an accumulation window only "
            "the last all-reduce matters, since the earlier ones are summed over again. With 8 "
            "microbatches per step and a 1B-parameter model in fp32, each backward sends 4 GB "
            "through the all-reduce: 32 GB per optimizer step where 4 GB would do, and on a slow "
            "interconnect communication then dominates the step time. The result is the same, so "
            "nothing looks wrong except the speed."
        ),
        example=(
            "model = DDP(model, device_ids=[rank])\n"
            "for i, batch in enumerate(loader):\n"
            "    loss = model(batch).loss / accum\n"
            "    loss.backward()\n"
            "    if (i + 1) % accum == 0:\n"
            "        optimizer.step()\n"
            "        optimizer.zero_grad()"
        ),
        use_instead=(
            "model = DDP(model, device_ids=[rank])\n"
            "for i, batch in enumerate(loader):\n"
            "    last = (i + 1) % accum == 0\n"
            "    with contextlib.nullcontext() if last else model.no_sync():\n"
            "        loss = model(batch).loss / accum\n"
            "        loss.backward()\n"
            "    if last:\n"
            "        optimizer.step()\n"
            "        optimizer.zero_grad()"
        ),
        references=(
            "https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html",
        ),
    )
    _HEAD = "import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net, device_ids=[rank])\n"
    valid = (
        # no_sync for the non-final microbatches
        _HEAD
        + "for i, b in enumerate(loader):\n    ctx = model.no_sync() if (i + 1) % accum else nullcontext()\n"
        "    with ctx:\n        model(b).loss.backward()\n    if (i + 1) % accum == 0:\n        opt.step()\n        opt.zero_grad()",
        # nanoGPT: require_backward_grad_sync toggled by hand
        _HEAD + "for micro_step in range(gradient_accumulation_steps):\n"
        "    model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)\n"
        "    logits, loss = model(X, Y)\n    scaler.scale(loss).backward()\nscaler.step(opt)\nscaler.update()",
        # model.no_sync through a variable (Accelerate's autoregressive example)
        _HEAD + "for i, b in enumerate(window):\n"
        "    ctx = model.no_sync if i < len(window) - 1 else contextlib.nullcontext\n"
        "    with ctx():\n        accelerator.backward(model(**b).loss)\nopt.step()",
        # no accumulation: one backward per step
        _HEAD + "for b in loader:\n    model(b).loss.backward()\n    opt.step()\n    opt.zero_grad()",
        # not DDP: a single-process model
        "import torch\nfor i, b in enumerate(loader):\n    model(b).loss.backward()\n"
        "    if (i + 1) % accum == 0:\n        opt.step()",
        # Accelerate handles synchronisation inside accumulate()
        _HEAD
        + "for b in loader:\n    with accelerator.accumulate(model):\n        accelerator.backward(model(b).loss)\n"
        "        if accelerator.sync_gradients:\n            opt.step()",
        # Fabric's no_backward_sync
        _HEAD + "for it, b in enumerate(loader):\n    is_accumulating = (it + 1) % accum != 0\n"
        "    with fabric.no_backward_sync(model, enabled=is_accumulating):\n        fabric.backward(model(b))\n"
        "    if not is_accumulating:\n        opt.step()",
    )
    invalid = (
        Invalid(
            _HEAD + "for i, b in enumerate(loader):\n    loss = model(b).loss / accum\n    loss.backward()\n"
            "    if (i + 1) % accum == 0:\n        opt.step()\n        opt.zero_grad()",
            line=6,
        ),
        # nanoGPT's micro-step loop without the toggle
        Invalid(
            _HEAD + "while True:\n    for micro_step in range(gradient_accumulation_steps):\n"
            "        logits, loss = model(X, Y)\n        scaler.scale(loss / gradient_accumulation_steps).backward()\n"
            "    scaler.step(opt)\n    scaler.update()\n    opt.zero_grad(set_to_none=True)",
            line=7,
        ),
        Invalid(
            "import torch\n\nclass Trainer:\n    def __init__(self, net):\n"
            "        self.model = torch.nn.parallel.DistributedDataParallel(net)\n\n"
            "    def train(self, loader):\n        for step, batch in enumerate(loader):\n"
            "            out = self.model(batch)\n            self.scaler.scale(out.loss).backward()\n"
            "            if step % self.args.gradient_accumulation_steps == 0:\n"
            "                self.scaler.step(self.optimizer)\n                self.scaler.update()",
            line=10,
        ),
        # a flag computed from a modulo
        Invalid(
            _HEAD + "for it, b in enumerate(loader):\n    is_update = (it + 1) % accum == 0\n"
            "    model(b).sum().backward()\n    if is_update:\n        opt.step()",
            line=6,
        ),
        # the DDP model passed into a training function
        Invalid(
            "from torch.nn.parallel import DistributedDataParallel\n\ndef main():\n"
            "    model = DistributedDataParallel(Net().cuda())\n    train(model)\n\n"
            "def train(model):\n    for i, (x, y) in enumerate(loader):\n"
            "        F.cross_entropy(model(x), y).backward()\n        if (i + 1) % n == 0:\n            opt.step()",
            line=9,
        ),
        # a counter reset
        Invalid(
            _HEAD + "count = 0\nfor b in loader:\n    model(b).loss.backward()\n    count += 1\n"
            "    if count == accum_steps:\n        opt.step()\n        count = 0",
            line=6,
        ),
    )

    valid = (
        *valid,
        # DeepSpeed's engine accumulates and synchronises by itself
        "import deepspeed\nengine, opt, _, _ = deepspeed.initialize(model=net, config=cfg)\n"
        "for b in loader:\n    loss = engine(b)\n    engine.backward(loss)\n    engine.step()",
    )
    invalid = (
        *invalid,
        # the HF no_trainer condition: every N steps or at the end of the epoch
        Invalid(
            _HEAD + "for step, batch in enumerate(loader):\n    outputs = model(**batch)\n"
            "    (outputs.loss / args.gradient_accumulation_steps).backward()\n"
            "    if step % args.gradient_accumulation_steps == 0 or step == len(loader) - 1:\n"
            "        opt.step()\n        lr_scheduler.step()\n        opt.zero_grad()",
            line=6,
        ),
        # the step every N micro-batches with a scaler
        Invalid(
            _HEAD + "scaler = torch.cuda.amp.GradScaler()\nfor i, (x, y) in enumerate(loader):\n"
            "    with torch.autocast('cuda'):\n        loss = F.cross_entropy(model(x), y) / grad_accum\n"
            "    scaler.scale(loss).backward()\n    if (i + 1) % grad_accum == 0:\n"
            "        scaler.step(opt)\n        scaler.update()\n        opt.zero_grad()",
            line=8,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        wrapped = _ddp_models(model)
        if not wrapped:
            return
        training = model.training
        checked: dict[int, bool] = {}
        for backward in training.of_kind("backward", "scaled_backward"):
            scope = backward.site.scope
            if id(scope) not in checked:
                checked[id(scope)] = self._uses_ddp(scope, wrapped) and not _mentions_sync_control(scope)
            if not checked[id(scope)]:
                continue
            step = self._accumulation_step(model, backward.site)
            if step is None:
                continue
            yield Diagnostic(
                backward.call,
                "This backward of a DistributedDataParallel model runs on every microbatch of an "
                "accumulation window, so gradients are all-reduced each time; run the non-final "
                "microbatches' forward and backward inside `model.no_sync()`.",
                related=((step.node, "the optimizer steps once per window here"),),
            )

    @staticmethod
    def _uses_ddp(scope: Scope, wrapped: set[str]) -> bool:
        for node in walk_scope(scope.node):
            if isinstance(node, cst.Call) and dotted(node.func) in wrapped:
                return True
        return False

    @staticmethod
    def _accumulation_step(model: FileModel, backward: Site) -> Site | None:
        """The optimizer step that makes ``backward`` part of an accumulation window, or None."""
        training = model.training
        loop = innermost_loop(backward)
        steps = training.events_in(backward.scope, "step", "scaler_step")
        if loop is None:
            return None
        for step in steps:
            # shape 1: step under an accumulation condition in the backward's loop
            if any(f.node is loop.node for f in step.site.frames):
                condition = training.under_accumulation(step.site, loop.node)
                if condition is not None and not any(f.node is condition.node for f in backward.frames):
                    return step.site
        # shape 2: a micro-step loop over the accumulation count, the step after it
        if isinstance(loop.node, cst.For) and any(
            isinstance(n, cst.Name | cst.Attribute)
            and is_step_count_name((dotted(n) or "").rsplit(".", 1)[-1])
            for n in walk(loop.node.iter)
        ):
            for step in steps:
                if step.order > backward.order and not any(f.node is loop.node for f in step.site.frames):
                    return step.site
        return None


class TokenMeanNotGlobal(Rule):
    id = "TL502"
    name = "token-mean-not-global"
    severity = Severity.WARNING
    probe = "tl502"
    summary = "A loss normalised by the local token count under data parallelism: ranks with fewer tokens weigh more."
    # Prefilter: a local count (a `sum`/`count_nonzero` call); a `/` (BinaryOperation divisions only);
    # a backward call (``call_pattern``); a summed or unreduced cross-entropy (its function
    # or class name, and `reduction=` or `size_average=`); a DATA_PARALLEL call or import.
    tokens = ("sum", "count_nonzero")
    requires = (
        call_pattern("sum", "count_nonzero"),
        ("/",),
        call_pattern("backward"),
        ("cross_entropy", "nll_loss", "CrossEntropyLoss", "NLLLoss"),
        ("reduction", "size_average"),
        (
            *("DistributedDataParallel", "init_process_group", "FullyShardedDataParallel", "fully_shard"),
            *("Accelerator", "initialize", "Fabric", "FSDPStrategy", "DDPStrategy"),
        ),
    )
    doc = RuleDoc(
        what=(
            "Reports, in a file that trains with several processes (DistributedDataParallel, "
            "`torch.distributed.init_process_group`, FSDP, Accelerate, Fabric, DeepSpeed), a summed or "
            "per-token loss divided by a token count computed on this rank (`mask.sum()`, "
            "`(labels != -100).sum()`, `count_nonzero`) that is never all-reduced or gathered, when "
            "the result is backpropagated."
        ),
        why=(
            "DDP averages the ranks' gradients with equal weight. If each rank first divides its "
            "summed loss by its own token count, a rank holding 100 valid tokens and a rank holding "
            "900 both contribute with weight 1/2: each token of the first rank counts 1/(2*100) = "
            "0.005, each of the second 1/(2*900) = 0.00056, nine times less, where the global mean "
            "gives every token 1/1000. Short sequences and heavily masked batches dominate the update."
        ),
        example=(
            "loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction='sum')\n"
            "n_tokens = (labels != -100).sum()\n"
            "loss = loss_sum / n_tokens\n"
            "loss.backward()"
        ),
        use_instead=(
            "loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction='sum')\n"
            "n_tokens = (labels != -100).sum()\n"
            "torch.distributed.all_reduce(n_tokens)\n"
            "loss = loss_sum * world_size / n_tokens  # DDP divides by world_size again\n"
            "loss.backward()"
        ),
        references=("https://huggingface.co/blog/gradient_accumulation",),
    )
    _DP = "import torch\nimport torch.nn.functional as F\nimport torch.distributed as dist\ndist.init_process_group('nccl')\n"
    valid = (
        _DP + "s = F.cross_entropy(x, y, reduction='sum')\nn = (y != -100).sum()\ndist.all_reduce(n)\n"
        "(s * dist.get_world_size() / n).backward()",
        # single process
        "import torch.nn.functional as F\ns = F.cross_entropy(x, y, reduction='sum')\nn = (y != -100).sum()\n"
        "(s / n).backward()",
        # Accelerate: the count is gathered
        "from accelerate import Accelerator\nimport torch.nn.functional as F\naccelerator = Accelerator()\n"
        "s = F.cross_entropy(x, y, reduction='sum')\nn = accelerator.gather((y != -100).sum()).sum()\n"
        "accelerator.backward(s / n)",
        # only logged
        _DP + "s = F.cross_entropy(x, y, reduction='sum')\nppl = (s / (y != -100).sum()).exp().item()",
        # a mean cross-entropy (not a division by a count)
        _DP + "loss = F.cross_entropy(x, y, ignore_index=-100)\nloss.backward()",
        # the count was all-reduced under another name first
        _DP + "n_local = mask.sum()\ntotal = n_local.clone()\ndist.all_reduce(total)\n"
        "per_tok = F.cross_entropy(x, y, reduction='none')\n((per_tok * mask).sum() / total).backward()",
        # divided by the batch size, not a token count
        _DP + "s = F.cross_entropy(x, y, reduction='sum')\n(s / x.size(0)).backward()",
    )
    invalid = (
        Invalid(
            _DP + "s = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction='sum')\n"
            "n = (labels != -100).sum()\nloss = s / n\nloss.backward()",
            line=7,
        ),
        Invalid(
            _DP + "per_tok = F.cross_entropy(x, y, reduction='none')\n"
            "loss = (per_tok * mask).sum() / mask.sum()\nloss.backward()",
            line=6,
        ),
        Invalid(
            "from torch.nn.parallel import DistributedDataParallel as DDP\nimport torch.nn.functional as F\n"
            "model = DDP(net)\nlogp = F.log_softmax(model(x), -1)\n"
            "nll = F.nll_loss(logp.flatten(0, 1), y.flatten(), reduction='sum')\n"
            "scaler.scale(nll / torch.count_nonzero(y != pad)).backward()",
            line=6,
        ),
        Invalid(
            "from accelerate import Accelerator\nimport torch.nn.functional as F\naccelerator = Accelerator()\n"
            "for batch in loader:\n    lab = batch['labels']\n"
            "    tok_loss = F.cross_entropy(model(batch).transpose(1, 2), lab, reduction='none')\n"
            "    mask = lab != -100\n    loss = (tok_loss * mask).sum() / mask.sum().clamp(min=1)\n"
            "    accelerator.backward(loss)",
            line=8,
        ),
        Invalid(
            "import lightning as L\nfrom torch import nn\nfabric = L.Fabric(devices=8)\n"
            "crit = nn.CrossEntropyLoss(reduction='sum', ignore_index=-100)\n"
            "num_tokens = batch['attention_mask'].sum()\nloss = crit(logits.view(-1, V), labels.view(-1)) / num_tokens\n"
            "fabric.backward(loss)",
            line=6,
        ),
        Invalid(
            _DP
            + "def step(model, batch):\n    per_tok = F.cross_entropy(model(batch.x), batch.y, reduction='none')\n"
            "    valid = batch.y.ne(-100)\n    n = valid.sum()\n    loss = (per_tok * valid).sum() / n\n"
            "    loss.backward()",
            line=9,
        ),
    )

    valid = (
        *valid,
        # the count of the whole window, all-reduced before the window's first backward
        _DP + "n = sum((b['labels'] != -100).sum() for b in window)\ndist.all_reduce(n)\nfor b in window:\n"
        "    s = F.cross_entropy(model(b).flatten(0, 1), b['labels'].flatten(), reduction='sum')\n"
        "    (s * dist.get_world_size() / n).backward()",
    )
    invalid = (
        *invalid,
        # a summed NLL divided by a count of non-pad targets, DDP model
        Invalid(
            "import torch\nimport torch.nn.functional as F\nfrom torch.nn.parallel import DistributedDataParallel\n"
            "model = DistributedDataParallel(net)\n"
            "s = F.nll_loss(F.log_softmax(model(x), -1).flatten(0, 1), y.flatten(), reduction='sum', ignore_index=pad)\n"
            "loss = s / (y != pad).sum()\nloss.backward()",
            line=6,
        ),
        # FSDP, token count through float()
        Invalid(
            "import torch\nimport torch.nn.functional as F\nfrom torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
            "model = FSDP(net)\nper_tok = F.cross_entropy(model(x).transpose(1, 2), y, reduction='none')\n"
            "n = float(mask.sum())\nloss = (per_tok * mask).sum() / n\nloss.backward()",
            line=7,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        if not self._data_parallel(model):
            return
        evidence = None
        for division in divisions(model):
            if not isinstance(division.node, cst.BinaryOperation):
                continue
            scope = division.site.scope
            if evidence is None:
                evidence = token_evidence(model)
            if not evidence.is_local_token_count(division.divisor, scope, division.site):
                continue
            origin = evidence.loss_origin(division.dividend, scope, division.site)
            if origin is None or origin.reduction not in ("sum", "none"):
                continue
            if self._made_global(model, division.divisor, scope, division.site):
                continue
            if not division_reaches_backward(model, division):
                continue
            yield Diagnostic(
                division.node,
                f"{snippet(model, division.divisor, 'This token count')} counts only this rank's tokens, "
                "so ranks with fewer tokens weigh more in the averaged gradient; all-reduce the count "
                "(and multiply the loss by the world size) before dividing.",
                related=((origin.node, origin.what),),
            )

    @staticmethod
    def _data_parallel(model: FileModel) -> bool:
        if model.calls_to(*DATA_PARALLEL):
            return True
        for scope in model.scopes:
            for bindings in scope.bindings.values():
                for b in bindings:
                    if b.kind == "import" and b.target in DATA_PARALLEL:
                        return True
        return False

    @staticmethod
    def _made_global(model: FileModel, divisor: cst.BaseExpression, scope: Scope, site: Site) -> bool:
        """A collective on the divisor (or on a name it is computed from) before the division, or the
        count computed from a collective's result."""
        names = {n.value for n in walk(divisor) if isinstance(n, cst.Name)}
        for node in walk(divisor):
            if isinstance(node, cst.Call) and attr_name(node) in GLOBAL_REDUCTIONS:
                return True
        # names the divisor is computed from, one assignment back
        for assign in model.assigns:
            if assign.scope is scope and assign.order < site.order and isinstance(assign.node, cst.Assign):
                if any(
                    isinstance(t.target, cst.Name) and t.target.value in names for t in assign.node.targets
                ):
                    value = assign.node.value
                    if any(
                        isinstance(n, cst.Call) and attr_name(n) in GLOBAL_REDUCTIONS for n in walk(value)
                    ):
                        return True
        for call in model.calls_in(scope):
            node = call.node
            assert isinstance(node, cst.Call)
            if call.order < site.order and attr_name(node) in GLOBAL_REDUCTIONS:
                if any(
                    isinstance(n, cst.Name) and n.value in names for a in node.args for n in walk(a.value)
                ):
                    return True
        return False
