"""Overhead of `trainlint run`'s instrumentation on a small GPT-style training step on CPU.

Trains the nanoGPT-style model of fixtures/run/nanogpt (4 microbatches of 8 x 64 tokens per step,
token-mean cross entropy, a GradScaler, unscale_ and clip_grad_norm_, AdamW, zero_grad) and times
optimizer steps with and without the monitor installed. The two modes alternate in blocks, so that
drift in the machine's load hits both alike; the result is the ratio of the median step times.
Every step of each instrumented block is timed, its first steps (which run the one-off checks)
included, and a fresh monitor is installed for each block.

    python bench/run_overhead.py [--rounds 5] [--steps 20] [--threads 1]
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


def timed(step, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        out.append(time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
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
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} x {args.steps} steps per mode")
    print(f"median step without instrumentation: {base * 1000:.2f} ms")
    print(f"median step with instrumentation:    {inst * 1000:.2f} ms")
    print(f"ratio: {inst / base:.3f}x (mean ratio {statistics.mean(watched) / statistics.mean(plain):.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
