"""Sampling and sharding checks at run time: TL505 (a shuffling DistributedSampler iterated again with
the same epoch, so the pass repeats the last one's order), TL503 (an optimizer holding parameters
that FSDP replaced when it wrapped the model), TL110 (a 16-bit FSDP mixed-precision policy without
``reduce_dtype``, with the dtypes the run resolved) and TL506 (``clip_grad_norm_`` given FSDP1's sharded
flat parameters: the norm it clips by is this rank's shard's).

TL505 wraps ``DistributedSampler.__iter__``: each pass's epoch and a digest of its index order are
kept per sampler, with the optimizer steps taken while the pass ran (a pass with no step is an
evaluation pass, whose order does not matter). TL503 notes, at each FSDP wrap (FSDP1's class, FSDP2's
``fully_shard``), which parameter tensors the module owned before and no longer owns after; at an
optimizer step, an optimizer that holds any of them is updating tensors the forward no longer uses.
TL506 looks at what ``clip_grad_norm_`` is given, with no collective of its own: flat parameters whose
gradient holds fewer elements than the unsharded parameter.
"""

from __future__ import annotations

import array
import hashlib
import importlib
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from trainlint.run.monitor import Monitor, OptimizerInfo, user_location

# Where FSDP2's ``fully_shard`` is importable from, across torch releases.
FULLY_SHARD_MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed.fsdp._fully_shard._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)


@dataclass
class Pass:
    epoch: int
    digest: str
    steps_at_start: int
    steps: int | None = None  # optimizer steps taken while the pass ran (to its end, else the next pass)


@dataclass
class SamplerState:
    where: tuple[str, int]
    passes: list[Pass] = field(default_factory=list)
    reported: bool = False


@dataclass
class ShardState:
    monitor: Monitor
    samplers: weakref.WeakKeyDictionary[Any, SamplerState] = field(default_factory=weakref.WeakKeyDictionary)
    replaced: dict[int, tuple[str, int]] = field(default_factory=dict)  # parameter id -> where it was wrapped
    # the replaced tensors themselves, weakly: an id is only theirs while they live (a strong reference
    # would keep a full copy of the model alive)
    tensors: weakref.WeakValueDictionary[int, Any] = field(default_factory=weakref.WeakValueDictionary)
    checked: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)


def install(monitor: Monitor) -> None:
    state = ShardState(monitor)
    _install_sampler(monitor, state)
    if torch.distributed.is_available():
        _install_fsdp(monitor, state)
        _install_clip(monitor)
    monitor.on_step_pre.append(lambda opt, info: _stale_parameters(state, opt, info))
    monitor.on_reset.append(lambda: state.__init__(monitor))


# -- TL505 ------------------------------------------------------------------------------------------
def _install_sampler(monitor: Monitor, state: ShardState) -> None:
    from torch.utils.data.distributed import DistributedSampler

    def make_init(original: Any) -> Any:
        def __init__(sampler: Any, *args: Any, **kwargs: Any) -> None:
            original(sampler, *args, **kwargs)
            state.samplers[sampler] = SamplerState(user_location())

        return __init__

    def make_iter(original: Any) -> Any:
        def __iter__(sampler: Any) -> Any:
            indices = list(original(sampler))
            seen = state.samplers.get(sampler)
            if seen is None or not getattr(sampler, "shuffle", False):
                return iter(indices)
            return _passing(state, _new_pass(state, sampler, seen, indices), indices)

        return __iter__

    monitor.patch(DistributedSampler, "__init__", make_init)
    monitor.patch(DistributedSampler, "__iter__", make_iter)


def _passing(state: ShardState, current: Pass, indices: list[int]) -> Any:
    yield from indices
    current.steps = state.monitor.steps - current.steps_at_start


