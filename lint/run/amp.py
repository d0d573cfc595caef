"""Mixed-precision checks at run time: TL101 (clip on scaled gradients), TL102 (a step that bypasses
the scaler), TL104 (a second unscale_) and TL105 (16-bit parameters without fp32 master weights)."""

from __future__ import annotations

import math
import weakref
from collections import Counter
from typing import Any

import torch

from trainlint.run.monitor import Monitor, OptimizerInfo

LOW = (torch.float16, torch.bfloat16)
ROUNDING_STEPS = 3  # steps over which TL105 measures updates lost to rounding


class AmpState:
    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        # scalers that scaled a loss since their last update(), and the optimizers each unscaled since
        self.scaled: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()
        self.in_scaler_step = 0
        self.snapshots: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.rounding: dict[int, list[tuple[int, int]]] = {}

    def still_scaled(self, params: list[torch.Tensor]) -> Any:
        """The scaler whose gradients for these parameters are still multiplied by its scale."""
        ids = {id(p) for p in params}
        for scaler, unscaled in list(self.scaled.items()):
            owners = [o for o in list(self.monitor.optimizers) if ids & self.monitor.info(o).param_ids]
            if not any(id(o) in unscaled for o in owners):
                return scaler
        return None


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def _norm(grads: list[torch.Tensor]) -> float:
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))


