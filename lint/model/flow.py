"""Control-flow facts about call sites: which loop a site repeats with, whether two sites share a loop
or exclude each other, and whether autograd is off where a site runs."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from trainlint.model.filemodel import FileModel, Frame, Scope, Site
from trainlint.model.vocab import GRAD_DISABLED


def innermost_loop(site: Site, *, orelse: bool = False) -> Frame | None:
    """The frame of the innermost loop whose body repeats ``site``. A loop's ``else:`` runs once, after
    the loop, so a site there repeats with the loop around that loop; with ``orelse``, the innermost
    loop frame of either branch is returned instead (callers that compare where a site sits textually)."""
    for frame in reversed(site.frames):
        if frame.kind == "loop" and (orelse or frame.branch == "body"):
            return frame
    return None


# Methods a training framework calls once per batch: their body is the body of a loop the file does not
# show (Lightning's ``training_step(self, batch, batch_idx)`` under manual optimization).
FRAMEWORK_STEP_METHODS = frozenset({"training_step"})


def iteration_frame(site: Site) -> Frame | None:
    """The loop that repeats ``site``: its innermost loop, or, outside any loop, the body of a framework
    step method (a frame whose node is the method), which the framework runs once per batch."""
    loop = innermost_loop(site)
    if loop is not None:
        return loop
    scope = site.scope
    node = scope.node
    if (
        scope.kind == "function"
        and scope.parent is not None
        and scope.parent.kind == "class"
        and isinstance(node, cst.FunctionDef)
        and node.name.value in FRAMEWORK_STEP_METHODS
        and len(node.params.params) >= 3  # self, batch, batch_idx
    ):
        return Frame("loop", node, "body")
    return None


def frames_inside(site: Site, loop: Frame) -> tuple[Frame, ...]:
    """The site's frames nested inside ``loop`` (empty when the site sits directly in its body)."""
    for index, frame in enumerate(site.frames):
        if frame is loop or (frame.node is loop.node and frame.branch == loop.branch):
            return site.frames[index + 1 :]
    return site.frames if loop.node is site.scope.node else ()


def in_loop(site: Site, loop: Frame) -> bool:
    """The site sits in ``loop``'s branch (at any depth); a method's frame holds its own sites."""
    return loop.node is site.scope.node or any(
        f.node is loop.node and f.branch == loop.branch for f in site.frames
    )


def share_loop(a: Site, b: Site) -> bool:
    """Both sites sit inside one same loop (at any depth, in any of its branches)."""
    loops = {id(f.node) for f in a.frames if f.kind == "loop"}
    return any(f.kind == "loop" and id(f.node) in loops for f in b.frames)


def exclusive(a: Iterable[Frame], b: Iterable[Frame]) -> bool:
    """True when two sites sit in different branches of the same ``if``: they never both run."""
    branches = {id(f.node): f.branch for f in a if f.kind == "if"}
    return any(f.kind == "if" and branches.get(id(f.node), f.branch) != f.branch for f in b)


def runs_with(inner: Site, outer: Site) -> bool:
    """Each run of ``inner`` is followed by ``outer`` in the same iteration: same loops, and every
    condition around ``outer`` also holds around ``inner``."""
    loops = [id(f.node) for f in inner.frames if f.kind == "loop"]
    if loops != [id(f.node) for f in outer.frames if f.kind == "loop"]:
        return False
    inner_ifs = {(id(f.node), f.branch) for f in inner.frames if f.kind == "if"}
    return {(id(f.node), f.branch) for f in outer.frames if f.kind == "if"} <= inner_ifs


def _context_callee(expr: cst.BaseExpression) -> cst.BaseExpression:
    """``torch.no_grad`` for both ``torch.no_grad`` and ``torch.no_grad()``."""
    return expr.func if isinstance(expr, cst.Call) else expr


def grad_disabled_function(model: FileModel, function: cst.FunctionDef, scope: Scope) -> bool:
    """The function is decorated with ``@torch.no_grad()`` (or ``inference_mode``); ``scope`` is where
    its decorators are resolved (the scope that holds the ``def``)."""
    return any(
        model.qualname(_context_callee(d.decorator), scope) in GRAD_DISABLED for d in function.decorators
    )


def grad_disabled(model: FileModel, site: Site, *, blocks: bool = True, decorators: bool = True) -> bool:
    """Autograd records nothing where ``site`` runs. ``blocks``: a ``with torch.no_grad():`` (or
    ``inference_mode``) around it in its own scope; ``decorators``: one of the functions around it,
    out to the first non-function scope, is decorated with one."""
    if blocks:
        for frame in site.frames:
            if frame.kind == "with" and isinstance(frame.node, cst.With):
                for item in frame.node.items:
                    if model.qualname(_context_callee(item.item), site.scope) in GRAD_DISABLED:
                        return True
    if decorators:
        scope: Scope | None = site.scope
        while scope is not None and scope.kind == "function":
            node = scope.node
            assert isinstance(node, cst.FunctionDef)
            if grad_disabled_function(model, node, scope.parent or scope):
                return True
            scope = scope.parent
    return False
