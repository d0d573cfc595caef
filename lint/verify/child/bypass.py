"""The ``ddp_bypass`` job (TL507) on one rank of the gloo group: a backward through the module that
DistributedDataParallel wraps, called directly (as written) and through the wrapper (fixed), with a
different batch on each rank; rank 0 compares the ranks' gradients."""

from __future__ import annotations

import torch

from . import state
from .compare import not_executable, note_text, result
from .sandbox import VariantFailed, exec_program, seed


def job_bypass(probe: dict) -> dict:
    import torch.distributed as dist

    spread: dict[str, float] = {}
    for name in ("as_written", "fixed"):
        seed(0)
        try:
            ns = exec_program(probe["programs"][name], name)
        except VariantFailed as exc:
            return {"failed": True, **not_executable(str(exc))}
        local = torch.cat([p.grad.detach().flatten() for p in ns["__tl_inner__"].parameters()])
        gathered = [torch.zeros_like(local) for _ in range(state.WORLD)]
        dist.all_gather(gathered, local)
        spread[name] = max(float((g - gathered[0]).abs().max()) for g in gathered)
    if state.RANK != 0:
        return {}
    evidence = {
        "world_size": state.WORLD,
        "backend": "gloo",
        "max_gradient_difference_between_ranks": spread,
    }
    notes = note_text(probe.get("notes", []))
    if spread["as_written"] > 0 and spread["fixed"] == 0:
        detail = (
            f"on {state.WORLD} processes (gloo) with different batches, the inner module's gradients differ "
            f"between ranks by up to {spread['as_written']:.3g} when it is called directly, and are "
            "identical when the DistributedDataParallel wrapper is called"
        )
        return result("confirmed", detail + notes, evidence, fixed_matches=True)
    return result(
        "not-reproduced",
        f"on {state.WORLD} processes the gradients are the same on every rank as written{notes}",
        evidence,
    )
