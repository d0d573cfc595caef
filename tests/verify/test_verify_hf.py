"""``--verify`` for TL205: the probe builds the user's transformers model and enables checkpointing as
written. transformers is not a dependency of the project: without it the probe says so; with a small
stand-in package on the child's ``PYTHONPATH`` (its ``gradient_checkpointing_enable`` picks the
reentrant variant when no kwargs are given, as transformers' ``modeling_utils`` does) it confirms,
and it clears the same code when the installed package defaults to the non-reentrant variant."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest

from trainlint.engine import lint_source
from trainlint.verify import torch_available, verify_findings

pytestmark = pytest.mark.skipif(not torch_available(), reason="--verify needs torch")

USER = """
from transformers import TinyConfig, TinyForCausalLM
from peft import get_peft_model

config = TinyConfig(num_hidden_layers=3)
model = TinyForCausalLM(config)
model = get_peft_model(model, lora_config)
model.gradient_checkpointing_enable()
"""
PRETRAINED = USER.replace("TinyForCausalLM(config)", 'TinyForCausalLM.from_pretrained("org/model")')

FAKE = """
import functools

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_REENTRANT = {reentrant}


class TinyConfig:
    def __init__(self, vocab_size=16, hidden_size=8, num_hidden_layers=2):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.proj = torch.nn.Linear(width, width)

    def forward(self, h):
        return torch.tanh(self.proj(h))


class TinyForCausalLM(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(Block(config.hidden_size) for _ in range(config.num_hidden_layers))
        self.head = torch.nn.Linear(config.hidden_size, config.vocab_size)

    @classmethod
    def from_pretrained(cls, name):
        raise OSError("no network")

    def get_input_embeddings(self):
        return self.embed

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        if gradient_checkpointing_kwargs is None:
            gradient_checkpointing_kwargs = {{"use_reentrant": DEFAULT_REENTRANT}}
        for layer in self.layers:
            layer._gradient_checkpointing_func = functools.partial(checkpoint, **gradient_checkpointing_kwargs)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for layer in self.layers:
            func = getattr(layer, "_gradient_checkpointing_func", None)
            h = func(layer.__call__, h) if func is not None and self.training else layer(h)
        return (self.head(h),)
"""


def verdict(code: str) -> dict:
    text = textwrap.dedent(code).lstrip("\n")
    (finding,) = lint_source(text, "train.py", ["TL205"])
    (verified,) = verify_findings([finding], {"train.py": text}, device="cpu", timeout=60)
    assert verified.verify is not None
    return verified.verify


def fake_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reentrant: bool) -> None:
    package = tmp_path / "site" / "transformers"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE.format(reentrant=reentrant))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))


def test_tl205_pretrained_weights_are_not_fetched() -> None:
    found = verdict(PRETRAINED)
    assert found["status"] == "not-executable" and "from_pretrained" in found["detail"], found


@pytest.mark.skipif(importlib.util.find_spec("transformers") is not None, reason="transformers is installed")
def test_tl205_without_transformers_says_so() -> None:
    found = verdict(USER)
    assert (found["status"], found["detail"]) == ("not-executable", "transformers is not installed")


def test_tl205_reentrant_default_leaves_the_layers_without_gradients(tmp_path, monkeypatch) -> None:
    fake_transformers(tmp_path, monkeypatch, reentrant=True)
    found = verdict(USER)
    assert found["status"] == "confirmed", found
    written, fixed = found["evidence"]["as_written"], found["evidence"]["fixed"]
    assert (written["use_reentrant"], written["layers"], written["trainable"]) == (["True"], 3, 6)
    assert (written["without_grad"], fixed["without_grad"], fixed["use_reentrant"]) == (6, 0, ["False"])


def test_tl205_cleared_where_the_default_is_not_reentrant(tmp_path, monkeypatch) -> None:
    fake_transformers(tmp_path, monkeypatch, reentrant=False)
    found = verdict(USER)
    assert found["status"] == "not-reproduced", found
    assert found["evidence"]["as_written"]["without_grad"] == 0
