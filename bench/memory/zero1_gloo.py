"""ZeRO-1 projection vs a real 2-process gloo run: DDP + ``ZeroRedundancyOptimizer`` (AdamW, fp32).

Each rank measures its own peak from the allocator's events (see accuracy.py); the prediction is the
ZeRO-1 column of ``trainlint memory`` for world size 2.

    python bench/memory/zero1_gloo.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.memory import models
from bench.memory.accuracy import allocator_peak
from trainlint.memory.measure import measure
from trainlint.memory.project import project
from trainlint.memory.train import Setup, make_batch

# Four equal layers, so that ZeroRedundancyOptimizer (which splits whole tensors) can halve the state.
KW = {"width": 512, "depth": 3, "d_in": 512, "d_out": 512}
BATCH = 64


def build() -> torch.nn.Module:
    return models.mlp(**KW)


def steps() -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(build())
    opt = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, foreach=True
    )
    setup = Setup(build=build, batch_size=BATCH)
    for _ in range(2):
        batch = make_batch(setup, model.module, None)
        model(batch).float().mean().backward()
        del batch
        opt.step()
        opt.zero_grad(set_to_none=True)


def worker(rank: int, queue: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(rank)
    queue.put((rank, allocator_peak(steps)))
    dist.destroy_process_group()


def main() -> int:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    measured = dict(queue.get() for _ in procs)
    m, _ = measure(Setup(build=build, batch_size=BATCH))
    pred = project(m, "zero1", world=2)
    print(f"ZeRO-1 projection, 2 ranks: peak {pred.peak:,} B during {pred.peak_phase} ({pred.terms})")
    for rank, peak in sorted(measured.items()):
        print(f"rank {rank}: measured peak {peak:,} B, error {(pred.peak - peak) / peak:+.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
