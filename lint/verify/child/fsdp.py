"""Sharded data parallelism for TL503, TL506 and TL110: the user's statements run on both ranks of the
gloo group of ``distributed`` (these are jobs of its pool), around one forward and backward of the
tiny model that the harness runs itself.

FSDP1 refuses a CPU-only machine unless ``device_id`` is the CPU; while a job runs, the class is
swapped for a subclass that sets it (the user's own ``device_id`` names a GPU that is not there).
FSDP2's ``fully_shard`` runs on the gloo group as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from . import state
from .compare import FLOAT32_SUMS, note_text, num, pct, result
from .sandbox import VariantFailed, call_user, exec_program, seed
from .standins import D

# The TL506 loss is scaled so that the gradient norm is well above any usual clipping bound: both
# clips then act, and they differ only in the norm they divide by.
CLIP_SCALE = 100.0


@contextlib.contextmanager
def cpu_fsdp() -> Iterator[None]:
    import torch.distributed.fsdp as fsdp_pkg
    import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp_mod

    original = fsdp_mod.FullyShardedDataParallel

    class CpuFSDP(original):  # type: ignore[misc, valid-type]
        def __init__(self, module, *args, **kwargs):
            kwargs["device_id"] = torch.device("cpu")
            super().__init__(module, *args, **kwargs)

    CpuFSDP.__name__ = CpuFSDP.__qualname__ = "FullyShardedDataParallel"
    fsdp_pkg.FullyShardedDataParallel = fsdp_mod.FullyShardedDataParallel = CpuFSDP  # type: ignore[misc]
    try:
        yield
    finally:
        fsdp_pkg.FullyShardedDataParallel = fsdp_mod.FullyShardedDataParallel = original  # type: ignore[misc]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter or gradient (a DTensor's local shard)."""
    to_local = getattr(tensor, "to_local", None)
    return (to_local() if callable(to_local) else tensor).detach().float().clone()


def params_of(module: torch.nn.Module) -> list[torch.Tensor]:
    return [local(p) for p in module.parameters()]


def forward_backward(module: torch.nn.Module, scale: float = 1.0) -> torch.Tensor:
    """One forward and backward of the wrapped tiny model on this rank's batch (the ranks' batches
    differ, so that their gradients do)."""
    gen = torch.Generator().manual_seed(200 + state.RANK)
    x = torch.randn(4, D, generator=gen)
    dtype = next(module.parameters()).dtype
    loss = (module(x.to(dtype)).float() * scale).pow(2).mean()
    loss.backward()
    return loss


