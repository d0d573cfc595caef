"""TL301's condition on CPython's tree (``Rule.gate_check``): padding evidence, a loss that may be a token
mean, and its division by what may be the accumulation step count in a scope that may backpropagate it.
Files without one never reach libcst for TL301, and no finding changes."""

from __future__ import annotations

import ast
import textwrap

import pytest
from conftest import gate_check_keeps_findings, lint_project

from trainlint.engine import _code_gate, lint_text
from trainlint.gates import code_facts, gates, pass_tree_checks
from trainlint.model.gate_mean_of_means import mean_of_means_possible, mean_of_means_possible_elsewhere
from trainlint.model.project import Project
from trainlint.results import LintOptions
from trainlint.rule import registry

RULE = registry().get("TL301")
OPTIONS = LintOptions(("TL301",), prefilter=False)
ON = LintOptions(("TL301",))

# Spellings of the invalid examples the rule reports: the check must keep each.
KEPT = [
    # the functional loss under another name, divided in place by a key of a config dict
    """
    import torch.nn.functional as Fn
    ce = Fn.cross_entropy
    for step, batch in enumerate(loader):
        loss = ce(model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        loss /= cfg["grad_accum_steps"]
        loss.backward()
    """,
    # a helper of the file runs the backward; the count converted with int()
    """
    from torch import nn
    crit = nn.CrossEntropyLoss(ignore_index=tok.pad_token_id)

    def run_backward(value):
        value.backward()

    for batch in loader:
        loss = crit(model(batch).view(-1, vocab), batch["labels"].view(-1))
        run_backward(loss / int(args.accumulation))
    """,
    # a loss function of the file returns the division; its caller backpropagates
    """
    import torch.nn.functional as F

    class Trainer:
        def compute(self, batch):
            loss = F.cross_entropy(self.model(batch).flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
            return loss.div(self.grad_accum)

        def fit(self, loader):
            for batch in loader:
                out = self.compute(batch)
                out.backward()
    """,
    # forward returns the divided token mean: its callers are elsewhere (the backward in another scope is
    # for the rule's raw-text prefilter, which asks for one)
    """
    import torch.nn.functional as F
    from torch import nn

    class AccumLoss(nn.Module):
        def forward(self, logits, labels, attention_mask):
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            return loss * (1.0 / self.accum_steps)

    def check_grad(x):
        x.sum().backward()
    """,
    # the micro-batch count, by len() of the loop's own list, in an async loop
    """
    import torch.nn.functional as F

    async def fit(micro_batches):
        n = len(micro_batches)
        async for batch in micro_batches:
            loss = F.cross_entropy(logits(batch).flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
            loss *= 1 / n
            loss.backward()
    """,
    # a language model's loss in a while loop, the count a modulo divisor of the file
    """
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(name)
    model.config.pad_token_id = tokenizer.eos_token_id
    i = 0
    while i < total:
        out = model(**next(batches))
        (out["loss"] / every).backward()
        if (i + 1) % every == 0:
            optimizer.step()
        i += 1
    """,
    # a lambda backpropagates a language model's loss; a comprehension does too
    """
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq
    model = AutoModelForCausalLM.from_pretrained(name)
    step = lambda b: (model(**b).loss / gradient_accumulation_steps).backward()
    [(model(**b).loss / gradient_accumulation_steps).backward() for b in window]
    """,
    # next-token targets of a model built out of sight, labelled with -100
    """
    for x, y in loader:
        y[y == pad] = -100
        logits, loss = model(x[:, :-1], y[:, 1:])
        loss = loss / accumulate_every
        loss.backward()
    """,
]

