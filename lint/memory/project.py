"""Per-rank projection of a measured single-process bill for each parallelism option (no torch here).

Sharding follows the ZeRO paper's order: stage 1 shards the optimizer state (with the fp32 master copy),
stage 2 the gradients too, stage 3 / FSDP full shard the parameters too. Plain data parallelism shards
nothing. Communication buffers are billed as their own term:

- DDP (and ZeRO-1, which PyTorch runs as DDP + ZeroRedundancyOptimizer) keeps gradient buckets as large
  as all gradients (``gradient_as_bucket_view=False``, the default);
- ZeRO-2 holds one unit's unsharded gradients before its reduce-scatter, in backward;
- ZeRO-3 / FSDP gather the largest unit's parameters in forward and backward, and its gradients in
  backward;
- FSDP hybrid shards within a node of ``gpus_per_node`` ranks;
- CPU offload keeps the sharded model state on the host and runs the optimizer there.

Building the model is not projected: sharded setups build on the meta device or shard at wrap time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainlint.memory import MODEL_STATE, TERMS

OPTIONS = ("ddp", "zero1", "zero2", "zero3", "fsdp-hybrid", "cpu-offload")
LABELS = {
    "ddp": "DDP",
    "zero1": "ZeRO-1",
    "zero2": "ZeRO-2",
    "zero3": "ZeRO-3/FSDP",
    "fsdp-hybrid": "FSDP hybrid",
    "cpu-offload": "CPU offload",
}


@dataclass(frozen=True)
class PhasePeak:
    """The live bytes by term at the peak of one phase of the measured run."""

    phase: str
    stage: str  # build | forward | backward | optimizer
    by_kind: dict[str, int]


@dataclass
class Measured:
    """The single-process bill of the setup, in bytes."""

    parameters: int
    trainable: int
    weights: int  # parameters and buffers
    buffers: int  # the part of ``weights`` that is never sharded
    gradients: int
    master: int
    optimizer: int
    peaks: list[PhasePeak]
    unit_weights: int = 0
    unit_grads: int = 0
    activations_measured: bool = True
    activation_sites: list[tuple[str, str, int]] = field(default_factory=list)
    peak_where: str = ""
    warnings: list[str] = field(default_factory=list)


@dataclass
class Projection:
    option: str
    group: int  # ranks the state is sharded over
    terms: dict[str, int]  # per rank, on the accelerator; "comm" is the communication buffers
    host: dict[str, int]  # per rank, offloaded to CPU memory
    model_state: int
    peak: int
    peak_phase: str


def shard(nbytes: int, ranks: int) -> int:
    """Bytes per rank of ``nbytes`` split evenly over ``ranks`` (rounded up)."""
    return -(-nbytes // ranks)


def _divisors(option: str, world: int, node: int) -> tuple[int, int, int]:
    """How many ranks share the parameters, the gradients, and the optimizer state (with master)."""
    if option == "ddp":
        return 1, 1, 1
    if option == "zero1":
        return 1, 1, world
    if option == "zero2":
        return 1, world, world
    if option == "fsdp-hybrid":
        local = min(world, node)
        return local, local, local
    if option in ("zero3", "cpu-offload"):
        return world, world, world
    raise ValueError(f"unknown parallelism option {option!r}")


def _comm(option: str, stage: str, m: Measured) -> int:
    if stage == "build":
        return 0
    if option in ("ddp", "zero1"):
        return m.gradients
    if option == "zero2":
        return m.unit_grads if stage == "backward" else 0
    gathered = m.unit_weights if stage in ("forward", "backward") else 0
    return gathered + (m.unit_grads if stage == "backward" else 0)


def _state(m: Measured, option: str, world: int, node: int) -> dict[str, int]:
    dw, dg, do = _divisors(option, world, node)
    return {
        "weights": m.buffers + shard(m.weights - m.buffers, dw),
        "gradients": shard(m.gradients, dg),
        "master": shard(m.master, do),
        "optimizer": shard(m.optimizer, do),
    }


def _phase_total(
    p: PhasePeak, m: Measured, option: str, state: dict[str, int], world: int, node: int
) -> dict:
    """The bytes of one measured phase peak on one rank under ``option``."""
    full = {"weights": m.weights, "gradients": m.gradients, "master": m.master, "optimizer": m.optimizer}
    offload = option == "cpu-offload"
    out = {}
    for kind in MODEL_STATE:  # the live part of each state term shrinks with its shard
        live = p.by_kind.get(kind, 0)
        out[kind] = 0 if offload else (live * state[kind] // full[kind] if full[kind] else live)
    out["activations"] = p.by_kind.get("activations", 0)
    temps = p.by_kind.get("temporaries", 0)
    if p.stage == "optimizer":  # the optimizer's temporaries cover only its shard (or run on the host)
        do = _divisors(option, world, node)[2]
        temps = 0 if offload else shard(temps, do)
    out["temporaries"] = temps
    out["comm"] = _comm(option, p.stage, m)
    return out


def project(m: Measured, option: str, world: int, node: int = 8) -> Projection:
    """The per-rank bill of ``m`` under one parallelism option with ``world`` ranks."""
    if world < 1 or node < 1:
        raise ValueError("world size and ranks per node must be at least 1")
    state = _state(m, option, world, node)
    best, best_phase, best_parts = 0, "", dict.fromkeys((*TERMS, "comm"), 0)
    for p in m.peaks:
        if p.stage == "build":  # frameworks build sharded or on the meta device; the steps are billed
            continue
        parts = _phase_total(p, m, option, state, world, node)
        total = sum(parts.values())
        if total > best:
            best, best_phase, best_parts = total, p.phase, parts
    comm = max((_comm(option, p.stage, m) for p in m.peaks), default=0)
    activations = max((p.by_kind.get("activations", 0) for p in m.peaks), default=0)
    if option == "cpu-offload":
        terms = dict.fromkeys(MODEL_STATE, 0)
        host = state
    else:
        terms, host = dict(state), {}
    terms.update(activations=activations, temporaries=best_parts["temporaries"], comm=comm)
    group = max(_divisors(option, world, node))
    return Projection(option, group, terms, host, sum(state.values()), best, best_phase)


def project_all(m: Measured, world: int, node: int = 8) -> list[Projection]:
    return [project(m, option, world, node) for option in OPTIONS]