def _digest(indices: list[Any]) -> str:
    try:  # the raw 64-bit integers, not their repr: half the time on a pass of a million samples
        data = array.array("q", indices).tobytes()
    except (TypeError, OverflowError):  # a subclass's own index type
        data = repr(indices).encode()
    return hashlib.sha1(data).hexdigest()[:12]


def _new_pass(state: ShardState, sampler: Any, seen: SamplerState, indices: list[int]) -> Pass:
    steps = state.monitor.steps
    if seen.passes and seen.passes[-1].steps is None:  # left before its end
        seen.passes[-1].steps = steps - seen.passes[-1].steps_at_start
    digest = _digest(indices)
    epoch = int(getattr(sampler, "epoch", 0))
    seen.passes.append(Pass(epoch, digest, steps))
    done = seen.passes[:-1]
    # a repeat needs an earlier training pass (one with steps) of the same epoch and order
    repeated = [p for p in done if p.epoch == epoch and p.digest == digest and (p.steps or 0) > 0]
    if not repeated or seen.reported:
        return seen.passes[-1]
    seen.reported = True
    state.monitor.record(
        "TL505",
        f"this DistributedSampler shuffles, but pass {len(seen.passes)} over it ran with epoch={epoch} "
        f"again and drew the same order as pass {seen.passes.index(repeated[0]) + 1} (which ran "
        f"{repeated[0].steps} optimizer steps): set_epoch() was not called between them",
        {
            "passes": len(seen.passes),
            "epochs_seen": [p.epoch for p in seen.passes],
            "same_order": True,
            "samples_per_pass": len(indices),
            "optimizer_steps_in_first_pass": repeated[0].steps,
        },
        where=seen.where,
    )
    return seen.passes[-1]


# -- TL503 ------------------------------------------------------------------------------------------
def _install_fsdp(monitor: Monitor, state: ShardState) -> None:
    def replaced_by(wrap: Any, module: Any, *args: Any, **kwargs: Any) -> Any:
        where = user_location()
        _reduce_dtype(monitor, kwargs.get("mixed_precision") or kwargs.get("mp_policy"), where)
        before = list(module.parameters()) if isinstance(module, torch.nn.Module) else []
        out = wrap(module, *args, **kwargs)
        after = {id(p) for p in (out if isinstance(out, torch.nn.Module) else module).parameters()}
        for p in before:
            if id(p) not in after:
                state.replaced[id(p)] = where
                state.tensors[id(p)] = p
        return out

    def make_fully_shard(original: Any) -> Any:
        def fully_shard(module: Any, *args: Any, **kwargs: Any) -> Any:
            return replaced_by(original, module, *args, **kwargs)

        return fully_shard

    def make_init(original: Any) -> Any:
        def __init__(wrapper: Any, module: Any, *args: Any, **kwargs: Any) -> None:
            def wrap(inner: Any, *a: Any, **k: Any) -> Any:
                original(wrapper, inner, *a, **k)
                return wrapper

            replaced_by(wrap, module, *args, **kwargs)

        return __init__

    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return
    monitor.patch(FullyShardedDataParallel, "__init__", make_init)
    _install_policies(monitor)
    for name in FULLY_SHARD_MODULES:
        try:
            owner = importlib.import_module(name)
        except ImportError:
            continue
        if callable(getattr(owner, "fully_shard", None)) and not isinstance(owner.fully_shard, type(torch)):
            monitor.patch(owner, "fully_shard", make_fully_shard)


# -- TL110 ------------------------------------------------------------------------------------------
def _install_policies(monitor: Monitor) -> None:
    """Stamp each FSDP mixed-precision policy with the place that built it (the static finding's)."""

    def make_init(original: Any) -> Any:
        def __init__(policy: Any, *args: Any, **kwargs: Any) -> None:
            original(policy, *args, **kwargs)
            object.__setattr__(policy, "_trainlint_where", user_location())  # frozen dataclasses too

        return __init__

    import torch.distributed.fsdp as fsdp

    for name in ("MixedPrecision", "MixedPrecisionPolicy"):
        cls = getattr(fsdp, name, None)
        if isinstance(cls, type):
            monitor.patch(cls, "__init__", make_init)