REJECTED = [
    # accelerate's sequence classifier: padding, `.loss / steps`, but a per-example model and no token loss
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained("bert-base-cased")
    model = AutoModelForSequenceClassification.from_pretrained("bert-base-cased")

    def collate_fn(examples):
        return tokenizer.pad(examples, padding="longest", return_tensors="pt")

    def training_function(config, args):
        gradient_accumulation_steps = int(config["gradient_accumulation_steps"])
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            loss = outputs.loss
            loss = loss / gradient_accumulation_steps
            accelerator.backward(loss)
            if step % gradient_accumulation_steps == 0:
                optimizer.step()
    """,
    # a library's backward: the loss is a parameter, no origin in the scope
    """
    import torch.nn.functional as F

    class Accelerator:
        def backward(self, loss, **kwargs):
            loss = loss / self.gradient_accumulation_steps
            loss.backward(**kwargs)

        def pad_across_processes(self, tensor, pad_index=0):
            return F.pad(tensor, (0, 1), value=pad_index)

        def token_loss(self, logits, labels):
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    """,
    # a sequence model's mean divided by the number of batches of a list made on the spot, or by a product
    """
    from torch import nn
    loss_fn = nn.CrossEntropyLoss(ignore_index=PAD_IDX)
    for src, tgt in train_dl:
        logits = model(src, tgt[:-1, :])
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), tgt[1:, :].reshape(-1))
        (loss / len(list(train_dl))).backward()
        (loss / (world_size * accum_steps)).backward()
    """,
    # the division only logged, in a function that neither backpropagates nor is a loss function
    """
    import torch.nn.functional as F

    def evaluate(model, batch):
        loss = F.cross_entropy(model(batch).flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        print(loss / gradient_accumulation_steps)
        return loss
    """,
    # nanoGPT: token cross-entropy, fixed-length blocks, no padding anywhere
    """
    import torch.nn.functional as F
    for micro_step in range(gradient_accumulation_steps):
        logits = model(X)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), Y.view(-1))
        loss = loss / gradient_accumulation_steps
        loss.backward()
    """,
    # a running total kept on self, or an output's second element, divided by the steps
    """
    import torch.nn.functional as F
    mask = batch["attention_mask"]
    self.total = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)
    (self.total / accum_steps).backward()
    (outputs[1] / accum_steps).backward()
    """,
    # a GAN: padding in a convolution, the division by something else
    """
    from torch import nn
    criterion = nn.BCELoss()
    conv = nn.Conv2d(3, 64, 4, 2, padding=1, padding_mode="zeros")
    for i, data in enumerate(dataloader):
        errD = criterion(netD(data), label) / temperature
        errD.backward()
    """,
]


def _reported(text: str) -> bool:
    return any(f.rule == "TL301" for f in lint_text(text, "x.py", OPTIONS).findings)


@pytest.mark.parametrize("code", [e.code for e in RULE.invalid] + KEPT)
def test_a_reported_division_keeps_the_file(code: str) -> None:
    text = textwrap.dedent(code)
    assert _reported(text), "not a finding of TL301: the case tests nothing"
    assert mean_of_means_possible(ast.parse(text))


@pytest.mark.parametrize("code", REJECTED)
def test_a_file_without_such_a_division_is_ruled_out(code: str) -> None:
    text = textwrap.dedent(code)
    assert not _reported(text)
    assert not mean_of_means_possible(ast.parse(text))


def test_most_valid_examples_are_ruled_out() -> None:
    # (the rest hold a token loss divided by the count, and only the rule's tracing tells them apart)
    ruled_out = [code for code in RULE.valid if not mean_of_means_possible(ast.parse(code))]
    assert len(ruled_out) >= len(RULE.valid) // 2


def test_the_engine_asks_the_check() -> None:
    assert gates()["TL301"].check == "gate_mean_of_means.mean_of_means_possible"
    assert not pass_tree_checks([gates()["TL301"]], ast.parse(textwrap.dedent(REJECTED[0])))
    assert pass_tree_checks([gates()["TL301"]], ast.parse(textwrap.dedent(KEPT[0])))


# Padding evidence in the places libcst's names are (``TokenEvidence._walk_file``), added to a file that has
# none (REJECTED[4]): each makes it a finding, and the check must keep it.
PADDING = [
    "def f():\n    global pad_id\n",
    "try:\n    pass\nexcept ValueError as attention_mask:\n    pass\n",
    "match x:\n    case {'a': 1, **loss_mask}:\n        pass\n    case P(label_mask=0) | [1, *pad_idx]:\n        pass\n",
    "def f(labels_mask=None, *, mask_prompt):\n    pass\n",
    "import data.padding_side as side\n",
    "from trl import DataCollatorForCompletionOnlyLM as C\n",
    "key = 'pad_token_id'\n",
    "collate(ignore_index=IGNORE)\n",
    "tok(texts, padding=True)\n",
    "y = -100\n",
]


@pytest.mark.parametrize("evidence", PADDING)
def test_padding_read_where_libcst_reads_it(evidence: str) -> None:
    text = textwrap.dedent(REJECTED[4]) + evidence
    assert _reported(text), "not a finding of TL301: the case tests nothing"
    assert mean_of_means_possible(ast.parse(text))


def test_every_reported_text_passes_the_check_and_the_findings_do_not_change() -> None:
    extra = [textwrap.dedent(code) for code in KEPT + REJECTED]
    extra += [textwrap.dedent(REJECTED[4]) + evidence for evidence in PADDING] + [SELECTION]
    assert gate_check_keeps_findings("TL301", mean_of_means_possible, extra) >= len(RULE.invalid) + len(KEPT)


# the model comes from another file's builder (pkg/train.py's TL301 finding, line 7)
BUILDER_PROJECT = {
    "pkg/__init__.py": "",
    "pkg/build.py": """
        from transformers import AutoModelForCausalLM


        def build_model(name):
            return AutoModelForCausalLM.from_pretrained(name)
        """,
    "pkg/train.py": """
        from pkg.build import build_model

        model = build_model("gpt2")
        for step, batch in enumerate(loader):
            mask = batch["attention_mask"]
            loss = model(**batch).loss
            loss = loss / gradient_accumulation_steps
            loss.backward()
        """,
}


def test_a_builder_of_a_language_model_in_another_file_keeps_the_finding(
    tmp_path, monkeypatch, capsys
) -> None:
    """The model comes from another file's builder: the file's own tree cannot show it is a language model,
    so the check rules the file out and the cross-file path (``wants_fact``) must take the rule back."""
    files = BUILDER_PROJECT
    found = lint_project(tmp_path, files, "pkg/train.py", monkeypatch, capsys)
    assert [(f["rule"], f["line"]) for f in found] == [("TL301", 7)]
    train = (tmp_path / "pkg/train.py").read_text()
    assert not mean_of_means_possible(ast.parse(train))  # (else this tests the file's own path)


# ``(per_token[mask] / mask.sum()) / n``: ``TokenEvidence._origin`` reads ``x[key]`` of a per-token loss
SELECTION = """
import torch.nn.functional as F
for batch in loader:
    labels = batch["labels"]
    per_token = F.cross_entropy(model(batch["input_ids"]).flatten(0, 1), labels.flatten(), reduction="none")
    mask = labels.flatten() != -100
    ((per_token[mask] / mask.sum()) / accum_steps).backward()
