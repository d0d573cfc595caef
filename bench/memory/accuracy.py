"""Accuracy of ``trainlint memory``'s single-process peak against a real CPU run of the same step.

The prediction runs the step on fake tensors under the dispatch-mode tracker. The measurement runs the
same step on real CPU tensors and reads the allocator itself: the profiler's allocation events
(``profile_memory=True``) give every allocation and free with its size, and the peak is the largest
running sum; nothing of the tracker is used. Also shown: DeepSpeed's ZeRO-2 model-state formula
(re-implemented from its source text, single GPU, no offload: it has no activations).

    python bench/memory/accuracy.py [--json bench/memory/results/accuracy.json]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.memory import models
from trainlint.memory.measure import measure
from trainlint.memory.render import single_peak
from trainlint.memory.train import Hooks, Setup, run_steps

MODELS = {
    "mlp": (lambda: models.mlp(width=512, depth=4, d_in=256), {"batch_size": 64}),
    "gpt": (lambda: models.gpt(vocab=1024, d=128, heads=4, layers=4), {"batch_size": 4, "seq_len": 128}),
    "cnn": (lambda: models.cnn(channels=16, depth=3), {"batch_size": 8, "input_shape": (3, 32, 32)}),
}
OPTIMIZERS = {"AdamW": {"lr": 1e-3}, "SGD": {"lr": 0.1, "momentum": 0.9}}
PRECISIONS = ("fp32", "amp-bf16", "amp-fp16", "bf16", "bf16-master")


def allocator_peak(fn) -> int:  # type: ignore[no-untyped-def]
    """The largest number of bytes allocated at once while ``fn`` runs, from the allocator's events."""
    gc.collect()  # garbage of an earlier run freed inside the window would lower the count
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            events.append((node.start_time_ns, f.ptr, f.alloc_size))
        stack.extend(node.children)
    live = peak = 0
    mine: set[int] = set()  # only frees of blocks allocated in the window count
    for _, ptr, size in sorted(events, key=lambda e: e[0]):
        if size > 0:
            mine.add(ptr)
        elif ptr not in mine:
            continue
        else:
            mine.discard(ptr)
        live += size
        peak = max(peak, live)
    return peak


def deepspeed_zero2_single_gpu(params: int) -> int:
    """DeepSpeed's ``estimate_zero2_model_states_mem_needs`` (deepspeed/runtime/zero/stage_1_and_2.py),
    1 GPU, no offload: the installed DeepSpeed's own function where the bench's environment has it,
    else its formula written out (0.19.8: ``2 * params + 18 * params / gpus``, the same 20 bytes per
    parameter on one GPU); fp16 Adam hard-coded, activations not counted."""
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except ImportError:
        return 2 * params + 18 * params
    _cpu, gpu = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=1, cpu_offload=False)
    return gpu


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for (name, (build, kw)), (opt, okw), prec, ckpt in itertools.product(
        MODELS.items(), OPTIMIZERS.items(), PRECISIONS, (False, True)
    ):
        setup = Setup(
            build=build, precision=prec, optimizer=opt, optimizer_kwargs=okw, checkpointing=ckpt, **kw
        )
        m, info = measure(setup)
        predicted = single_peak(m)
        measured = allocator_peak(lambda s=setup: run_steps(s, Hooks()))
        ds = deepspeed_zero2_single_gpu(info.parameters)
        row = {
            "model": name,
            "optimizer": opt,
            "precision": prec,
            "checkpointing": ckpt,
            "predicted": predicted,
            "measured": measured,
            "error": (predicted - measured) / measured,
            "deepspeed": ds,
            "deepspeed_error": (ds - measured) / measured,
        }
        rows.append(row)
        print(
            f"{name:4} {opt:5} {prec:11} ckpt={ckpt!s:5} predicted {predicted:>11,} measured {measured:>11,} "
            f"error {row['error']:+7.1%}  deepspeed {row['deepspeed_error']:+7.1%}",
            flush=True,
        )
    errors = [abs(r["error"]) for r in rows]
    ds_errors = [abs(r["deepspeed_error"]) for r in rows]
    print(
        f"median |error|: trainlint {statistics.median(errors):.1%}, max {max(errors):.1%}; "
        f"deepspeed formula {statistics.median(ds_errors):.1%}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
