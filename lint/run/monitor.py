"""The run-time monitor: wraps the few torch APIs the hazards go through and records what it sees.

No dispatch mode and no per-op hook: a wrapper costs one Python call on the APIs a training step
calls a handful of times (step, zero_grad, backward, the loss, clipping, checkpoint), and the costly
measurements (clones, graph walks, RNG states) run only on the first steps or when a hazard shows.
Imported only by ``trainlint run`` and the pytest plugin: it imports torch.
"""

from __future__ import annotations

import contextlib
import functools
import os
import runpy
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the trainlint package
_PLUMBING = {os.path.abspath(m.__file__) for m in (runpy, contextlib, functools)}
_MISSING = object()


class StopRun(BaseException):
    """Raised from the optimizer-step hook once the requested steps ran; a BaseException so that a
    user's ``except Exception`` does not swallow it."""


@dataclass
class Observation:
    """One hazard seen at one place of the user's code; later sightings only raise ``count``."""

    rule: str
    path: str
    line: int
    message: str
    measured: dict[str, Any]
    count: int = 1


@dataclass
class OptimizerInfo:
    where: tuple[str, int]
    steps: int = 0
    backward_at_zero: int | None = None  # the monitor's backward count at this optimizer's last zero_grad
    stepped_since_zero: bool = True
    param_ids: frozenset[int] = frozenset()


def _is_user_file(name: str) -> bool:
    return not (name.startswith((_TORCH_DIR, _OWN_DIR, "<frozen")) or os.path.abspath(name) in _PLUMBING)


