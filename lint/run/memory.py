"""Memory-measurement checks at run time: TL401 (a peak read with no reset before it), TL403
(empty_cache() on every step) and TL404 (a reading before the optimizer's first step).

The readings are wrapped, not polled: nothing here runs unless the user's code reads memory.
TL402 (timing without a sync) is in ``timing``.
"""

from __future__ import annotations

from typing import Any

import torch

from trainlint.run.monitor import Monitor

MIB = 1 << 20
EMPTY_CACHE_STEPS = 3  # consecutive steps with an empty_cache() call that make TL403


def install(monitor: Monitor) -> None:
    # steps at which a peak was read since the last reset: a peak read once (say at the end of a run)
    # is a fair number; read on several steps it is a running high-water mark, not a per-step peak
    state: dict[str, set[int]] = {"peak_steps": set(), "empty_steps": set()}

    def make_reset(original: Any) -> Any:
        def reset_peak_memory_stats(*args: Any, **kwargs: Any) -> Any:
            state["peak_steps"].clear()
            return original(*args, **kwargs)

        return reset_peak_memory_stats

    def make_reading(original: Any, peak: bool) -> Any:
        def reading(*args: Any, **kwargs: Any) -> Any:
            value = original(*args, **kwargs)
            name = original.__name__
            if peak:
                state["peak_steps"].add(monitor.steps)
            if peak and len(state["peak_steps"]) > 1:
                monitor.record(
                    "TL401",
                    f"{name}() read {value / MIB:.1f} MiB on {len(state['peak_steps'])} different steps "
                    "with no reset_peak_memory_stats() in between: each reading is the peak since the "
                    "start, not the step's own",
                    {"mib": value / MIB, "steps_read": len(state["peak_steps"])},
                )
            fresh = [o for o, info in list(monitor.optimizers.items()) if info.steps == 0]
            if fresh and monitor.steps == 0:
                monitor.record(
                    "TL404",
                    f"{name}() read {value / MIB:.1f} MiB before the first optimizer step: "
                    f"{type(fresh[0]).__name__}'s state (moments, master copies) is not allocated yet",
                    {"mib": value / MIB},
                )
            return value

        return reading

    def make_empty_cache(original: Any) -> Any:
        def empty_cache(*args: Any, **kwargs: Any) -> Any:
            state["empty_steps"].add(monitor.steps)
            steps = state["empty_steps"]
            if len(steps) >= EMPTY_CACHE_STEPS and all(
                monitor.steps - k in steps for k in range(EMPTY_CACHE_STEPS)
            ):
                monitor.record(
                    "TL403",
                    f"torch.cuda.empty_cache() ran in each of {len(steps)} optimizer steps so far: every "
                    "call returns cached blocks that the next step allocates again",
                    {"steps_with_empty_cache": len(steps)},
                )
            return original(*args, **kwargs)

        return empty_cache

    monitor.patch(torch.cuda, "reset_peak_memory_stats", make_reset)
    for name, peak in (
        ("max_memory_allocated", True),
        ("max_memory_reserved", True),
        ("memory_allocated", False),
        ("memory_reserved", False),
    ):
        monitor.patch(torch.cuda, name, lambda original, peak=peak: make_reading(original, peak))
    monitor.patch(torch.cuda, "empty_cache", make_empty_cache)
    monitor.on_reset.append(lambda: [v.clear() for v in state.values()])
