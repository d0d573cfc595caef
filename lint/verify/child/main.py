"""The child's entry point (``BOOT`` runs ``main``): wait until the parent releases the job (torch and
the compiler are imported meanwhile), read it, run each probe under its time limit, send one JSON
result per probe down the results pipe. Results travel apart from stdout, so that whatever user code
prints can never be mistaken for one."""

from __future__ import annotations

import json
import os
import time
import traceback

import torch

from .compare import not_executable, result
from .confine import install as confine_writes
from .distributed import close_pool, drive_distributed, warm_pool, worker_main
from .drivers import drive_accumulation, drive_grads, drive_half, drive_rng, drive_side_effects, drive_step
from .fsdp import FSDP_JOBS
from .hf import drive_hf_checkpointing
from .loop_drivers import drive_graph, drive_loop
from .sampler_order import drive_sampler_order
from .sandbox import (
    ProbeTimeout,
    VariantFailed,
    close_private_fd,
    load_compiler,
    private_fd,
    results_channel,
    seed,
    setup_process,
    time_limit,
)

DRIVERS = {
    "grads": drive_grads,
    "side_effects": drive_side_effects,
    "step": drive_step,
    "accumulation": drive_accumulation,
    "half": drive_half,
    "loop": drive_loop,
    "graph": drive_graph,
    "rng": drive_rng,
    "ddp_sync": drive_distributed,
    "ddp_tokens": drive_distributed,
    "sampler_order": drive_sampler_order,
    **{name: drive_distributed for name in FSDP_JOBS},
    "ddp_bypass": drive_distributed,
    "deepspeed_scaling": drive_distributed,
    "hf_checkpointing": drive_hf_checkpointing,
}


def run_probe(probe: dict, timeout: float) -> dict:
    driver = DRIVERS.get(probe["driver"])
    if driver is None:
        return result("error", f"unknown probe driver {probe['driver']!r}", {})
    started = time.perf_counter()
    try:
        with time_limit(timeout):
            out = driver(probe)
    except ProbeTimeout:
        out = not_executable(f"the snippet did not finish within {timeout:g}s (it may loop forever)")
    except VariantFailed as exc:
        out = not_executable(str(exc))
    except BaseException as exc:  # a bug in the harness
        out = result(
            "error",
            f"harness error: {type(exc).__name__}: {exc}",
            {"traceback": traceback.format_exc()[-2000:]},
        )
    out["elapsed_s"] = round(time.perf_counter() - started, 3)
    return out


def _wait_for_job(fd: int) -> None:
    """The parent starts the child before the job exists (torch is imported meanwhile), names on this
    pipe the driver of each kind of probe it builds, one a line, and closes it once the job file is
    written. A driver that needs the data-parallel workers starts them at once (no user code has run
    yet), while the parent goes on building."""
    pending = b""
    private_fd(fd)
    try:
        while chunk := os.read(fd, 4096):
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                warm_pool([{"driver": line.decode("utf-8", "replace")}])
    finally:
        close_private_fd(fd)


def main(argv: list[str]) -> int:
    confine_writes()  # before any user code, and inherited by the forked data-parallel workers
    if argv and argv[0] == "--worker":
        return worker_main(argv[1:])
    try:
        return _main(argv)
    finally:
        close_pool()


def _main(argv: list[str]) -> int:
    spec_path, send = argv[0], results_channel(argv[1])  # before any user code runs
    load_compiler()
    if len(argv) > 2 and argv[2].startswith("wait:"):
        _wait_for_job(int(argv[2][5:]))
    with open(spec_path, encoding="utf-8") as fh:
        job = json.load(fh)
    warm_pool(job["probes"])  # forks: before CUDA is touched and before any user code runs
    requested = device = job["device"]
    if device in ("auto", "cuda"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # `--device cuda` on a machine without CUDA still runs, on the CPU, and every verdict says so.
    fallback_note = (
        "--device cuda was asked for but CUDA is not available: ran on cpu. "
        if requested == "cuda" and device == "cpu"
        else ""
    )
    setup_process(device)
    for probe in job["probes"]:
        send({"id": probe["id"], "started": True})
        seed(0)
        out = run_probe(probe, float(job["timeout"]))
        out["id"] = probe["id"]
        out.setdefault("device", device)
        if fallback_note:
            out["detail"] = fallback_note + out.get("detail", "")
        out["torch"] = torch.__version__.split("+")[0]
        send(out)
    return 0
