"""TL3xx: gradient accumulation and the loss (normalisation over the accumulation window)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import libcst as cst

from trainlint.events import Event, in_grad_disabled_block, mentions_parameters_of
from trainlint.evidence import (
    LossOrigin,
    frames_inside,
    in_loop,
    innermost_loop,
    is_number,
    is_step_count_name,
    modulo_divisors,
    token_evidence,
)
from trainlint.model import (
    FileModel,
    Frame,
    Scope,
    Site,
    attr_name,
    children,
    dotted,
    positional,
    receiver,
    walk,
)
from trainlint.rule import (
    Applicability,
    Diagnostic,
    FixSpec,
    Invalid,
    Rule,
    RuleDoc,
    Severity,
    TextEditSpec,
    call_pattern,
)
from trainlint.rules.amp import (
    block_of,
    ends_file,
    line_indent,
    reindented,
    standalone_call,
    whole_lines,
)


@dataclass(frozen=True)
class Division:
    """``dividend / divisor`` at ``node`` (a BinaryOperation, an AugAssign or a ``.div`` call)."""

    node: cst.CSTNode
    dividend: cst.BaseExpression
    divisor: cst.BaseExpression
    site: Site
    target: str | None = None  # for ``x /= n``: the name divided in place


def _reciprocal(expr: cst.BaseExpression) -> cst.BaseExpression | None:
    """``n`` in ``1 / n`` or ``1.0 / n``."""
    if (
        isinstance(expr, cst.BinaryOperation)
        and isinstance(expr.operator, cst.Divide)
        and isinstance(expr.left, cst.Integer | cst.Float)
        and float(expr.left.evaluated_value) == 1.0
    ):
        return expr.right
    return None


class AccumulationMeanOfMeans(Rule):
    id = "TL301"
    name = "accumulation-mean-of-means"
    severity = Severity.WARNING
    probe = "tl301"
    summary = "A token-mean loss divided by the number of accumulation steps: microbatches weigh the same whatever their token counts."
    # Prefilter: a backward call (`backward_calls`); a division (`/`, `/=`, `* (1 / n)`, `.div(n)`); a
    # step-count divisor (`is_step_count_name` lower-cases: "acc"/"gas" in every letter case; a `%`
    # condition's divisor; a backslash for an escaped string key); padding evidence (one of the words
    # `TokenEvidence._scan` looks for in the raw text before walking, or a PADDING_DATA import/call).
    tokens = ("backward",)
    requires = (
        call_pattern("backward"),
        ("/", "div"),
        (
            *("acc", "Acc", "aCc", "acC", "ACc", "AcC", "aCC", "ACC"),
            *("gas", "Gas", "gAs", "gaS", "GAs", "GaS", "gAS", "GAS"),
            *("%", "\\"),
        ),
        (
            *("attention_mask", "pad_token", "pad_id", "pad_index", "padding", "pad_to_multiple_of"),
            *("pad_sequence", "pad_right", "pad_left", "mask_prompt", "loss_mask", "labels_mask"),
            *("label_mask", "ignore_index", "-100", "DataCollator", "SFTDataset", "get_sft_collate_fn"),
            *("Alpaca", "Deita", "Dolly", "FLAN", "JSON", "LIMA", "LongForm"),
        ),
    )
    doc = RuleDoc(
        what=(
            "Reports a loss that is a mean over a variable number of valid tokens and is then divided "
            "by the gradient-accumulation count: `loss / accum_steps`, `loss /= "
            "args.gradient_accumulation_steps`, `loss * (1 / n)`, `(loss / n).backward()`, "
            "`fabric.backward(loss / accum_iters)`. The loss counts as a token mean when it is a "
            "cross-entropy with `ignore_index` or over flattened sequence logits, a language model's "
            "`.loss`, or a sum divided by this microbatch's own token count; and the file shows that "
            "the number of valid tokens varies (padding, `-100` labels, `attention_mask`, "
            "`pad_token_id`, padding data collators, prompt masking).\n\n"
            "It is not reported for fixed-size examples (an image or sequence classifier divided by "
            "the count is exact), for language-model pretraining on fixed-length blocks with no "
            "padding or masking, for a sum-reduced loss, or for a loss already normalised by the "
            "window's token count (`num_items_in_batch`)."
        ),
        why=(
            "Averaging inside each microbatch and then averaging the microbatches is a mean of means: "
            "every microbatch gets the same total weight, however many tokens it holds. Take an "
            "accumulation window of two microbatches, one with 10 valid tokens and one with 1000 "
            "(a short answer next to a long one, after padding and prompt masking). Dividing each "
            "token mean by 2 gives each token of the small microbatch a weight of 1/(2*10) = 0.05 and "
            "each token of the large one 1/(2*1000) = 0.0005: a hundred times less. Training on the "
            "same 1010 tokens in one batch would weigh every token 1/1010 (about 0.001). The gradient "
            "is biased towards short sequences, and it changes with the micro-batch size, so "
            "changing the accumulation setting changes the model you get."
        ),
        example=(
            "for step, batch in enumerate(loader):\n"
            "    loss = model(**batch).loss  # mean over this microbatch's valid tokens\n"
            "    loss = loss / accum_steps\n"
            "    loss.backward()\n"
            "    if (step + 1) % accum_steps == 0:\n"
            "        optimizer.step()\n"
            "        optimizer.zero_grad()"
        ),
        use_instead=(
            "for window in windows:  # the accum_steps microbatches of one optimizer step\n"
            "    n_tokens = sum((b['labels'][..., 1:] != -100).sum() for b in window)\n"
            "    torch.distributed.all_reduce(n_tokens)  # when data parallel\n"
            "    for batch in window:\n"
            "        logits = model(**batch).logits[..., :-1, :]\n"
            "        loss = F.cross_entropy(logits.flatten(0, 1), batch['labels'][..., 1:].flatten(),\n"
            "                               ignore_index=-100, reduction='sum')\n"
            "        (loss * world_size / n_tokens).backward()  # DDP averages over ranks\n"
            "    optimizer.step()\n"
            "    optimizer.zero_grad()"
        ),
        fix_safety=(
            "This rule has no automatic fix: the correct denominator is the number of valid tokens in "
            "the whole accumulation window, which has to be counted before the window's first "
            "backward (and all-reduced across ranks)."
        ),
        references=(
            "https://huggingface.co/blog/gradient_accumulation",
            "https://pytorch.org/docs/stable/generated/torch.nn.CrossEntropyLoss.html",
        ),
    )
    valid = (
        # an image classifier: every example is one unit, dividing by the count is exact
        "import torch\nfrom torch import nn\ncriterion = nn.CrossEntropyLoss()\n"
        "for i, (images, target) in enumerate(loader):\n"
        "    output = model(images)\n    loss = criterion(output, target) / accum_steps\n    loss.backward()\n"
        "    if (i + 1) % accum_steps == 0:\n        optimizer.step()\n        optimizer.zero_grad()",
        # sequence classification .loss (per example), even with padding in the file
        "from transformers import AutoModelForSequenceClassification, AutoTokenizer\n"
        "model = AutoModelForSequenceClassification.from_pretrained('bert-base-cased')\n"
        "tok = AutoTokenizer.from_pretrained('bert-base-cased')\n"
        "enc = tok(texts, padding='longest')\n"
        "for step, batch in enumerate(loader):\n"
        "    outputs = model(**batch)\n    loss = outputs.loss\n"
        "    loss = loss / args.gradient_accumulation_steps\n    accelerator.backward(loss)",
        # nanoGPT: fixed-length blocks, no padding or masking anywhere
        "for micro_step in range(gradient_accumulation_steps):\n"
        "    with ctx:\n        logits, loss = model(X, Y)\n"
        "        loss = loss / gradient_accumulation_steps\n"
        "    X, Y = get_batch('train')\n    scaler.scale(loss).backward()",
        # litgpt pretraining: token cross-entropy on packed blocks, no padding evidence
        "from litgpt.utils import chunked_cross_entropy\n"
        "input_ids = train_data[:, 0:block].contiguous()\ntargets = train_data[:, 1:block + 1].contiguous()\n"
        "logits = model(input_ids)\nloss = chunked_cross_entropy(logits, targets)\n"
        "fabric.backward(loss / train.gradient_accumulation_iters(devices))",
        # sum reduction: the count division is the caller's choice, not a mean of means
        "import torch.nn.functional as F\nlabels[labels == pad] = -100\n"
        "loss = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100, reduction='sum')\n"
        "loss = loss / accum_steps\nloss.backward()",
        # transformers normalises by the window's token count (accelerate's reference pattern)
        "from transformers import AutoModelForCausalLM\nmodel = AutoModelForCausalLM.from_pretrained(name)\n"
        "n = accelerator.gather(sum((b['labels'] != -100).sum() for b in window)).sum().item()\n"
        "for batch in window:\n"
        "    outputs = model(**batch, num_items_in_batch=n)\n    loss = outputs.loss\n"
        "    loss = loss * gradient_accumulation_steps * accelerator.num_processes\n"
        "    accelerator.backward(loss)\n"
        "losses = accelerator.gather(sum(losses)).sum().item() / (accelerator.num_processes * gradient_accumulation_steps)",
        # only logged: the division never reaches backward
        "import torch.nn.functional as F\nlabels = batch['labels']  # -100 on padding\nmask = batch['attention_mask']\n"
        "loss = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)\n"
        "loss.backward()\nrunning += loss.item() / accum_steps",
        # summed and divided by the window's global token count, computed outside the microbatch loop
        "import torch.nn.functional as F\nn_tokens = window_tokens(window)  # all-reduced\n"
        "for batch in window:\n    labels = batch['labels']  # -100 on padding\n"
        "    loss = F.cross_entropy(model(batch['input_ids']).flatten(0, 1), labels.flatten(), reduction='sum')\n"
        "    (loss / n_tokens).backward()",
        # the PyTorch AMP recipe: generic loss_fn, no token data
        "scaler = torch.amp.GradScaler()\nfor epoch in epochs:\n"
        "    for i, (input, target) in enumerate(data):\n"
        "        with torch.autocast(device_type='cuda', dtype=torch.float16):\n"
        "            output = net(input)\n            loss = loss_fn(output, target)\n"
        "            loss = loss / iters_to_accumulate\n"
        "        scaler.scale(loss).backward()\n"
        "        if (i + 1) % iters_to_accumulate == 0:\n"
        "            scaler.step(opt)\n            scaler.update()\n            opt.zero_grad(set_to_none=True)",
        # divided by something that is not the accumulation count
        "import torch.nn.functional as F\nmask = batch['attention_mask']\n"
        "loss = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)\n"
        "(loss / temperature).backward()",
        # a name with accum in it that is the token count of the window
        "import torch.nn.functional as F\nmask = batch['attention_mask']\n"
        "loss = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)\n"
        "(loss / accum_tokens).backward()",
        # sequence classification with flattened logits over the class axis
        "from torch.nn import CrossEntropyLoss\nloss_fct = CrossEntropyLoss()\nmask = batch['attention_mask']\n"
        "loss = loss_fct(logits.view(-1, self.num_labels), labels.view(-1))\n"
        "loss = loss / args.gradient_accumulation_steps\nloss.backward()",
    )
    invalid = (
        # HF causal LM, padded batches, `.loss` traced through `outputs`
        Invalid(
            "from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq\n"
            "model = AutoModelForCausalLM.from_pretrained(name)\n"
            "for step, batch in enumerate(loader):\n"
            "    outputs = model(**batch)\n    loss = outputs.loss\n"
            "    loss = loss / args.gradient_accumulation_steps\n    accelerator.backward(loss)",
            line=6,
        ),
        # in-place division
        Invalid(
            "import torch.nn.functional as F\nlabels = batch['labels']  # -100 on padding and prompt\n"
            "attention_mask = batch['attention_mask']\n"
            "loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)\n"
            "loss /= args.gradient_accumulation_steps\nloss.backward()",
            line=5,
        ),
        # multiply by the reciprocal
        Invalid(
            "import torch.nn.functional as F\n"
            "loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=tok.pad_token_id)\n"
            "loss = loss * (1 / n_accum)\nloss.backward()",
            line=3,
        ),
        # divided inside the backward call
        Invalid(
            "from torch import nn\ncriterion = nn.CrossEntropyLoss(ignore_index=-100)\n"
            "for i, batch in enumerate(loader):\n"
            "    logits = model(batch['input_ids'], attention_mask=batch['attention_mask'])\n"
            "    loss = criterion(logits.view(-1, vocab_size), batch['labels'].view(-1))\n"
            "    (loss / accum).backward()",
            line=6,
        ),
        # a method: self.accumulation_steps, self.criterion set in __init__
        Invalid(
            "import torch\n\nclass Trainer:\n    def __init__(self, accumulation_steps):\n"
            "        self.criterion = torch.nn.CrossEntropyLoss(ignore_index=self.tokenizer.pad_token_id)\n"
            "        self.accumulation_steps = accumulation_steps\n\n"
            "    def train_step(self, batch):\n"
            "        logits = self.model(batch['input_ids'])\n"
            "        loss = self.criterion(logits.reshape(-1, logits.size(-1)), batch['labels'].reshape(-1))\n"
            "        loss = loss / self.accumulation_steps\n        loss.backward()",
            line=11,
        ),
        # litgpt finetuning: fabric.backward, accumulation count from a method, SFT data module
        Invalid(
            "from litgpt.data import Alpaca\nfrom litgpt.utils import chunked_cross_entropy\n\n"
            "def fit(fabric, model, train, batch):\n"
            "    input_ids, targets = batch['input_ids'], batch['labels']\n"
            "    logits = model(input_ids)\n"
            "    loss = chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:])\n"
            "    fabric.backward(loss / train.gradient_accumulation_iters(devices))",
            line=8,
        ),
        # the divisor is the count of a modulo accumulation condition
        Invalid(
            "import torch.nn.functional as F\nfor i, batch in enumerate(loader):\n"
            "    out = model(batch['input_ids'], attention_mask=batch['attention_mask'])\n"
            "    loss = F.cross_entropy(out.view(-1, out.size(-1)), batch['labels'].view(-1))\n"
            "    loss = loss / n\n    loss.backward()\n"
            "    if (i + 1) % n == 0:\n        optimizer.step()\n        optimizer.zero_grad()",
            line=5,
        ),
        # a hand-written masked mean per microbatch, then divided by the count
        Invalid(
            "import torch.nn.functional as F\n"
            "per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction='none')\n"
            "mask = batch['attention_mask']\n"
            "loss = (per_token * mask).sum() / mask.sum()\n"
            "scaler.scale(loss / grad_accum).backward()",
            line=5,
        ),
        # logits, loss = model(x, y) on a local GPT whose forward computes a flattened cross-entropy
        Invalid(
            "import torch.nn.functional as F\nfrom torch import nn\n\nclass GPT(nn.Module):\n"
            "    def forward(self, idx, targets):\n        logits = self.head(self.body(idx))\n"
            "        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)\n"
            "        return logits, loss\n\nmodel = GPT()\n"
            "for step in range(accum_steps):\n    x, y = next(batches)\n    y[y == pad_id] = -100\n"
            "    logits, loss = model(x, y)\n    loss = loss / accum_steps\n    loss.backward()",
            line=15,
        ),
        # model(...).loss inline, masked LM collator
        Invalid(
            "from transformers import AutoModelForMaskedLM, DataCollatorForLanguageModeling\n"
            "collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)\n"
            "model = AutoModelForMaskedLM.from_pretrained(name)\n"
            "for batch in loader:\n    model_engine.backward(model(**batch).loss / accumulate_grad_batches)",
            line=5,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        evidence = None
        counts_by_scope: dict[int, set[str]] = {}
        for division in divisions(model):
            scope = division.site.scope
            if id(scope) not in counts_by_scope:
                counts_by_scope[id(scope)] = self._modulo_counts(model, scope)
            if not self._is_step_count(model, division.divisor, scope, counts_by_scope[id(scope)]):
                continue
            if not division_reaches_backward(model, division):
                continue
            if evidence is None:
                evidence = token_evidence(model)
                if not evidence.padding:
                    return
            origin = evidence.loss_origin(division.dividend, scope, division.site)
            if origin is None or origin.reduction != "mean":
                continue
            yield self._diagnostic(model, division, origin, evidence.padding_near(scope))

    def _diagnostic(self, model: FileModel, division: Division, origin: LossOrigin, padding) -> Diagnostic:
        related = [(origin.node, origin.what)]
        if padding is not None:
            related.append((padding.node, f"variable number of valid tokens per batch: {padding.what}"))
        return Diagnostic(
            division.node,
            f"{snippet(model, division.node, 'this division')} averages per-microbatch token means, so "
            "each microbatch weighs the same however many valid tokens it holds. Sum-reduce the loss "
            "and divide by the number of valid tokens in the whole accumulation window (all-reduced "
            "across ranks).",
            related=tuple(related),
        )

    # -- the divisor -----------------------------------------------------------------------------------
    @staticmethod
    def _modulo_counts(model: FileModel, scope: Scope) -> set[str]:
        """Names ``n`` of the scope's accumulation conditions: an ``if`` whose test has ``... % n``
        (directly or through a flag such as ``is_accumulating = i % n != 0``) and whose body steps
        an optimizer."""
        counts: set[str] = set()
        training = model.training
        for event in training.events_in(scope, "step", "scaler_step"):
            for frame in event.site.frames:
                if not isinstance(frame.node, cst.If) or not training.accumulation_condition(frame, scope):
                    continue
                test = frame.node.test
                counts.update(modulo_divisors(test))
                for node in walk(test):
                    if isinstance(node, cst.Name):
                        for value in model.values_of(node, scope):
                            counts.update(modulo_divisors(value))
        return counts

    def _is_step_count(
        self, model: FileModel, expr: cst.BaseExpression, scope: Scope, modulo: set[str]
    ) -> bool:
        if isinstance(expr, cst.Call):
            name = attr_name(expr)
            if name in ("float", "int") and len(expr.args) == 1:
                return self._is_step_count(model, expr.args[0].value, scope, modulo)
            return name is not None and is_step_count_name(name)
        if isinstance(expr, cst.Subscript):
            for element in expr.slice:
                if isinstance(element.slice, cst.Index) and isinstance(element.slice.value, cst.SimpleString):
                    key = element.slice.value.evaluated_value
                    if isinstance(key, str) and is_step_count_name(key):
                        return True
            return False
        path = dotted(expr)
        if path is None:
            return False
        if path not in modulo and not is_step_count_name(path.rsplit(".", 1)[-1]):
            return False
        return not self._counts_tokens(model, expr, scope)

    @staticmethod
    def _counts_tokens(model: FileModel, expr: cst.BaseExpression, scope: Scope) -> bool:
        """A name bound to a count computed from the data (``.sum()``, ``count_nonzero``, ``!=``)."""
        for value in model.values_of(expr, scope):
            for node in walk(value):
                if isinstance(node, cst.Call) and attr_name(node) in ("sum", "count_nonzero", "numel"):
                    return True
                if isinstance(node, cst.Comparison):
                    return True
        return False


# -- shared by the TL3xx and TL5xx rules ---------------------------------------------------------------


def snippet(model: FileModel, node: cst.CSTNode, fallback: str, limit: int = 60) -> str:
    """The node's code in backticks, without outer parentheses; ``fallback`` when long."""
    if isinstance(node, cst.BinaryOperation):
        node = node.with_changes(lpar=(), rpar=())
    text = model.code(node).strip()
    if len(text) > limit or "\n" in text:
        return fallback
    return f"`{text}`"