def _global_max(value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _named(ns: dict, dotted: str):
    """The object a dotted name of the program (``model``, ``self.model``) is bound to."""
    head, *rest = dotted.split(".")
    value = ns[head]
    for attr in rest:
        value = getattr(value, attr)
    return value


def _run(probe: dict, name: str) -> dict:
    """Execute one variant under the CPU FSDP class (from the same seed, so that the variants build the
    same tiny model); the namespace it leaves."""
    seed(0)
    with cpu_fsdp():
        return exec_program(probe["programs"][name], name)


def job_order(probe: dict) -> dict:
    """TL503: the user's statements from the optimizer through the wrap, one step of the harness, and
    whether the wrapped model's parameters moved; then the same with the optimizer built after."""
    changed: dict[str, float] = {}
    used: dict[str, str] = {}
    updated: dict[str, list[torch.Tensor]] = {}  # each parameter's change in the step
    for name in ("as_written", "fixed"):
        try:
            ns = _run(probe, name)
            module, optimizer = _named(ns, probe["model"]), _named(ns, probe["optimizer"])
            before = params_of(module)
            forward_backward(module)
            optimizer.step()
        except VariantFailed as exc:
            return {"failed": True, **result("not-executable", f"{name}: {exc}", {})}
        updated[name] = [a - b for a, b in zip(params_of(module), before, strict=True)]
        moved = [d.abs().max().item() for d in updated[name] if d.numel()]
        changed[name] = _global_max(max([0.0, *moved]))
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        in_forward = sum(1 for p in module.parameters() if id(p) in held)
        used[name] = f"{in_forward} of the optimizer's {len(held)} parameters"
    apart = [
        (a - b).abs().max().item()
        for a, b in zip(updated["as_written"], updated["fixed"], strict=True)
        if a.numel() and a.shape == b.shape
    ]
    notes = note_text(probe.get("notes", []))
    ev = {
        "world_size": state.WORLD,
        "backend": "gloo",
        "max_parameter_change": {k: num(v) for k, v in changed.items()},
        "optimizer_parameters_in_the_wrapped_model": used,
        "step_as_written_vs_fixed_max_abs": num(_global_max(max([0.0, *apart]))),
    }
    if changed["as_written"] > 0.0:
        detail = (
            f"on {state.WORLD} processes (gloo), one optimizer step changed the wrapped model's parameters by "
            f"up to {num(changed['as_written'])} ({used['as_written']} are the "
            f"wrapped model's; the step differs from the one with the optimizer built after the wrap by "
            f"{ev['step_as_written_vs_fixed_max_abs']} (max abs))"
        )
        return result("not-reproduced", detail + notes, ev)
    if changed["fixed"] == 0.0:
        detail = "the wrapped model did not change even with the optimizer built after the wrap"
        return result("not-executable", detail + notes, ev)
    detail = (
        f"on {state.WORLD} processes (gloo), after one step the wrapped model's parameters did not change "
        f"({used['as_written']} are the wrapped model's); with the optimizer "
        f"built after the wrap they moved by up to {num(changed['fixed'])}"
    )
    return result("confirmed", detail + notes, ev, fixed_matches=True)


def job_clip(probe: dict) -> dict:
    """TL506: the user's wrap, a backward with large gradients, then the user's clip statement (the
    program's ``__tl_after_backward__``) vs
    FSDP's own ``clip_grad_norm_`` with the same bound; the gradients each rank is left with."""
    grads: dict[str, list[torch.Tensor]] = {}
    for name in ("as_written", "reference"):
        try:
            ns = _run(probe, name)
            module = _named(ns, probe["model"])
            forward_backward(module, scale=CLIP_SCALE)
            call_user(ns["__tl_after_backward__"])
        except VariantFailed as exc:
            return {"failed": True, **result("not-executable", f"{name}: {exc}", {})}
        grads[name] = [local(p.grad) for p in module.parameters() if p.grad is not None]
    worst = 0.0
    for got, ref in zip(grads["as_written"], grads["reference"], strict=True):
        scale = ref.abs().max().item()
        diff = (got - ref).abs().max().item()
        if FLOAT32_SUMS.exceeded(diff, scale):
            worst = max(worst, diff / scale if scale else float("inf"))
    worst = _global_max(worst)
    local_sq = sum(float(g.pow(2).sum()) for g in grads["as_written"])
    ev = {
        "world_size": state.WORLD,
        "backend": "gloo",
        "clipped_gradient_max_rel": num(worst),
        "tolerance": FLOAT32_SUMS.as_evidence(),
        "local_norm_after_clip_rank0": num(local_sq**0.5),
    }
    notes = note_text(probe.get("notes", []))
    if worst == 0.0:
        detail = "the gradients after the clip match FSDP's own clip_grad_norm_ on every rank"
        return result("not-reproduced", detail + notes, ev)
    detail = (
        f"on {state.WORLD} processes (gloo), each rank clipped its shard by its own norm: the gradients "
        f"differ from FSDP's clip_grad_norm_ (the global norm) by {pct(worst)} (max rel)"
    )
    return result("confirmed", detail + notes, ev)


@contextlib.contextmanager
def _recording_reduce_scatter(dist, seen: list[str]) -> Iterator[None]:
    """Record the dtype of every reduce-scatter input (FSDP1 and FSDP2 call the module's function by
    name at run time; the name differs between torch releases)."""
    names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def recorder(original):
        def recording(output, input, *args, **kwargs):
            seen.append(str(input.dtype).replace("torch.", ""))
            return original(output, input, *args, **kwargs)

        return recording

    for n in names:
        setattr(dist, n, recorder(originals[n]))
    try:
        yield
    finally:
        for n, original in originals.items():
            setattr(dist, n, original)


def job_reduce_dtype(probe: dict) -> dict:
    """TL110: the user's mixed-precision policy on an FSDP-wrapped tiny model: the dtype gradients
    are reduce-scattered in, and how far the reduced gradients are from a float32 reduction."""
    import torch.distributed as dist

    runs: dict[str, dict] = {}
    for name in ("as_written", "reference"):
        seen: list[str] = []
        try:
            with _recording_reduce_scatter(dist, seen):
                ns = _run(probe, name)
                module = ns["__tl_wrapped__"]
                forward_backward(module, scale=float(probe.get("scale", 1.0)))
        except VariantFailed as exc:
            return {"failed": True, **result("not-executable", f"{name}: {exc}", {})}
        grads = [local(p.grad) for p in module.parameters() if p.grad is not None]
        runs[name] = {"dtypes": sorted(set(seen)), "grads": grads}
    worst = 0.0
    for got, ref in zip(runs["as_written"]["grads"], runs["reference"]["grads"], strict=True):
        scale = ref.abs().max().item()
        if scale:
            worst = max(worst, (got - ref).abs().max().item() / scale)
    worst = _global_max(worst)
    dtypes = runs["as_written"]["dtypes"]
    ev = {
        "world_size": state.WORLD,
        "backend": "gloo",
        "reduce_scatter_dtype": {"as_written": dtypes, "with_float32_reduce": runs["reference"]["dtypes"]},
        "gradient_max_rel_vs_float32_reduce": num(worst),
    }
    notes = note_text(probe.get("notes", []))
    if not dtypes:
        return result("not-executable", "no reduce-scatter ran in the backward" + notes, ev)
    low = [d for d in dtypes if d in ("bfloat16", "float16")]
    if not low:
        return result("not-reproduced", f"gradients are reduce-scattered in {', '.join(dtypes)}" + notes, ev)
    detail = (
        f"on {state.WORLD} processes (gloo), gradients are reduce-scattered in {', '.join(low)}; reduced in "
        f"float32 instead they differ by {pct(worst)} (max rel) on two ranks, more with more ranks"
    )
    return result("confirmed", detail + notes, ev)


FSDP_JOBS = {"fsdp_order": job_order, "fsdp_clip": job_clip, "fsdp_reduce_dtype": job_reduce_dtype}
