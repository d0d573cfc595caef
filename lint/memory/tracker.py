"""A dispatch-mode tracker that sorts every live storage into a term of the memory bill.

Every tensor an operator returns is looked up by its storage (views and in-place results share one, so
nothing is counted twice); a weak reference to the storage tells when it is freed. A storage starts as a
temporary and is promoted when the training loop says what it is (weights after the model is built,
gradients after backward, optimizer state after a step, activations when it is still alive at the end of
a forward pass). The live set is captured at each phase's peak and its kinds are resolved only when the
run ends, so a gradient allocated in the middle of backward is billed as a gradient at the peak.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainlint.memory import TERMS

# A kind may only be replaced by a more specific one: a weight saved for backward stays a weight.
_PRIORITY = {"weights": 0, "master": 1, "optimizer": 2, "gradients": 3, "activations": 4, "temporaries": 5}
# Frames in these folders are not the model's code: torch, trainlint itself, the standard library.
# The console script that started trainlint (`bin/trainlint`) is not the model's code either.
SKIP_DIRS = (
    *(
        os.path.dirname(p) + os.sep
        for p in (torch.__file__, os.path.dirname(__file__), sysconfig.get_paths()["stdlib"] + os.sep + "x")
    ),
    sysconfig.get_paths()["scripts"] + os.sep,
)


@dataclass(eq=False)
class Block:
    """One storage: its size, its kind, and where it was created (module path, source line)."""

    nbytes: int
    kind: str
    phase: str
    module: str
    line: str


@dataclass
class Snapshot:
    """The live storages at the peak of one phase."""

    phase: str
    stage: str  # build | forward | backward | optimizer
    total: int
    module: str
    blocks: list[Block] = field(repr=False)

    def by_kind(self) -> dict[str, int]:
        out = dict.fromkeys(TERMS, 0)
        for b in self.blocks:
            out[b.kind] += b.nbytes
        return out

    def sites(self, kind: str, top: int = 3) -> list[tuple[str, str, int]]:
        """The largest (module, source line, bytes) groups of ``kind`` alive at this peak."""
        groups: dict[tuple[str, str], int] = {}
        for b in self.blocks:
            if b.kind == kind:
                groups[b.module, b.line] = groups.get((b.module, b.line), 0) + b.nbytes
        ranked = sorted(groups.items(), key=lambda kv: -kv[1])[:top]
        return [(m, line, n) for (m, line), n in ranked]


def _user_line() -> str:
    """The innermost frame outside torch, this package and the standard library: the model's line."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(SKIP_DIRS) and not name.startswith("<"):
            rel = os.path.relpath(name)
            return f"{name if rel.startswith('..') else rel}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class MemoryTracker(TorchDispatchMode):
    """Counts live storage bytes by kind and keeps the live set at each phase's peak."""

    def __init__(self) -> None:
        super().__init__()
        self._blocks: dict[int, Block] = {}  # id(storage) -> block; removed by the weakref callback
        self._refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.phase, self.stage = "build", "build"
        self.snapshots: dict[str, Snapshot] = {}
        self._peak = 0
        self._peak_module = ""
        self._dirty = False
        self._modules: list[str] = []
        self._handles: list[Any] = []

    # -- storages --------------------------------------------------------------------------------
    def _block_of(self, t: torch.Tensor) -> Block | None:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse / nested tensors have no plain storage
            return None
        key = id(st)
        block = self._blocks.get(key)
        if block is None:
            module = self._modules[-1] if self._modules else ""
            line = _user_line() if self.stage == "forward" else ""
            block = Block(st.nbytes(), "temporaries", self.phase, module, line)
            self._blocks[key] = block
            self._refs[key] = weakref.ref(st, lambda _r, k=key: self._free(k))
            self.current += block.nbytes
        return block

    def _free(self, key: int) -> None:
        if self._dirty:
            self._snapshot()
        block = self._blocks.pop(key, None)
        self._refs.pop(key, None)
        if block is not None:
            self.current -= block.nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._block_of(leaf)
        if self.current > self._peak:
            self._peak, self._dirty = self.current, True
            self._peak_module = self._modules[-1] if self._modules else ""
        return out

    def mark(self, tensors: Iterable[torch.Tensor | None], kind: str) -> int:
        """Give these tensors' storages ``kind`` (unless they already have a stronger one); their bytes."""
        seen: set[int] = set()
        total = 0
        for t in tensors:
            if t is None:
                continue
            block = self._block_of(t)
            if block is None or id(block) in seen:
                continue
            seen.add(id(block))
            total += block.nbytes
            if _PRIORITY[kind] < _PRIORITY[block.kind]:
                block.kind = kind
        return total

    # -- phases ----------------------------------------------------------------------------------
    def _snapshot(self) -> None:
        self._dirty = False
        self.snapshots[self.phase] = Snapshot(
            self.phase, self.stage, self._peak, self._peak_module, list(self._blocks.values())
        )

    def enter(self, phase: str, stage: str) -> None:
        """Start a new phase; at the end of a forward pass what is still alive becomes activations."""
        if self._dirty:
            self._snapshot()
        if self.stage == "forward":
            for b in self._blocks.values():
                if b.kind == "temporaries" and b.phase == self.phase:
                    b.kind = "activations"
        self.phase, self.stage = phase, stage
        self._modules.clear()  # checkpoint's early-stopped recomputation skips forward hooks
        self._peak, self._dirty = self.current, True
        self._peak_module = self._modules[-1] if self._modules else ""

    def finish(self) -> None:
        self.enter("end", "end")
        self._dirty = False

    # -- module attribution ----------------------------------------------------------------------
    def watch(self, model: torch.nn.Module) -> None:
        names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}

        def pre(module: torch.nn.Module, _args: Any) -> None:
            self._modules.append(names.get(id(module), type(module).__name__))

        def post(_module: torch.nn.Module, _args: Any, _out: Any) -> None:
            if self._modules:
                self._modules.pop()

        for m in model.modules():
            self._handles.append(m.register_forward_pre_hook(pre))
            self._handles.append(m.register_forward_hook(post))

    def unwatch(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