def divisions(model: FileModel) -> Iterator[Division]:
    """Every ``a / b``, ``a * (1 / b)``, ``a /= b``, ``a *= 1 / b`` and ``a.div(b)`` of the file."""
    for site in model.binops:
        node = site.node
        assert isinstance(node, cst.BinaryOperation)
        if isinstance(node.operator, cst.Divide):
            yield Division(node, node.left, node.right, site)
        elif isinstance(node.operator, cst.Multiply):
            for mine, other in ((node.right, node.left), (node.left, node.right)):
                count = _reciprocal(mine)
                if count is not None:
                    yield Division(node, other, count, site)
    for site in model.augassigns:
        node = site.node
        assert isinstance(node, cst.AugAssign)
        target = node.target.value if isinstance(node.target, cst.Name) else None
        if isinstance(node.operator, cst.DivideAssign):
            yield Division(node, node.target, node.value, site, target)
        elif isinstance(node.operator, cst.MultiplyAssign):
            count = _reciprocal(node.value)
            if count is not None:
                yield Division(node, node.target, count, site, target)
    for site in model.calls:
        call = site.node
        assert isinstance(call, cst.Call)
        if attr_name(call) == "div" and isinstance(call.func, cst.Attribute) and len(positional(call)) == 1:
            yield Division(call, call.func.value, positional(call)[0], site)


