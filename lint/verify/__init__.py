"""The runtime check (``--verify``): run the flagged snippet in a child process and compare gradients.

Only this package may import torch, and only inside the child process (the package ``child``): the parent
builds probe programs from the file model and reads back one JSON result per finding.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from typing import Any

from trainlint.rule import Finding


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def torch_version() -> str:
    try:
        from importlib.metadata import version

        return version("torch").split("+")[0]
    except Exception:  # no distribution metadata
        return "unknown"


def verify_findings(
    findings: Iterable[Finding],
    sources: dict[str, str],
    device: str = "auto",
    timeout: float = 60.0,
    early: Any = None,
) -> list[Finding]:
    """The findings in the same order, with a ``verify`` dict on those whose rule has a probe.
    ``early``: a child from ``runner.start_early``, started before linting (used or ended here)."""
    from trainlint.notebook_fix import back_in_cells, for_verify
    from trainlint.verify.harness import verify_all

    original = list(findings)
    in_code, code = for_verify(original, sources)  # a notebook's probes run on its joined code cells
    return back_in_cells(verify_all(in_code, code, device=device, timeout=timeout, early=early), original)


__all__ = ["torch_available", "torch_version", "verify_findings"]
