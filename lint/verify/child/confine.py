"""A guard in the child against writing outside its own folders, and against starting programs.

The parent (``runner.py``) gives the child a fresh temporary folder as its working folder, HOME and
TMPDIR, but no mount namespace: the filesystem the child sees is the user's, so a snippet that writes
``/home/me/.bashrc`` or ``../../other-repo/x`` by absolute path would succeed. ``install`` adds an audit
hook (PEP 578) that refuses, with ``PermissionError``:

- opening a file for writing, creating, removing, renaming, linking, truncating or changing the mode,
  owner or times of a path whose real location (links resolved) is outside the working folder and
  TMPDIR (``/dev/null`` and ``/dev/shm``, where Python's multiprocessing keeps its shared memory, are
  allowed too); also ``torch.save`` to such a path, a sqlite database there, and a Unix socket file;
- starting a program (``os.system``, ``subprocess``, ``os.exec*``, ``os.spawn*``, ``posix_spawn``): a new
  program would run without this guard. The harness's own data-parallel workers are the exception:
  they run this package, which installs the guard again.

This is a guard against accidents and naive code, NOT a sandbox against hostile code: native code
(``ctypes``, a compiled extension, torch's other C++ file I/O such as ``torch.from_file(shared=True)``),
``os.mkfifo``/``os.mknod`` (no audit event) and paths relative to a folder descriptor (``dir_fd``) do
not pass through it, and Python code can find other ways around it (removing the ``torch.save`` check,
for one). The real
barriers are the ones the parent sets up: the namespaces where the system allows them, the resource
limits, the allow-listed environment, and the results pipe the snippet cannot reach.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterable

# audit events that change the file system, and which of their arguments name the paths they change
_CHANGES: dict[str, tuple[int, ...]] = {
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.mkdir": (0,),
    "os.rename": (0, 1),  # os.rename and os.replace: the source goes away, the target is written
    "os.link": (0, 1),  # a hard link inside to a file outside would let it be written from inside
    "os.symlink": (1,),
    "os.truncate": (0,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.chflags": (0,),
    "os.lchflags": (0,),
    "os.utime": (0,),
    "os.setxattr": (0,),
    "os.removexattr": (0,),
    "shutil.rmtree": (0,),
    "shutil.copyfile": (1,),
    "shutil.copymode": (1,),
    "shutil.copystat": (1,),
    "shutil.move": (0, 1),
    "shutil.chown": (0,),
    "sqlite3.connect": (0,),  # sqlite creates and writes the database file from C
}
# audit events that start a program, and where their argument vector is
_STARTS: dict[str, int | None] = {
    "subprocess.Popen": 1,
    "os.exec": 1,
    "os.posix_spawn": 1,
    "os.spawn": 2,
    "os.system": None,
    "os.startfile": None,
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
ALWAYS_WRITABLE = (os.devnull, "/dev/shm")


def _within(real: str, roots: tuple[str, ...]) -> bool:
    return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def _worker_argv() -> list[str]:
    """How the harness starts its data-parallel workers (``distributed.py``): the start of their argv."""
    from . import BOOT

    return [sys.executable, "-c", BOOT, os.path.dirname(os.path.abspath(__file__))]


class Guard:
    """The audit hook (called with each event) that keeps writes inside ``folders`` (and
    ``ALWAYS_WRITABLE``) and refuses new programs other than the harness's workers."""

    def __init__(self, folders: Iterable[str]) -> None:
        self.roots = tuple(os.path.realpath(f) for f in folders)
        self.exact = tuple(os.path.realpath(p) for p in ALWAYS_WRITABLE)
        self.worker = _worker_argv()

    def refuse_outside(self, path: object, what: str = "writing") -> None:
        if isinstance(path, int) or path is None:  # an open descriptor: it was checked when opened
            return
        real = os.path.realpath(os.fsdecode(path))  # type: ignore[arg-type]
        if not _within(real, self.roots) and not _within(real, self.exact):
            raise PermissionError(
                errno.EACCES,
                f"trainlint --verify: {what} outside the probe's temporary folder is refused",
                real,
            )

    def __call__(self, event: str, args: tuple) -> None:
        if event == "open":
            path, _mode, flags = args
            if isinstance(flags, int) and flags & _WRITE_FLAGS:
                self.refuse_outside(path)
        elif event in _CHANGES:
            for index in _CHANGES[event]:
                self.refuse_outside(args[index], "changing files")
        elif event == "socket.bind" and isinstance(args[1], str | bytes) and args[1][:1] not in ("\0", b"\0"):
            self.refuse_outside(args[1], "creating a socket file")  # AF_UNIX; not the abstract namespace
        elif event in _STARTS:
            at = _STARTS[event]
            given = args[at] if at is not None else None
            if isinstance(given, str | bytes | os.PathLike):  # one command string
                given = [given]
            argv = [os.fsdecode(a) for a in given] if given is not None else []
            if argv[: len(self.worker)] != self.worker:
                raise PermissionError(
                    errno.EACCES, "trainlint --verify: starting a program from a probe is refused"
                )


def _guard_torch_save(guard: Guard) -> None:
    """``torch.save`` to a path writes its archive from C++, which raises no audit event: the path is
    checked on the way in. (The legacy format, ``_use_new_zipfile_serialization=False``, uses ``open``.)"""
    serialization = sys.modules.get("torch.serialization")
    original = getattr(serialization, "_open_zipfile_writer", None)
    if original is None:
        return

    def checked(name_or_buffer: object, *args: object, **kwargs: object) -> object:
        if isinstance(name_or_buffer, str | bytes | os.PathLike):
            guard.refuse_outside(name_or_buffer)
        return original(name_or_buffer, *args, **kwargs)

    serialization._open_zipfile_writer = checked  # type: ignore[union-attr]


def install() -> None:
    """Guard this process and the processes it forks: writes stay in the working folder and TMPDIR."""
    folders = [os.getcwd()]
    if os.environ.get("TMPDIR"):
        folders.append(os.environ["TMPDIR"])
    guard = Guard(folders)
    sys.addaudithook(guard)
    _guard_torch_save(guard)
