"""Settings of the child process that change after import: the device and 16-bit dtype (set once the
job is read) and the data-parallel rank and world size (set in a worker). Other modules read them as
``state.DEVICE`` at call time, never import them by name, so that they see the current value."""

from __future__ import annotations

import torch

DEVICE = "cpu"
LOW_DTYPE = torch.bfloat16
RANK = 0
WORLD = 1
# the synthetic float inputs of an entry function require grad (a probe runs both states)
INPUTS_REQUIRE_GRAD = False
