"""TL301 accumulation-mean-of-means."""

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
    call_pattern,
)
from trainlint.model import (
    FileModel,
    Scope,
    attr_name,
    dotted,
    walk,
)
from trainlint.model.crossfile import (
    Elsewhere,
    constructed_class,
    project_method,
    related_elsewhere,
    shown_path,
)
from trainlint.model.losses import (
    Division,
    call_reaches_backward,
    division_reaches_backward,
    divisions,
    returns_division,
    snippet,
)
from trainlint.model.tokens import LossOrigin, builds_language_model, token_evidence
from trainlint.model.training import (
    counted_by_callers,
    counts_loop_items,
    is_step_count_name,
    modulo_divisors,
)


class AccumulationMeanOfMeans(Rule):
    id = "TL301"
    name = "accumulation-mean-of-means"
    severity = Severity.WARNING
    probe = True
    summary = "A token-mean loss divided by the number of accumulation steps: microbatches weigh the same whatever their token counts."
    # Prefilter: a backward call (`backward_calls`); a division (`/`, `/=`, `* (1 / n)`, `.div(n)`); a
    # step-count divisor (`is_step_count_name` lower-cases: "acc"/"gas" in every letter case; a `%`
    # condition's divisor; a backslash for an escaped string key; `len(` for a micro-batch count that
    # another method passes, see ``counted_by_callers``); padding evidence (one of the words
    # `TokenEvidence._scan` looks for in the raw text before walking, or a PADDING_DATA import/call).
    tokens = ("backward",)
    requires = (
        call_pattern("backward"),
        ("/", "div"),
        (
            *("acc", "Acc", "aCc", "acC", "ACc", "AcC", "aCC", "ACC"),
            *("gas", "Gas", "gAs", "gaS", "GAs", "GaS", "gAS", "GAS"),
            *("%", "\\", "len("),
        ),
        (
            *("attention_mask", "pad_token", "pad_id", "pad_index", "padding", "pad_to_multiple_of"),
            *("pad_sequence", "pad_right", "pad_left", "mask_prompt", "loss_mask", "labels_mask"),
            *("label_mask", "ignore_index", "-100", "DataCollator", "SFTDataset", "get_sft_collate_fn"),
            *("Alpaca", "Deita", "Dolly", "FLAN", "JSON", "LIMA", "LongForm"),
        ),
    )
    # the token mean may come from another project file (a helper, a base class's method: no padding
    # word need show here), or a loss class there divides it by the accumulation steps (no division here)
    project_requires = (requires[0], requires[2])
    # In the code: the backward that the loss class's result or the division reaches (a call of it, or
    # of this file's function that runs one), or the loss function that returns the division to
    # callers elsewhere (`forward`, `__call__`, a name with "loss": ``_returned_by_a_loss``).
    project_gate = (
        ("call:backward", "call:manual_backward", "def:forward", "def:__call__", "def~(?i:loss)"),
    )
    # In the tree: padding evidence, a loss that may be a token mean (a cross-entropy, a language model,
    # next-token or masked targets) and its division by what may be the step count in a scope that may
    # backpropagate it
    gate_check = "gate_mean_of_means.mean_of_means_possible"
    # Cross-file: such a division whatever the file calls its loss and model (padding evidence, or a
    # dividend that may be another file's token mean), or a call of another file's loss class
    project_gate_check = "gate_mean_of_means.mean_of_means_possible_elsewhere"
    # The imported definitions a cross-file finding can rest on: those reached through what the divided
    # loss's origin calls (a helper, a base class's method, an instance's method, a language model's
    # builder) or through the loss class an instance called here is built from; an import reached
    # through none of them (the trainer's `Accelerator`, a dataset class) does not send the file to libcst
    project_callees = "gate_mean_of_means.token_mean_callees"

    @classmethod
    def wants_fact(cls, kind: str, facts: dict[str, Any]) -> bool:
        if kind == "class":
            return "returns_token_mean_methods" in facts or "returns_divided_token_mean_methods" in facts
        # (a builder of a language model: the loss of the model it returns may be a token mean)
        return kind == "function" and ("returns_token_mean" in facts or builds_language_model(facts))

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
        """
        import torch
        from torch import nn
        criterion = nn.CrossEntropyLoss()
        for i, (images, target) in enumerate(loader):
            output = model(images)
            loss = criterion(output, target) / accum_steps
            loss.backward()
            if (i + 1) % accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
        """,
        # sequence classification .loss (per example), even with padding in the file
        """
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        model = AutoModelForSequenceClassification.from_pretrained('bert-base-cased')
        tok = AutoTokenizer.from_pretrained('bert-base-cased')
        enc = tok(texts, padding='longest')
        for step, batch in enumerate(loader):
            outputs = model(**batch)
            loss = outputs.loss
            loss = loss / args.gradient_accumulation_steps
            accelerator.backward(loss)
        """,
        # nanoGPT: fixed-length blocks, no padding or masking anywhere
        """
        for micro_step in range(gradient_accumulation_steps):
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            X, Y = get_batch('train')
            scaler.scale(loss).backward()
        """,
        # litgpt pretraining: token cross-entropy on packed blocks, no padding evidence
        """
        from litgpt.utils import chunked_cross_entropy
        input_ids = train_data[:, 0:block].contiguous()
        targets = train_data[:, 1:block + 1].contiguous()
        logits = model(input_ids)
        loss = chunked_cross_entropy(logits, targets)
        fabric.backward(loss / train.gradient_accumulation_iters(devices))
        """,
        # sum reduction: the count division is the caller's choice, not a mean of means
        """
        import torch.nn.functional as F
        labels[labels == pad] = -100
        loss = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100, reduction='sum')
        loss = loss / accum_steps
        loss.backward()
        """,
        # transformers normalises by the window's token count (accelerate's reference pattern)
        """
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(name)
        n = accelerator.gather(sum((b['labels'] != -100).sum() for b in window)).sum().item()
        for batch in window:
            outputs = model(**batch, num_items_in_batch=n)
            loss = outputs.loss
            loss = loss * gradient_accumulation_steps * accelerator.num_processes
            accelerator.backward(loss)
        losses = accelerator.gather(sum(losses)).sum().item() / (accelerator.num_processes * gradient_accumulation_steps)
        """,
        # only logged: the division never reaches backward
        """
        import torch.nn.functional as F
        labels = batch['labels']  # -100 on padding
        mask = batch['attention_mask']
        loss = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)
        loss.backward()
        running += loss.item() / accum_steps
        """,
        # summed and divided by the window's global token count, computed outside the microbatch loop
        """
        import torch.nn.functional as F
        n_tokens = window_tokens(window)  # all-reduced
        for batch in window:
            labels = batch['labels']  # -100 on padding
            loss = F.cross_entropy(model(batch['input_ids']).flatten(0, 1), labels.flatten(), reduction='sum')
            (loss / n_tokens).backward()
        """,
        # the PyTorch AMP recipe: generic loss_fn, no token data
        """
        scaler = torch.amp.GradScaler()
        for epoch in epochs:
            for i, (input, target) in enumerate(data):
                with torch.autocast(device_type='cuda', dtype=torch.float16):
                    output = net(input)
                    loss = loss_fn(output, target)
                    loss = loss / iters_to_accumulate
                scaler.scale(loss).backward()
                if (i + 1) % iters_to_accumulate == 0:
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad(set_to_none=True)
        """,
        # divided by something that is not the accumulation count
        """
        import torch.nn.functional as F
        mask = batch['attention_mask']
        loss = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)
        (loss / temperature).backward()
        """,
        # a name with accum in it that is the token count of the window
        """
        import torch.nn.functional as F
        mask = batch['attention_mask']
        loss = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)
        (loss / accum_tokens).backward()
        """,
        # sequence classification with flattened logits over the class axis
        """
        from torch.nn import CrossEntropyLoss
        loss_fct = CrossEntropyLoss()
        mask = batch['attention_mask']
        loss = loss_fct(logits.view(-1, self.num_labels), labels.view(-1))
        loss = loss / args.gradient_accumulation_steps
        loss.backward()
        """,
        # the same trainer done right: a summed loss over the window's valid tokens, which the other
        # method counts and passes
        """
        import torch.nn.functional as F

        class Trainer:
            def micro_step(self, batch, n_tokens):
                logits, labels = self.model(batch["input_ids"]), batch["labels"]
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
                (loss / n_tokens).backward()

            def train_step(self, micro_batches):
                tokens = sum(int((b["labels"] != -100).sum()) for b in micro_batches)
                for batch in micro_batches:
                    self.micro_step(batch, tokens)
        """,
        # a loss from config scaled back to a token sum before the window's division
        """
        from mylib import config

        class Recipe:
            def setup(self, cfg, tokenizer):
                self.criterion = config.instantiate(cfg.criterion)
                self.collate = config.collate(pad_id=tokenizer.pad_id)

            def fit(self, loader):
                for i, batch in enumerate(loader):
                    n = (batch["labels"] != self.criterion.ignore_index).sum()
                    loss = self.criterion(self.net(batch["ids"]), batch["labels"]) * n
                    loss = loss / self.grad_accum
                    loss.backward()
        """,
    )
    invalid = (
        # a loss built from config (its `ignore_index` read here), computed by a method of the class
        Invalid(
            """
            from mylib import config

            class Recipe:
                def setup(self, cfg, tokenizer):
                    self.criterion = config.instantiate(cfg.criterion)
                    self.collate = config.collate(pad_id=tokenizer.pad_id, ignore=self.criterion.ignore_index)

                def step_loss(self, batch):
                    out = self.criterion(self.net(batch["ids"]), batch["labels"])
                    return out

                def fit(self, loader):
                    for i, batch in enumerate(loader):
                        loss = self.step_loss(batch)
                        loss = loss / self.grad_accum
                        loss.backward()
            """,
            line=15,
        ),
        # HF causal LM, padded batches, `.loss` traced through `outputs`
        Invalid(
            """
            from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq
            model = AutoModelForCausalLM.from_pretrained(name)
            for step, batch in enumerate(loader):
                outputs = model(**batch)
                loss = outputs.loss
                loss = loss / args.gradient_accumulation_steps
                accelerator.backward(loss)
            """,
            line=6,
        ),
        # in-place division
        Invalid(
            """
            import torch.nn.functional as F
            labels = batch['labels']  # -100 on padding and prompt
            attention_mask = batch['attention_mask']
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
            loss /= args.gradient_accumulation_steps
            loss.backward()
            """,
            line=5,
        ),
        # multiply by the reciprocal
        Invalid(
            """
            import torch.nn.functional as F
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=tok.pad_token_id)
            loss = loss * (1 / n_accum)
            loss.backward()
            """,
            line=3,
        ),
        # divided inside the backward call
        Invalid(
            """
            from torch import nn
            criterion = nn.CrossEntropyLoss(ignore_index=-100)
            for i, batch in enumerate(loader):
                logits = model(batch['input_ids'], attention_mask=batch['attention_mask'])
                loss = criterion(logits.view(-1, vocab_size), batch['labels'].view(-1))
                (loss / accum).backward()
            """,
            line=6,
        ),
        # a method: self.accumulation_steps, self.criterion set in __init__
        Invalid(
            """
            import torch

            class Trainer:
                def __init__(self, accumulation_steps):
                    self.criterion = torch.nn.CrossEntropyLoss(ignore_index=self.tokenizer.pad_token_id)
                    self.accumulation_steps = accumulation_steps

                def train_step(self, batch):
                    logits = self.model(batch['input_ids'])
                    loss = self.criterion(logits.reshape(-1, logits.size(-1)), batch['labels'].reshape(-1))
                    loss = loss / self.accumulation_steps
                    loss.backward()
            """,
            line=11,
        ),
        # litgpt finetuning: fabric.backward, accumulation count from a method, SFT data module
        Invalid(
            """
            from litgpt.data import Alpaca
            from litgpt.utils import chunked_cross_entropy

            def fit(fabric, model, train, batch):
                input_ids, targets = batch['input_ids'], batch['labels']
                logits = model(input_ids)
                loss = chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:])
                fabric.backward(loss / train.gradient_accumulation_iters(devices))
            """,
            line=8,
        ),
        # the divisor is the count of a modulo accumulation condition
        Invalid(
            """
            import torch.nn.functional as F
            for i, batch in enumerate(loader):
                out = model(batch['input_ids'], attention_mask=batch['attention_mask'])
                loss = F.cross_entropy(out.view(-1, out.size(-1)), batch['labels'].view(-1))
                loss = loss / n
                loss.backward()
                if (i + 1) % n == 0:
                    optimizer.step()
                    optimizer.zero_grad()
            """,
            line=5,
        ),
        # a hand-written masked mean per microbatch, then divided by the count
        Invalid(
            """
            import torch.nn.functional as F
            per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction='none')
            mask = batch['attention_mask']
            loss = (per_token * mask).sum() / mask.sum()
            scaler.scale(loss / grad_accum).backward()
            """,
            line=5,
        ),
        # logits, loss = model(x, y) on a local GPT whose forward computes a flattened cross-entropy
        Invalid(
            """
            import torch.nn.functional as F
            from torch import nn

            class GPT(nn.Module):
                def forward(self, idx, targets):
                    logits = self.head(self.body(idx))
                    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)
                    return logits, loss

            model = GPT()
            for step in range(accum_steps):
                x, y = next(batches)
                y[y == pad_id] = -100
                logits, loss = model(x, y)
                loss = loss / accum_steps
                loss.backward()
            """,
            line=15,
        ),
        # model(...).loss inline, masked LM collator
        Invalid(
            """
            from transformers import AutoModelForMaskedLM, DataCollatorForLanguageModeling
            collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
            model = AutoModelForMaskedLM.from_pretrained(name)
            for batch in loader:
                model_engine.backward(model(**batch).loss / accumulate_grad_batches)
            """,
            line=5,
        ),
        # the trainer split in two: one method's token mean divided by the count the other passes
        Invalid(
            """
            import torch.nn.functional as F

            class Trainer:
                def micro_step(self, batch, n_micro):
                    logits, labels = self.model(batch["input_ids"]), batch["labels"]
                    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
                    (loss / n_micro).backward()

                def train_step(self, micro_batches):
                    for batch in micro_batches:
                        self.micro_step(batch, len(micro_batches))
                    self.optimizer.step()
            """,
            line=7,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        if model.project is not None:
            yield from self._through_loss_wrappers(model)
        evidence = None
        counts_by_scope: dict[int, set[str]] = {}
        for division in divisions(model):
            scope = division.site.scope
            if id(scope) not in counts_by_scope:
                counts_by_scope[id(scope)] = self._modulo_counts(model, scope)
            if not self._is_step_count(
                model, division.divisor, scope, counts_by_scope[id(scope)]
            ) and not counts_loop_items(model, division.divisor, division.site):
                continue
            if not division_reaches_backward(model, division) and not _returned_by_a_loss(division):
                continue
            if evidence is None:
                evidence = token_evidence(model)
                if not evidence.padding and model.project is None:
                    return
            origin = evidence.loss_origin(division.dividend, scope, division.site)
            if origin is None or origin.reduction != "mean":
                continue
            # a hand-written masked mean of another file shows itself that the token count varies
            if not evidence.padding and origin.elsewhere is None:
                continue
            yield self._diagnostic(model, division, origin, evidence.padding_near(scope))

    def _through_loss_wrappers(self, model: FileModel) -> Iterator[Diagnostic]:
        """``loss = criterion(logits, labels)`` then ``loss.backward()``, where ``criterion`` is a loss
        class of another project file whose ``__call__``/``forward`` returns its token-mean
        cross-entropy divided by the accumulation steps: reported at the call, the division related."""
        for site in model.calls:
            call = site.node
            assert isinstance(call, cst.Call)
            if dotted(call.func) is None:
                continue
            fact = constructed_class(model, call.func, site.scope)
            methods = fact.facts.get("returns_divided_token_mean_methods", ()) if fact is not None else ()
            method = next((m for m in ("__call__", "forward") if m in methods), None)
            if fact is None or method is None or not call_reaches_backward(model, site):
                continue
            found = project_method(model, cst.Attribute(call.func, cst.Name(method)), site.scope)
            where = found.facts.get("returns_divided_token_mean") if found is not None else None
            if found is None or where is None:
                continue
            at = Elsewhere(
                shown_path(found.path), where[0], where[1], "the token mean divided by the steps here"
            )
            yield Diagnostic(
                call,
                f"`{model.code(call.func)}` (a `{fact.name}`) returns a token-mean loss divided by the number "
                "of accumulation steps, so each microbatch weighs the same however many valid tokens it "
                "holds. Sum-reduce the loss and divide by the number of valid tokens in the whole "
                "accumulation window (all-reduced across ranks).",
                elsewhere=related_elsewhere(at),
            )

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
            elsewhere=related_elsewhere(origin.elsewhere),
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
        if (
            path not in modulo
            and not is_step_count_name(path.rsplit(".", 1)[-1])
            and not counted_by_callers(model, expr, scope)
        ):
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


def _returned_by_a_loss(division: Division) -> bool:
    """A loss function or loss module (``__call__``, ``forward``, a name with "loss") that returns the
    divided loss: its callers backpropagate it, wherever they are."""
    function = division.site.scope.node
    if not isinstance(function, cst.FunctionDef):
        return False
    name = function.name.value
    return (name in ("__call__", "forward") or "loss" in name.lower()) and returns_division(division)