# What frameworks call it: ``loss.backward()``, ``torch.autograd.backward``, ``accelerator``/``fabric``/
# DeepSpeed ``engine``/ColossalAI ``booster.backward(loss)``, Lightning's ``self.manual_backward``.
# Any other name ending in ``backward`` (``_must_be_in_backward(node)``, ``is_backward(x)``) is a
# backward only when it is this file's own function that runs one (see ``backward_calls``).
BACKWARD_NAMES = frozenset({"backward", "manual_backward"})


def is_backward_call(call: cst.Call) -> bool:
    return attr_name(call) in BACKWARD_NAMES


def backward_calls(model: FileModel, scope: Scope) -> list[Site]:
    """Backward calls of the scope: ``x.backward()``, ``fabric.backward(x)``,
    ``self.manual_backward(x)``, and calls of this file's functions that run a backward."""
    out = []
    for site in model.calls_in(scope):
        call = site.node
        assert isinstance(call, cst.Call)
        if is_backward_call(call):
            out.append(site)
        elif isinstance(call.func, cst.Name):
            definition = model.definition(call.func.value, scope)
            inner = model.scope_for(definition) if isinstance(definition, cst.FunctionDef) else None
            if inner is not None and any(is_backward_call(s.node) for s in model.calls_in(inner)):  # type: ignore[arg-type]
                out.append(site)
    return out


def names_reach_backward(model: FileModel, scope: Scope, names: set[str], after: int) -> bool:
    """Whether one of ``names`` (or a name computed from one, up to three assignments on) is used
    in a backward call of the scope after program position ``after``."""
    backwards = [b for b in backward_calls(model, scope) if b.order > after]
    seen = set(names)
    for _ in range(3):
        if not names:
            return False
        for call in backwards:
            for n in walk(call.node):
                if isinstance(n, cst.Name) and n.value in names:
                    return True
        names = _derived_names(model, scope, names, after) - seen
        seen |= names
    return False


def division_reaches_backward(model: FileModel, division: Division) -> bool:
    node = division.node
    for call in backward_calls(model, division.site.scope):
        if call.statement is division.site.statement and any(n is node for n in walk(call.node)):
            return True
    names = _assigned_names(division)
    return names_reach_backward(model, division.site.scope, names, division.site.order)


def _assigned_names(division: Division) -> set[str]:
    if division.target is not None:
        return {division.target}
    statement = division.site.statement
    if not isinstance(statement, cst.SimpleStatementLine):
        return set()
    names: set[str] = set()
    for small in statement.body:
        if isinstance(small, cst.Assign | cst.AugAssign) and any(
            n is division.node for n in walk(small.value)
        ):
            targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else [small.target]
            names.update(t.value for t in targets if isinstance(t, cst.Name))
    return names


def _derived_names(model: FileModel, scope: Scope, names: set[str], after: int) -> set[str]:
    """Names assigned after ``after`` in the scope from an expression that uses one of ``names``."""
    out: set[str] = set()
    for site in model.assigns:
        if site.scope is not scope or site.order <= after or not isinstance(site.node, cst.Assign):
            continue
        if any(isinstance(n, cst.Name) and n.value in names for n in walk(site.node.value)):
            for target in site.node.targets:
                if isinstance(target.target, cst.Name):
                    out.add(target.target.value)
    return out


