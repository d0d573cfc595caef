"""Stand-in blocks and values a probe program builds itself: a block for a checkpoint function to run,
the plain call in place of checkpoint, numbers chosen by use (named in the detail)."""

from __future__ import annotations

import torch

from . import capture
from .standins import D, RowBatchNorm

_CHECKPOINT_KEYWORDS = ("use_reentrant", "preserve_rng_state", "context_fn", "determinism_check", "debug")


def plain_checkpoint(function, *args, **kwargs):
    """In place of checkpoint in the reference: the function called directly (checkpoint's own
    keywords dropped)."""
    return function(*args, **{k: v for k, v in kwargs.items() if k not in _CHECKPOINT_KEYWORDS})


class _CountedBatchNorm(RowBatchNorm):
    """BatchNorm whose forward is counted (``effect``): the side effect a TL203 probe stands in for."""

    def forward(self, x, *args, **kwargs):
        capture.count("effect")
        return super().forward(x)


def block(kind: str = "") -> torch.nn.Module:
    """A stand-in block for a checkpointed function to run: a Linear, then Dropout(p=0.1) when the
    probe needs random numbers drawn inside it, or a counted BatchNorm (running statistics)."""
    extra = {"dropout": [torch.nn.Dropout(0.1)], "batchnorm": [_CountedBatchNorm()]}.get(kind, [])
    return torch.nn.Sequential(torch.nn.Linear(D, D), *extra)


def chosen(name: str, value):
    """A value the probe picks for a number that is not in the file (by how the code uses it); it is
    named in the detail (``compare.result``)."""
    capture.sized_by_pattern[name] = value
    return value
