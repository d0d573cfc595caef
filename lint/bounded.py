"""One piece of work in a forked child process whose address space is capped: libcst's memory grows
with the file (about 600 MB per MB of ordinary code, several times more for crafted files), and an
allocation that fails in its native parser aborts the whole process. In a child, that is one file's
problem and the run goes on.
"""

from __future__ import annotations

import functools
import os
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


# The C heap keeps what Python and libcst free: after a large tree is released the pages stay with
# the process (a 245 KB file's libcst tree left 130 MiB behind on torch's corpus), so a long run's
# resident memory is its worst file's plus everything since. Returning the free pages costs 10-80 ms,
# so it is done only once the process has grown by this much since the last time.
_TRIM_STEP = 32 * 1024**2
_trimmed_at = [0]


def _resident() -> int:
    """The bytes of this process that are resident now (``/proc/self/statm``'s second field)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere: musl, macOS)."""
    import ctypes

    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:  # pragma: no cover - no C library to load
        return None


def give_back_memory() -> None:
    """Return the C heap's free pages to the system when the process has grown enough to matter."""
    if not available():
        return
    try:
        now = _resident()
    except (OSError, ValueError, IndexError):  # pragma: no cover - /proc not mounted
        return
    if now < _trimmed_at[0] + _TRIM_STEP:
        return
    trim = _malloc_trim()
    if trim is None:
        _trimmed_at[0] = sys.maxsize  # never again in this process
        return
    trim(0)
    _trimmed_at[0] = _resident()


def run_bounded(work: Callable[[], T], extra_bytes: int) -> Bounded[T]:
    """``work()`` in a forked child allowed ``extra_bytes`` of address space beyond what it starts
    with (never more than the limit already set). The value comes back pickled through a pipe."""
    import pickle  # here, not at the top: a run of small files never forks, and pre-commit's pays 3 ms

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
    import pickle  # run_bounded loaded it before the fork
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
