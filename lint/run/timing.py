"""TL402 at run time: a wall-clock interval around training work closed without waiting for the device.

The clocks (``time.time``, ``time.perf_counter``, ``time.monotonic``) are wrapped; two reads in the
same frame of the user's code, the second later in the code than the first, make an interval (the
wrap-around from a loop's last read to its first is not one; a rolling timer read at a single place
is therefore left to the static pass). It is a hazard when a backward or an optimizer step
ran inside it and nothing waited for the device: no ``torch.cuda.synchronize()``, no event or stream
``synchronize()``, no device-to-host read (``.item()``, ``.cpu()``, ``.tolist()``). On CUDA the first
such interval at a place is measured: the time the device still needed (a synchronize right there).
On the CPU the work is synchronous and the interval is right; the finding then says that the missing
time is not measurable on this device.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any

import torch

from trainlint.run.monitor import Monitor, _is_user_file

CLOCKS = ("time", "perf_counter", "monotonic")
# the calls that make the host wait for the device
SYNCS = (
    (torch.cuda, "synchronize"),
    (torch.cuda.Event, "synchronize"),
    (torch.cuda.Stream, "synchronize"),
    (torch.Tensor, "item"),
    (torch.Tensor, "cpu"),
    (torch.Tensor, "tolist"),
)


@dataclass
class Read:
    frame: FrameType  # kept so that a frame id cannot be reused by another call while compared
    offset: int  # the frame's bytecode offset at the read
    clock: str
    value: float
    work: int
    syncs: int


@dataclass
class TimingState:
    monitor: Monitor
    clock: Callable[[], float]  # the originals, for measuring the queued work without counting it
    wait: Callable[[], None]
    syncs: int = 0
    last: dict[CodeType, Read] = field(default_factory=dict)  # one read per function: few frames kept
    user_code: dict[CodeType, bool] = field(default_factory=dict)


def install(monitor: Monitor) -> None:
    state = TimingState(monitor, time.perf_counter, torch.cuda.synchronize)

    def make_sync(original: Any) -> Any:
        def waits_for_device(*args: Any, **kwargs: Any) -> Any:
            state.syncs += 1
            return original(*args, **kwargs)

        return waits_for_device

    def make_clock(original: Any) -> Any:
        def clock() -> float:
            value = original()
            frame = sys._getframe(1)
            code = frame.f_code
            user = state.user_code.get(code)
            if user is None:
                user = state.user_code[code] = _is_user_file(code.co_filename) and not any(
                    d in code.co_filename for d in ("site-packages", "dist-packages")
                )
            if user:
                _read(
                    state, Read(frame, frame.f_lasti, original.__name__, value, _work(monitor), state.syncs)
                )
            return value

        return clock

    for owner, name in SYNCS:
        monitor.patch(owner, name, make_sync)
    for name in CLOCKS:
        monitor.patch(time, name, make_clock)
    monitor.on_reset.append(lambda: state.last.clear())


def _work(monitor: Monitor) -> int:
    return monitor.backward_calls + monitor.steps


def _read(state: TimingState, read: Read) -> None:
    code = read.frame.f_code
    before = state.last.get(code)
    state.last[code] = read
    if before is None or before.frame is not read.frame or before.clock != read.clock:
        return
    if read.offset <= before.offset:
        return  # a loop's back edge (the end of one iteration to the start of the next) times nothing
    if read.work == before.work or read.syncs != before.syncs:
        return  # no training work inside, or something waited for the device
    where = (code.co_filename, read.frame.f_lineno)
    first = ("TL402", *where) not in state.monitor.observations
    interval_ms = (read.value - before.value) * 1e3
    calls = read.work - before.work
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        queued_ms = _queued_ms(state) if first else None
        tail = (
            f"the device still had {queued_ms:.1f} ms of queued work when it closed"
            if queued_ms is not None
            else "the device's queued work is left out"
        )
        measured = {"interval_ms": interval_ms, "queued_ms": queued_ms, "device": "cuda"}
    else:
        tail = (
            "this run is on the CPU, where the work is synchronous and the interval is right; on CUDA "
            "the kernels would still be queued (not measurable on this device)"
        )
        measured = {"interval_ms": interval_ms, "queued_ms": None, "device": "cpu", "applicable": False}
    state.monitor.record(
        "TL402",
        f"a {interval_ms:.1f} ms interval around {calls} backward/optimizer-step call(s) closed here "
        f"without synchronize() or a device-to-host read: {tail}",
        {**measured, "work_calls": calls},
        where=where,
    )


def _queued_ms(state: TimingState) -> float:
    """How long the device still needs: a synchronize right at the closing read (the first time only,
    so the user's later intervals are not changed)."""
    start = state.clock()
    state.wait()
    return (state.clock() - start) * 1e3
