"""Activation-checkpointing checks at run time: TL201 (no use_reentrant), TL203 (state changed again
by the recomputation) and TL204 (random draws recomputed without the RNG state).

The first calls of each checkpoint site run a probe: the function's outputs are kept from the forward
pass and compared, by value, with the recomputed ones, and the modules the function reaches are
fingerprinted before and after each pass. Early stopping is turned off for those calls so that the
recomputation runs to the end and its outputs can be compared.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.utils.checkpoint as ckpt

from trainlint.run.monitor import Monitor, user_location

PROBED_CALLS = 4  # calls per checkpoint site that are probed
SIMPLE = (int, float, bool, str)


def _modules(function: Any) -> list[torch.nn.Module]:
    found = []
    if isinstance(function, torch.nn.Module):
        found.append(function)
    owner = getattr(function, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        found.append(owner)
    for cell in getattr(function, "__closure__", None) or ():
        try:
            if isinstance(cell.cell_contents, torch.nn.Module):
                found.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return found


def _state(modules: list[torch.nn.Module]) -> dict[str, Any]:
    """A cheap fingerprint of module state: buffer version counters and identities, plain attributes."""
    out: dict[str, Any] = {}
    for root in modules:
        for prefix, module in root.named_modules():
            for name, buf in module.named_buffers(recurse=False):
                out[f"{prefix}.{name}".lstrip(".")] = (id(buf), buf._version, _show(buf))
            for name, value in vars(module).items():
                if not name.startswith("_") and isinstance(value, SIMPLE) and name != "training":
                    out[f"{prefix}.{name}".lstrip(".")] = value
    return out


def _show(buf: torch.Tensor) -> str:
    return f"{buf.item():g}" if buf.numel() == 1 else f"tensor of {buf.numel()}"


def _changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    out = []
    for key, value in after.items():
        old = before.get(key)
        if old != value:
            show = lambda v: v[2] if isinstance(v, tuple) else repr(v)  # noqa: E731
            out.append(f"{key} {show(old) if old is not None else 'unset'} -> {show(value)}")
    return out


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


class Probe:
    """Wraps one checkpointed call's function: call 1 is the forward pass, call 2 the recomputation."""

    def __init__(self, monitor: Monitor, function: Any, where: tuple[str, int], preserve_rng: bool) -> None:
        self.monitor, self.function, self.where, self.preserve_rng = monitor, function, where, preserve_rng
        self.calls = 0
        self.modules = _modules(function)
        self.forward_out: list[torch.Tensor] = []
        self.forward_changes: list[str] = []
        self.drew_random = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        before = _state(self.modules)
        rng = torch.get_rng_state() if self.calls == 1 else None
        try:
            out = self.function(*args, **kwargs)
        finally:
            changes = _changes(before, _state(self.modules))
        if self.calls == 1:
            self.forward_changes = changes
            self.drew_random = not torch.equal(rng, torch.get_rng_state())
            self.forward_out = [t.detach().clone() for t in _tensors(out)]
        elif self.calls == 2:
            self._recomputed(out, changes)
        return out

    def _recomputed(self, out: Any, changes: list[str]) -> None:
        diff = 0.0
        for old, new in zip(self.forward_out, _tensors(out), strict=False):
            if old.shape == new.shape and old.is_floating_point():
                diff = max(diff, float((old - new.detach()).abs().max()) if old.numel() else 0.0)
        if changes:
            self.monitor.record(
                "TL203",
                f"the recomputation in backward changed module state again ({'; '.join(changes[:4])}); "
                f"the recomputed outputs differ from the forward ones by {diff:.3g} (max abs)",
                {"changes": changes, "max_abs_output_diff": diff},
                where=self.where,
            )
        if self.drew_random and not self.preserve_rng:
            self.monitor.record(
                "TL204",
                "the checkpointed function draws random numbers (dropout) and preserve_rng_state=False: "
                f"the recomputed outputs differ from the forward ones by {diff:.3g} (max abs), so the "
                "gradients belong to a different dropout mask",
                {"max_abs_output_diff": diff},
                where=self.where,
            )


def install(monitor: Monitor) -> None:
    probed: Counter[tuple[str, int]] = Counter()

    def make_checkpoint(original: Any) -> Any:
        def checkpoint(function: Any, *args: Any, use_reentrant: bool | None = None, **kwargs: Any) -> Any:
            where = user_location()
            if use_reentrant is None:
                _report_reentrant(monitor, function, args, where)
            if probed[where] >= PROBED_CALLS or not torch.is_grad_enabled():
                return original(function, *args, use_reentrant=use_reentrant, **kwargs)
            probed[where] += 1
            probe = Probe(monitor, function, where, kwargs.get("preserve_rng_state", True))
            with ckpt.set_checkpoint_early_stop(False):
                return original(probe, *args, use_reentrant=use_reentrant, **kwargs)

        return checkpoint

    monitor.patch(ckpt, "checkpoint", make_checkpoint)
    monitor.on_reset.append(probed.clear)


def _report_reentrant(monitor: Monitor, function: Any, args: tuple[Any, ...], where: tuple[str, int]) -> None:
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    params = [p for m in _modules(function) for p in m.parameters() if p.requires_grad]
    if torch.is_grad_enabled() and params and not any(t.requires_grad for t in inputs):
        message = (
            "checkpoint() without use_reentrant ran in the reentrant mode, and no input requires grad: "
            f"the {len(params)} parameter tensors inside get no gradient"
        )
    else:
        message = (
            "checkpoint() without use_reentrant ran in the reentrant mode (PyTorch warns, and plans to "
            "make this an error); pass use_reentrant=False"
        )
    measured = {
        "inputs_requiring_grad": sum(t.requires_grad for t in inputs),
        "parameters_inside": len(params),
    }
    monitor.record("TL201", message, measured, where=where)
