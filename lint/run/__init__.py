"""``trainlint run``: watch the user's own training run and confirm each hazard with measured numbers.

Nothing here is imported by the static pass: ``trainlint.run.cli`` imports torch only when a run
starts, and the pytest plugin only when ``--trainlint`` is given.
"""

from __future__ import annotations

import warnings

# torch warns on import when numpy is missing; trainlint does not depend on numpy and never converts
# to it, so the warning is noise on every `trainlint run` / `trainlint memory`
NUMPY_WARNING = "Failed to initialize NumPy"


def quiet_torch_import() -> None:
    """Silence only torch's missing-numpy warning; call before torch is first imported."""
    warnings.filterwarnings("ignore", message=NUMPY_WARNING, category=UserWarning)
