"""The runtime check (``--verify``): run the flagged snippet in a child process and compare gradients.

Only this package may import torch, and only inside the child process (the package ``child``): the parent
builds probe programs from the file model and reads back one JSON result per finding.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

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
) -> list[Finding]:
    """The findings in the same order, with a ``verify`` dict on those whose rule has a probe."""
    from trainlint.verify.harness import verify_all

    return verify_all(list(findings), sources, device=device, timeout=timeout)


__all__ = ["torch_available", "torch_version", "verify_findings"]
