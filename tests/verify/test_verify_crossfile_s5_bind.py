"""``--verify`` on a TL203 finding whose side effect is in another file of the project (issue 14): the
checkpoint call runs a layer the file builds by name (``globals()[name]``, YOLO's ``parse_model``),
whose class in another file holds a BatchNorm. The probe stands in for the layer with a counted
BatchNorm and says so; before, it stopped at "no call labelled `checkpoint-call`"."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainlint.verify import torch_available

pytestmark = pytest.mark.skipif(not torch_available(), reason="--verify needs torch")

CONV = """
from torch import nn


class Conv(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.lin = nn.Linear(c, c)
        self.bn = nn.BatchNorm1d(c)

    def forward(self, x):
        return self.bn(self.lin(x))
"""

TASKS = """
from torch import nn
from torch.utils.checkpoint import checkpoint

from conv import Conv


def parse_model(names, c):
    layers = []
    for name in names:
        m = globals()[name]
        if m in {Conv}:
            layers.append(m(c))
    return nn.Sequential(*layers)


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.model = parse_model(["Conv", "Conv"], c)

    def run_layer(self, module, x):
        if not x.requires_grad:
            return module(x)
        return checkpoint(module, x, use_reentrant=False)
"""


def verify_project(root: Path) -> list[dict]:
    (root / ".git").mkdir()
    (root / "conv.py").write_text(textwrap.dedent(CONV))
    (root / "tasks.py").write_text(textwrap.dedent(TASKS))
    args = ["--verify", "--no-cache", "--select", "TL203", "--format", "json", "--exit-zero", "."]
    done = subprocess.run(
        [sys.executable, "-P", "-m", "trainlint", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return [f for f in json.loads(done.stdout)["findings"] if f["path"].endswith("tasks.py")]


def test_tl203_batchnorm_of_a_layer_in_another_file_is_stood_in_and_named(tmp_path):
    (finding,) = verify_project(tmp_path)
    v = finding["verify"]
    assert v["status"] == "confirmed", v["detail"]
    # the recomputation runs the BatchNorm again: two forwards under checkpoint, one without
    (counts,) = v["evidence"]["executions"].values()
    assert counts == {"checkpointed": 2, "plain": 1}
    assert any("running_mean" in name for name in v["evidence"]["state_differs"])
    # what is synthetic is named: the stand-in layer, where the real effect is, the inputs' grad
    assert "stand-in for `module` (as at conv.py, line" in v["detail"]
    assert "`module` stood in by a Linear, then BatchNorm; the synthetic inputs require grad" in v["detail"]
    assert "__tl_" not in v["detail"]


MODELING = """
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.half()

    def forward(self, x):
        return self.body(x)
"""

OPTIMIZATION = """
import torch
from torch.optim import Optimizer


class BertAdam(Optimizer):
    def __init__(self, params, lr, t_total, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, t_total=t_total))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
"""

# CLIP4Clip's shape: the model converted when built (another file), the optimizer class of the
# project's own top-level package (`modules/`, next to the script), built in another function from
# argparse settings and a step count the script computes from its data
TRAIN = """
import argparse

from modules.modeling import Net
from modules.optimization import BertAdam


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=1e-3)
    return parser.parse_args()


def prep_optimizer(args, model, num_train_optimization_steps):
    weight_decay = 0.0
    return BertAdam(model.parameters(), lr=args.lr, t_total=num_train_optimization_steps, weight_decay=weight_decay)


def main(data):
    args = get_args()
    model = Net()
    optimizer = prep_optimizer(args, model, len(data))
    for x, y in data:
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
"""


@pytest.mark.parametrize(
    ("default", "status"), [("default=1e-3", "confirmed"), ("required=True", "not-executable")]
)
def test_tl105_optimizer_of_the_projects_own_package_with_argparse_settings(tmp_path, default, status):
    (tmp_path / ".git").mkdir()
    (tmp_path / "modules").mkdir()
    (tmp_path / "modules" / "__init__.py").write_text("")
    (tmp_path / "modules" / "modeling.py").write_text(textwrap.dedent(MODELING))
    (tmp_path / "modules" / "optimization.py").write_text(textwrap.dedent(OPTIMIZATION))
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN).replace("default=1e-3", default))
    args = ["--verify", "--no-cache", "--select", "TL105", "--format", "json", "--exit-zero", "."]
    done = subprocess.run(
        [sys.executable, "-P", "-m", "trainlint", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    (finding,) = json.loads(done.stdout)["findings"]
    v = finding["verify"]
    # before: "No module named 'modules'" (the optimizer class imported without the project's folder)
    assert "No module named" not in v["detail"]
    assert v["status"] == status, v["detail"]
    if status == "confirmed":
        assert "`args.lr` = 1e-3 (argparse default)" in v["detail"]
        assert (
            "`num_train_optimization_steps` is not in the file: taken as the number of steps" in v["detail"]
        )
    else:  # the setting has no value in the file: named, nothing guessed
        assert "`args.lr`" in v["detail"]