# -- TL302 ------------------------------------------------------------------------------------------------

DETACHING_METHODS = frozenset({"item", "detach", "detach_", "tolist", "numpy"})
DETACHING_FUNCTIONS = frozenset({"builtins.float", "builtins.int", "builtins.round"})


def backward_losses(model: FileModel, scope: Scope) -> list[tuple[str, Site]]:
    """The dotted loss expressions the scope's backward calls differentiate: ``loss`` in
    ``loss.backward()``, ``accelerator.backward(loss)``, ``scaler.scale(loss / n).backward()``."""
    out = []
    for site in backward_calls(model, scope):
        call = site.node
        assert isinstance(call, cst.Call)
        if not is_backward_call(call):
            # a helper of this file that runs the backward: its loss-named arguments
            for arg in call.args:
                key = dotted(arg.value)
                if key is not None and "loss" in key.rsplit(".", 1)[-1].lower():
                    out.append((key, site))
            continue
        args = positional(call)
        if args:
            expr: cst.CSTNode = args[0]
        elif isinstance(call.func, cst.Attribute):
            expr = call.func.value
        else:
            continue
        if isinstance(expr, cst.Call) and attr_name(expr) == "scale" and positional(expr):
            expr = positional(expr)[0]
        for node in _value_references(expr):
            key = dotted(node)
            if key is not None:
                out.append((key, site))
    return out


