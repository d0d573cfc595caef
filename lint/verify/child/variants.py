"""A probe's variants run one after the other in this process, each from the same seed and with the
loop's capture cleared, each measured as soon as it ends; the first that fails ends the probe."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from . import capture
from .compare import not_executable
from .sandbox import VariantFailed, exec_program, seed

T = TypeVar("T")


def run_variants(
    probe: dict,
    wording: dict[str, str],
    measure: Callable[[dict[str, Any]], T],
    prepare: Callable[[str, dict[str, T]], None] | None = None,
) -> tuple[dict[str, T], dict | None]:
    """``measure(namespace)`` of each variant named in ``wording``, in its order, and None; or,
    when one fails, what ran before it and its ``not-executable`` result: the exception prefixed by
    that variant's wording (``"through the wrapper, "``; empty for the program as written).
    ``prepare(name, runs so far)`` runs before each (a reference set up from the run as written)."""
    runs: dict[str, T] = {}
    for name, prefix in wording.items():
        capture.current_loop.clear()
        seed(0)
        if prepare is not None:
            prepare(name, runs)
        try:
            namespace = exec_program(probe["programs"][name], name)
        except VariantFailed as exc:
            return runs, {"failed": True, **not_executable(f"{prefix}{exc}")}
        runs[name] = measure(namespace)
    return runs, None
