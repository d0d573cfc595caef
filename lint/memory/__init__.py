"""``trainlint memory``: the memory bill of a training setup, per rank, without a GPU.

The model is built under ``FakeTensorMode`` (no weight is allocated), two training steps run on fake CPU
tensors under a dispatch-mode tracker that sorts every storage into one of the bill's terms, and the
measured single-process bill is then projected per rank for each parallelism option.

Only the ``memory`` subcommand imports this package: it needs torch, static linting does not.
"""

from __future__ import annotations

#: The terms of the bill, in the order they are shown.
TERMS = ("weights", "gradients", "master", "optimizer", "activations", "temporaries")
#: Terms that belong to the model state (sharded by ZeRO / FSDP).
MODEL_STATE = ("weights", "gradients", "master", "optimizer")
