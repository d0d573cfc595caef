"""Feature switches around a site: ``if args.deepspeed:`` (or the ``else`` of ``if not
self.use_deepspeed:``) selects the branch that holds the engine's code. One fact, asked by a rule
(is the receiver the engine?) and by its probe (which flags make the program take that branch)."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from trainlint.model.filemodel import Frame, Site
from trainlint.model.syntax import dotted


@dataclass(frozen=True, eq=False)
class Switch:
    """An ``if`` whose test is a flag (``name`` or ``not name``) and whose ``branch`` holding the site
    is the one the flag being set selects: ``body`` of ``if name:``, ``orelse`` of ``if not name:``."""

    frame: Frame
    test: cst.BaseExpression  # the ``if``'s whole test, ``not`` included
    branch: str
    name: str  # the flag, dotted: ``args.deepspeed``


def switches_of(site: Site, word: str) -> tuple[Switch, ...]:
    """Every switch, outermost first, whose flag's last part holds ``word`` (any case) and whose
    selected branch holds ``site``. An ``if`` around a ``def`` counts for the sites in that function:
    the function exists only where the branch ran."""
    word = word.lower()
    found = []
    for frame in site.frames:
        if frame.kind != "if" or not isinstance(frame.node, cst.If):
            continue
        flag, selected = frame.node.test, "body"
        if isinstance(flag, cst.UnaryOperation) and isinstance(flag.operator, cst.Not):
            flag, selected = flag.expression, "orelse"
        name = dotted(flag)
        if frame.branch == selected and name is not None and word in name.rsplit(".", 1)[-1].lower():
            found.append(Switch(frame, frame.node.test, selected, name))
    return tuple(found)


def switch_of(site: Site, word: str) -> Switch | None:
    """The innermost of ``switches_of(site, word)``, or None when no such switch selects the site."""
    found = switches_of(site, word)
    return found[-1] if found else None