def _value_references(expr: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """Maximal Name/Attribute chains of ``expr`` that are values (not called functions)."""
    if isinstance(expr, cst.Name | cst.Attribute) and dotted(expr) is not None:
        yield expr
        return
    if isinstance(expr, cst.Call):
        if isinstance(expr.func, cst.Attribute):
            yield from _value_references(expr.func.value)
        for arg in expr.args:
            yield from _value_references(arg.value)
        return
    for child in expr.children:
        yield from _value_references(child)


class LossAccumulatedWithGraph(Rule):
    id = "TL302"
    name = "loss-accumulated-with-graph"
    severity = Severity.WARNING
    probe = "tl302"
    summary = "A running loss total keeps every iteration's autograd graph alive."
    # Prefilter: a backward call (``call_pattern``) and an addition to a total (`+=`, `t = t + x`,
    # `.append(x)`). Nothing else it needs shows in the text: this stays as broad as backward calls.
    tokens = ("backward",)
    requires = (
        call_pattern("backward"),
        ("+", "append"),
    )
    has_fix = True
    doc = RuleDoc(
        what=(
            "Reports a running total or list inside a loop that collects a loss tensor that is "
            "backpropagated in the same loop (`total += loss`, `total = total + loss`, "
            "`losses.append(loss)`) without `.item()`, `.detach()`, `float()` or `.tolist()`. A "
            "total that is itself backpropagated later (`sum(losses).backward()`), one reset on each "
            "iteration, and additions under `torch.no_grad()` are not reported."
        ),
        why=(
            "A loss tensor carries its `grad_fn`, and adding it to a total makes the total's "
            "`grad_fn` point at it, so the autograd graph of every iteration stays reachable until "
            "the total is dropped. The graph nodes alone are kept even after `backward()` freed the "
            "saved tensors; when the addition happens before `backward()`, or the graph is retained, "
            "the saved activations stay too. With 200 MB of saved activations per step, a "
            "100-step epoch would pin 20 GB; in the lighter case the process still leaks thousands "
            "of graph nodes per step, and memory climbs steadily over an epoch until it runs out "
            "or the epoch ends."
        ),
        example=(
            "total_loss = 0.0\n"
            "for x, y in loader:\n"
            "    loss = criterion(model(x), y)\n"
            "    loss.backward()\n"
            "    optimizer.step()\n"
            "    optimizer.zero_grad()\n"
            "    total_loss += loss"
        ),
        use_instead=(
            "total_loss = 0.0\n"
            "for x, y in loader:\n"
            "    loss = criterion(model(x), y)\n"
            "    loss.backward()\n"
            "    optimizer.step()\n"
            "    optimizer.zero_grad()\n"
            "    total_loss += loss.item()  # or loss.detach() to avoid a sync per step"
        ),
        fix_safety=(
            "The fix appends `.item()` or `.detach()` to the loss where it is added or appended. It "
            "looks at every use of the total in the same function: when each one also works with a "
            "Python number (arithmetic, comparisons, f-strings, `print`, `float`, `sum`, `len`, "
            "`math`/`numpy`/`statistics`, logger and `add_scalar` calls) and the total starts as a "
            "number or an empty list, it uses `.item()`; otherwise (`torch.stack(losses)`, "
            "`total.item()`, `dist.all_reduce(total)`, a method called on the loss, or a use it "
            "cannot classify) it uses `.detach()`. `.detach()` is safe: the total keeps its value, "
            "dtype, device and type and only stops recording the graph, which nothing needs (the "
            "rule only reports totals that are not backpropagated in the function); it is marked "
            "unsafe when the total leaves the function (returned, stored on `self` or in a "
            "container), where code out of sight might still differentiate it. `.item()` is always "
            "unsafe: the total becomes a Python float, accumulated in double precision, each call "
            "waits for the GPU, and it raises if the loss has more than one element."
        ),
        references=(
            "https://pytorch.org/docs/stable/notes/faq.html#my-model-reports-cuda-runtime-error-2-out-of-memory",
        ),
    )
    valid = (
        "total = 0.0\nfor x, y in loader:\n    loss = crit(model(x), y)\n    loss.backward()\n    total += loss.item()",
        "total = 0.0\nfor x, y in loader:\n    loss = crit(model(x), y)\n    loss.backward()\n    total += loss.detach()",
        "total = 0.0\nfor x, y in loader:\n    loss = crit(model(x), y)\n    loss.backward()\n    total += float(loss)",
        "losses = []\nfor x, y in loader:\n    loss = crit(model(x), y)\n    loss.backward()\n"
        "    losses.append(loss.detach().cpu())",
        # the total is what gets backpropagated: keeping the graph is the point
        "total = 0\nfor chunk in chunks:\n    total = total + model(chunk).loss\ntotal.backward()",
        "losses = []\nfor head in heads:\n    loss = crit(head(h), y)\n    losses.append(loss)\n"
        "torch.stack(losses).sum().backward()",
        # building one loss from parts, then backward
        "for x, y in loader:\n    loss = crit(model(x), y)\n    loss += 0.01 * aux_loss\n    loss.backward()",
        # eval loop: no backward, under no_grad
        "import torch\nwith torch.no_grad():\n    for x, y in val_loader:\n        loss = crit(model(x), y)\n"
        "        val_loss += loss\n",
        # converted to a float before being added
        "for x, y in loader:\n    loss = crit(model(x), y)\n    loss.backward()\n    loss = loss.item()\n    total += loss",
        # reset on every iteration: the graph lives for one iteration only
        "for batch in loader:\n    running = 0\n    for chunk in batch:\n        l = model(chunk).loss\n"
        "        l.backward()\n        running += l\n    print(running)",
        # a step function's micro-step loop: the list lives for one optimizer step
        "def train_step(model, it):\n    losses = []\n    for _ in range(args.gradient_accumulation_steps):\n"
        "        loss = model(next(it)).loss\n        loss.backward()\n        losses.append(loss)\n"
        "    return torch.stack(losses).mean().item()",
        # accumulated under no_grad
        "import torch\nfor x, y in loader:\n    loss = crit(model(x), y)\n    loss.backward()\n"
        "    with torch.no_grad():\n        total += loss",
        # an eval loop after the training loop, in the same epoch loop (accelerate's examples): the
        # loss there comes from a no_grad forward, and no iteration of it makes a graph
        "import torch\nfor epoch in range(E):\n    for batch in train_loader:\n        loss = model(**batch).loss\n"
        "        accelerator.backward(loss)\n        optimizer.step()\n    losses = []\n"
        "    for batch in eval_loader:\n        with torch.no_grad():\n            outputs = model(**batch)\n"
        "        loss = outputs.loss\n        losses.append(loss)",
        # a predicate whose name ends in "backward" is not a backward (torch/_functorch/partitioners.py)
        "output_values = []\nfor x in outputs:\n    if _must_be_in_backward(x):\n        continue\n"
        "    output_values.append(x)",
        # ... even when it appends the training loop's last loss by mistake: one graph, not one per step
        "import torch\nfor epoch in range(E):\n    for batch in train_loader:\n        loss = model(**batch).loss\n"
        "        accelerator.backward(loss)\n    losses = []\n    for batch in eval_loader:\n"
        "        with torch.no_grad():\n            outputs = model(**batch)\n"
        "        losses.append(gather(loss.repeat(bs)))",
    )
    invalid = (
        # added in a loop of its own inside the training loop
        Invalid(
            "history = []\nfor x, y in loader:\n    loss = crit(model(x), y)\n    loss.backward()\n"
            "    for log in loggers:\n        history.append(loss)",
            line=6,
        ),
        # added once per epoch, after the epoch's loop: one graph per epoch stays alive
        Invalid(
            "history = []\nfor epoch in range(E):\n    for x, y in loader:\n        loss = crit(model(x), y)\n"
            "        loss.backward()\n    history.append(loss)",
            line=6,
        ),
        # reset once per epoch, accumulated over the whole data loader
        Invalid(
            "for epoch in range(3):\n    running_loss = 0.0\n    for x, y in train_loader:\n"
            "        loss = crit(model(x), y)\n        loss.backward()\n        running_loss += loss",
            line=6,
        ),
        Invalid(
            "total_loss = 0\nfor x, y in loader:\n    loss = crit(model(x), y)\n    loss.backward()\n"
            "    total_loss += loss",
            line=5,
        ),
        Invalid(
            "losses = []\nfor x, y in loader:\n    loss = crit(model(x), y)\n    loss.backward()\n"
            "    losses.append(loss)",
            line=5,
        ),
        Invalid(
            "epoch_loss = 0\nfor x, y in loader:\n    loss = crit(model(x), y)\n    loss.backward()\n"
            "    epoch_loss = epoch_loss + loss",
            line=5,
        ),
        # .cpu() and .float() keep the graph
        Invalid(
            "hist = []\nfor x, y in loader:\n    loss = crit(model(x), y)\n    scaler.scale(loss).backward()\n"
            "    hist.append(loss.float().cpu())",
            line=5,
        ),
        # HF style .loss through accelerator.backward
        Invalid(
            "def train(model, loader, accelerator):\n    tr_loss = 0.0\n    for batch in loader:\n"
            "        outputs = model(**batch)\n        accelerator.backward(outputs.loss)\n"
            "        tr_loss += outputs.loss\n    return tr_loss / len(loader)",
            line=6,
        ),
        # the scaled loss added before backward
        Invalid(
            "for step, batch in enumerate(loader):\n    loss = model(**batch).loss / accum\n"
            "    self.total_loss += loss\n    loss.backward()",
            line=3,
        ),
        # a dict of running totals
        Invalid(
            "stats = {'loss': 0}\nfor x, y in loader:\n    loss = crit(model(x), y)\n    loss.backward()\n"
            "    stats['loss'] += loss",
            line=5,
        ),
        Invalid(
            "while step < max_steps:\n    loss = crit(model(x), y)\n    fabric.backward(loss)\n"
            "    running_loss += loss * x.size(0)\n    step += 1",
            line=4,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        losses_by_scope: dict[int, list[tuple[str, Site]]] = {}
        for site, target, added, statement in self._additions(model):
            if not site.inside("loop") or in_grad_disabled_block(model, site) or self._window_loop(site):
                continue
            scope = site.scope
            if id(scope) not in losses_by_scope:
                losses_by_scope[id(scope)] = backward_losses(model, scope)
            loop = innermost_loop(site)
            for key, backward in losses_by_scope[id(scope)]:
                # graphs pile up only when one loop holds both: the backward inside the addition's loop
                # or the addition inside the backward's (an eval loop after the training loop, both in
                # the epoch loop, makes no new graph per iteration)
                backward_loop = innermost_loop(backward)
                if key == target or not (
                    (loop is not None and in_loop(backward, loop))
                    or (backward_loop is not None and in_loop(site, backward_loop))
                ):
                    continue
                if not self._attached_reference(model, added, key, site):
                    continue
                if self._total_is_backpropagated(model, site, target) or self._reset_in_loop(
                    model, site, target
                ):
                    continue
                yield Diagnostic(
                    statement,
                    f"{snippet(model, statement, 'This running total')} keeps every iteration's autograd "
                    f"graph alive through `{key}`; accumulate `{key}.item()` or `{key}.detach()` instead.",
                    related=((backward.node, "the loss is backpropagated here"),),
                    fix=detach_fix(model, site, target, added, key, is_list=isinstance(statement, cst.Call)),
                )
                break

    @staticmethod
    def _additions(model: FileModel) -> Iterator[tuple[Site, str, cst.BaseExpression, cst.CSTNode]]:
        """(site, running total as dotted text, the added expression, the statement to report)."""
        for site in model.augassigns:
            node = site.node
            assert isinstance(node, cst.AugAssign)
            key = _target_key(node.target)
            if isinstance(node.operator, cst.AddAssign) and key is not None:
                yield site, key, node.value, node
        for site in model.assigns:
            node = site.node
            if not isinstance(node, cst.Assign) or len(node.targets) != 1:
                continue
            key = _target_key(node.targets[0].target)
            value = node.value
            if (
                key is not None
                and isinstance(value, cst.BinaryOperation)
                and isinstance(value.operator, cst.Add)
            ):
                if _target_key(value.left) == key:
                    yield site, key, value.right, node
                elif _target_key(value.right) == key:
                    yield site, key, value.left, node
        for site in model.calls:
            call = site.node
            assert isinstance(call, cst.Call)
            if attr_name(call) == "append" and isinstance(call.func, cst.Attribute) and len(call.args) == 1:
                key = _target_key(call.func.value)
                if key is not None:
                    yield site, key, call.args[0].value, call

    @staticmethod
    def _attached_reference(model: FileModel, added: cst.BaseExpression, key: str, site: Site) -> bool:
        """``key`` occurs in ``added`` outside any detaching call, and its value at this point is not a
        number taken out of the graph (``loss = loss.item()`` earlier in the loop)."""
        found = False
        for _node, detached in _references(model, added, key, site.scope, False):
            if not detached:
                found = True
        if not found:
            return False
        if "." not in key:
            earlier = [
                s
                for s in model.assigns
                if s.scope is site.scope
                and s.order < site.order
                and isinstance(s.node, cst.Assign)
                and any(_target_key(t.target) == key for t in s.node.targets)
            ]
            if earlier and _is_detaching(model, earlier[-1].node.value, site.scope):  # type: ignore[union-attr]
                return False
        return True

    @staticmethod
    def _total_is_backpropagated(model: FileModel, site: Site, target: str) -> bool:
        head = target.split(".")[0].split("[")[0]
        for backward in backward_calls(model, site.scope):
            for n in walk(backward.node):
                if isinstance(n, cst.Name) and n.value == head and not head == "self":
                    return True
                if dotted(n) == target:
                    return True
        return names_reach_backward(model, site.scope, {head}, site.order) if head != "self" else False

    @staticmethod
    def _window_loop(site: Site) -> bool:
        """The addition's only loop is the micro-step loop of one window (``for _ in
        range(accum_steps)``): a total local to the step lives for one optimizer step, not the run."""
        loops = site.inside("loop")
        if len(loops) != 1 or not isinstance(loops[0].node, cst.For):
            return False
        return any(
            isinstance(n, cst.Name | cst.Attribute)
            and is_step_count_name((dotted(n) or "").rsplit(".", 1)[-1])
            for n in walk(loops[0].node.iter)
        )

    @staticmethod
    def _reset_in_loop(model: FileModel, site: Site, target: str) -> bool:
        """``target = ...`` (a plain assignment) inside a loop around the addition: the total then
        lives for one iteration of that loop only. Not when the addition's own loop walks a data
        loader: a total reset once per epoch still holds a whole epoch of graphs."""
        loop_frames = [f for f in site.frames if f.kind == "loop"]
        innermost = loop_frames[-1].node if loop_frames else None
        if isinstance(innermost, cst.For) and any(
            isinstance(n, cst.Name | cst.Attribute)
            and "loader" in (dotted(n) or "").rsplit(".", 1)[-1].lower()
            for n in walk(innermost.iter)
        ):
            return False
        loops = {id(f.node) for f in loop_frames}
        for other in model.assigns:
            if other is site or other.scope is not site.scope or not isinstance(other.node, cst.Assign):
                continue
            if not any(id(f.node) in loops for f in other.frames):
                continue
            for t in other.node.targets:
                if _target_key(t.target) == target:
                    value = other.node.value
                    if not (isinstance(value, cst.BinaryOperation) and _target_key(value.left) == target):
                        return True
        return False


def _target_key(expr: cst.CSTNode) -> str | None:
    """``total``, ``self.total``, ``stats['loss']`` as text."""
    key = dotted(expr)
    if key is not None:
        return key
    if isinstance(expr, cst.Subscript):
        base = dotted(expr.value)
        if base is not None:
            return base + "[" + "".join(cst.Module([]).code_for_node(e) for e in expr.slice) + "]"
    return None


def _is_detaching(model: FileModel, expr: cst.BaseExpression, scope: Scope) -> bool:
    if isinstance(expr, cst.Call):
        if attr_name(expr) in DETACHING_METHODS and isinstance(expr.func, cst.Attribute):
            return True
        if model.qualname(expr.func, scope) in DETACHING_FUNCTIONS:
            return True
    return isinstance(expr, cst.Attribute) and expr.attr.value == "data"


def _references(
    model: FileModel, expr: cst.CSTNode, key: str, scope: Scope, detached: bool
) -> Iterator[tuple[cst.CSTNode, bool]]:
    """Occurrences of ``key`` in ``expr``, each with whether a detaching call encloses it."""
    if dotted(expr) == key:
        yield expr, detached
        return
    if isinstance(expr, cst.BaseExpression) and _is_detaching(model, expr, scope):
        detached = True
    for child in expr.children:
        yield from _references(model, child, key, scope, detached)


# How the running total is used elsewhere in its scope decides between `.item()` and `.detach()`.
LIST_METHODS = frozenset({"append", "extend", "insert", "clear", "copy", "pop", "remove", "reverse", "count"})
NUMBER_FUNCTIONS = frozenset(
    {
        "builtins.print", "builtins.float", "builtins.int", "builtins.round", "builtins.str",
        "builtins.len", "builtins.format", "builtins.repr", "builtins.bool",
    }
)  # fmt: skip
PASS_THROUGH_FUNCTIONS = frozenset(
    {"builtins.sum", "builtins.min", "builtins.max", "builtins.abs", "builtins.sorted"}
)
NUMBER_MODULES = ("math.", "numpy.", "statistics.")
# Method calls that accept a Python number as well as a tensor (loggers, progress bars, formatting).
LOGGING_METHODS = frozenset(
    {
        "log", "info", "debug", "warning", "warn", "error", "write", "add_scalar", "add_scalars",
        "log_metrics", "log_dict", "set_postfix", "set_description", "format",
    }
)  # fmt: skip
TENSOR_WORDS = ("reduce", "gather", "broadcast", "tensor", "stack", "sync")
NOT_REFERENCES = (cst.Param, cst.FunctionDef, cst.ClassDef, cst.ImportAlias, cst.AsName, cst.NameItem)


def _parents(root: cst.CSTNode) -> dict[int, cst.CSTNode]:
    """Parent of every syntax node of ``root``'s own scope (nested defs, classes, lambdas are not
    entered), keyed by ``id``."""
    out: dict[int, cst.CSTNode] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        for child in children(node):
            out[id(child)] = node
            if not isinstance(child, cst.FunctionDef | cst.ClassDef | cst.Lambda):
                stack.append(child)
    return out


def _name_references(parents: dict[int, cst.CSTNode], root: cst.CSTNode) -> dict[str, list[cst.Name]]:
    out: dict[str, list[cst.Name]] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        for child in children(node):
            if isinstance(child, cst.FunctionDef | cst.ClassDef | cst.Lambda):
                continue
            if isinstance(child, cst.Name):
                parent = parents.get(id(child))
                if isinstance(parent, NOT_REFERENCES) or (
                    isinstance(parent, cst.Attribute) and parent.attr is child
                ):
                    continue
                if isinstance(parent, cst.Arg) and parent.keyword is child:
                    continue
                out.setdefault(child.value, []).append(child)
            stack.append(child)
    return out


@dataclass
class _Uses:
    """What the uses of a running total in its scope allow: ``kinds`` holds ``number`` (works with a
    Python float), ``tensor`` (needs a tensor), ``escape`` (leaves the scope: returned, stored on an
    object or in a container) and ``unknown``."""

    model: FileModel
    scope: Scope
    parents: dict[int, cst.CSTNode]
    names: dict[str, list[cst.Name]]

    def of_total(self, target: str, is_list: bool) -> set[str]:
        scope = self.scope
        if "." in target or "[" in target:
            return {"escape"}  # self.total, stats["loss"]: visible beyond the scope
        bindings = scope.bindings.get(target)
        if not bindings or target in scope.global_names or target in scope.nonlocal_names:
            return {"escape"}
        kinds: set[str] = set()
        for binding in bindings:
            if binding.kind == "param":
                kinds.add("escape")
            elif binding.kind != "assign":
                kinds.add("unknown")
            elif not self._self_update(binding.value, target):
                kinds.add(self._initial(binding.value, is_list))
        for name in self.names.get(target, ()):
            kinds.add(self._use(name, target, is_list, 0))
        kinds.discard("write")
        return kinds

    def _initial(self, value: cst.BaseExpression | None, is_list: bool) -> str:
        if is_list:
            return "number" if isinstance(value, cst.List) and not value.elements else "unknown"
        if is_number(value):
            return "number"
        if isinstance(value, cst.Call) and (self.model.qualname(value.func, self.scope) or "").startswith(
            "torch."
        ):
            return "tensor"
        return "unknown"

    @staticmethod
    def _self_update(value: cst.BaseExpression | None, target: str) -> bool:
        return isinstance(value, cst.BinaryOperation) and target in (dotted(value.left), dotted(value.right))

    def _use(self, node: cst.CSTNode, target: str, is_list: bool, depth: int) -> str:
        parents = self.parents
        current = node
        element = not is_list  # the value in hand is a number or a tensor, not the list holding them
        for _ in range(64):
            parent = parents.get(id(current))
            if parent is None:
                return "unknown"
            if isinstance(parent, cst.Attribute):
                return "number" if not element and parent.attr.value in LIST_METHODS else "tensor"
            if isinstance(parent, cst.Subscript) and parent.value is current:
                if element:
                    return "tensor"
                element = True
            elif isinstance(parent, cst.BinaryOperation | cst.UnaryOperation) and element:
                pass
            elif isinstance(parent, cst.IfExp) and parent.test is not current:
                pass
            elif isinstance(
                parent, cst.Element | cst.DictElement | cst.List | cst.Tuple | cst.Dict | cst.Set
            ):
                pass  # a display holding the value: what happens to the display decides
            elif isinstance(parent, cst.Arg):
                call = parents.get(id(parent))
                if not isinstance(call, cst.Call):
                    return "unknown"
                kind = self._call(call)
                if kind != "through":
                    return kind
                parent, element = call, True
            elif isinstance(parent, cst.AugAssign | cst.AssignTarget):
                return "write" if getattr(parent, "target", None) is current else "unknown"
            elif isinstance(parent, cst.Assign):
                return self._assigned(parent, target, not element, depth)
            elif isinstance(parent, cst.Return | cst.Yield):
                return "escape"
            elif isinstance(
                parent, cst.Comparison | cst.ComparisonTarget | cst.FormattedStringExpression | cst.Expr
            ):
                return "number"
            elif isinstance(parent, cst.If | cst.While | cst.IfExp | cst.Assert):
                return "number"  # as a condition
            else:
                return "unknown"
            current = parent
        return "unknown"

    def _assigned(self, assign: cst.Assign, target: str, is_list: bool, depth: int) -> str:
        targets = [t.target for t in assign.targets]
        if not all(isinstance(t, cst.Name) for t in targets):
            return "escape"  # self.loss = total, metrics["loss"] = total
        if any(t.value == target for t in targets):  # type: ignore[union-attr]
            return "write"  # total = total + ...
        if depth >= 2:
            return "unknown"
        kinds = {
            self._use(ref, t.value, is_list, depth + 1)  # type: ignore[union-attr]
            for t in targets
            for ref in self.names.get(t.value, ())  # type: ignore[union-attr]
        } - {"write"}
        for worst in ("escape", "tensor", "unknown"):
            if worst in kinds:
                return worst
        return "number"

    def _call(self, call: cst.Call) -> str:
        callee = self.model.qualname(call.func, self.scope) or ""
        name = (attr_name(call) or "").lower()
        if callee.startswith("torch.") or any(word in name for word in TENSOR_WORDS):
            return "tensor"
        if callee in PASS_THROUGH_FUNCTIONS:
            return "through"
        if callee in NUMBER_FUNCTIONS or callee.startswith(NUMBER_MODULES):
            return "number"
        if isinstance(call.func, cst.Attribute) and name in LOGGING_METHODS:
            return "number"
        return "unknown"


def detach_fix(
    model: FileModel, site: Site, target: str, added: cst.BaseExpression, key: str, is_list: bool
) -> FixSpec | None:
    """Append ``.item()`` or ``.detach()`` to every attached reference of ``key`` in ``added``."""
    refs = [node for node, detached in _references(model, added, key, site.scope, False) if not detached]
    if not refs:
        return None
    parents = _parents(site.scope.node)
    receivers = any(
        isinstance(parents.get(id(ref)), cst.Attribute | cst.Subscript)
        and getattr(parents.get(id(ref)), "value", None) is ref
        for ref in refs
    )
    uses = _Uses(model, site.scope, parents, _name_references(parents, site.scope.node)).of_total(
        target, is_list
    )
    if not receivers and uses <= {"number"}:
        method, applicability = "item", Applicability.UNSAFE
    else:
        method = "detach"
        applicability = Applicability.UNSAFE if "escape" in uses else Applicability.SAFE
    return FixSpec(
        applicability,
        f"Accumulate `{key}.{method}()` instead of `{key}`",
        tuple(TextEditSpec(ref, "after", f".{method}()") for ref in refs),
    )


# -- TL303 ------------------------------------------------------------------------------------------------


def _optimizer_expr(event: Event) -> cst.BaseExpression | None:
    """The optimizer a step acts on: the receiver of ``opt.step()``, the argument of
    ``scaler.step(opt)``."""
    if event.kind == "scaler_step":
        args = positional(event.call)
        return args[0] if args else None
    return receiver(event.call)


class ZeroGradEveryMicrostep(Rule):
    id = "TL303"
    name = "zero-grad-every-microstep"
    severity = Severity.ERROR
    probe = "tl303"
    summary = (
        "zero_grad() runs on every iteration while step() runs only at the end of an accumulation window."
    )
    # Prefilter: zero_grad, step and backward method calls (events, ``call_pattern``), and an
    # accumulation condition (`%`, `sync_gradients`, or a counter reset `if n == k` / `if n >= k`).
    tokens = ("zero_grad",)
    requires = (
        call_pattern("zero_grad"),
        call_pattern("step"),
        call_pattern("backward"),
        ("%", "sync_gradients", "==", ">="),
    )
    has_fix = True
    doc = RuleDoc(
        what=(
            "Reports `optimizer.zero_grad()` (or `model.zero_grad()` for the model that optimizer "
            "updates) that runs on every iteration of a loop in which `optimizer.step()` runs only "
            "under an accumulation condition (`(i + 1) % accum == 0`, `accelerator.sync_gradients`, "
            "`if not is_accumulating:`, a counter compared with the accumulation count), while a "
            "backward runs on every iteration. Not reported when `zero_grad()` sits under the same "
            "condition, inside `accelerator.accumulate(...)` (whose prepared optimizer skips it "
            "between updates), or for a different optimizer (a GAN's discriminator)."
        ),
        why=(
            "Accumulation relies on `.grad` summing over the window's backward passes. Clearing it on "
            "every iteration leaves only the last microbatch's gradient when `step()` finally runs. "
            "With 8 accumulation steps of 4 examples each, the update is computed from 4 examples "
            "instead of 32, so it is about sqrt(8), nearly three times, noisier than intended; and if "
            "the loss was also divided by 8, the step is 8 times too small as well. Nothing fails and "
            "the loss still goes down, only slower."
        ),
        example=(
            "for i, (x, y) in enumerate(loader):\n"
            "    optimizer.zero_grad()\n"
            "    loss = criterion(model(x), y) / accum_steps\n"
            "    loss.backward()\n"
            "    if (i + 1) % accum_steps == 0:\n"
            "        optimizer.step()"
        ),
        use_instead=(
            "for i, (x, y) in enumerate(loader):\n"
            "    loss = criterion(model(x), y) / accum_steps\n"
            "    loss.backward()\n"
            "    if (i + 1) % accum_steps == 0:\n"
            "        optimizer.step()\n"
            "        optimizer.zero_grad()"
        ),
        fix_safety=(
            "The fix moves the `zero_grad()` line (with its trailing comment) to right after the step "
            "line, inside the branch that steps. It is offered only when that is the loop's one step "
            "of that optimizer, both calls stand alone on their lines, and the `zero_grad()` sits "
            "directly in the loop body (or in a `with` block there) that keeps another statement. It "
            "is unsafe because it changes when gradients are cleared beyond the bug itself: code that "
            "reads `.grad` after the step in the same iteration now sees it cleared, and gradients "
            "from before the loop or from an incomplete window at the end of the previous epoch are no "
            "longer cleared at the start of the next window (add a `zero_grad()` before the loop if "
            "that matters)."
        ),
    )
    valid = (
        "for i, (x, y) in enumerate(loader):\n    loss = crit(model(x), y) / n\n    loss.backward()\n"
        "    if (i + 1) % n == 0:\n        optimizer.step()\n        optimizer.zero_grad()",
        # zero_grad at the start of a window
        "for i, (x, y) in enumerate(loader):\n    if i % accum == 0:\n        optimizer.zero_grad()\n"
        "    crit(model(x), y).backward()\n    if (i + 1) % accum == 0:\n        optimizer.step()",
        # no accumulation: step every iteration
        "for x, y in loader:\n    optimizer.zero_grad()\n    crit(model(x), y).backward()\n    optimizer.step()",
        # zero_grad once per epoch, in the outer loop
        "for epoch in range(E):\n    optimizer.zero_grad()\n    for i, b in enumerate(loader):\n"
        "        model(b).loss.backward()\n        if (i + 1) % accum == 0:\n            optimizer.step()",
        # accelerate's accumulate(): the prepared optimizer skips zero_grad between updates
        "for batch in loader:\n    with accelerator.accumulate(model):\n        loss = model(**batch).loss\n"
        "        accelerator.backward(loss)\n        if accelerator.sync_gradients:\n"
        "            optimizer.step()\n        optimizer.zero_grad()",
        # a GAN: the generator steps every n_critic iterations with its own zero_grad
        "for i, real in enumerate(loader):\n    d_opt.zero_grad()\n    d_loss(real).backward()\n    d_opt.step()\n"
        "    if i % n_critic == 0:\n        g_opt.zero_grad()\n        g_loss().backward()\n        g_opt.step()",
        # a skipped step that is not accumulation (NaN guard)
        "for x, y in loader:\n    optimizer.zero_grad()\n    loss = crit(model(x), y)\n    loss.backward()\n"
        "    if torch.isfinite(loss):\n        optimizer.step()",
        # nanoGPT: inner micro-step loop, step and zero_grad after it
        "while True:\n    for micro_step in range(gradient_accumulation_steps):\n"
        "        logits, loss = model(X, Y)\n        scaler.scale(loss).backward()\n"
        "    scaler.step(optimizer)\n    scaler.update()\n    optimizer.zero_grad(set_to_none=True)",
        # litgpt / Fabric: step and zero_grad both under `if not is_accumulating`
        "for batch in loader:\n    iter_num += 1\n    is_accumulating = iter_num % accum_iters != 0\n"
        "    with fabric.no_backward_sync(model, enabled=is_accumulating):\n"
        "        fabric.backward(model(batch).loss / accum_iters)\n"
        "    if not is_accumulating:\n        optimizer.step()\n        optimizer.zero_grad()",
    )
    invalid = (
        Invalid(
            "for i, (x, y) in enumerate(loader):\n    optimizer.zero_grad()\n    loss = crit(model(x), y) / n\n"
            "    loss.backward()\n    if (i + 1) % n == 0:\n        optimizer.step()",
            line=2,
        ),
        # zero_grad after the conditional step, but unconditional
        Invalid(
            "for i, b in enumerate(loader):\n    model(b).loss.backward()\n    if (i + 1) % accum_steps == 0:\n"
            "        optimizer.step()\n    optimizer.zero_grad()",
            line=5,
        ),
        # a flag computed from a modulo
        Invalid(
            "for it, batch in enumerate(loader):\n    is_accumulating = (it + 1) % accum != 0\n"
            "    opt.zero_grad()\n    fabric.backward(model(batch).loss)\n    if not is_accumulating:\n"
            "        opt.step()",
            line=3,
        ),
        # scaler.step(opt) under the condition, self.optimizer
        Invalid(
            "def train(self):\n    for step, batch in enumerate(self.loader):\n        self.optimizer.zero_grad()\n"
            "        self.scaler.scale(self.model(batch)).backward()\n"
            "        if step % self.args.gradient_accumulation_steps == 0 or step == len(self.loader) - 1:\n"
            "            self.scaler.step(self.optimizer)\n            self.scaler.update()",
            line=3,
        ),
        # model.zero_grad() on the model the optimizer updates
        Invalid(
            "import torch\nopt = torch.optim.AdamW(model.parameters())\nfor i, b in enumerate(loader):\n"
            "    model.zero_grad()\n    model(b).loss.backward()\n    if (i + 1) % accum == 0:\n        opt.step()",
            line=4,
        ),
        # a counter compared with the accumulation count
        Invalid(
            "count = 0\nfor b in loader:\n    optimizer.zero_grad(set_to_none=True)\n    model(b).loss.backward()\n"
            "    count += 1\n    if count == args.gradient_accumulation_steps:\n        optimizer.step()\n"
            "        count = 0",
            line=3,
        ),
        # accelerate without accumulate(): the flag is never False, zero_grad really clears
        Invalid(
            "for step, batch in enumerate(loader):\n    outputs = model(**batch)\n"
            "    accelerator.backward(outputs.loss / accum)\n    optimizer.zero_grad()\n"
            "    if step % accum == 0:\n        optimizer.step()\n        lr_scheduler.step()",
            line=4,
        ),
        # inside a `with` block (autocast) in the loop
        Invalid(
            "import torch\nfor i, b in enumerate(loader):\n    with torch.autocast('cuda'):\n"
            "        optimizer.zero_grad()\n        loss = model(b).loss\n    loss.backward()\n"
            "    if (i + 1) % grad_accum == 0:\n        optimizer.step()",
            line=4,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        reported: set[int] = set()
        for step in training.of_kind("step", "scaler_step"):
            optimizer = _optimizer_expr(step)
            key = dotted(optimizer)
            loop = innermost_loop(step.site)
            if key is None or loop is None:
                continue
            condition = training.under_accumulation(step.site, loop.node)
            if condition is None:
                continue
            scope = step.site.scope
            if not self._backward_every_iteration(training, scope, loop, condition):
                continue
            for zero in training.events_in(scope, "zero_grad"):
                if id(zero.site.node) in reported or not in_loop(zero.site, loop):
                    continue
                if not self._same_optimizer(model, zero, optimizer, scope):
                    continue
                if not self._unconditional(zero.site, loop) or self._inside_accumulate(zero.site):
                    continue
                reported.add(id(zero.site.node))
                step_line = model.position(step.site.node).start.line
                yield Diagnostic(
                    zero.call,
                    f"`{model.code(zero.call.func)}()` runs on every iteration but the optimizer steps only "
                    f"at the end of an accumulation window (line {step_line}), so all but the last "
                    "microbatch's gradients are thrown away; call it right after the step, under the "
                    "same condition.",
                    related=((step.site.node, "the optimizer steps here, under an accumulation condition"),),
                    fix=self._move_fix(model, training, zero, step, loop),
                )

    @staticmethod
    def _move_fix(model: FileModel, training, zero: Event, step: Event, loop: Frame) -> FixSpec | None:
        """Move the ``zero_grad()`` line to right after the step line. Only when the step is the one
        step of that optimizer in the loop, both calls stand alone on their lines, the ``zero_grad()``
        sits in the loop body (or a ``with`` block in it) and its block keeps another statement."""
        key = dotted(_optimizer_expr(step))
        steps = [
            e
            for e in training.events_in(step.site.scope, "step", "scaler_step")
            if in_loop(e.site, loop) and dotted(_optimizer_expr(e)) == key
        ]
        zero_statement, step_statement = zero.site.statement, step.site.statement
        if (
            steps != [step]
            or not standalone_call(zero_statement, zero.call)
            or not standalone_call(step_statement, step.call)
            or any(f.kind != "with" for f in frames_inside(zero.site, loop))
        ):
            return None
        block = block_of(zero.site.scope.node, zero_statement)
        if not isinstance(block, cst.IndentedBlock) or len(block.body) < 2:
            return None
        indent = line_indent(model, step_statement)
        moved = reindented(model, zero_statement, indent) if indent is not None else None
        if moved is None or line_indent(model, zero_statement) is None:
            return None
        content = "".join(line + "\n" for line in whole_lines(model, step_statement)) + moved
        if ends_file(model, step_statement):
            content = content[:-1]
        return FixSpec(
            Applicability.UNSAFE,
            f"Move `{model.code(zero.call.func)}()` right after the step on line "
            f"{model.position(step.call).start.line}",
            (
                TextEditSpec(zero_statement, "delete_lines", ""),
                TextEditSpec(step_statement, "delete_lines", content),
            ),
        )

    @staticmethod
    def _backward_every_iteration(training, scope: Scope, loop: Frame, condition: Frame) -> bool:
        """A backward runs on every iteration, and none runs only with the step: a backward under the
        step's own condition (a GAN generator updated every n_critic iterations) means the
        unconditional backward belongs to something else."""
        every = False
        for event in training.events_in(scope, "backward", "scaled_backward"):
            if not in_loop(event.site, loop):
                continue
            if any(f.node is condition.node for f in event.site.frames):
                return False
            every = True
        return every

    @staticmethod
    def _same_optimizer(model: FileModel, zero: Event, optimizer: cst.BaseExpression, scope: Scope) -> bool:
        if zero.key is None:
            return False
        if zero.key == dotted(optimizer):
            return True
        # model.zero_grad() where the optimizer is built from model.parameters()
        return any(
            isinstance(value, cst.Call) and mentions_parameters_of(value, zero.key)
            for value in model.values_of(optimizer, scope)
        )

    @staticmethod
    def _unconditional(site: Site, loop: Frame) -> bool:
        """No ``if``, loop or exception handler between the loop body and the site."""
        for frame in frames_inside(site, loop):
            if frame.kind in ("if", "loop") or (frame.kind == "try" and frame.branch == "handler"):
                return False
        return True

    @staticmethod
    def _inside_accumulate(site: Site) -> bool:
        for frame in site.frames:
            if frame.kind == "with" and isinstance(frame.node, cst.With):
                for item in frame.node.items:
                    if isinstance(item.item, cst.Call) and attr_name(item.item) in ("accumulate", "no_sync"):
                        return True
        return False
