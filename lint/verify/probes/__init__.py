"""Probes: for one finding, the programs (as written, reference, fixed) that show whether it is real.

``PROBES`` maps a rule id to its probe, a function that takes a ``ProbeContext`` and returns a probe
dict for the child runtime (``driver`` plus one program per variant), or raises ``NotExecutable`` with
the reason. A rule says it has one with ``probe = True``; a test holds the two sets equal, so that
``--list-rules`` and the README never promise a probe that ``--verify`` would not run.

One module per rule family, as in ``rules/``; helpers shared by several families live in ``_*.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainlint.verify.context import ProbeContext
from trainlint.verify.probes import (
    accumulation,
    amp,
    checkpoint,
    distributed,
    engines,
    hf,
    sharding,
    wrapping,
)

Probe = Callable[[ProbeContext], dict[str, Any]]

PROBES: dict[str, Probe] = {
    "TL101": amp.tl101,
    "TL102": amp.tl102,
    "TL103": amp.tl103,
    "TL104": amp.tl104,
    "TL105": amp.tl105,
    "TL110": sharding.tl110,
    "TL201": checkpoint.tl201,
    "TL202": checkpoint.tl202,
    "TL203": checkpoint.tl203,
    "TL204": checkpoint.tl204,
    "TL205": hf.tl205,
    "TL301": accumulation.tl301,
    "TL302": accumulation.tl302,
    "TL303": accumulation.tl303,
    "TL501": distributed.tl501,
    "TL502": distributed.tl502,
    "TL503": sharding.tl503,
    "TL504": engines.tl504,
    "TL505": sharding.tl505,
    "TL506": sharding.tl506,
    "TL507": wrapping.tl507,
}

__all__ = ["PROBES", "Probe"]
