"""What a probe program reaches as ``__tl__`` (the programs are written by ``trainlint.verify``'s
probe builders: ``__tl__.layer("Linear")``, ``__tl__.DEVICE``...). Every name a builder may write is
here; the settings that change after import are read through ``__getattr__`` so they are current."""

from __future__ import annotations

from . import state
from .blocks import block, chosen, plain_checkpoint
from .capture import (
    begin_micro,
    begin_run,
    count,
    counting_pass,
    entry_notes,
    hit,
    iteration,
    record,
    snapshot,
    token_weight,
    watch,
)
from .distributed import all_ranks_batch, ddp, global_count, rank_batch
from .sandbox import Unbound, seed
from .standins import (
    LONG_STEPS,
    STEPS,
    Backward,
    Config,
    D,
    Loader,
    NoOp,
    NullContext,
    Output,
    TinyLM,
    arg,
    census,
    concat_batches,
    config_as,
    config_defaults,
    data,
    layer,
    layers,
    loss,
    micro_loss,
    missing,
    on_path,
    param,
    place,
    scaler,
    sequential,
    set_on,
    set_path,
    tiny_model,
    token_batches,
    zero,
    zero_all,
)

_LIVE = ("DEVICE", "LOW_DTYPE", "RANK", "WORLD")


def __getattr__(name: str):
    if name in _LIVE:
        return getattr(state, name)
    raise AttributeError(name)


__all__ = [
    "LONG_STEPS",
    "STEPS",
    "Backward",
    "Config",
    "D",
    "Loader",
    "NoOp",
    "NullContext",
    "Output",
    "TinyLM",
    "Unbound",
    "all_ranks_batch",
    "arg",
    "begin_micro",
    "begin_run",
    "block",
    "census",
    "chosen",
    "concat_batches",
    "config_as",
    "config_defaults",
    "count",
    "counting_pass",
    "data",
    "ddp",
    "entry_notes",
    "global_count",
    "hit",
    "iteration",
    "layer",
    "layers",
    "loss",
    "micro_loss",
    "missing",
    "on_path",
    "param",
    "place",
    "plain_checkpoint",
    "rank_batch",
    "record",
    "scaler",
    "seed",
    "sequential",
    "set_on",
    "set_path",
    "snapshot",
    "tiny_model",
    "token_batches",
    "token_weight",
    "watch",
    "zero",
    "zero_all",
]
