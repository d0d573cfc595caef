"""TL504 on one rank of the gloo pair: one accumulation window through a real DeepSpeed engine as
written and without the manual division, from the same seed; the updates (or, where the loop takes no
step, the gradients) compared.

DeepSpeed runs on the CPU accelerator over the pair's existing gloo group. Its shared-memory
all-reduce op is switched off: DeepSpeed would JIT-compile it with a C++ toolchain on first use
(minutes, into a build cache outside the sandbox); the collectives then go through torch.distributed.
"""

from __future__ import annotations

import os

import torch

from . import state
from .compare import FLOAT32_SUMS, not_executable, note_text, num, result
from .variants import run_variants

SHM_OP = "deepspeed_shm_comm"


def _import_deepspeed():
    """DeepSpeed on the CPU accelerator over the existing group, or None when it is not installed."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for name, value in (("RANK", state.RANK), ("LOCAL_RANK", state.RANK), ("WORLD_SIZE", state.WORLD)):
        os.environ.setdefault(name, str(value))
    try:
        import deepspeed
    except ImportError:
        return None
    deepspeed.ops.__compatible_ops__[SHM_OP] = False
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    return deepspeed


def _change(module: torch.nn.Module, before: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    moved = [p.detach().float() - before[n] for n, p in module.named_parameters()]
    grads = [
        p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
        for p in module.parameters()
    ]
    return moved, grads


def _norm(tensors: list[torch.Tensor]) -> float:
    return float(sum(t.pow(2).sum() for t in tensors)) ** 0.5


def job_scaling(probe: dict) -> dict:
    """Each variant's accumulation window on this rank; the update as written over the reference's."""
    if _import_deepspeed() is None:
        return {"failed": True, **not_executable("deepspeed is not installed")}
    runs, failed = run_variants(
        probe,
        {"as_written": "", "reference": "without the division, "},
        lambda ns: _change(ns["__tl_model__"], ns["__tl_before__"]),
    )
    if failed is not None:
        return failed
    stepped = _norm(runs["reference"][0]) > 0.0
    index, what = (0, "update") if stepped else (1, "accumulated gradient")
    got, want = _norm(runs["as_written"][index]), _norm(runs["reference"][index])
    if want == 0.0:
        return not_executable("the window left the model unchanged" + note_text(probe.get("notes", [])))
    ratio = got / want
    ev = {
        "world_size": state.WORLD,
        "backend": "gloo",
        "gradient_accumulation_steps": probe.get("accumulation"),
        "compared": what,
        "norm": {"as_written": num(got), "without_manual_division": num(want)},
        "ratio": num(ratio),
        "tolerance": FLOAT32_SUMS.as_evidence(),
    }
    notes = note_text(probe.get("notes", []))
    if not FLOAT32_SUMS.exceeded(abs(got - want), want):
        detail = f"the {what} matches the engine's own scaling (ratio {num(ratio)})"
        return result("not-reproduced", detail + notes, ev)
    detail = (
        f"through DeepSpeed's engine the {what} of one accumulation window is {num(ratio)} times the one "
        f"without the manual division (the engine divides by gradient_accumulation_steps="
        f"{probe.get('accumulation')} itself)"
    )
    return result("confirmed", detail + notes, ev)


DEEPSPEED_JOBS = {"deepspeed_scaling": job_scaling}
