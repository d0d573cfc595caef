"""accelerate's training-memory estimate beside the measured peaks of ``accuracy.py``'s matrix.

Run in the bench's own environment (accelerate is never a dependency of trainlint):

    python bench/memory/accelerate_compare.py [--measured bench/memory/results/accuracy.json]

It calls accelerate's own functions, as ``accelerate estimate-memory`` does: ``calculate_maximum_sizes``
on the model built under ``init_empty_weights`` (meta device, no weight allocated), then
``estimate_training_usage`` for the dtype, reported as the largest of its terms (the command's
"Training using Adam" column). The precision policies map to its dtypes: fp32 -> float32, every
16-bit policy -> float16 (bfloat16 for the bf16 ones; the formula is the same). The measured bytes
are read from accuracy.py's JSON, so the real runs are not repeated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from accelerate import init_empty_weights
from accelerate.commands.estimate import estimate_training_usage
from accelerate.utils import calculate_maximum_sizes

sys.path.insert(0, str(Path(__file__).resolve().parents[1].parent))
from bench.memory.accuracy import MODELS

DTYPES = {
    "fp32": "float32",
    "amp-bf16": "bfloat16",
    "amp-fp16": "float16",
    "bf16": "bfloat16",
    "bf16-master": "bfloat16",
}


def accelerate_estimate(model_name: str, precision: str) -> int:
    with init_empty_weights():
        model = MODELS[model_name][0]()
    total, _largest = calculate_maximum_sizes(model)
    return int(max(estimate_training_usage(total, DTYPES[precision]).values()))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measured", type=Path, default=Path("bench/memory/results/accuracy.json"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = json.loads(args.measured.read_text())
    for row in rows:
        row["accelerate"] = accelerate_estimate(row["model"], row["precision"])
        row["accelerate_error"] = (row["accelerate"] - row["measured"]) / row["measured"]
        print(
            f"{row['model']:4} {row['optimizer']:5} {row['precision']:11} ckpt={row['checkpointing']!s:5} "
            f"measured {row['measured']:>11,} accelerate {row['accelerate']:>11,} "
            f"({row['accelerate_error']:+.1%}) trainlint {row['error']:+.1%} "
            f"deepspeed {row['deepspeed_error']:+.1%}"
        )
    for key in ("error", "deepspeed_error", "accelerate_error"):
        errors = [abs(r[key]) for r in rows]
        print(f"{key}: median |error| {statistics.median(errors):.1%}, max {max(errors):.1%}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
