"""Process hygiene: child processes that never outlive trainlint (linting workers, the ``--verify``
child), and a run that ends cleanly on SIGTERM or when its reader goes away.

``PR_SET_PDEATHSIG`` (Linux) makes the kernel signal a process when its parent dies, whatever killed
the parent (``timeout``, SIGKILL, a crash): no worker is left behind to hold memory or a lock.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> bool:
    """In a child process: be sent ``sig`` when ``parent`` dies (and exit now if it already has).
    Returns whether the kernel could promise it (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        promised = libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before the request: nobody would signal us
        os._exit(1)
    return promised


def init_worker(parent: int) -> None:
    """``initializer`` of a linting worker pool: die with the main process, and take SIGTERM with the
    default action (the main process's handler, inherited through fork, is for the main process)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(parent)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread: the run unwinds as for Ctrl-C, so the worker pool and the
    ``--verify`` child are shut down on the way out."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated()


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Within: SIGTERM raises ``Terminated`` (main thread only; the previous handler comes back)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def discard_stdout() -> None:
    """The reader of stdout went away: later writes, and the flush at exit, go nowhere instead of
    failing (Python would otherwise end with a BrokenPipeError message and exit code 120)."""
    _discard(sys.stdout)


PENDING_EXIT: list[int] = []  # the exit code of a command whose output is being printed


def pending_exit(code: int) -> int:
    """Record ``code`` as the command's exit code before its output (or its error message) is written:
    when the reader goes away (``trainlint run ... | head -1``) the write raises BrokenPipeError, and
    ``trainlint.cli.main`` then exits with this code instead of 0. Returns ``code``."""
    PENDING_EXIT[:] = [code]
    return code


def discard_stderr() -> None:
    """As ``discard_stdout``, for stderr: a command that only notes progress there goes on without it."""
    _discard(sys.stderr)


def _discard(stream: TextIO) -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
