"""Session 5 tuning misses of TL101, TL204 and TL504: the general shapes of the real cases, each with a
look-alike that stays silent."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from conftest import lint_project

from trainlint.cli import run
from trainlint.engine import lint_source


def lint(root: Path, files: dict[str, str], target: str, monkeypatch, capsys) -> list[tuple[str, int]]:
    """(rule, line) of each finding in ``target`` of the project ``files``."""
    return [(f["rule"], f["line"]) for f in lint_project(root, files, target, monkeypatch, capsys)]


# -- TL101: an updater class's method receives the scaler as an optional keyword and clips -------------
UPDATER = """
    from typing import Optional

    import torch


    class Updater:
        def __init__(self, network, optimizer):
            self.network = network
            self.optimizer = optimizer

        def step(self, *, grad_scaler: Optional[torch.cuda.amp.GradScaler] = None):
            torch.nn.utils.clip_grad_norm_(self.network.parameters(), 1.0)
            if grad_scaler is not None:
                grad_scaler.step(self.optimizer)
                grad_scaler.update()
            else:
                self.optimizer.step()
    """

ENGINE = """
    import torch

    from .updater import Updater


    class Engine:
        def __init__(self, model, optimizer):
            self._grad_scaler = torch.amp.GradScaler()
            self._updater = Updater(model, optimizer)

        def train_step(self, loss):
            self._grad_scaler.scale(loss).backward()
            {between}self._updater.step(grad_scaler=self._grad_scaler)
    """


@pytest.mark.parametrize("name", ["grad_scaler", "gs"])
def test_tl101_updater_method_clips_before_the_scaler_it_receives_steps(
    tmp_path, monkeypatch, capsys, name: str
) -> None:
    # the parameter is a scaler by its name, or (``gs``) only by its ``Optional[GradScaler]`` annotation
    files = {
        "pkg/__init__.py": "",
        "pkg/updater.py": UPDATER.replace("grad_scaler", name),
        "pkg/engine.py": ENGINE.format(between="").replace("grad_scaler=", f"{name}="),
    }
    assert ("TL101", 12) in lint(tmp_path, files, "pkg/updater.py", monkeypatch, capsys)


def test_tl101_updater_method_silent_when_the_caller_unscales_first(tmp_path, monkeypatch, capsys) -> None:
    between = "self._grad_scaler.unscale_(self._updater.optimizer)\n            "
    files = {
        "pkg/__init__.py": "",
        "pkg/updater.py": UPDATER,
        "pkg/engine.py": ENGINE.format(between=between),
    }
    assert [f for f in lint(tmp_path, files, "pkg/updater.py", monkeypatch, capsys) if f[0] == "TL101"] == []


# -- TL504: the division in one function, the engine's backward (under a DeepSpeed guard) in another ---
SCHEDULES = """
    import torch


    def forward_step(step_func, data, model, losses):
        output, loss_func = step_func(data, model)
        loss, reduced = loss_func(output)
        output = loss / {count}
        losses.append(reduced)
        return output


    def backward_step(optimizer, output, output_grad, model=None):
        if args.deepspeed:
            model.backward(output)
        else:
            output = optimizer.scale_loss(output)
            torch.autograd.backward(output, grad_tensors=output_grad)


    def forward_backward(step_func, data, model, optimizer):
        losses = []
        for _ in range(get_num_microbatches()):
            output = forward_step(step_func, data, model, losses)
            backward_step(optimizer, output, None, model)
        return losses
    """


def tl504_lines(code: str) -> list[int]:
    source = textwrap.dedent(code).lstrip("\n")
    return [f.line for f in lint_source(source, "schedules.py", ["TL504"])]


def test_tl504_division_in_the_forward_step_backward_by_the_engine_in_the_backward_step() -> None:
    source = textwrap.dedent(SCHEDULES.format(count="get_num_microbatches()")).lstrip("\n")
    found = lint_source(source, "schedules.py", ["TL504"])
    assert [(f.line, sorted(r.line for r in f.related)) for f in found] == [(14, [7])]


def test_tl504_split_division_look_alikes_are_silent() -> None:
    # divided by a token count, not by the accumulation steps
    assert tl504_lines(SCHEDULES.format(count="num_tokens")) == []
    # the plain PyTorch backward: the division is needed there
    plain = SCHEDULES.format(count="get_num_microbatches()").replace("if args.deepspeed:", "if args.apex:")
    assert tl504_lines(plain) == []


# -- TL204: torch's checkpoint_wrapper with preserve_rng_state=False on blocks that have dropout -------
BLOCK = """
    import torch.nn as nn


    class Block(nn.Module):
        def __init__(self, dim, dropout=0.0):
            super().__init__()
            self.proj = nn.Linear(dim, dim)
            self.dropout = {dropout}

        def forward(self, x):
            return x + self.dropout(self.proj(x))
    """

MODEL = """
    import torch.nn as nn

    from .block import Block


    class Model(nn.Module):
        def __init__(self, blocks):
            super().__init__()
            self.blocks = nn.ModuleDict(blocks)

        def apply_activation_checkpointing(self):
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper as ptd_checkpoint_wrapper,
            )

            preserve_rng_state = False
            for idx, block in enumerate(self.blocks.values()):
                block = ptd_checkpoint_wrapper(block, preserve_rng_state=preserve_rng_state)
                self.blocks.register_module(str(idx), block)
    """


def test_tl204_checkpoint_wrapper_without_rng_state_on_blocks_with_dropout(
    tmp_path, monkeypatch, capsys
) -> None:
    dropout = "nn.Dropout(dropout) if dropout > 0.0 else nn.Identity()"
    files = {"pkg/__init__.py": "", "pkg/block.py": BLOCK.format(dropout=dropout), "pkg/model.py": MODEL}
    assert ("TL204", 18) in lint(tmp_path, files, "pkg/model.py", monkeypatch, capsys)


def test_tl204_checkpoint_wrapper_look_alikes_are_silent(tmp_path, monkeypatch, capsys) -> None:
    # no randomness in the blocks
    files = {
        "pkg/__init__.py": "",
        "pkg/block.py": BLOCK.format(dropout="nn.Identity()"),
        "pkg/model.py": MODEL,
    }
    assert [f for f in lint(tmp_path, files, "pkg/model.py", monkeypatch, capsys) if f[0] == "TL204"] == []
    # the RNG state preserved
    files["pkg/block.py"] = BLOCK.format(dropout="nn.Dropout(dropout)")
    files["pkg/model.py"] = MODEL.replace("preserve_rng_state = False", "preserve_rng_state = True")
    assert [f for f in lint(tmp_path, files, "pkg/model.py", monkeypatch, capsys) if f[0] == "TL204"] == []


def test_tl101_warm_run_follows_the_caller_of_the_updater_method(tmp_path, monkeypatch, capsys) -> None:
    """The finding rests on the engine's call: a cached run of the updater recomputes it when the
    engine (another file) starts to unscale first, and when it stops again."""
    files = {"pkg/__init__.py": "", "pkg/updater.py": UPDATER, "pkg/engine.py": ENGINE.format(between="")}
    lint(tmp_path, files, "pkg/updater.py", monkeypatch, capsys)  # (writes the project)
    engine = tmp_path / "pkg" / "engine.py"
    original = engine.read_text()

    def tl101() -> list[int]:
        capsys.readouterr()
        assert run(["--cache-dir", str(tmp_path / "cache"), "--format", "json", "pkg/updater.py"]) in (0, 1)
        return [f["line"] for f in json.loads(capsys.readouterr().out)["findings"] if f["rule"] == "TL101"]

    assert tl101() == [12]  # cold, now cached
    unscaled = "self._grad_scaler.unscale_(self._updater.optimizer)\n        self._updater.step("
    engine.write_text(original.replace("self._updater.step(", unscaled))
    assert tl101() == []  # warm, only the engine changed: recomputed, gone
    engine.write_text(original + "\n# a comment changes the text, not the facts\n")
    assert tl101() == [12]