"""


def test_a_selection_of_a_per_token_loss_keeps_the_file() -> None:
    assert _reported(SELECTION), "not a finding of TL301: the case tests nothing"
    assert mean_of_means_possible(ast.parse(SELECTION))


# -- ``Rule.project_gate_check``: the rule run with the project's facts (``mean_of_means_possible_elsewhere``)
ELSEWHERE_KEPT = [
    # another file's helper returns a hand-written token mean: no padding word needed here
    """
    from helpers import token_loss
    for batch in micro_batches:
        loss = token_loss(model, batch)
        (loss / len(micro_batches)).backward()
    """,
    # a base class's method there, then arithmetic, divided in place by a key
    """
    class Trainer(BaseTrainer):
        def step(self, batch):
            loss = self.compute_loss(batch) * 1.0
            loss /= self.cfg["grad_accum"]
            loss.backward()
    """,
    # a model a builder of another file makes, in a file that names a per-example model (padding shown)
    """
    from transformers import AutoModelForSequenceClassification
    from builders import build_lm
    model = build_lm(name)

    def compute_loss(batch):
        mask = batch["attention_mask"]
        return model(**batch).loss / gradient_accumulation_steps
    """,
    # another file's loss class, built into a name of the enclosing scope, its call backpropagated
    """
    from losses import AccumLoss
    criterion = AccumLoss(accum_steps)

    def train(loader):
        for batch in loader:
            criterion(model(batch["x"]), batch["y"]).backward()
    """,
    # ... built into ``self.criterion`` through a module imported whole
    """
    import losses

    class Trainer:
        def __init__(self, n):
            self.criterion = losses.AccumLoss(n)

        def step(self, logits, labels):
            loss = self.criterion(logits, labels)
            loss.backward()
    """,
    # ... through an alias, by an alternative constructor, in a lambda
    """
    import losses
    Loss = losses.AccumLoss
    crit = Loss.from_config(cfg)
    run = lambda x, y: crit(x, y).backward()
    """,
]

ELSEWHERE_REJECTED = [
    # a model's `.loss` divided by the steps, no padding word: never another file's token mean
    """
    def train(model, loader, accum_steps):
        for batch in loader:
            (model(**batch).loss / accum_steps).backward()
            (model(**batch)["loss"] / accum_steps).backward()
    """,
    # another file's helper, its loss scaled up rather than divided, or divided by something else
    """
    from helpers import token_loss
    for step, batch in enumerate(loader):
        loss = token_loss(model, batch) * accum_steps
        (loss / temperature).backward()
        if step % accum_steps == 0:
            optimizer.step()
    """,
    # the loss object a parameter here (the module's instance is not what the function calls), or built
    # from the file's own class
    """
    from losses import AccumLoss
    criterion = AccumLoss(accum_steps)

    class LocalLoss:
        pass

    def train(model, loader, criterion):
        local = LocalLoss()
        for batch in loader:
            criterion(model(batch["x"]), batch["y"]).backward()
            local(model(batch["x"]), batch["y"]).backward()
    """,
    # the instance called where nothing backpropagates, the backward elsewhere
    """
    from losses import AccumLoss
    criterion = AccumLoss(accum_steps)

    def evaluate(x, y):
        print(criterion(x, y))

    def train(loss):
        loss.backward()
    """,
]


@pytest.mark.parametrize("code", ELSEWHERE_KEPT)
def test_a_possible_cross_file_finding_keeps_the_file(code: str) -> None:
    tree = ast.parse(textwrap.dedent(code))
    assert mean_of_means_possible_elsewhere(tree)
    assert not mean_of_means_possible(tree)  # (else the file's own check would keep it)


@pytest.mark.parametrize("code", ELSEWHERE_REJECTED)
def test_a_file_without_a_cross_file_finding_is_ruled_out(code: str) -> None:
    assert not mean_of_means_possible_elsewhere(ast.parse(textwrap.dedent(code)))


def test_what_the_file_check_keeps_the_project_check_keeps() -> None:
    texts = [e.code for e in RULE.invalid] + [textwrap.dedent(c) for c in KEPT]
    texts += [textwrap.dedent(REJECTED[4]) + evidence for evidence in PADDING]
    assert all(mean_of_means_possible_elsewhere(ast.parse(t)) for t in texts)


TOKEN_MEAN = """
    import torch.nn.functional as F


    def token_loss(model, batch):
        logits = model(batch["input_ids"])
        labels = batch["labels"]
        mask = (labels != -100).float()
        loss_sum = (F.cross_entropy(logits.transpose(1, 2), labels, reduction="none") * mask).sum()
        return loss_sum / mask.sum()
    """
ACCUM_LOSS = """
    import torch.nn.functional as F


    class AccumLoss:
        def __init__(self, accum_steps):
            self.accum_steps = accum_steps

        def __call__(self, logits, labels):
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            return loss / self.accum_steps
    """
BASE_TRAINER = """
    import torch.nn.functional as F


    class BaseTrainer:
        def compute_loss(self, batch):
            logits = self.model(batch["input_ids"])
            labels = batch["labels"]
            mask = (labels != -100).float()
            loss_sum = (F.cross_entropy(logits.transpose(1, 2), labels, reduction="none") * mask).sum()
            return loss_sum / mask.sum()
    """
BUILDER = """
    from transformers import AutoModelForCausalLM


    def build_lm(name):
        return AutoModelForCausalLM.from_pretrained(name)
    """

# Every kind of cross-file finding of TL301: (the project's files, the linted one, the finding's line)
CROSS_FILE = [
    # an imported helper's token mean divided by the micro-batch count bound before the loop
    (
        {"helpers.py": TOKEN_MEAN},
        """
        from helpers import token_loss


        def train_step(model, optimizer, micro_batches):
            n_micro = len(micro_batches)
            for batch in micro_batches:
                loss = token_loss(model, batch)
                loss = loss / n_micro
                loss.backward()
            optimizer.step()
        """,
        8,
    ),
    # the base class's method of another file
    (
        {"base.py": BASE_TRAINER},
        """
        from base import BaseTrainer


        class Trainer(BaseTrainer):
            def train_step(self, micro_batches):
                for batch in micro_batches:
                    loss = self.compute_loss(batch)
                    loss = loss / len(micro_batches)
                    loss.backward()
                self.optimizer.step()
        """,
        8,
    ),
    # a loss function returns the helper's token mean divided by the steps (its callers backpropagate)
    (
        {"helpers.py": TOKEN_MEAN},
        '''
        """The caller runs loss.backward() on what compute_loss returns."""
        from helpers import token_loss


        def compute_loss(model, batch, accum_steps):
            loss = token_loss(model, batch)
            return loss / accum_steps
        ''',
        7,
    ),
    # a language model made by another file's builder, returned by a loss function of a padded batch
    (
        {"builders.py": BUILDER},
        '''
        """The caller runs loss.backward() on what compute_loss returns."""
        from builders import build_lm

        model = build_lm("gpt2")


        def compute_loss(batch, gradient_accumulation_steps):
            mask = batch["attention_mask"]
            return model(**batch).loss / gradient_accumulation_steps
        ''',
        9,
    ),
    # the loss class of another file divides by the steps, its instance a name here
    (
        {"losses.py": ACCUM_LOSS},
        """
        from losses import AccumLoss


        def train(model, loader, accum_steps):
            criterion = AccumLoss(accum_steps)
            for batch in loader:
                loss = criterion(model(batch["input_ids"]), batch["labels"])
                loss.backward()
        """,
        7,
    ),
    # ... or an attribute of the trainer, the class of a module imported whole
    (
        {"losses.py": ACCUM_LOSS},
        """
        import losses


        class Trainer:
            def __init__(self, accum_steps):
                self.criterion = losses.AccumLoss(accum_steps)

            def step(self, logits, labels):
                self.criterion(logits, labels).backward()
        """,
        9,
    ),
]


def _project(root, files: dict[str, str], text: str) -> tuple[str, str]:
    (root / "pyproject.toml").write_text("")
    for name, other in files.items():
        (root / name).write_text(textwrap.dedent(other).lstrip())
    (root / "train.py").write_text(textwrap.dedent(text).lstrip())
    return (root / "train.py").read_text(), str(root / "train.py")


@pytest.mark.parametrize(("files", "text", "line"), CROSS_FILE)
def test_each_kind_of_cross_file_finding_is_reported(
    tmp_path, monkeypatch, capsys, files, text, line
) -> None:
    linted, path = _project(tmp_path, files, text)
    active, crossfile, tree, *_ = _code_gate(linted, ON)
    assert "TL301" not in {g.id for g in active} and "TL301" in {g.id for g in crossfile}
    assert mean_of_means_possible_elsewhere(tree)
    found = lint_project(tmp_path, {**files, "train.py": text}, "train.py", monkeypatch, capsys)
    assert [(f["rule"], f["line"]) for f in found if f["rule"] == "TL301"] == [("TL301", line)]
    off = lint_text(linted, path, OPTIONS)
    assert [f.line for f in off.findings if f.rule == "TL301"] == [line]


def test_a_candidate_ruled_out_asks_neither_the_index_nor_libcst(tmp_path) -> None:
    """The project holds what TL301 wants of an import (a helper's token mean, a loss class that
    divides), the file passes the rule's project prefilter, but nothing here can use it."""
    linted, path = _project(
        tmp_path,
        {"helpers.py": textwrap.dedent(TOKEN_MEAN) + textwrap.dedent(ACCUM_LOSS)},
        """
        from helpers import AccumLoss, token_loss


        def train(model, criterion, loader, optimizer, accum_steps):
            for step, batch in enumerate(loader):
                loss = token_loss(model, batch) * accum_steps
                loss = loss + criterion(model(batch["input_ids"]), batch["labels"])
                loss.backward()
                if (step + 1) % accum_steps == 0:
                    optimizer.step()
        """,
    )
    gate, tree = gates()["TL301"], ast.parse(linted)
    assert gate.can_fire_in_project(linted) and gate.in_project_code(code_facts(tree).text)
    assert not pass_tree_checks([gate], tree)
    wanted = [f for f in Project.for_file(path).imported_facts(linted) if RULE.wants_fact(f.kind, f.facts)]
    assert {f.name for f in wanted} == {"AccumLoss", "token_loss"}  # (without the check, TL301 would run)
    assert not mean_of_means_possible_elsewhere(tree)
    assert "TL301" not in {g.id for g in _code_gate(linted, ON)[1]}
    on = lint_text(linted, path, ON)
    assert not on.parsed and not on.findings
    assert [f for f in lint_text(linted, path, OPTIONS).findings if f.rule == "TL301"] == []


@pytest.mark.parametrize("code", ELSEWHERE_REJECTED)
def test_the_rule_with_the_project_reports_nothing_the_check_rules_out(tmp_path, code: str) -> None:
    """Run whatever the gates say, with a project that holds what the imports name."""
    linted, path = _project(tmp_path, {"helpers.py": TOKEN_MEAN, "losses.py": ACCUM_LOSS}, code)
    assert [f for f in lint_text(linted, path, OPTIONS).findings if f.rule == "TL301"] == []


def test_the_engine_asks_the_project_check() -> None:
    assert gates()["TL301"].project_check == "gate_mean_of_means.mean_of_means_possible_elsewhere"
    rejected = ast.parse(textwrap.dedent(ELSEWHERE_REJECTED[0]))
    assert not pass_tree_checks([gates()["TL301"]], rejected, project=True)
    assert pass_tree_checks([gates()["TL301"]], ast.parse(textwrap.dedent(ELSEWHERE_KEPT[0])), project=True)