def install(monitor: Monitor) -> None:
    state = AmpState(monitor)
    scaler_cls = torch.amp.GradScaler

    def make_scale(original: Any) -> Any:
        def scale(scaler: Any, outputs: Any) -> Any:
            if scaler.is_enabled():
                state.scaled.setdefault(scaler, set())
            return original(scaler, outputs)

        return scale

    def make_unscale(original: Any) -> Any:
        def unscale_(scaler: Any, optimizer: torch.optim.Optimizer) -> Any:
            unscaled = state.scaled.get(scaler)
            if unscaled is not None and id(optimizer) in unscaled:
                monitor.record(
                    "TL104",
                    "scaler.unscale_(optimizer) called a second time for this optimizer since the last "
                    "update(); PyTorch raises a RuntimeError here",
                    {"loss_scale": scaler.get_scale()},
                )
            elif unscaled is not None:
                unscaled.add(id(optimizer))
            return original(scaler, optimizer)

        return unscale_

    def make_step(original: Any) -> Any:
        def step(scaler: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            state.in_scaler_step += 1
            try:
                return original(scaler, optimizer, *args, **kwargs)
            finally:
                state.in_scaler_step -= 1

        return step

    def make_update(original: Any) -> Any:
        def update(scaler: Any, *args: Any, **kwargs: Any) -> Any:
            state.scaled.pop(scaler, None)
            return original(scaler, *args, **kwargs)

        return update

    monitor.patch(scaler_cls, "scale", make_scale)
    monitor.patch(scaler_cls, "unscale_", make_unscale)
    monitor.patch(scaler_cls, "step", make_step)
    monitor.patch(scaler_cls, "update", make_update)
    _install_clips(monitor, state)
    monitor.on_step_pre.append(lambda opt, info: _step_pre(state, opt, info))
    monitor.on_step_post.append(lambda opt, info: _step_post(state, opt, info))
    monitor.on_reset.append(lambda: state.__init__(monitor))


def _install_clips(monitor: Monitor, state: AmpState) -> None:
    def make_clip_norm(original: Any) -> Any:
        def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            scaler = state.still_scaled(params) if state.scaled else None
            total = original(params, max_norm, *args, **kwargs)
            if scaler is not None and _grads(params):
                _report_clip_norm(monitor, scaler, float(total), float(max_norm))
            return total

        return clip_grad_norm_

    def make_clip_value(original: Any) -> Any:
        def clip_grad_value_(parameters: Any, clip_value: float, *args: Any, **kwargs: Any) -> Any:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            scaler = state.still_scaled(params) if state.scaled else None
            if scaler is not None and _grads(params):
                seen = max(float(g.detach().abs().max()) for g in _grads(params))
                scale = scaler.get_scale()
                monitor.record(
                    "TL101",
                    f"clip_grad_value_({clip_value:g}) ran on gradients still multiplied by the loss "
                    f"scale {scale:g}: the largest |grad| it saw was {seen:.4g} instead of {seen / scale:.4g}",
                    {"loss_scale": scale, "max_abs_grad_seen": seen, "max_abs_grad_true": seen / scale},
                )
            return original(params, clip_value, *args, **kwargs)

        return clip_grad_value_

    for owner in (torch.nn.utils, torch.nn.utils.clip_grad):
        monitor.patch(owner, "clip_grad_norm_", make_clip_norm)
        monitor.patch(owner, "clip_grad_value_", make_clip_value)


def _coefficient(norm: float, max_norm: float) -> float:
    return min(1.0, max_norm / (norm + 1e-6)) if math.isfinite(norm) else 0.0


def _report_clip_norm(monitor: Monitor, scaler: Any, seen: float, max_norm: float) -> None:
    scale = scaler.get_scale()
    true = seen / scale
    applied, wanted = _coefficient(seen, max_norm), _coefficient(true, max_norm)
    monitor.record(
        "TL101",
        f"clip_grad_norm_ ran while the GradScaler's gradients for this optimizer were still multiplied "
        f"by the loss scale {scale:g}: it saw a total norm of {seen:.4g} instead of {true:.4g} "
        f"(max_norm {max_norm:g}), so it multiplied the gradients by {applied:.3g} instead of {wanted:.3g}",
        {"loss_scale": scale, "norm_seen": seen, "norm_true": true, "max_norm": max_norm},
    )


def _step_pre(state: AmpState, optimizer: torch.optim.Optimizer, info: OptimizerInfo) -> None:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not state.in_scaler_step and state.scaled:
        scaler = state.still_scaled(params)
        grads = _grads(params)
        if scaler is not None and grads:
            scale = scaler.get_scale()
            seen = _norm(grads)
            state.monitor.record(
                "TL102",
                f"optimizer.step() ran directly after a loss-scaled backward: it consumed gradients "
                f"multiplied by the loss scale {scale:g} (gradient norm {seen:.4g} instead of "
                f"{seen / scale:.4g}), and no inf/NaN check skipped a bad step",
                {"loss_scale": scale, "grad_norm_seen": seen, "grad_norm_true": seen / scale},
            )
    if info.steps < ROUNDING_STEPS and any(p.dtype in LOW for p in params):
        state.snapshots[id(optimizer)] = [
            (p, p.detach().clone()) for p in params if p.dtype in LOW and p.grad is not None
        ]


def _dtypes(tensors: Any) -> dict[str, int]:
    return dict(Counter(str(t.dtype).replace("torch.", "") for t in tensors))


def _step_post(state: AmpState, optimizer: torch.optim.Optimizer, info: OptimizerInfo) -> None:
    snapshot = state.snapshots.pop(id(optimizer), None)
    if snapshot is None:
        return
    lost = changed = 0
    for param, before in snapshot:
        moving = param.grad != 0 if param.grad is not None else torch.ones_like(param, dtype=torch.bool)
        lost += int(((param.detach() == before) & moving).sum())
        changed += int(moving.sum())
    tally = state.rounding.setdefault(id(optimizer), [])
    tally.append((lost, changed))
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state_tensors = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    lost_all, moving_all = sum(t[0] for t in tally), sum(t[1] for t in tally)
    fraction = lost_all / moving_all if moving_all else 0.0
    measured = {
        "param_dtypes": _dtypes(params),
        "grad_dtypes": _dtypes(p.grad for p in params if p.grad is not None),
        "state_dtypes": _dtypes(t for t in state_tensors if t.is_floating_point()),
        "updates_rounded_to_zero": round(fraction, 4),
        "steps_measured": len(tally),
    }
    obs = state.monitor.record("TL105", "", measured, where=info.where)
    obs.measured = measured
    obs.message = (
        f"{type(optimizer).__name__} updates 16-bit parameters in place, with no fp32 master copy "
        f"(parameters {measured['param_dtypes']}, gradients {measured['grad_dtypes']}, optimizer state "
        f"{measured['state_dtypes'] or 'none'}): {fraction:.1%} of the updates with a non-zero gradient "
        f"rounded to zero over the first {len(tally)} step(s)"
    )
    obs.count = len(tally)
