"""Small helpers of the project index's store: digests of answers, the answer a dependency record
holds, stamps of files and folders, atomic writes, and a pause of the cyclic garbage collector while
summaries are built."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from stat import S_ISDIR
from typing import Any


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
