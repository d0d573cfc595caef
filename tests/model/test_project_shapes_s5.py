"""Issue 13's shapes, each written as the issue describes it (helpers, ``self.`` methods, base classes
in another file), linted through the project index with only the one file named, as pre-commit does;
each with a correct look-alike that must stay silent."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import lint_project

MASKED_MEAN_HELPER = """
    import torch.nn.functional as F


    def token_loss(model, batch):
        logits = model(batch["input_ids"])
        labels = batch["labels"]
        mask = (labels != -100).float()
        loss_sum = (F.cross_entropy(logits.transpose(1, 2), labels, reduction="none") * mask).sum()
        loss = loss_sum / mask.sum()
        return loss


    def token_sum(model, batch):
        logits = model(batch["input_ids"])
        labels = batch["labels"]
        mask = (labels != -100).float()
        return (F.cross_entropy(logits.transpose(1, 2), labels, reduction="none") * mask).sum()


    def weighted_loss(model, batch):
        per_example = F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")
        weights = batch["w"]
        return (per_example * weights).sum() / weights.sum()
    """

BASE_TRAINER = """
    import torch.nn.functional as F


    class BaseTrainer:
        def compute_loss(self, batch):
            logits = self.model(batch["input_ids"])
            mask = batch["attention_mask"]
            loss = F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
            loss = (loss * mask).sum()
            loss = loss / mask.sum()
            return loss

        def train_step(self, batch):
            loss = F.cross_entropy(self.model(batch["x"]), batch["y"])
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            return loss
    """


lint = lint_project


def where(findings: list[dict], rule: str) -> list[tuple[str, int, set[tuple[str, int]]]]:
    return [
        (f["path"], f["line"], {(r.get("path", f["path"]), r["line"]) for r in f["related"]})
        for f in findings
        if f["rule"] == rule
    ]


# -- TL301: a helper returns a hand-written token mean, the caller divides by the micro-batch count -------
SELF_METHOD_TRAINER = """
    import torch.nn.functional as F


    class Trainer:
        def compute_loss(self, batch):
            logits = self.model(batch["input_ids"])
            per_token = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
            mask = batch["labels"].flatten() != -100
            loss = per_token[mask].sum()
            loss = loss / mask.sum()
            return loss, logits

        def train_step(self, micro_batches):
            for i, batch in enumerate(micro_batches):
                loss, _ = self.compute_loss(batch)
                (loss / len(micro_batches)).backward()
            self.optimizer.step()
    """


def test_tl301_self_method_token_mean_divided_by_the_loop_count(tmp_path: Path, monkeypatch, capsys) -> None:
    found = where(
        lint(tmp_path, {"trainer.py": SELF_METHOD_TRAINER}, "trainer.py", monkeypatch, capsys), "TL301"
    )
    assert found == [("trainer.py", 16, {("trainer.py", 10), ("trainer.py", 8)})]


def test_tl301_helper_of_another_file_then_a_count_bound_before_the_loop(
    tmp_path, monkeypatch, capsys
) -> None:
    train = """
        from helpers import token_loss


        def train_step(model, optimizer, micro_batches):
            n_micro = len(micro_batches)
            for batch in micro_batches:
                loss = token_loss(model, batch)
                loss = loss / n_micro
                loss.backward()
            optimizer.step()
        """
    files = {"helpers.py": MASKED_MEAN_HELPER, "train.py": train}
    found = where(lint(tmp_path, files, "train.py", monkeypatch, capsys), "TL301")
    assert found == [("train.py", 8, {("train.py", 7), ("helpers.py", 9)})]


@pytest.mark.parametrize(
    ("helper", "divisor"),
    [
        ("token_sum", "len(micro_batches)"),  # a sum over the tokens: the division is the caller's choice
        ("weighted_loss", "len(micro_batches)"),  # a weighted mean over examples, not tokens
        ("token_loss", "len(other)"),  # not the count of the loop's micro-batches
    ],
)
def test_tl301_look_alikes_of_the_helper_shape(
    tmp_path, monkeypatch, capsys, helper: str, divisor: str
) -> None:
    train = f"""
        from helpers import {helper}


        def train_step(model, optimizer, micro_batches, other):
            for batch in micro_batches:
                loss = {helper}(model, batch)
                (loss / {divisor}).backward()
            optimizer.step()
        """
    files = {"helpers.py": MASKED_MEAN_HELPER, "train.py": train}
    assert where(lint(tmp_path, files, "train.py", monkeypatch, capsys), "TL301") == []


# a package's trainer whose loss comes from its base class's method (engine/trainer.py's TL301 finding)
BASE_TRAINER_PROJECT = {
    "engine/__init__.py": "",
    "engine/base.py": BASE_TRAINER,
    "engine/trainer.py": """
        from engine.base import BaseTrainer


        class Trainer(BaseTrainer):
            def train_step(self, micro_batches):
                for batch in micro_batches:
                    loss = self.compute_loss(batch)
                    loss = loss / len(micro_batches)
                    loss.backward()
                self.optimizer.step()
        """,
}


def test_tl301_method_of_a_base_class_in_another_file(tmp_path: Path, monkeypatch, capsys) -> None:
    files = BASE_TRAINER_PROJECT
    found = where(lint(tmp_path, files, "engine/trainer.py", monkeypatch, capsys), "TL301")
    assert found == [("engine/trainer.py", 8, {("engine/trainer.py", 7), ("engine/base.py", 10)})]


# -- TL502: the helper's division by this rank's token count, backpropagated by its caller ---------------
DDP_TRAINER = """
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP


    class Trainer:
        def __init__(self, model):
            self.model = DDP(model)

        def compute_loss(self, batch):
            logits = self.model(batch["input_ids"])
            labels = batch["labels"]
            mask = (labels != -100).float()
            loss_sum = (F.cross_entropy(logits.transpose(1, 2), labels, reduction="none") * mask).sum()
            loss = loss_sum / mask.sum()
            return loss

        def train_step(self, micro_batches):
            for batch in micro_batches:
                loss = self.compute_loss(batch)
                (loss / len(micro_batches)).backward()
            self.optimizer.step()
    """


def test_tl502_and_tl301_for_the_split_ddp_trainer(tmp_path: Path, monkeypatch, capsys) -> None:
    findings = lint(tmp_path, {"trainer.py": DDP_TRAINER}, "trainer.py", monkeypatch, capsys)
    assert where(findings, "TL502") == [("trainer.py", 14, {("trainer.py", 13)})]
    assert [line for _, line, _ in where(findings, "TL301")] == [20]


def test_tl502_silent_when_the_returned_loss_is_only_logged(tmp_path: Path, monkeypatch, capsys) -> None:
    logged = DDP_TRAINER.replace(
        "(loss / len(micro_batches)).backward()", "self.log(loss.item())\n            self.other.backward()"
    )
    assert where(lint(tmp_path, {"trainer.py": logged}, "trainer.py", monkeypatch, capsys), "TL502") == []


# -- TL302: a helper (also a ``self.`` method) runs the backward and returns the loss the caller adds ----
STEPPER = """
    import torch


    class Stepper:
        def train_step(self, batch):
            loss = torch.nn.functional.cross_entropy(self.model(batch["x"]), batch["y"])
            loss.backward()
            return loss

        def train_step_value(self, batch):
            loss = torch.nn.functional.cross_entropy(self.model(batch["x"]), batch["y"])
            loss.backward()
            return loss.item()
    """


@pytest.mark.parametrize(
    ("files", "target", "line", "other"),
    [
        (
            {
                "engine/base.py": BASE_TRAINER,
                "engine/trainer.py": """
                from engine.base import BaseTrainer


                class Trainer(BaseTrainer):
                    def fit(self, loader):
                        total = 0.0
                        for batch in loader:
                            total += self.train_step(batch)
                        return total
                """,
            },
            "engine/trainer.py",
            8,
            ("engine/base.py", 15),
        ),
        (
            {
                "engine/steps.py": STEPPER,
                "engine/runner.py": """
                from engine.steps import Stepper


                class Runner:
                    def __init__(self):
                        self.stepper = Stepper()

                    def fit(self, loader):
                        losses = []
                        for batch in loader:
                            losses.append(self.stepper.train_step(batch))
                        return losses
                """,
            },
            "engine/runner.py",
            11,
            ("engine/steps.py", 7),
        ),
    ],
)
def test_tl302_returned_loss_added_directly(
    tmp_path, monkeypatch, capsys, files, target, line, other
) -> None:
    files = {"engine/__init__.py": "", **files}
    found = where(lint(tmp_path, files, target, monkeypatch, capsys), "TL302")
    assert len(found) == 1 and found[0][:2] == (target, line)
    assert other in found[0][2]


@pytest.mark.parametrize(
    "added",
    [
        "self.stepper.train_step(batch).item()",
        "float(self.stepper.train_step(batch))",
        "self.stepper.train_step_value(batch)",
    ],
)
def test_tl302_detached_or_number_returning_helpers_are_silent(
    tmp_path, monkeypatch, capsys, added: str
) -> None:
    runner = f"""
        from engine.steps import Stepper


        class Runner:
            def __init__(self):
                self.stepper = Stepper()

            def fit(self, loader):
                total = 0.0
                for batch in loader:
                    total += {added}
                return total
        """
    files = {"engine/__init__.py": "", "engine/steps.py": STEPPER, "engine/runner.py": runner}
    assert where(lint(tmp_path, files, "engine/runner.py", monkeypatch, capsys), "TL302") == []


# -- TL203: the checkpointed module's class (another file) has a side effect in forward ------------------
BLOCKS = """
    from torch import nn


    class BNBlock(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.add_module("norm", nn.BatchNorm2d(c))

        def forward(self, x):
            return self.norm(x)


    class AuxBlock(nn.Module):
        def __init__(self, width, tracker):
            super().__init__()
            self.proj = nn.Linear(width, width)
            self.tracker = tracker

        def forward(self, x):
            out = self.proj(x)
            self.tracker.add_aux_loss(out.pow(2).mean())
            return out


    class PlainBlock(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.proj = nn.Linear(width, width)

        def forward(self, x):
            return self.proj(x)
    """

CKPT_SHAPES = {
    # a partial of checkpoint kept on self, called later with the block
    "partial_on_self": """
        import functools

        from torch import nn
        from torch.utils.checkpoint import checkpoint

        from nets.blocks import {cls}


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.block = {cls}(8)
                self.ckpt = functools.partial(checkpoint, use_reentrant=False)

            def forward(self, x):
                return self.ckpt(self.block, x)
        """,
    # the loop variable walks a ModuleList of the blocks
    "module_list": """
        from torch import nn
        from torch.utils.checkpoint import checkpoint

        from nets.blocks import {cls}


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList([{cls}(8) for _ in range(4)])

            def forward(self, x):
                for blk in self.blocks:
                    x = checkpoint(blk, x, use_reentrant=False)
                return x
        """,
    # the checkpointed module is a parameter; the file's caller passes the block
    "parameter": """
        from torch.utils.checkpoint import checkpoint

        from nets.blocks import {cls}


        def run_layer(module, x):
            return checkpoint(module, x, use_reentrant=False)


        class Net:
            def __init__(self):
                self.block = {cls}(8)

            def forward(self, x):
                return run_layer(self.block, x)
        """,
    # a create_custom_forward factory closes over the block
    "factory_closure": """
        from torch.utils.checkpoint import checkpoint

        from nets.blocks import {cls}


        def create_custom_forward(module):
            def custom_forward(*inputs):
                return module(*inputs)

            return custom_forward


        class Net:
            def __init__(self):
                self.layers = [{cls}(8) for _ in range(3)]

            def forward(self, x):
                for layer in self.layers:
                    x = checkpoint(create_custom_forward(layer), x, use_reentrant=False)
                return x
        """,
}


@pytest.mark.parametrize(
    ("shape", "line"),
    [("partial_on_self", 16), ("module_list", 14), ("parameter", 7), ("factory_closure", 19)],
)
@pytest.mark.parametrize(("cls", "effect_line"), [("BNBlock", 7), ("AuxBlock", 21), ("PlainBlock", None)])
def test_tl203_checkpointed_block_of_another_file(
    tmp_path, monkeypatch, capsys, shape: str, line: int, cls: str, effect_line: int | None
) -> None:
    files = {"nets/__init__.py": "", "nets/blocks.py": BLOCKS, "model.py": CKPT_SHAPES[shape].format(cls=cls)}
    found = where(lint(tmp_path, files, "model.py", monkeypatch, capsys), "TL203")
    if effect_line is None:  # the look-alike: a block without side effects
        assert found == []
    else:
        assert found == [("model.py", line, {("nets/blocks.py", effect_line)})]


def test_tl203_batchnorm_handed_to_a_closure_factory_in_the_same_file(tmp_path, monkeypatch, capsys) -> None:
    model = """
        from torch import nn
        from torch.utils.checkpoint import checkpoint


        def make_forward(layer):
            def run(x):
                return layer(x)

            return run


        class Net(nn.Module):
            def __init__(self, stats):
                super().__init__()
                self.norm = nn.BatchNorm2d(8, track_running_stats=stats)
                self.frozen = nn.BatchNorm2d(8, track_running_stats=False)

            def forward(self, x):
                x = checkpoint(make_forward(self.norm), x, use_reentrant=False)
                return checkpoint(make_forward(self.frozen), x, use_reentrant=False)
        """
    found = where(lint(tmp_path, {"model.py": model}, "model.py", monkeypatch, capsys), "TL203")
    assert found == [("model.py", 19, {("model.py", 15)})]


# -- TL204: a wrapper of the same file whose parameter default is preserve_rng_state=False ---------------
def test_tl204_same_file_wrapper_default(tmp_path: Path, monkeypatch, capsys) -> None:
    blocks = """
        import torch.utils.checkpoint as cp
        from torch import nn


        def ckpt(fn, x, preserve=False):
            return cp.checkpoint(fn, x, use_reentrant=False, preserve_rng_state=preserve)


        class Block(nn.Module):
            def __init__(self, p):
                super().__init__()
                self.drop = nn.Dropout(p)
                self.fc = nn.Linear(8, 8)

            def inner(self, x):
                return self.drop(self.fc(x))

            def plain(self, x):
                return self.fc(x)

            def forward(self, x):
                x = ckpt(self.plain, x)
                x = ckpt(self.inner, x, True)
                return ckpt(self.inner, x)
        """
    found = where(lint(tmp_path, {"blocks.py": blocks}, "blocks.py", monkeypatch, capsys), "TL204")
    assert found == [("blocks.py", 24, {("blocks.py", 6)})]


# -- TL102: the scaled backward in one method, the plain step in another --------------------------------
SPLIT_TRAINER = """
    import torch


    class Trainer:
        def __init__(self, model, optimizer):
            self.model = model
            self.optimizer = optimizer
            self.scaler = torch.cuda.amp.GradScaler()

        def backward(self, loss):
            self.scaler.scale(loss).backward()

        def optimizer_step(self):
            self.optimizer.step()
            self.optimizer.zero_grad()
    """


def test_tl102_scaler_only_ever_scales_while_another_method_steps(tmp_path, monkeypatch, capsys) -> None:
    found = where(lint(tmp_path, {"t.py": SPLIT_TRAINER}, "t.py", monkeypatch, capsys), "TL102")
    assert found == [("t.py", 14, {("t.py", 11)})]


@pytest.mark.parametrize(
    "step",
    [
        "self.scaler.step(self.optimizer)\n            self.scaler.update()",
        "self.updater.apply(self.optimizer, self.scaler)",
    ],
)
def test_tl102_scaler_stepped_or_handed_on_is_silent(tmp_path, monkeypatch, capsys, step: str) -> None:
    text = SPLIT_TRAINER.replace("self.optimizer.step()", step)
    assert where(lint(tmp_path, {"t.py": text}, "t.py", monkeypatch, capsys), "TL102") == []


# -- TL301: the loss is a token mean computed out of sight ---------------------------------------------
BUILDERS = """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification


    def build_lm(cfg):
        model = AutoModelForCausalLM.from_pretrained(cfg.name)
        return model


    def build_classifier(cfg):
        return AutoModelForSequenceClassification.from_pretrained(cfg.name)
    """

LOOP = """
    from builders import {builder}


    def train(cfg, loader, optimizer, tokenizer):
        model = {builder}(cfg)
        for step, batch in enumerate(loader):
            batch = tokenizer.pad(batch, padding=True)
            loss = model(**batch).loss
            loss = loss / cfg.gradient_accumulation_steps
            loss.backward()
            if (step + 1) % cfg.gradient_accumulation_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
    """


@pytest.mark.parametrize(("builder", "lines"), [("build_lm", [9]), ("build_classifier", [])])
def test_tl301_model_built_by_a_builder_of_another_file(
    tmp_path, monkeypatch, capsys, builder, lines
) -> None:
    files = {"builders.py": BUILDERS, "train.py": LOOP.format(builder=builder)}
    found = where(lint(tmp_path, files, "train.py", monkeypatch, capsys), "TL301")
    assert [line for _, line, _ in found] == lines


@pytest.mark.parametrize(
    ("masking", "lines"),
    [
        ("y[y == pad_id] = -1", [5]),  # targets masked with -1: a loss over the valid tokens
        ("y = y.clamp(min=0)", []),  # no ignore label, nothing says the targets are tokens
    ],
)
def test_tl301_model_returning_the_loss_with_masked_targets(
    tmp_path, monkeypatch, capsys, masking, lines
) -> None:
    train = f"""
        def train(model, loader, optimizer, accum_steps, pad_id):
            for step, (x, y) in enumerate(loader):
                {masking}
                logits, loss = model(x, y)
                loss = loss / accum_steps
                loss.backward()
                if (step + 1) % accum_steps == 0:
                    optimizer.step()
                    optimizer.zero_grad()
        """
    found = where(lint(tmp_path, {"train.py": train}, "train.py", monkeypatch, capsys), "TL301")
    assert [line for _, line, _ in found] == lines


def test_tl301_labels_masked_with_minus_100_for_a_model_of_unknown_class(
    tmp_path, monkeypatch, capsys
) -> None:
    train = """
        from mylib import build


        def train(cfg, loader, optimizer):
            model = build(cfg)
            for step, batch in enumerate(loader):
                labels = batch["input_ids"].clone()
                labels[batch["attention_mask"] == 0] = -100
                loss = model(**batch, labels=labels).loss
                loss = loss / cfg.gradient_accumulation_steps
                loss.backward()
        """
    found = where(lint(tmp_path, {"train.py": train}, "train.py", monkeypatch, capsys), "TL301")
    assert [line for _, line, _ in found] == [10]


@pytest.mark.parametrize(("reduction", "lines"), [("", [11]), (', reduction="sum"', [])])
def test_tl301_loss_wrapper_that_divides_by_the_accumulation_steps(
    tmp_path, monkeypatch, capsys, reduction: str, lines: list[int]
) -> None:
    train = f"""
        import torch.nn.functional as F


        class AccumLoss:
            def __init__(self, accum_steps, ignore_index=-100):
                self.accum_steps = accum_steps
                self.ignore_index = ignore_index

            def __call__(self, logits, labels):
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=self.ignore_index{reduction})
                return loss / self.accum_steps


        def train(model, loader, accum_steps):
            criterion = AccumLoss(accum_steps)
            for batch in loader:
                criterion(model(batch["input_ids"]), batch["labels"]).backward()
        """
    found = where(lint(tmp_path, {"train.py": train}, "train.py", monkeypatch, capsys), "TL301")
    assert [line for _, line, _ in found] == lines


@pytest.mark.parametrize(("reduction", "lines"), [("", [7]), (', reduction="sum"', [])])
def test_tl301_loss_wrapper_class_of_another_module(tmp_path, monkeypatch, capsys, reduction, lines) -> None:
    wrapper = f"""
        import torch.nn.functional as F


        class AccumLoss:
            def __init__(self, accum_steps, ignore_index=-100):
                self.accum_steps = accum_steps
                self.ignore_index = ignore_index

            def __call__(self, logits, labels):
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=self.ignore_index{reduction})
                return loss / self.accum_steps
        """
    train = """
        from losses import AccumLoss


        def train(model, loader, optimizer, accum_steps):
            criterion = AccumLoss(accum_steps)
            for step, batch in enumerate(loader):
                loss = criterion(model(batch["input_ids"]), batch["labels"])
                loss.backward()
        """
    files = {"losses.py": wrapper, "train.py": train}
    found = where(lint(tmp_path, files, "train.py", monkeypatch, capsys), "TL301")
    assert [(line, related) for _, line, related in found] == [(n, {("losses.py", 11)}) for n in lines]
