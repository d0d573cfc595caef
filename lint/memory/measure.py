"""Run the setup on fake tensors under the tracker and turn what it saw into a ``Measured`` bill."""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)

from trainlint.memory.project import Measured, PhasePeak
from trainlint.memory.tracker import SKIP_DIRS, MemoryTracker
from trainlint.memory.train import Hooks, RunInfo, Setup, run_steps

# Operators whose output shape or value depends on the data cannot run on fake tensors.
DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)


class TrackingHooks(Hooks):
    """Classifies the run's tensors in the tracker and records the resident size of each state term."""

    def __init__(self, tracker: MemoryTracker) -> None:
        self.t = tracker
        self.sizes = {"weights": 0, "buffers": 0, "gradients": 0, "master": 0, "optimizer": 0}

    def enter(self, phase: str, stage: str) -> None:
        self.t.enter(phase, stage)

    def built(self, model: nn.Module) -> None:
        self.t.watch(model)
        self.sizes["buffers"] = self.t.mark(model.buffers(), "weights")
        self.sizes["weights"] = self.t.mark([*model.parameters(), *model.buffers()], "weights")

    def optimizer_built(self, master: list[torch.Tensor] | None) -> None:
        self.sizes["master"] = self.t.mark(master or [], "master")

    def after_backward(self, params: list[nn.Parameter]) -> None:
        self.sizes["gradients"] = max(
            self.sizes["gradients"], self.t.mark((p.grad for p in params), "gradients")
        )

    def after_step(self, optimizer: torch.optim.Optimizer, scaler: Any) -> None:
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        if scaler is not None:  # the loss scale and its growth counter live as long as the optimizer
            state += [x for x in (scaler._scale, scaler._growth_tracker) if x is not None]
        self.sizes["optimizer"] = self.t.mark(state, "optimizer")

    def finish(self) -> None:
        self.t.finish()
        self.t.unwatch()


def _user_frame(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(SKIP_DIRS)]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def describe_failure(exc: BaseException) -> str:
    """``Type: message at file:line`` naming the innermost frame of the user's code."""
    first = str(exc).strip().split("\n")[0]
    return f"{type(exc).__name__}: {first}{_user_frame(exc)}"


def _run(setup: Setup, forward: bool) -> tuple[RunInfo, TrackingHooks]:
    tracker = MemoryTracker()
    hooks = TrackingHooks(tracker)
    try:
        with FakeTensorMode(), tracker:
            info = run_steps(setup, hooks, forward=forward)
    finally:
        tracker.unwatch()
    return info, hooks


def measure(setup: Setup) -> tuple[Measured, RunInfo]:
    """The single-process bill of ``setup``, from two fake training steps.

    When the forward pass needs data (``nonzero``, ``.item()``, boolean masks), the model state is still
    measured (zero gradients instead of a backward pass) and the activations are reported as unknown.
    """
    warnings: list[str] = []
    try:
        info, hooks = _run(setup, forward=True)
        complete = True
    except DATA_DEPENDENT as e:
        op = getattr(e, "func", None) or str(e).split("\n")[0]
        warnings.append(
            f"the forward pass calls a data-dependent operator ({op}){_user_frame(e)}, which fake tensors "
            "cannot run: activations and temporaries are NOT measured; the bill holds the model state only"
        )
        info, hooks = _run(setup, forward=False)
        complete = False
    tracker = hooks.t
    snaps = list(tracker.snapshots.values())
    peaks = [PhasePeak(s.phase, s.stage, s.by_kind()) for s in snaps]
    top = max(snaps, key=lambda s: s.total)
    act = max(snaps, key=lambda s: s.by_kind()["activations"])
    where = f"{top.phase}" + (f" in {top.module}" if top.module else "")
    s = hooks.sizes
    measured = Measured(
        parameters=info.parameters,
        trainable=info.trainable,
        weights=s["weights"],
        buffers=s["buffers"],
        gradients=s["gradients"],
        master=s["master"],
        optimizer=s["optimizer"],
        peaks=peaks,
        unit_weights=info.unit_weights,
        unit_grads=info.unit_grads,
        activations_measured=complete,
        activation_sites=act.sites("activations") if complete else [],
        peak_where=where,
        warnings=warnings,
    )
    return measured, info
