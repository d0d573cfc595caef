"""Data-parallel checks at run time: TL501 (gradient all-reduces per optimizer step under DDP without
``no_sync()``) and TL502 (ranks' valid-token counts differ while each normalises its loss locally).

TL501 counts the all-reduces DDP really issues: a counting comm hook wraps DDP's default all-reduce
(registered at the model's first forward, unless the user registers a hook of their own, which is then
wrapped instead). TL502 gathers each rank's accumulation window (valid tokens and the weight its loss
gave them) on the first steps; every rank runs the same instrumented step, so the gather is matched.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from trainlint.run.monitor import Monitor, user_location

TOLERANCE = 1e-3  # relative per-token weight difference between ranks reported by TL502
GATHER_STEPS = 3  # optimizer steps whose windows are gathered across ranks (one collective each)


@dataclass
class DdpState:
    monitor: Monitor
    hooked: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    rounds: set[int] = field(default_factory=set)  # backward calls that all-reduced since the last step
    buckets: int = 0
    bucket_bytes: int = 0
    gathers: int = 0


def install(monitor: Monitor) -> None:
    if not torch.distributed.is_available():
        return
    from torch.nn.parallel import DistributedDataParallel as DDP

    state = DdpState(monitor)

    def counted(hook: Any) -> Any:
        def counting_hook(hook_state: Any, bucket: Any) -> Any:
            state.rounds.add(monitor.backward_calls)  # the backward in flight (counted when it ends)
            state.buckets += 1
            buffer = bucket.buffer()
            state.bucket_bytes += buffer.numel() * buffer.element_size()
            return hook(hook_state, bucket)

        counting_hook.__annotations__ = {}  # DDP checks them and this module's are strings
        return counting_hook

    def hooked(model: Any) -> None:
        state.hooked.add(model)
        group = getattr(model, "process_group", None)
        if group is not None:  # freed after the run, not by the model's reducer: see Monitor
            monitor.keep_until_released(group)

    def make_register(original: Any) -> Any:
        def register_comm_hook(model: Any, hook_state: Any, hook: Any) -> Any:
            hooked(model)
            return original(model, hook_state, counted(hook))

        return register_comm_hook

    def make_builtin(original: Any) -> Any:
        def _register_builtin_comm_hook(model: Any, *args: Any, **kwargs: Any) -> Any:
            hooked(model)  # a C++ hook cannot be wrapped: this model's all-reduces go uncounted
            return original(model, *args, **kwargs)

        return _register_builtin_comm_hook

    def make_forward(original: Any) -> Any:
        def forward(model: Any, *args: Any, **kwargs: Any) -> Any:
            if model not in state.hooked:
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

                hooked(model)
                DDP.register_comm_hook(model, None, allreduce_hook)  # the patched one: counted
            return original(model, *args, **kwargs)

        return forward

    monitor.patch(DDP, "register_comm_hook", make_register)
    monitor.patch(DDP, "_register_builtin_comm_hook", make_builtin)
    monitor.patch(DDP, "forward", make_forward)
    monitor.on_step_pre.append(lambda opt, info: _all_reduces_per_step(state))
    monitor.on_window.append(lambda window, where: _gather_windows(state, window, where))
    monitor.on_reset.append(lambda: state.__init__(monitor))


def _all_reduces_per_step(state: DdpState) -> None:
    rounds, buckets, sent = len(state.rounds), state.buckets, state.bucket_bytes
    state.rounds, state.buckets, state.bucket_bytes = set(), 0, 0
    if rounds < 2:
        return
    per_round = sent // rounds
    state.monitor.record(
        "TL501",
        f"DDP all-reduced the gradients {rounds} times for one optimizer step ({buckets} bucket "
        f"all-reduces, {per_round:,} bytes per round): with no_sync() around all but the last "
        f"microbatch's backward it would all-reduce once; {rounds - 1} rounds "
        f"({(rounds - 1) * per_round:,} bytes per rank) were wasted",
        {"all_reduce_rounds": rounds, "bucket_all_reduces": buckets, "bytes_per_round": per_round},
    )


def _gather_windows(state: DdpState, window: list[Any], where: tuple[str, int] | None) -> None:
    dist = torch.distributed
    if not (len(state.hooked) and dist.is_initialized() and dist.get_world_size() > 1):
        return
    if state.gathers >= GATHER_STEPS:
        return
    state.gathers += 1
    # a plain tensor, not all_gather_object: that pickles through numpy, which may be absent
    mine = torch.tensor([sum(m.tokens for m in window), sum(m.weight for m in window)], dtype=torch.float64)
    ranks = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(ranks, mine)  # every rank is at the same optimizer step: matched
    tokens = [int(r[0]) for r in ranks]
    weights = [float(r[1]) for r in ranks]
    if 0 in tokens or len(set(tokens)) == 1 or sum(weights) == 0:
        return
    fair = sum(weights) / sum(tokens)  # DDP averages ranks: every token alike across the world
    errors = [(w / t) / fair - 1 for t, w in zip(tokens, weights, strict=True)]
    if max(abs(e) for e in errors) <= TOLERANCE:
        return
    rank = dist.get_rank()
    state.monitor.record(
        "TL502",
        f"the ranks had {tokens} valid tokens in this step, but each normalised its loss by its own "
        f"count, so DDP's average weighs a token on rank {rank} by {errors[rank]:+.1%} "
        f"(ranks: {', '.join(f'{e:+.1%}' for e in errors)}) against a global token mean",
        {"tokens_per_rank": tokens, "weight_error_per_rank": errors, "rank": rank},
        where=where or user_location(),
    )
