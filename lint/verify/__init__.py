"""The runtime check (``--verify``): run the flagged snippet in a child process and compare gradients.

Only this package may import torch, and only inside the child process or behind ``torch_available``.
"""

from __future__ import annotations

import importlib.util


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None
