"""The training step whose memory is billed: model, precision policy, optimizer, checkpointing, steps.

The same code runs on fake tensors for the prediction and on real CPU tensors for the benchmark's
measurement; what each run learns about its tensors goes through a ``Hooks`` object.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

PRECISIONS = ("fp32", "amp-bf16", "amp-fp16", "bf16", "bf16-master")


class SetupError(Exception):
    """The setup cannot be run as given (bad factory, option, or model); a one-line message."""


@dataclass
class Setup:
    """One training setup; ``build`` makes the model (called under the fake mode for a prediction)."""

    build: Callable[[], nn.Module]
    label: str = "model"
    make_batch: Callable[[int, int | None], Any] | None = None
    batch_size: int = 1
    seq_len: int | None = None
    input_shape: tuple[int, ...] | None = None
    precision: str = "fp32"
    optimizer: str = "AdamW"
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    checkpointing: bool = False
    grad_accum: int = 1
    steps: int = 2
    labels: bool = False  # pass the input ids as ``labels=`` (Hugging Face models compute their loss)


@dataclass
class RunInfo:
    """What the step learned about the model, independent of how memory was measured."""

    parameters: int = 0
    trainable: int = 0
    unit_weights: int = 0  # bytes of the largest FSDP unit (one block, or what is outside the blocks)
    unit_grads: int = 0
    blocks: int = 0


class Hooks:
    """Told about the run's tensors; the real-tensor benchmark uses this do-nothing base."""

    def enter(self, phase: str, stage: str) -> None: ...
    def built(self, model: nn.Module) -> None: ...
    def optimizer_built(self, master: list[torch.Tensor] | None) -> None: ...
    def after_backward(self, params: list[nn.Parameter]) -> None: ...
    def after_step(self, optimizer: torch.optim.Optimizer, scaler: Any) -> None: ...
    def finish(self) -> None: ...


def load_object(spec: str, what: str) -> Any:
    """``pkg.module:attr`` imported with the current folder on ``sys.path`` (this runs user code)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SetupError(f"{what} must look like pkg.module:name, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # the user's module may fail in any way while importing
        raise SetupError(f"cannot import {module_name!r} for {what}: {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SetupError(f"{module_name!r} has no {attr!r} (for {what})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise SetupError(f"{spec} is not callable (for {what})")
    return obj


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of the first ``nn.ModuleList`` / ``nn.Sequential``: the model's repeated blocks."""
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 0:
            return list(m)
    return []


def checkpoint_blocks(blocks: list[nn.Module]) -> None:
    """Recompute each block in backward instead of keeping its activations (non-reentrant)."""
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)  # type: ignore[method-assign]


