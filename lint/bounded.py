"""One piece of work in a forked child process whose address space is capped: libcst's memory grows
with the file (about 600 MB per MB of ordinary code, several times more for crafted files), and an
allocation that fails in its native parser aborts the whole process. In a child, that is one file's
problem and the run goes on.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Bounded(Generic[T]):
    """The child's value, or why there is none (``failure``: a sentence for the user)."""

    value: T | None
    failure: str | None = None


def available() -> bool:
    """Forking and ``RLIMIT_AS`` both work as documented only on Linux."""
    return sys.platform == "linux" and hasattr(os, "fork")


def _address_space() -> int:
    """The bytes of address space this process has now (``/proc/self/statm``'s first field)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def run_bounded(work: Callable[[], T], extra_bytes: int) -> Bounded[T]:
    """``work()`` in a forked child allowed ``extra_bytes`` of address space beyond what it starts
    with (never more than the limit already set). The value comes back pickled through a pipe."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; its outcome is what the tests check
        os.close(read_end)
        _child(work, extra_bytes, write_end)
    os.close(write_end)
    chunks = []
    with os.fdopen(read_end, "rb") as pipe:
        while chunk := pipe.read(1 << 20):
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    data = b"".join(chunks)
    if data:
        kind, payload = pickle.loads(data)
        if kind == "ok":
            return Bounded(payload)
        return Bounded(None, payload)
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        name = signal.Signals(number).name if number in signal.valid_signals() else str(number)
        return Bounded(None, f"the process parsing it ran out of memory or crashed ({name})")
    return Bounded(None, f"the process parsing it exited with status {os.WEXITSTATUS(status)}")


def _child(work: Callable[[], T], extra_bytes: int, write_end: int) -> None:  # pragma: no cover
    import faulthandler
    import resource

    code = 0
    try:
        # libcst's native parser reports a failed allocation on stderr before it aborts (and a fault
        # handler, when one is on, dumps every thread): the parent says it better, once
        faulthandler.disable()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        wanted = _address_space() + extra_bytes
        if soft != resource.RLIM_INFINITY:
            wanted = min(wanted, soft)
        resource.setrlimit(resource.RLIMIT_AS, (wanted, hard))
        try:
            outcome: tuple[str, object] = ("ok", work())
        except MemoryError:
            outcome = ("failure", f"parsing it needs more than the {extra_bytes >> 20} MiB of memory allowed")
        except Exception as exc:  # the work's own failure: the parent reports it for this file
            outcome = ("failure", f"internal error while parsing it: {type(exc).__name__}: {exc}")
        data = pickle.dumps(outcome)
        view = memoryview(data)
        while view:
            view = view[os.write(write_end, view) :]
    except BaseException:
        code = 70  # EX_SOFTWARE: the parent says the process failed
    finally:
        os._exit(code)
