"""Overhead of `trainlint run`'s instrumentation on a small GPT-style training step on CPU.

Trains the nanoGPT-style model of fixtures/run/nanogpt (4 microbatches of 8 x 64 tokens per step,
token-mean cross entropy, a GradScaler, unscale_ and clip_grad_norm_, AdamW, zero_grad) and times
optimizer steps with and without the monitor installed. The two modes alternate in blocks, so that
drift in the machine's load hits both alike; the result is the ratio of the median step times.
Every step of each instrumented block is timed, its first steps (which run the one-off checks)
included, and a fresh monitor is installed for each block.

With ``--wrappers`` it also times, on their own, the wrappers a step or an epoch goes through that
session 4 added: ``clip_grad_norm_`` (TL506's check stacked on TL101's), the FSDP-wrap and HF checks
run at each optimizer step (TL503, TL205), and one pass over a shuffling ``DistributedSampler``
(TL505: the indices are listed and digested once per pass).

    python bench/run_overhead.py [--rounds 5] [--steps 20] [--threads 1] [--clock cpu|wall] [--wrappers]

``--clock cpu`` (the default) times with the process's CPU time (user+sys, all threads), which other
jobs on a shared machine disturb far less than the wall clock.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "fixtures" / "run" / "nanogpt" / "model.py"


def load_model_module():
    spec = importlib.util.spec_from_file_location("bench_nanogpt_model", MODEL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_training(accum: int = 4, batch: int = 8, block: int = 64, vocab: int = 65):
    gpt = load_model_module()
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(block_size=block, vocab_size=vocab))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99))
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # the calls are made (and wrapped) all the same
    data = torch.randint(0, vocab, (accum, batch, block + 1))

    def step() -> None:
        for micro in range(accum):
            x, y = data[micro, :, :-1], data[micro, :, 1:]
            logits, _ = model(x)
            loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1), ignore_index=-1) / accum
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
clock = CLOCKS["cpu"]


def timed(step, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = clock()
        step()
        out.append(clock() - start)
    return out


def per_call(call, n: int, repeats: int = 5) -> float:
    """Best of ``repeats`` of the mean time of ``n`` calls, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        for _ in range(n):
            call()
        best = min(best, (clock() - start) / n)
    return best


def wrapper_costs() -> list[tuple[str, float, float]]:
    """(what, plain seconds, instrumented seconds) for the session-4 wrappers, each timed alone."""
    from trainlint.run.monitor import Monitor

    gpt = load_model_module()
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(block_size=64, vocab_size=65))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the timed steps change nothing
    model(torch.randint(0, 65, (2, 64)))[0].sum().backward()
    params = list(model.parameters())
    rows = []
    for label, n, make in (
        ("clip_grad_norm_ over the model's parameters", 2000, lambda: lambda: clip(params)),
        ("optimizer.step() (SGD, lr 0): the step hooks", 2000, lambda: optimizer.step),
        *(
            (f"one pass over a shuffling DistributedSampler of {size:,}", reps, sampler_pass(size))
            for size, reps in ((100_000, 20), (1_000_000, 3))
        ),
    ):
        plain = per_call(make(), n)
        monitor = Monitor()
        with monitor.active():  # instrumented names are looked up afresh inside make()
            inst = per_call(make(), n)
        rows.append((label, plain, inst))
    return rows


def clip(params: list[torch.Tensor]) -> None:
    torch.nn.utils.clip_grad_norm_(params, 1e9)


def sampler_pass(size: int):
    def make():
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(range(size), num_replicas=1, rank=0, shuffle=True)
        return lambda: sum(1 for _ in sampler)

    return make


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    parser.add_argument("--wrappers", action="store_true", help="also time the session-4 wrappers alone")
    args = parser.parse_args(argv)
    global clock
    clock = CLOCKS[args.clock]
    sys.path.insert(0, str(ROOT))
    from trainlint.run.monitor import Monitor

    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    step = make_training()
    timed(step, 5)  # warm-up: allocator, kernels, optimizer state
    plain: list[float] = []
    watched: list[float] = []
    for _ in range(args.rounds):
        plain += timed(step, args.steps)
        monitor = Monitor()
        with monitor.active():
            watched += timed(step, args.steps)
        assert not monitor.observations, monitor.observations  # a clean loop must stay clean
    base, inst = statistics.median(plain), statistics.median(watched)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} x {args.steps} steps per "
        f"mode, {args.clock} time"
    )
    print(f"median step without instrumentation: {base * 1000:.2f} ms")
    print(f"median step with instrumentation:    {inst * 1000:.2f} ms")
    print(f"ratio: {inst / base:.3f}x (mean ratio {statistics.mean(watched) / statistics.mean(plain):.3f}x)")
    if args.wrappers:
        for label, plain_s, inst_s in wrapper_costs():
            print(f"{label}: {plain_s * 1e6:,.1f} us plain, {inst_s * 1e6:,.1f} us instrumented")
    return 0


if __name__ == "__main__":
    sys.exit(main())
