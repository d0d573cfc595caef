"""Gradient-accumulation checks at run time: TL301 (microbatches weighted equally whatever their
token counts), TL302 (a running total that keeps every iteration's graph) and TL303 (zero_grad()
discarding gradients that no step used)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from trainlint.run.monitor import Monitor, OptimizerInfo, user_frame, user_location

TOLERANCE = 1e-3  # relative per-token weight difference reported as a weighting error
GRAPH_STEPS = 6  # steps over which TL302 watches running totals
GRAPH_CAP = 100_000  # autograd nodes walked at most per tensor


@dataclass
class Microbatch:
    tokens: int
    weight: float  # d(backward'd loss) / d(token-mean loss): the share given to this microbatch


@dataclass
class AccumulationState:
    monitor: Monitor
    # (loss, valid tokens, place, whether it is a token sum rather than a token mean)
    pending: list[tuple[torch.Tensor, torch.Tensor, tuple[str, int], bool]] = field(default_factory=list)
    window: list[Microbatch] = field(default_factory=list)
    where: tuple[str, int] | None = None
    graphs: dict[tuple[int, str], list[int]] = field(default_factory=dict)


def install(monitor: Monitor) -> None:
    state = AccumulationState(monitor)

    def make_cross_entropy(original: Any) -> Any:
        def cross_entropy(input: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(input, target, *args, **kwargs)
            reduction = kwargs.get("reduction", args[5] if len(args) > 5 else "mean")
            if (
                reduction in ("mean", "sum")
                and torch.is_grad_enabled()
                and isinstance(target, torch.Tensor)
                and not target.is_floating_point()
                and out.requires_grad
            ):
                ignore = kwargs.get("ignore_index", args[2] if len(args) > 2 else -100)
                valid = (target != ignore).sum()
                state.pending.append((out, valid, user_location(), reduction == "sum"))
            return out

        return cross_entropy

    monitor.patch(torch.nn.functional, "cross_entropy", make_cross_entropy)
    monitor.on_backward.append(lambda loss: _backward(state, loss))
    monitor.on_step_pre.append(lambda opt, info: _window_done(state))
    monitor.on_step_post.append(lambda opt, info: _graph_growth(state))
    monitor.on_zero_grad.append(lambda opt, info: _zero_grad(state, info))
    monitor.on_reset.append(lambda: state.__init__(monitor))


def _backward(state: AccumulationState, loss: torch.Tensor) -> None:
    pending, state.pending = state.pending, []
    if len(pending) != 1 or loss.numel() != 1:
        return  # several losses or a non-scalar root: no single token mean to relate it to
    term, tokens, where, summed = pending[0]
    value = float(term.detach())
    if value == 0.0:
        return
    # the share is relative to the token mean: a token sum is the mean times the token count
    share = float(loss.detach()) / value * (int(tokens) if summed else 1)
    state.window.append(Microbatch(int(tokens), share))
    state.where = state.where or where


def _window_done(state: AccumulationState) -> None:
    window, state.window = state.window, []
    where, state.where = state.where, None
    for hook in state.monitor.on_window:
        hook(window, where)
    if len(window) < 2 or where is None:
        return
    total_tokens = sum(m.tokens for m in window)
    total_weight = sum(m.weight for m in window)
    if total_tokens == 0 or total_weight == 0 or any(m.tokens == 0 for m in window):
        return
    fair = total_weight / total_tokens  # every token weighted alike, same total weight
    errors = [(m.weight / m.tokens) / fair - 1 for m in window]
    worst = max(errors, key=abs)
    if abs(worst) <= TOLERANCE:
        return
    tokens = [m.tokens for m in window]
    shares = [m.weight / total_weight for m in window]
    obs = state.monitor.record(
        "TL301",
        f"an accumulation window of {len(window)} microbatches had {tokens} valid tokens, but the "
        f"microbatches got {_fmt(shares)} of the update: a token's weight is off by "
        f"{min(errors):+.1%} to {max(errors):+.1%} (first window seen)",
        {"tokens": tokens, "shares": shares, "weight_error": errors, "worst_error": worst},
        where=where,
    )
    if abs(worst) > abs(obs.measured["worst_error"]):
        obs.measured["worst_error_any_window"] = worst


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.3g}" for v in values) + "]"


def _zero_grad(state: AccumulationState, info: OptimizerInfo) -> None:
    if info.backward_at_zero is None or info.stepped_since_zero:
        return
    discarded = state.monitor.backward_calls - info.backward_at_zero
    if discarded > 0:
        state.window.clear()
        state.where = None
        state.monitor.record(
            "TL303",
            f"zero_grad() discarded the gradients of {discarded} backward call(s) that no optimizer "
            "step used: the step sees only the microbatches after the last zero_grad()",
            {"backward_calls_discarded": discarded},
        )


def _graph_nodes(tensor: torch.Tensor) -> int:
    seen: set[int] = set()
    todo = [tensor.grad_fn]
    while todo and len(seen) < GRAPH_CAP:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        todo.extend(n for n, _ in getattr(node, "next_functions", ()))
    return len(seen)


def _graph_growth(state: AccumulationState) -> None:
    if state.monitor.steps > GRAPH_STEPS:
        return
    frame = user_frame()
    for _ in range(3):  # the step's frame and two callers: the loop may sit above a train_step()
        if frame is None:
            break
        for name, value in list(frame.f_locals.items()):
            if isinstance(value, torch.Tensor) and value.grad_fn is not None and value.numel() == 1:
                sizes = state.graphs.setdefault((id(frame.f_code), name), [])
                sizes.append(_graph_nodes(value))
                if len(sizes) >= 3 and sizes[-1] > sizes[-2] > sizes[-3]:
                    _report_growth(state, frame, name, sizes)
        frame = frame.f_back


def _report_growth(state: AccumulationState, frame: Any, name: str, sizes: list[int]) -> None:
    state.monitor.record(
        "TL302",
        f"`{name}` holds an autograd graph that grows every step ({' -> '.join(map(str, sizes))} nodes "
        f"over {len(sizes)} steps): each iteration's graph and saved activations stay alive",
        {"variable": name, "graph_nodes": list(sizes)},
        where=(frame.f_code.co_filename, frame.f_lineno),
    )
