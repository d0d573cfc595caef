"""TL502 token-mean-not-global."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from trainlint.api import Diagnostic, Invalid, Rule, RuleDoc, Severity, call_pattern
from trainlint.model import FileModel, Scope, Site, attr_name, walk
from trainlint.model.losses import division_reaches_backward, divisions, snippet
from trainlint.model.tokens import token_evidence
from trainlint.model.vocab import DATA_PARALLEL


class TokenMeanNotGlobal(Rule):
    id = "TL502"
    name = "token-mean-not-global"
    severity = Severity.WARNING
    probe = True
    summary = "A loss normalised by the local token count under data parallelism: ranks with fewer tokens weigh more."
    # Prefilter: a local count (a `sum`/`count_nonzero` call); a `/` (BinaryOperation divisions only);
    # a backward call (``call_pattern``); a summed or unreduced cross-entropy (its function
    # or class name, and `reduction=` or `size_average=`), or a loss read for its `ignore_index` (a
    # token mean built elsewhere, made a sum by multiplying with the count); a DATA_PARALLEL call or import.
    tokens = ("sum", "count_nonzero")
    requires = (
        call_pattern("sum", "count_nonzero"),
        ("/",),
        call_pattern("backward"),
        ("cross_entropy", "nll_loss", "CrossEntropyLoss", "NLLLoss", "ignore_index"),
        ("reduction", "size_average", "ignore_index"),
        (
            *("DistributedDataParallel", "init_process_group", "FullyShardedDataParallel", "fully_shard"),
            *("Accelerator", "initialize", "Fabric", "FSDPStrategy", "DDPStrategy"),
        ),
    )
    # In the tree: a `/` by what may be a local token count, a summed or unreduced loss, a backward
    # call and a data-parallel call or import.
    gate_check = "gate_distributed_misc.token_count_division_under_data_parallel"
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
        """
        import torch.nn.functional as F
        s = F.cross_entropy(x, y, reduction='sum')
        n = (y != -100).sum()
        (s / n).backward()
        """,
        # Accelerate: the count is gathered
        """
        from accelerate import Accelerator
        import torch.nn.functional as F
        accelerator = Accelerator()
        s = F.cross_entropy(x, y, reduction='sum')
        n = accelerator.gather((y != -100).sum()).sum()
        accelerator.backward(s / n)
        """,
        # only logged
        _DP + "s = F.cross_entropy(x, y, reduction='sum')\nppl = (s / (y != -100).sum()).exp().item()",
        # a mean cross-entropy (not a division by a count)
        _DP + "loss = F.cross_entropy(x, y, ignore_index=-100)\nloss.backward()",
        # the count was all-reduced under another name first
        _DP + "n_local = mask.sum()\ntotal = n_local.clone()\ndist.all_reduce(total)\n"
        "per_tok = F.cross_entropy(x, y, reduction='none')\n((per_tok * mask).sum() / total).backward()",
        # the same recipe with the running count all-reduced before the division
        """
        import torch
        from mylib import config

        class Recipe:
            def setup(self, cfg):
                self.model = torch.distributed.fsdp.fully_shard(self.model)
                self.loss_fn = config.instantiate(cfg.loss)

            def train(self, loader):
                total, count = 0, 0
                for i, batch in enumerate(loader):
                    n = (batch["labels"] != self.loss_fn.ignore_index).sum()
                    count += n
                    total += self.loss_fn(self.model(batch["ids"]), batch["labels"]) * n
                    if (i + 1) % self.accum == 0:
                        torch.distributed.all_reduce(count)
                        loss = total / count
                        loss.backward()
        """,
        # divided by the batch size, not a token count
        _DP + "s = F.cross_entropy(x, y, reduction='sum')\n(s / x.size(0)).backward()",
    )
    invalid = (
        # a config-built token-mean loss scaled back to a sum and summed over the window, then
        # divided by this rank's running count of valid tokens
        Invalid(
            """
            import torch
            from mylib import config, fsdp_wrap

            class Recipe:
                def setup(self, cfg):
                    self.model = fsdp_wrap(torch.distributed.fsdp.fully_shard(self.model))
                    self.loss_fn = config.instantiate(cfg.loss)

                def train(self, loader):
                    total, count = 0, 0
                    for i, batch in enumerate(loader):
                        n = (batch["labels"] != self.loss_fn.ignore_index).sum()
                        count += n
                        total += self.loss_fn(self.model(batch["ids"]), batch["labels"]) * n
                        if (i + 1) % self.accum == 0:
                            loss = total / count
                            loss.backward()
                            total, count = 0, 0
            """,
            line=16,
        ),
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
            """
            from torch.nn.parallel import DistributedDataParallel as DDP
            import torch.nn.functional as F
            model = DDP(net)
            logp = F.log_softmax(model(x), -1)
            nll = F.nll_loss(logp.flatten(0, 1), y.flatten(), reduction='sum')
            scaler.scale(nll / torch.count_nonzero(y != pad)).backward()
            """,
            line=6,
        ),
        Invalid(
            """
            from accelerate import Accelerator
            import torch.nn.functional as F
            accelerator = Accelerator()
            for batch in loader:
                lab = batch['labels']
                tok_loss = F.cross_entropy(model(batch).transpose(1, 2), lab, reduction='none')
                mask = lab != -100
                loss = (tok_loss * mask).sum() / mask.sum().clamp(min=1)
                accelerator.backward(loss)
            """,
            line=8,
        ),
        Invalid(
            """
            import lightning as L
            from torch import nn
            fabric = L.Fabric(devices=8)
            crit = nn.CrossEntropyLoss(reduction='sum', ignore_index=-100)
            num_tokens = batch['attention_mask'].sum()
            loss = crit(logits.view(-1, V), labels.view(-1)) / num_tokens
            fabric.backward(loss)
            """,
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
            """
            import torch
            import torch.nn.functional as F
            from torch.nn.parallel import DistributedDataParallel
            model = DistributedDataParallel(net)
            s = F.nll_loss(F.log_softmax(model(x), -1).flatten(0, 1), y.flatten(), reduction='sum', ignore_index=pad)
            loss = s / (y != pad).sum()
            loss.backward()
            """,
            line=6,
        ),
        # FSDP, token count through float()
        Invalid(
            """
            import torch
            import torch.nn.functional as F
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            model = FSDP(net)
            per_tok = F.cross_entropy(model(x).transpose(1, 2), y, reduction='none')
            n = float(mask.sum())
            loss = (per_tok * mask).sum() / n
            loss.backward()
            """,
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