def make_optimizer(setup: Setup, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """A torch.optim class by name (or ``pkg.module:Class``); foreach as on CUDA unless told otherwise."""
    if ":" in setup.optimizer:
        cls = load_object(setup.optimizer, "--optimizer")
    else:
        cls = getattr(torch.optim, setup.optimizer, None)
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
        raise SetupError(
            f"unknown optimizer {setup.optimizer!r}: name a torch.optim class or pkg.module:Class"
        )
    kwargs = dict(setup.optimizer_kwargs)
    accepted = inspect.signature(cls).parameters
    # On CUDA, Adam/AdamW/SGD default to the foreach implementation, whose temporaries cover all
    # parameters at once; fake and CPU tensors would default to the per-parameter loop.
    if "foreach" in accepted and "foreach" not in kwargs and not kwargs.get("fused"):
        kwargs["foreach"] = True
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as e:
        raise SetupError(f"cannot build {setup.optimizer} with {setup.optimizer_kwargs}: {e}") from e


def default_batch(setup: Setup, model: nn.Module) -> Any:
    """A random batch the model's first layer accepts, when no ``--input`` factory is given."""
    b, t = setup.batch_size, setup.seq_len
    if setup.input_shape is not None:
        return torch.randn(b, *setup.input_shape)
    first = next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
    if isinstance(first, nn.Embedding):
        if t is None:
            raise SetupError("the model starts with an embedding: give --seq-len")
        return torch.randint(0, first.num_embeddings, (b, t))
    if isinstance(first, nn.Linear):
        return torch.randn(b, first.in_features) if t is None else torch.randn(b, t, first.in_features)
    raise SetupError(
        f"cannot guess the input of a model starting with {type(first).__name__}: "
        "give --input-shape C,H,W (without the batch) or --input pkg.module:make_batch"
    )


def make_batch(setup: Setup, model: nn.Module, dtype: torch.dtype | None) -> Any:
    if setup.make_batch is not None:
        try:
            batch = setup.make_batch(setup.batch_size, setup.seq_len)
        except Exception as e:  # user code
            raise SetupError(f"the input factory raised {type(e).__name__}: {e}") from e
    else:
        batch = default_batch(setup, model)
    if dtype is not None:  # a model in bf16 takes bf16 inputs
        batch = tree_map(
            lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, batch
        )
    if setup.labels and isinstance(batch, torch.Tensor):
        batch = {"input_ids": batch, "labels": batch}
    return batch


def call_model(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def compute_loss(out: Any, batch: Any) -> torch.Tensor:
    """The model's own loss when it returns one; cross-entropy on token ids; else the mean output."""
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    tensors = [x for x in tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not tensors:
        raise SetupError("the model returned no floating-point tensor to take a loss of")
    logits = tensors[0]
    ids = batch if isinstance(batch, torch.Tensor) else None
    if (
        ids is not None
        and not ids.is_floating_point()
        and logits.dim() >= 2
        and logits.shape[:-1] == ids.shape
    ):
        return nn.functional.cross_entropy(logits.flatten(0, -2).float(), ids.flatten())
    return logits.float().mean()


def _units(model: nn.Module, blocks: list[nn.Module]) -> tuple[int, int]:
    """Weight and gradient bytes of the largest FSDP unit: one block, or everything outside them."""

    def size(ps: list[nn.Parameter]) -> tuple[int, int]:
        w = sum(p.numel() * p.element_size() for p in ps)
        return w, sum(p.numel() * p.element_size() for p in ps if p.requires_grad)

    inside = {id(p) for b in blocks for p in b.parameters()}
    units = [size(list(b.parameters())) for b in blocks]
    units.append(size([p for p in model.parameters() if id(p) not in inside]))
    return max(units)


def cast_model(model: nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` that fake tensors allow (their mode keeps weak references, so ``to`` cannot
    swap parameters in place); tied parameters stay tied."""
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table, make in ((module._parameters, nn.Parameter), (module._buffers, None)):
            for name, t in table.items():
                if t is None or not t.is_floating_point():
                    continue
                if id(t) not in done:
                    new = t.detach().to(dtype)
                    done[id(t)] = make(new, requires_grad=t.requires_grad) if make else new
                table[name] = done[id(t)]


def _optimizer_step(opt: torch.optim.Optimizer, scaler: Any, params: list, master: list | None) -> None:
    if master is not None:  # fp32 copies of the 16-bit gradients, for the fp32 master weights
        for m, p in zip(master, params, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
    if scaler is not None:
        scaler.unscale_(opt)  # GradScaler.step() reads found_inf with .item(); the state is the same
        opt.step()
        scaler.update()
    else:
        opt.step()
    if master is not None:
        with torch.no_grad():
            for m, p in zip(master, params, strict=True):
                p.copy_(m)
                m.grad = None
    opt.zero_grad(set_to_none=True)
    for p in params:
        p.grad = None


def _build(setup: Setup, hooks: Hooks) -> tuple[nn.Module, list[nn.Module], list | None]:
    try:
        model = setup.build()
    except SetupError:
        raise
    except Exception as e:  # user code
        raise SetupError(f"the model factory raised {type(e).__name__}: {e}") from e
    if not isinstance(model, nn.Module):
        raise SetupError(f"the model factory returned {type(model).__name__}, not an nn.Module")
    model.train()
    blocks = find_blocks(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    master = None
    if setup.precision == "bf16-master":
        master = [p.detach().to(torch.float32, copy=True).requires_grad_(True) for p in trainable]
    if setup.precision in ("bf16", "bf16-master"):
        cast_model(model, torch.bfloat16)
    if setup.checkpointing:
        if not blocks:
            raise SetupError("--checkpointing: the model has no nn.ModuleList / nn.Sequential of blocks")
        checkpoint_blocks(blocks)
    hooks.built(model)
    return model, blocks, master


def run_steps(setup: Setup, hooks: Hooks, forward: bool = True) -> RunInfo:
    """Build, then ``setup.steps`` optimizer steps of ``grad_accum`` micro-batches each.

    With ``forward=False`` the gradients are zeros instead of a backward pass: the model state alone.
    """
    if setup.precision not in PRECISIONS:
        raise SetupError(f"unknown precision {setup.precision!r}; choose from {', '.join(PRECISIONS)}")
    hooks.enter("build", "build")
    model, blocks, master = _build(setup, hooks)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(setup, master if master is not None else trainable)
    scaler = torch.amp.GradScaler("cpu") if setup.precision == "amp-fp16" else None
    hooks.optimizer_built(master)
    amp = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(setup.precision)
    dtype = torch.bfloat16 if setup.precision in ("bf16", "bf16-master") else None
    for step in range(1, setup.steps + 1):
        for micro in range(1, setup.grad_accum + 1):
            tag = f"step{step}" + (f".micro{micro}" if setup.grad_accum > 1 else "")
            if not forward:
                hooks.enter(f"{tag}.backward", "backward")
                for p in trainable:
                    p.grad = torch.zeros_like(p)
                hooks.after_backward(trainable)
                continue
            hooks.enter(f"{tag}.forward", "forward")
            batch = make_batch(setup, model, dtype)
            ctx = torch.autocast("cpu", dtype=amp) if amp else contextlib.nullcontext()
            with ctx:
                out = call_model(model, batch)
                loss = compute_loss(out, batch) / setup.grad_accum
            hooks.enter(f"{tag}.backward", "backward")
            (scaler.scale(loss) if scaler is not None else loss).backward()
            del out, loss, batch
            hooks.after_backward(trainable)
        hooks.enter(f"step{step}.optimizer", "optimizer")
        _optimizer_step(opt, scaler, trainable, master)
        hooks.after_step(opt, scaler)
    hooks.finish()
    unit_w, unit_g = _units(model, blocks)
    n = sum(p.numel() for p in model.parameters())
    return RunInfo(n, sum(p.numel() for p in trainable), unit_w, unit_g, len(blocks))