def user_frame() -> FrameType | None:
    """The innermost frame outside torch, trainlint and the standard-library plumbing."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and not _is_user_file(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def user_location() -> tuple[str, int]:
    frame = user_frame()
    return (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("<unknown>", 0)


class Monitor:
    """Installs the wrappers, dispatches the events checks subscribe to, and keeps observations."""

    def __init__(self, max_steps: int | None = None) -> None:
        self.max_steps = max_steps
        self.steps = 0
        self.backward_calls = 0
        self.observations: dict[tuple[str, str, int], Observation] = {}
        self.optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, OptimizerInfo] = (
            weakref.WeakKeyDictionary()
        )
        self.on_step_pre: list[Callable[[torch.optim.Optimizer, OptimizerInfo], None]] = []
        self.on_step_post: list[Callable[[torch.optim.Optimizer, OptimizerInfo], None]] = []
        self.on_backward: list[Callable[[torch.Tensor], None]] = []
        self.on_zero_grad: list[Callable[[torch.optim.Optimizer, OptimizerInfo], None]] = []
        self.on_reset: list[Callable[[], None]] = []
        # each accumulation window's microbatches (accumulation.Microbatch) and the place of its first
        # loss, at every optimizer step
        self.on_window: list[Callable[[list[Any], tuple[str, int] | None], None]] = []
        self._patches: list[tuple[Any, str, Any]] = []
        self._handles: list[Any] = []
        self._kept: list[Any] = []  # see keep_until_released
        self._in_backward = 0
        self.installed = False

    # -- recording -------------------------------------------------------------------------------
    def record(
        self, rule: str, message: str, measured: dict[str, Any], where: tuple[str, int] | None = None
    ) -> Observation:
        path, line = where or user_location()
        key = (rule, path, line)
        seen = self.observations.get(key)
        if seen is not None:
            seen.count += 1
            return seen
        obs = Observation(rule, path, line, message, measured)
        self.observations[key] = obs
        return obs

    def reset(self) -> None:
        """Forget what was seen (the pytest plugin: one test's hazards are not the next one's)."""
        self.observations.clear()
        self.optimizers.clear()
        self.steps = self.backward_calls = 0
        for hook in self.on_reset:
            hook()

    # -- patching --------------------------------------------------------------------------------
    def patch(self, owner: Any, name: str, make: Callable[[Any], Callable[..., Any]]) -> None:
        """Replace ``owner.name`` by ``make(original)``; ``uninstall`` puts the original back."""
        original = getattr(owner, name)
        wrapper = functools.wraps(original)(make(original))
        self._patches.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, wrapper)

    def install(self) -> None:
        from trainlint.run import accumulation, amp, checkpoint, distributed, hf, memory, sharding, timing

        if self.installed:
            return
        self.installed = True
        self._install_core()
        for check in (amp, accumulation, checkpoint, memory, distributed, sharding, hf, timing):
            check.install(self)

    def uninstall(self) -> None:
        for handle in reversed(self._handles):
            handle.remove()
        for owner, name, original in reversed(self._patches):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._handles.clear()
        self._patches.clear()
        self.installed = False

    def keep_until_released(self, obj: Any) -> None:
        """Hold ``obj`` until ``release()``, which the runner calls once the script's globals are gone.

        For a process group: DDP's C++ reducer holds one, and once ``destroy_process_group()`` dropped
        the world's reference, freeing the script's model would free the group from the reducer's
        destructor, with the GIL held, while gloo joins its worker threads. A worker still letting go of
        a finished collective of tensors made in Python (trainlint's TL502 gather, the comm hook's
        all-reduce) needs the GIL for that: a deadlock, seen under load. Dropped from Python instead,
        torch's holder releases the GIL before the group's destructor runs.
        """
        if not any(kept is obj for kept in self._kept):
            self._kept.append(obj)

    def release(self) -> None:
        self._kept.clear()

    @contextlib.contextmanager
    def active(self) -> Iterator[Monitor]:
        self.install()
        try:
            yield self
        finally:
            self.uninstall()

    # -- the core events -------------------------------------------------------------------------
    def info(self, optimizer: torch.optim.Optimizer) -> OptimizerInfo:
        info = self.optimizers.get(optimizer)
        if info is None:  # built before the monitor was installed
            info = self.optimizers[optimizer] = OptimizerInfo(where=user_location())
        if not info.param_ids:
            info.param_ids = frozenset(id(p) for g in optimizer.param_groups for p in g["params"])
        return info

    def _install_core(self) -> None:
        monitor = self

        def make_init(original: Callable[..., None]) -> Callable[..., None]:
            def __init__(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
                original(opt, *args, **kwargs)
                if opt not in monitor.optimizers:
                    monitor.optimizers[opt] = OptimizerInfo(where=user_location())

            return __init__

        def make_backward(original: Callable[..., Any]) -> Callable[..., Any]:
            def backward(tensor: Any, *args: Any, **kwargs: Any) -> Any:
                if monitor._in_backward:  # Tensor.backward calls torch.autograd.backward
                    return original(tensor, *args, **kwargs)
                monitor._in_backward += 1
                try:
                    if isinstance(tensor, torch.Tensor):
                        for hook in monitor.on_backward:
                            hook(tensor)
                    return original(tensor, *args, **kwargs)
                finally:
                    monitor._in_backward -= 1
                    monitor.backward_calls += 1

            return backward

        def make_zero_grad(original: Callable[..., Any]) -> Callable[..., Any]:
            def zero_grad(obj: Any, *args: Any, **kwargs: Any) -> Any:
                monitor._zero_grad(obj)
                return original(obj, *args, **kwargs)

            return zero_grad

        self.patch(torch.optim.Optimizer, "__init__", make_init)
        self.patch(torch.Tensor, "backward", make_backward)
        self.patch(torch.autograd, "backward", make_backward)
        self.patch(torch.optim.Optimizer, "zero_grad", make_zero_grad)
        self.patch(torch.nn.Module, "zero_grad", make_zero_grad)
        self._handles.append(register_optimizer_step_pre_hook(self._step_pre))
        self._handles.append(register_optimizer_step_post_hook(self._step_post))

    def _zero_grad(self, obj: Any) -> None:
        if isinstance(obj, torch.optim.Optimizer):
            targets = [obj]
        else:  # model.zero_grad(): the optimizers that own its first parameter
            first = next(obj.parameters(), None)
            targets = [
                o for o in list(self.optimizers) if first is not None and id(first) in self.info(o).param_ids
            ]
        for opt in targets:
            info = self.info(opt)
            for hook in self.on_zero_grad:
                hook(opt, info)
            info.backward_at_zero = self.backward_calls
            info.stepped_since_zero = False

    def _step_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        info = self.info(optimizer)
        for hook in self.on_step_pre:
            hook(optimizer, info)

    def _step_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        info = self.info(optimizer)
        info.steps += 1
        info.stepped_since_zero = True
        self.steps += 1
        for hook in self.on_step_post:
            hook(optimizer, info)
        if self.max_steps is not None and self.steps >= self.max_steps:
            raise StopRun
