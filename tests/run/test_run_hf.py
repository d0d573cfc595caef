"""`trainlint run` on TL205 with a small stand-in ``transformers`` package on ``PYTHONPATH`` (transformers
is not a dependency): its ``PreTrainedModel.gradient_checkpointing_enable`` lives in
``transformers.modeling_utils`` and picks the reentrant variant when called without kwargs, as
transformers' releases before 5.x do. The run must see the checkpointed layers left without gradients
when the embedding is frozen, and nothing when the kwargs are passed or the default is non-reentrant."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]

MODELING = """
import functools

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_REENTRANT = {reentrant}


class PreTrainedModel(torch.nn.Module):
    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        if gradient_checkpointing_kwargs is None:
            gradient_checkpointing_kwargs = {{"use_reentrant": DEFAULT_REENTRANT}}
        for layer in self.layers:
            layer._gradient_checkpointing_func = functools.partial(checkpoint, **gradient_checkpointing_kwargs)


class TinyModel(PreTrainedModel):
    def __init__(self, layers=3):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(layers))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            func = getattr(layer, "_gradient_checkpointing_func", None)
            h = func(layer.__call__, h) if func is not None and self.training else layer(h)
        return self.head(h).sum()
"""

SCRIPT = """
import torch
from transformers import TinyModel

model = TinyModel()
model.embed.requires_grad_(False)  # frozen embedding, as under adapters
model.gradient_checkpointing_enable()
opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
for _ in range(2):
    model(torch.randint(0, 16, (2, 5))).backward()
    opt.step()
    opt.zero_grad()
"""


def run(tmp_path: Path, script: str, reentrant: bool = True) -> dict:
    package = tmp_path / "site" / "transformers"
    package.mkdir(parents=True)
    (package / "modeling_utils.py").write_text(MODELING.format(reentrant=reentrant))
    (package / "__init__.py").write_text("from .modeling_utils import PreTrainedModel, TinyModel\n")
    (tmp_path / "work").mkdir()
    path = tmp_path / "work" / "train.py"
    path.write_text(textwrap.dedent(script).lstrip("\n"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    cmd = [sys.executable, "-m", "trainlint", "run", "--format", "json", "--", "python", str(path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)
    data = json.loads(proc.stdout)
    assert data["run"]["ended"] == "finished", (data["run"], proc.stderr[-2000:])
    return data


def observed(data: dict) -> list[dict]:
    return [f for f in data["findings"] if f["rule"] == "TL205" and f["run"]["status"] != "not-reached"]


def test_tl205_reentrant_layers_lose_their_gradients(tmp_path: Path) -> None:
    (hit,) = observed(run(tmp_path, SCRIPT))
    assert (hit["line"], hit["run"]["status"]) == (6, "seen")
    assert hit["run"]["measured"] == {
        "use_reentrant": ["True"],
        "checkpointed_layers": 3,
        "trainable_inside": 6,
        "without_grad": 6,
    }


@pytest.mark.parametrize(
    ("script", "reentrant"),
    [
        (SCRIPT.replace("enable()", 'enable(gradient_checkpointing_kwargs={"use_reentrant": False})'), True),
        (SCRIPT, False),
        (
            SCRIPT.replace(
                "model.embed.requires_grad_(False)  # frozen embedding, as under adapters", "pass"
            ),
            True,
        ),
    ],
    ids=["kwargs_passed", "non_reentrant_default", "embedding_trains"],
)
def test_tl205_silent_when_the_layers_get_gradients(tmp_path: Path, script: str, reentrant: bool) -> None:
    assert observed(run(tmp_path, script, reentrant)) == []
