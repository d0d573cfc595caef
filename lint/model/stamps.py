"""Small helpers of the project index: its root search, digests of texts and answers, the answer a
dependency record holds, stamps of files and folders, atomic writes, the texts known to parse, and a
pause of the cyclic garbage collector while summaries are built."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from stat import S_ISDIR
from typing import Any

ROOT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")


# digests of the texts summarised in this process (each a text CPython parsed, with this Python: the
# store of summaries is per trainlint, Python and libcst version): the lint of a file no rule can run
# on needs CPython's verdict alone, and a summary of the same text is that verdict
_PARSED: set[str] = set()
_PARSED_KEPT = 100_000


def parsed_before(digest: str | None = None) -> bool:
    """Whether a summary of the text of this digest (``text_digest``) was made (or read) in this
    process: CPython parses it. None: whether any was."""
    return bool(_PARSED) and (digest is None or digest in _PARSED)


def note_parsed(digest: str) -> None:
    """Note that the text of this digest was summarised (so parsed)."""
    if len(_PARSED) >= _PARSED_KEPT:  # (a long editor session)
        _PARSED.clear()
    _PARSED.add(digest)


def text_digest(text: str) -> str:
    """The digest a text is known by (its summary's name in the store)."""
    # (the same text object is asked again by each step of its lookup and lint: the gate, the verdict,
    # the project's questions; a few kept by identity spare hashing it each time)
    known = _DIGESTS.get(id(text))
    if known is not None and known[0] is text:
        return known[1]
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    if len(_DIGESTS) >= 4:
        del _DIGESTS[next(iter(_DIGESTS))]
    _DIGESTS[id(text)] = (text, digest)
    return digest


_DIGESTS: dict[int, tuple[str, str]] = {}  # id -> (the text, held so that its id is not reused, digest)


def find_root(path: str | os.PathLike[str], batch: object | None = None) -> Path | None:
    """The project folder of a file: the nearest folder at or above it with a root marker. ``batch``:
    a token shared by the lookups of one run (see ``dependency_key``), which ask each folder once.
    Without one, the answer for a folder is kept for a second (the steps of one file's lookup and
    lint ask it in turn; ``ProjectIndex.forget_paths`` keeps its resolutions so)."""
    folder = os.path.dirname(os.path.abspath(path))
    now = time.monotonic()
    if batch is None:
        if _LAST_ROOT[0] == folder and now - _LAST_ROOT[1] <= 1.0:
            return _LAST_ROOT[2]  # type: ignore[no-any-return]
        root = _find_root(folder, {})
    else:
        if _ROOTS[0] is not batch:
            _ROOTS[:] = [batch, {}]
        root = _find_root(folder, _ROOTS[1])
    _LAST_ROOT[:] = [folder, now, root]  # (a batch's answer too: the file's lint asks it next, without one)
    return root


def project_root(path: str, batch: object | None = None) -> Path | None:
    """The project folder of a linted file on disk (``find_root``), or None where no other file's facts
    can be asked for it: stdin, a string, a file outside any project (``Project.for_file``)."""
    if not path or path.startswith("<") or not os.path.isfile(path):
        return None
    return find_root(path, batch)


_ROOTS: list[Any] = [None, {}]  # the batch whose roots are known, and its folders' roots
_LAST_ROOT: list[Any] = ["", 0.0, None]  # the folder last asked without a batch, when, its root


def _find_root(folder: str, known: dict[str, Path | None]) -> Path | None:
    passed = []
    while folder not in known:  # (strings, not pathlib: asked for every file of a warm run)
        passed.append(folder)
        if any(os.path.exists(os.path.join(folder, marker)) for marker in ROOT_MARKERS):
            known[folder] = Path(folder)
            break
        parent = os.path.dirname(folder)
        if parent == folder:
            known[folder] = None
            break
        folder = parent
    root = known[folder]
    known.update(dict.fromkeys(passed, root))
    return root


def answer_digest(answer: object) -> str:
    """A short digest of JSON data (a summary, a list of dependencies)."""
    return hashlib.sha256(json.dumps(answer, sort_keys=True, default=str).encode()).hexdigest()[:16]


def folder_mtime(folder: str) -> int:
    """A folder's modification time; -1 for anything else (a file, nothing)."""
    try:
        info = os.stat(folder)
    except OSError:
        return -1
    return info.st_mtime_ns if S_ISDIR(info.st_mode) else -1


def stat_stamp(file: str) -> str:
    """A file's ``mtime,size``; ``-1,-1`` when it is not there."""
    try:
        info = os.stat(file)
    except OSError:
        return "-1,-1"
    return f"{info.st_mtime_ns},{info.st_size}"


class RunStamps:
    """Stamps of folders (``folder_mtime``) and files (``stat_stamp``) as strings, as the dependency
    records hold them: taken afresh, or once per path for every check made with the same ``batch`` (a
    run's token). The records of one project list mostly the same folders, about 80 each: a warm run
    over the subset made 39,893 stat calls checking them, 6,135 with one stamp per path."""

    def __init__(self) -> None:
        self._batch: object | None = None
        self._folders: dict[str, str] = {}
        self._files: dict[str, str] = {}

    def start(self, batch: object | None) -> None:
        """Stamp afresh from now on, unless ``batch`` is the one of the previous checks."""
        if batch is None or batch is not self._batch:
            self._folders.clear()
            self._files.clear()
        self._batch = batch

    def folder(self, folder: str) -> str:
        if self._batch is None or folder not in self._folders:
            self._folders[folder] = str(folder_mtime(folder))
        return self._folders[folder]

    def file(self, file: str) -> str:
        if self._batch is None or file not in self._files:
            self._files[file] = stat_stamp(file)
        return self._files[file]


def file_stamp(seen: tuple[tuple[int, int], str] | None, file: str | Path) -> tuple[int, int]:
    """A file's (mtime, size) when its summary was read (``seen``: the index's note of it), else now;
    (-1, -1) when it is not there."""
    if seen is not None:
        return seen[0]
    try:
        info = os.stat(file)
    except OSError:
        return (-1, -1)
    return (info.st_mtime_ns, info.st_size)


def split_joined(joined: str, separator: str = "\0") -> list[str]:
    """The parts of a string joined with ``separator`` (none for the empty string)."""
    return joined.split(separator) if joined else []


def write_atomic(entry: Path, body: str) -> None:
    """Write a store file through a temporary one renamed into place: a reader never sees half."""
    temporary = entry.with_name(f".{entry.stem}.{os.getpid()}.tmp")
    try:
        try:
            temporary.write_text(body, encoding="utf-8")
        except FileNotFoundError:  # the folder's first entry
            entry.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text(body, encoding="utf-8")
        os.replace(temporary, entry)
    except OSError:
        pass  # a read-only or full disk only costs speed


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the duration (back on after, if it was on). A parse
    and a summary allocate many objects, each allocation counting towards a collection that scans
    every summary already kept: twice the cost of the parse on a project of 800 files. Trees and
    summaries hold no reference cycle, so reference counting frees what is dropped meanwhile."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def recorded_answer(
    record: dict[str, Any] | None, field: str, value: str
) -> tuple[list[str], list[str]] | None:
    """The dependencies and GradScaler receivers a record holds, when its ``field`` is ``value``."""
    try:
        if record is None or record.get(field) != value:
            return None
        files, digests, scaler = (
            split_joined(record["files"]),
            split_joined(record["digests"], " "),
            record["scaler"],
        )
        if (
            len(digests) == len(files)
            and isinstance(scaler, list)
            and all(isinstance(n, str) for n in scaler)
        ):
            return [f"{f}={d}" for f, d in zip(files, digests, strict=True)], list(scaler)
    except (KeyError, TypeError, AttributeError):
        pass  # damaged: gathered afresh
    return None
