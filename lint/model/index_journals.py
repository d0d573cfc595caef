"""The project index's journals in the result cache's store: the manifest (each file's facts digest
by its stamp) and the dependency records (what a file's key rests on). Both are appended lines, read
once per process, so that a run neither creates a file per answer nor opens one per question."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from trainlint.model.stamps import RunStamps, split_joined, write_atomic

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_RECORDS_KEPT = 16  # dependency records held decoded in memory (see ``IndexJournals._remember``)


class IndexJournals:
    """The journals of one project's index (``ProjectIndex`` sets these attributes up)."""

    root: Path
    store: Path | None
    _stamps: dict[str, list[Any]] | None  # the manifest: path -> [mtime, size, facts digest]
    _unsaved: list[str]  # manifest lines not appended yet
    _records: dict[str, dict[str, Any]]  # slot (a path, a callers question) -> record, the latest
    _journal: dict[str, str] | None  # the records' journal: slot name -> JSON text
    _stamped: RunStamps  # the stamps ``recorded`` compares

    # -- the manifest: each file's facts digest by its modification time and size ----------------------
    # One journal per project in the store, read once per process: a warm run that names one file
    # digests its imports' facts from stat calls, reading no other file. Lines are appended (a line
    # that two writers garble is skipped on reading, which only costs speed) and the journal is
    # rewritten when it holds more stale lines than live ones.
    def _manifest(self) -> dict[str, list[Any]]:
        if self._stamps is not None:
            return self._stamps
        self._stamps, lines = {}, 0
        path = self._manifest_path()
        for line in _journal_lines(path):
            lines += 1
            try:
                name, mtime, size, facts = json.loads(line)
            except (ValueError, TypeError):
                continue
            self._stamps[name] = [mtime, size, facts]
        if path is not None and lines > 2 * len(self._stamps) + 1000:
            write_atomic(
                path, "".join(json.dumps([name, *entry]) + "\n" for name, entry in self._stamps.items())
            )
        return self._stamps

    def _manifest_path(self) -> Path | None:
        if self.store is None:
            return None
        return self.store / f"manifest-{hashlib.sha256(str(self.root).encode()).hexdigest()[:16]}.jsonl"

    def save_manifest(self) -> None:
        """Append the digests computed since the last save to the project's journal."""
        path = self._manifest_path()
        if path is None or not self._unsaved:
            return
        body, self._unsaved = "".join(self._unsaved), []
        _append(path, body)

    # -- records: the files a file's key rests on, valid while nothing they came from has moved --------
    # Gathering a file's dependencies resolves the imports of every package ``__init__`` on the way,
    # for every file, and its GradScaler callers summarise the whole project: most of a warm run. A
    # record keeps such an answer with what decided it: the modification times of the folders the
    # lookups and the walk consulted (an entry added, removed or renamed changes them) and the stamps
    # (mtime, size) of the files read. Checking it is one stat call per folder and file (stamps kept
    # as one string each: one comparison, and fast to read); any difference gathers afresh.
    def recorded(self, slot: str, batch: object | None = None) -> dict[str, Any] | None:
        """The record under ``slot`` while every stamp in it holds (``RunStamps``: ``batch``), else None."""
        record = self._records.get(slot)
        if record is None:
            record = self._remember(slot, self._read_record(slot) or {})
        stamped = self._stamped
        stamped.start(batch)
        try:
            if " ".join(map(stamped.folder, split_joined(record["folders"]))) != record["stamps"]:
                return None
            files, stamps = split_joined(record["files"]), split_joined(record["file_stamps"], " ")
            if len(files) != len(stamps) or any(
                stamped.file(f) != s for f, s in zip(files, stamps, strict=True)
            ):
                return None
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        return record

    def keep_record(
        self, slot: str, folders: dict[str, int], files: dict[str, tuple[int, int]], **answer: Any
    ) -> bool:
        """Keep ``answer`` with the stamps that decided it, unless one is too recent to tell a later
        change in the same clock tick apart (as git treats "racy" entries): gathered afresh then.
        Whether it was kept."""
        newest = max([*folders.values(), *(mtime for mtime, _ in files.values())], default=-1)
        if newest >= time.time_ns() - 2_000_000_000:
            return False
        record = {
            "folders": "\0".join(folders),
            "stamps": " ".join(str(stamp) for stamp in folders.values()),
            "files": "\0".join(files),
            "file_stamps": " ".join(f"{mtime},{size}" for mtime, size in files.values()),
            **answer,
        }
        self._remember(slot, record)
        self._append_record(slot, record)
        return True

    def _remember(self, slot: str, record: dict[str, Any]) -> dict[str, Any]:
        """Keep a record in memory for the next questions about the same file (its key is computed
        when the cache is asked and again when the result is stored): only the latest ones decoded,
        since a record lists every folder consulted (up to 10 KB each in diffusers)."""
        while len(self._records) >= _RECORDS_KEPT:
            del self._records[next(iter(self._records))]
        self._records[slot] = record
        return record

    def update_record(self, slot: str, **answer: Any) -> None:
        """Change the answer of a record that still holds (its stamps stay those that decided it)."""
        if slot not in self._records:
            return
        self._append_record(slot, self._remember(slot, {**self._records[slot], **answer}))

    # The records of a project are lines of one journal in the store (``<slot name>\t<JSON>``), not a
    # file each: creating a file cost a cold run about 0.3 ms of CPU per record, and a warm run opened
    # one per file linted. Lines are appended (the latest line of a slot counts; one that two writers
    # garble is no record, which only costs speed), and the journal is rewritten when it holds more
    # stale lines than live ones.
    def _slot_name(self, slot: str) -> str:
        return hashlib.sha256(f"{self.root}\0{slot}".encode("utf-8", "surrogatepass")).hexdigest()[:32]

    def _records_path(self) -> Path | None:
        if self.store is None:
            return None
        return self.store / f"records-{hashlib.sha256(str(self.root).encode()).hexdigest()[:16]}.jsonl"

    def _journaled_records(self) -> dict[str, str]:
        """Each slot name's latest record (its JSON text, decoded when asked), read once per process."""
        if self._journal is not None:
            return self._journal
        self._journal, lines = {}, 0
        path = self._records_path()
        for line in _journal_lines(path):
            name, _, body = line.partition("\t")
            if len(name) == 32 and body:
                lines += 1
                self._journal[name] = body
        if path is not None and lines > 2 * len(self._journal) + 1000:
            write_atomic(path, "".join(f"{name}\t{record}\n" for name, record in self._journal.items()))
        return self._journal

    def _append_record(self, slot: str, record: dict[str, Any]) -> None:
        path = self._records_path()
        if path is None:
            return
        name, body = self._slot_name(slot), json.dumps(record)
        self._journaled_records()[name] = body
        _append(path, f"{name}\t{body}\n")

    def holds_record(self, slot: str) -> bool:
        """Whether a record of ``slot`` is in memory or in the journal (whether it holds is
        ``recorded``'s question)."""
        return slot in self._records or self._slot_name(slot) in self._journaled_records()

    def _read_record(self, slot: str) -> dict[str, Any] | None:
        body = self._journaled_records().get(self._slot_name(slot))
        try:
            record = json.loads(body) if body is not None else None
        except (ValueError, RecursionError):
            return None
        return record if isinstance(record, dict) else None


def _journal_lines(path: Path | None) -> list[str]:
    """The lines of a journal (none where it is absent or unreadable)."""
    try:
        return path.read_text(encoding="utf-8").splitlines() if path is not None else []
    except (OSError, UnicodeDecodeError):
        return []


def _append(path: Path, lines: str) -> None:
    """Append ``lines`` to a journal in one write (never interleaved with another process's)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o600)
    except OSError:
        return
    try:
        os.write(descriptor, lines.encode("utf-8", "surrogatepass"))
    except OSError:
        pass  # a read-only or full disk only costs speed
    finally:
        os.close(descriptor)
