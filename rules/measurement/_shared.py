"""Helpers shared by the measurement rules (private to this family)."""

from __future__ import annotations

import libcst as cst

from trainlint.model import (
    FileModel,
    Site,
)
from trainlint.model.vocab import MEMORY_READINGS as MEMORY_READINGS  # (the family's rules import these here)
from trainlint.model.vocab import PEAK_READINGS as PEAK_READINGS

TRAINING_WORK = ("backward", "scaled_backward", "step", "scaler_step")


def local_function_calls(model: FileModel, site: Site, predicate) -> bool:
    """Whether ``site`` calls a function of this file (``f()``, ``self.f()``) whose body has a call
    satisfying ``predicate`` (one level)."""
    definition = model.local_callee(site)
    if definition is None:
        return False
    inner = model.scope_for(definition)
    return any(predicate(s) for s in model.calls if s.scope is inner)


def assigned_to(site: Site) -> list[str]:
    statement = site.statement
    out = []
    if isinstance(statement, cst.SimpleStatementLine):
        for small in statement.body:
            if isinstance(small, cst.Assign) and small.value is site.node:
                out.extend(t.target.value for t in small.targets if isinstance(t.target, cst.Name))
    return out
