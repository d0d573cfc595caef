"""TL507 on one rank of the gloo pair: the user's loop as written and with the flagged call made
through the wrapper, each from the same seed; after each, the two ranks' parameters are gathered and
compared. DDP's all-reduce keeps replicas equal to the last bit, so any difference is the bypass."""

from __future__ import annotations

import torch

from . import state
from .compare import note_text, num, pct, result
from .variants import run_variants


def _across_ranks(flat: torch.Tensor) -> float:
    """The largest difference between any rank's copy of ``flat`` and rank 0's."""
    import torch.distributed as dist

    gathered = [torch.empty_like(flat) for _ in range(state.WORLD)]
    dist.all_gather(gathered, flat)
    return max((g - gathered[0]).abs().max().item() for g in gathered)


def _measure(module: torch.nn.Module, before: dict) -> dict[str, float]:
    """How far the ranks' parameters (and the gradients the loop left) are apart, and how far rank 0's
    parameters moved."""
    params = [(n, p.detach().float()) for n, p in module.named_parameters()]
    flat = torch.cat([p.flatten() for _, p in params])
    start = torch.cat([before[n].flatten() for n, _ in params])
    grads = torch.cat(
        [
            p.grad.detach().float().flatten() if p.grad is not None else torch.zeros(p.numel())
            for p in module.parameters()
        ]
    )
    moved = torch.tensor([(flat - start).abs().max().item(), grads.abs().max().item()])
    import torch.distributed as dist

    dist.all_reduce(moved, op=dist.ReduceOp.MAX)
    return {
        "parameters": _across_ranks(flat),
        "gradients": _across_ranks(grads),
        "moved": float(moved[0]),
        "grad_size": float(moved[1]),
    }


def job_bypass(probe: dict) -> dict:
    """The loop of each variant on this rank; the ranks' parameters (or, when no step ran, the
    gradients left by the last backward) compared after it."""
    runs, failed = run_variants(
        probe,
        {"as_written": "", "fixed": "through the wrapper, "},
        lambda ns: _measure(ns["__tl_model__"], ns["__tl_before__"]),
    )
    if failed is not None:
        return failed
    aw, fixed = runs["as_written"], runs["fixed"]
    # the parameters where an optimizer step ran, else the gradients the backward left
    what, size = ("parameters", "moved") if aw["moved"] > 0.0 else ("gradients", "grad_size")
    notes = note_text(probe.get("notes", []))
    ev = {
        "world_size": state.WORLD,
        "backend": "gloo",
        "iterations": probe.get("iterations"),
        "compared": what,
        f"{what}_max_abs_across_ranks": {k: num(v[what]) for k, v in runs.items()},
        "parameter_change_max_abs": {k: num(v["moved"]) for k, v in runs.items()},
    }
    if aw[size] == 0.0:
        return result(
            "not-executable", "the loop left the model's parameters and gradients unchanged" + notes, ev
        )
    head = f"on {state.WORLD} processes (gloo) with a different batch on each rank, after {probe.get('iterations')} iteration(s)"
    if aw[what] == 0.0:
        detail = f"{head} the ranks' {what} are identical: the gradients were all-reduced"
        return result("not-reproduced", detail + notes, ev)
    detail = (
        f"{head} the ranks' {what} differ by up to {num(aw[what])} ({pct(aw[what] / aw[size])} of the "
        f"largest {'update' if what == 'parameters' else 'gradient'}): no gradient was all-reduced"
    )
    if fixed[what] == 0.0:
        detail += "; called through the wrapper they are identical"
    return result("confirmed", detail + notes, ev, fixed_matches=fixed[what] == 0.0)


BYPASS_JOBS = {"ddp_bypass": job_bypass}
