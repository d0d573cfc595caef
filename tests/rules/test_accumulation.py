"""TL3xx (gradient accumulation and the loss) and the token evidence they build on."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from trainlint.engine import lint_source
from trainlint.model import FileModel
from trainlint.model.tokens import token_evidence
from trainlint.rule import registry


def tl301(code: str):
    return lint_source(textwrap.dedent(code), "snippet.py", ["TL301"])


# -- TL301: what is reported, where, and what it says -------------------------------------------------

HF_SFT_LOOP = """
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq

    model = AutoModelForCausalLM.from_pretrained("gpt2")
    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)

    def train(model, loader, optimizer, args):
        for step, batch in enumerate(loader):
            outputs = model(**batch)
            loss = outputs.loss
            loss = loss / args.gradient_accumulation_steps
            loss.backward()
            if (step + 1) % args.gradient_accumulation_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
"""


def test_message_names_the_division_the_cause_and_the_fix() -> None:
    (finding,) = tl301(HF_SFT_LOOP)
    assert finding.rule == "TL301"
    assert finding.line == 11
    assert "`loss / args.gradient_accumulation_steps`" in finding.message
    assert "however many valid tokens" in finding.message
    assert "whole accumulation window" in finding.message
    assert "across ranks" in finding.message
    assert finding.fix is None


def test_related_points_at_the_loss_and_at_the_padding_evidence() -> None:
    (finding,) = tl301(HF_SFT_LOOP)
    lines = {r.line: r.message for r in finding.related}
    # the model call whose .loss is divided (line 9), then the padding collator (line 2 import)
    assert 9 in lines and "language-model loss" in lines[9]
    evidence = [(line, m) for line, m in lines.items() if m.startswith("variable number of valid tokens")]
    assert len(evidence) == 1
    assert evidence[0][0] in (2, 5)  # the collator import or its -100 label padding


def test_the_reported_range_is_the_division() -> None:
    (finding,) = tl301(
        """
        import torch.nn.functional as F
        mask = batch["attention_mask"]
        loss = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)
        fabric.backward(loss / accum_iters)
        """
    )
    assert (finding.line, finding.column, finding.end_column) == (5, 17, 35)


def test_script_style_module_code_is_a_scope() -> None:
    findings = tl301(
        """
        import torch
        import torch.nn.functional as F

        tokenizer.pad_token = tokenizer.eos_token
        for i, batch in enumerate(loader):
            logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), batch["labels"][:, 1:].reshape(-1))
            loss = loss / GRAD_ACCUM
            loss.backward()
            if (i + 1) % GRAD_ACCUM == 0:
                opt.step()
                opt.zero_grad()
        """
    )
    assert [f.line for f in findings] == [9]


def test_run_mlm_style_loop_with_the_language_modeling_collator() -> None:
    findings = tl301(
        """
        from transformers import AutoModelForMaskedLM, DataCollatorForLanguageModeling

        def main(args):
            model = AutoModelForMaskedLM.from_pretrained(args.model_name_or_path)
            data_collator = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm_probability=0.15)
            model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
            for epoch in range(args.num_train_epochs):
                model.train()
                for step, batch in enumerate(train_dataloader):
                    outputs = model(**batch)
                    loss = outputs.loss
                    loss = loss / args.gradient_accumulation_steps
                    accelerator.backward(loss)
                    if step % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1:
                        optimizer.step()
                        optimizer.zero_grad()
        """
    )
    assert [f.line for f in findings] == [13]


def test_cnn_dividing_by_the_count_is_not_reported() -> None:
    code = """
        import torch
        from torch import nn

        model = torchvision.models.resnet50()
        criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for i, (images, target) in enumerate(train_loader):
            output = model(images)
            loss = criterion(output, target)
            loss = loss / args.accum_steps
            loss.backward()
            if (i + 1) % args.accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
        """
    assert tl301(code) == []
    # The same loop on a padded token batch is reported: the rule is not simply off for this shape.
    token_version = (
        textwrap.dedent(code)
        .replace("output = model(images)", "output = model(ids).view(-1, vocab)")
        .replace("images, target", "ids, target")
        + "\nmask = batch['attention_mask']\n"
    )
    assert [f.line for f in tl301(token_version)] == [11]


def test_pytorch_amp_gradient_accumulation_recipe_is_not_reported() -> None:
    # From the "Automatic Mixed Precision examples" page of the PyTorch docs.
    code = """
        scaler = torch.amp.GradScaler()

        for epoch in epochs:
            for i, (input, target) in enumerate(data):
                with torch.autocast(device_type='cuda', dtype=torch.float16):
                    output = model(input)
                    loss = loss_fn(output, target)
                    loss = loss / iters_to_accumulate

                # Accumulates scaled gradients.
                scaler.scale(loss).backward()

                if (i + 1) % iters_to_accumulate == 0:
                    # may unscale_ here if desired (e.g., to allow clipping unscaled gradients)

                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad()
        """
    assert tl301(code) == []


def test_sequence_classification_loss_is_not_reported_even_with_padding() -> None:
    code = """
        from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding
        model = AutoModelForSequenceClassification.from_pretrained("bert-base-cased", num_labels=2)
        collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            loss = outputs.loss
            loss = loss / gradient_accumulation_steps
            accelerator.backward(loss)
        """
    assert tl301(code) == []
    # With a causal LM instead the same loop is reported.
    lm = code.replace("AutoModelForSequenceClassification", "AutoModelForCausalLM")
    assert [f.line for f in tl301(lm)] == [8]


def test_fixed_length_pretraining_without_padding_is_not_reported() -> None:
    nanogpt = """
        for micro_step in range(gradient_accumulation_steps):
            if ddp:
                model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            X, Y = get_batch('train')
            scaler.scale(loss).backward()
        """
    assert tl301(nanogpt) == []
    litgpt_pretrain = """
        from litgpt.utils import chunked_cross_entropy

        def fit(fabric, model, train_iterator, train, devices):
            for train_data in train_iterator:
                input_ids = train_data[:, 0 : model.max_seq_length].contiguous().long()
                targets = train_data[:, 1 : (model.max_seq_length + 1)].contiguous().long()
                logits = model(input_ids)
                loss = chunked_cross_entropy(logits, targets)
                fabric.backward(loss / train.gradient_accumulation_iters(devices))
        """
    assert tl301(litgpt_pretrain) == []
    # The finetuning script differs by its padded, prompt-masked SFT data: reported.
    litgpt_finetune = "from litgpt.data import Alpaca\n" + textwrap.dedent(litgpt_pretrain)
    assert [f.line for f in tl301(litgpt_finetune)] == [11]


def test_division_in_a_comment_is_not_reported() -> None:
    code = """
        from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq
        model = AutoModelForCausalLM.from_pretrained(name)
        for batch in loader:
            outputs = model(**batch)
            loss = outputs.loss
            # loss = loss / args.gradient_accumulation_steps
            model.backward(loss)
        """
    assert tl301(code) == []


def test_accelerate_num_items_in_batch_reference_pattern_is_not_reported() -> None:
    code = """
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM-360M")
        for update_step in range(total_gradient_updates):
            local_num_items_in_batch = sum([(batch["labels"].ne(-100)).sum() for batch in batch_samples])
            num_items_in_batch = accelerator.gather(local_num_items_in_batch).sum().item()
            losses = []
            for i, batch in enumerate(batch_samples):
                outputs = model(**batch, use_cache=False, num_items_in_batch=num_items_in_batch)
                loss = outputs.loss
                loss = loss * gradient_accumulation_steps * accelerator.num_processes
                accelerator.backward(loss)
                losses.append(loss.detach())
            losses = accelerator.gather(sum(losses)).sum().item() / (
                accelerator.num_processes * gradient_accumulation_steps
            )
        """
    assert tl301(code) == []
    # ... but dividing that normalised loss by the count again would be a different bug, not this one
    again = code.replace(
        "loss = loss * gradient_accumulation_steps * accelerator.num_processes",
        "loss = loss / gradient_accumulation_steps",
    )
    assert tl301(again) == []


def test_sum_reduced_loss_divided_by_the_count_is_not_reported() -> None:
    code = """
        import torch.nn.functional as F
        mask = batch["attention_mask"]
        loss = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100, reduction="sum")
        loss = loss / accum_steps
        loss.backward()
        """
    assert tl301(code) == []
    assert [f.line for f in tl301(code.replace(', reduction="sum"', ""))] == [5]


def test_a_loss_only_logged_is_not_reported() -> None:
    code = """
        import torch.nn.functional as F
        mask = batch["attention_mask"]
        loss = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)
        loss.backward()
        total_loss += loss.detach().float() / accum_steps
        log_loss = loss.item() / args.gradient_accumulation_steps
        """
    assert tl301(code) == []


def test_backward_through_a_derived_name_and_a_local_helper() -> None:
    code = """
        import torch.nn.functional as F

        def step(batch, accum_steps):
            def do_backward(x):
                x.backward()
            mask = batch["attention_mask"]
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            scaled = loss / accum_steps
            total = scaled + aux
            do_backward(total)
        """
    assert [f.line for f in tl301(code)] == [9]


def test_loss_function_of_the_same_file_is_followed_one_level() -> None:
    code = """
        import torch.nn.functional as F

        def lm_loss(logits, labels):
            shift_logits = logits[..., :-1, :].contiguous()
            return F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), labels[..., 1:].reshape(-1))

        def train(model, loader, grad_accum_steps):
            for batch in loader:
                logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
                loss = lm_loss(logits, batch["labels"])
                (loss / grad_accum_steps).backward()
        """
    assert [f.line for f in tl301(code)] == [12]


def test_segmentation_void_label_is_not_token_padding() -> None:
    code = """
        from torch import nn
        criterion = nn.CrossEntropyLoss(ignore_index=255)
        for i, (image, mask) in enumerate(loader):
            out = model(image)
            loss = criterion(out, mask) / accum_steps
            loss.backward()
        """
    assert tl301(code) == []


def test_noqa_suppresses() -> None:
    code = HF_SFT_LOOP.replace(
        "loss = loss / args.gradient_accumulation_steps",
        "loss = loss / args.gradient_accumulation_steps  # noqa: TL301",
    )
    assert tl301(code) == []


def test_tl301_documentation_carries_the_numeric_illustration() -> None:
    rule = registry().get("TL301")
    assert rule is not None
    text = rule.explain()
    assert "10 valid tokens" in text and "1000" in text
    # 1/(2*10) and 1/(2*1000) differ by a factor 100
    assert "0.05" in text and "0.0005" in text and "hundred" in text
    assert len(rule.valid) >= 8 and len(rule.invalid) >= 8


# -- the evidence module ------------------------------------------------------------------------------


def _model(code: str) -> FileModel:
    return FileModel.from_source(textwrap.dedent(code))


def _origin_of_z(code: str):
    """The origin of the value bound to ``z``, seen from a call ``use(z)`` appended to the code."""
    model = _model(code + "\nuse(z)")
    site = model.calls[-1]
    return token_evidence(model).loss_origin(cst.Name("z"), site.scope, site)


@pytest.mark.parametrize(
    ("code", "reduction"),
    [
        (
            "import torch.nn.functional as F\nloss = F.cross_entropy(x.view(-1, V), y.view(-1))\nz = loss / n",
            "mean",
        ),
        (
            "import torch.nn.functional as F\nloss = F.cross_entropy(x, y, ignore_index=-100)\nz = loss / n",
            "mean",
        ),
        (
            "import torch.nn.functional as F\nloss = F.cross_entropy(x.view(-1, V), y.view(-1), reduction='sum')\nz = loss",
            "sum",
        ),
        (
            "import torch.nn.functional as F\nl = F.cross_entropy(x, y, reduction='none')\nz = (l * m).sum() / m.sum()",
            "mean",
        ),
        (
            "import torch.nn.functional as F\nl = F.cross_entropy(x, y, reduction='none')\nz = (l * m).sum() / n_global",
            "normalized",
        ),
        (
            "from transformers import GPT2LMHeadModel\nm = GPT2LMHeadModel(cfg)\nout = m(**b)\nz = out.loss / n",
            "mean",
        ),
        (
            "from transformers import GPT2LMHeadModel\nm = GPT2LMHeadModel(cfg)\nz = m(**b)['loss'] / n",
            "mean",
        ),
        ("from transformers import GPT2LMHeadModel\nm = GPT2LMHeadModel(cfg)\nz = m(**b)[0] / n", "mean"),
    ],
)
def test_loss_origin_reductions(code: str, reduction: str) -> None:
    origin = _origin_of_z(code)
    assert origin is not None
    assert origin.reduction == reduction


@pytest.mark.parametrize(
    "code",
    [
        "from torch import nn\nc = nn.CrossEntropyLoss()\nloss = c(out, y)\nz = loss / n",  # per example
        "loss = loss_fn(out, y)\nz = loss / n",  # unknown function
        "from transformers import BertForSequenceClassification\nm = BertForSequenceClassification(c)\nz = m(**b).loss / n",
        "z = loss / n",  # a parameter: nothing to trace
        # a subscripted result of something that is not a model
        "from transformers import AutoModelForCausalLM\nloss = compute(x)[0]\nz = loss / n",
        "import torch.nn.functional as F\nloss = F.cross_entropy(x.view(-1, self.num_labels), y.view(-1))\nz = loss / n",
    ],
)
def test_loss_origin_unknown_or_per_example(code: str) -> None:
    assert _origin_of_z(code) is None


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("x = batch['attention_mask']", "`attention_mask`"),
        ("labels[labels == tok.pad_token_id] = -100", "`pad_token_id`"),
        ("loss = F.cross_entropy(a, b, ignore_index=IGNORE)", "`ignore_index`"),
        ("from transformers import DataCollatorForLanguageModeling", "`DataCollatorForLanguageModeling`"),
        ("import transformers\nc = transformers.DataCollatorForSeq2Seq(tok)", "`DataCollatorForSeq2Seq`"),
        ("from torch.nn.utils.rnn import pad_sequence", "`pad_sequence`"),
        ("enc = tokenizer(texts, padding='max_length', truncation=True)", "tokenizer padding"),
        ("from litgpt.data import Alpaca", "`Alpaca`"),
    ],
)
def test_padding_evidence(code: str, expected: str) -> None:
    found = {e.what for e in token_evidence(_model(code)).padding}
    assert expected in found


@pytest.mark.parametrize(
    "code",
    [
        "conv = nn.Conv2d(3, 64, 3, padding=1)",
        "loss = nn.CrossEntropyLoss(ignore_index=255)",
        "x = F.pad(x, (1, 1))",
        "mask = torch.tril(torch.ones(T, T))\natt = att.masked_fill(mask == 0, float('-inf'))",
        "# labels = -100 for padding\nx = 1",
        "from mylib import Alpaca",
    ],
)
def test_no_padding_evidence(code: str) -> None:
    assert token_evidence(_model(code)).padding == []


def test_evidence_is_built_once_per_file_model() -> None:
    model = _model("x = batch['attention_mask']")
    assert token_evidence(model) is token_evidence(model)


# -- TL302 ----------------------------------------------------------------------------------------------


def tl302(code: str):
    return lint_source(textwrap.dedent(code), "snippet.py", ["TL302"])


def test_tl302_reports_the_running_total_and_points_at_the_backward() -> None:
    (finding,) = tl302(
        """
        total_loss = 0.0
        for x, y in loader:
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            total_loss += loss
        """
    )
    assert finding.line == 7
    assert "`total_loss += loss`" in finding.message and "loss.item()" in finding.message
    assert [r.line for r in finding.related] == [5]


def test_tl302_detached_forms_are_not_reported() -> None:
    base = """
        total = 0.0
        for x, y in loader:
            loss = criterion(model(x), y)
            loss.backward()
            total += {}
        """
    for added in (
        "loss.item()",
        "loss.detach()",
        "float(loss)",
        "loss.detach().cpu()",
        "loss.data",
        "loss.tolist()",
    ):
        assert tl302(base.format(added)) == [], added
    # and the plain tensor is reported, so the loop above can fail
    assert len(tl302(base.format("loss"))) == 1


def test_tl302_total_backpropagated_later_is_not_reported() -> None:
    code = """
        losses = []
        for task in tasks:
            loss = task.loss(model(batch))
            loss.backward(retain_graph=True)
            losses.append(loss)
        total = torch.stack(losses).sum()
        total.backward()
        """
    assert tl302(code) == []


def test_tl302_loss_only_in_an_eval_loop_is_not_reported() -> None:
    code = """
        import torch
        val_loss = 0
        model.eval()
        for x, y in val_loader:
            loss = criterion(model(x), y)
            val_loss += loss
        """
    assert tl302(code) == []


# -- TL303 ----------------------------------------------------------------------------------------------


def tl303(code: str):
    return lint_source(textwrap.dedent(code), "snippet.py", ["TL303"])


def test_tl303_reports_zero_grad_with_the_conditional_step_as_related() -> None:
    (finding,) = tl303(
        """
        for i, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            loss = criterion(model(x), y) / accum_steps
            loss.backward()
            if (i + 1) % accum_steps == 0:
                optimizer.step()
        """
    )
    assert finding.line == 3
    assert finding.severity.value == "error"
    assert "`optimizer.zero_grad()`" in finding.message and "line 7" in finding.message
    assert [r.line for r in finding.related] == [7]


def test_tl303_moving_zero_grad_under_the_condition_fixes_it() -> None:
    code = """
        for i, (x, y) in enumerate(loader):
            loss = criterion(model(x), y) / accum_steps
            loss.backward()
            if (i + 1) % accum_steps == 0:
                optimizer.step()
            optimizer.zero_grad()
        """
    assert [f.line for f in tl303(code)] == [7]
    fixed = code.replace("\n            optimizer.zero_grad()", "\n                optimizer.zero_grad()")
    assert tl303(fixed) == []


def test_tl303_gan_with_two_optimizers_is_not_reported() -> None:
    code = """
        for i, real in enumerate(loader):
            opt_d.zero_grad()
            d_loss(real).backward()
            opt_d.step()
            opt_g.zero_grad()
            if i % n_critic == 0:
                g_loss().backward()
                opt_g.step()
        """
    # opt_g's zero_grad runs every iteration, but its backward only runs with its step
    assert tl303(code) == []


def test_tl302_tl303_documentation_has_numbers() -> None:
    tl302_doc = registry().get("TL302").explain()  # type: ignore[union-attr]
    assert "200 MB" in tl302_doc and "20 GB" in tl302_doc
    tl303_doc = registry().get("TL303").explain()  # type: ignore[union-attr]
    assert "4 examples instead of 32" in tl303_doc