def _reduce_dtype(monitor: Monitor, policy: Any, wrapped_at: tuple[str, int]) -> None:
    """A policy whose parameters are 16-bit and whose reduce_dtype is None: FSDP reduce-scatters the
    gradients in the parameter dtype. The dtypes are the run's, whatever expression gave them."""
    low = (torch.float16, torch.bfloat16)
    if policy is None or getattr(policy, "param_dtype", None) not in low:
        return
    if getattr(policy, "reduce_dtype", None) is not None:
        return
    dtype = str(policy.param_dtype).replace("torch.", "")
    monitor.record(
        "TL110",
        f"FSDP wrapped the model (at line {wrapped_at[1]}) with param_dtype={dtype} and reduce_dtype=None: "
        f"its gradients are reduce-scattered in {dtype}; pass reduce_dtype=torch.float32",
        {"param_dtype": dtype, "reduce_dtype": None, "wrapped_at_line": wrapped_at[1]},
        where=getattr(policy, "_trainlint_where", wrapped_at),
    )


def _stale_parameters(state: ShardState, optimizer: Any, info: OptimizerInfo) -> None:
    if not state.replaced or optimizer in state.checked:
        return
    state.checked.add(optimizer)
    held = [p for g in optimizer.param_groups for p in g["params"]]
    stale = [p for p in held if state.tensors.get(id(p)) is p]
    if not stale:
        return
    wrapped_at = state.replaced[id(stale[0])]
    state.monitor.record(
        "TL503",
        f"at its first step this optimizer held {len(stale)} of its {len(held)} parameter tensors from "
        f"before FSDP wrapped the model (at line {wrapped_at[1]}); the wrapped forward uses new ones, so "
        f"{sum(p.grad is None for p in stale)} of them have no gradient and the model is never updated",
        {
            "stale_parameters": len(stale),
            "optimizer_parameters": len(held),
            "stale_with_grad": sum(p.grad is not None for p in stale),
            "wrapped_at_line": wrapped_at[1],
        },
        where=info.where,
    )


# -- TL506 ------------------------------------------------------------------------------------------
def _install_clip(monitor: Monitor) -> None:
    try:
        from torch.distributed.fsdp._flat_param import FlatParameter
    except ImportError:
        return

    def make_clip_norm(original: Any) -> Any:
        def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            total = original(params, max_norm, *args, **kwargs)
            sharded = [
                p
                for p in params
                if isinstance(p, FlatParameter)
                and p.grad is not None
                and p.grad.numel() < p._unpadded_unsharded_size.numel()
            ]
            if sharded:
                _report_local_clip(monitor, sharded, float(total))
            return total

        return clip_grad_norm_

    for owner in (torch.nn.utils, torch.nn.utils.clip_grad):
        monitor.patch(owner, "clip_grad_norm_", make_clip_norm)


def _report_local_clip(monitor: Monitor, sharded: list[Any], local_norm: float) -> None:
    held = sum(p.grad.numel() for p in sharded)
    whole = sum(p._unpadded_unsharded_size.numel() for p in sharded)
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_initialized() else 1
    monitor.record(
        "TL506",
        f"clip_grad_norm_ was given {len(sharded)} FSDP flat parameter(s) whose gradients on this rank "
        f"hold {held:,} of their {whole:,} elements ({held / whole:.0%}, {world} ranks): the norm it "
        f"clipped by ({local_norm:.4g}) is this rank's shard's, not the model's; FSDP's own "
        "model.clip_grad_norm_ reduces it over the ranks",
        {
            "flat_parameters": len(sharded),
            "elements_on_this_rank": held,
            "elements_unsharded": whole,
            "world_size": world,
            "local_norm": local_norm,
        },
    )
