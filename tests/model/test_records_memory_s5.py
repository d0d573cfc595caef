"""A long run keeps only the latest dependency records in memory (each lists every folder its lookups
consulted: up to 10 KB in diffusers) decoded, and still answers from the older ones, kept as the
journal's text (a new process reads them back from the store)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from trainlint.model import index_journals
from trainlint.model.project import ProjectIndex

PAST = time.time() - 3600


def test_records_held_in_memory_are_bounded_and_older_ones_come_from_the_store(tmp_path: Path) -> None:
    root = tmp_path / "p"
    root.mkdir()
    folders = {}
    for n in range(3):
        folder = root / f"pkg{n}"
        folder.mkdir()
        os.utime(folder, (PAST, PAST))
        folders[str(folder)] = folder.stat().st_mtime_ns
    index = ProjectIndex(root, tmp_path / "store")
    slots = [str(root / f"m{n}.py") for n in range(3 * index_journals._RECORDS_KEPT)]
    for slot in slots:
        index.keep_record(slot, folders, {}, text=slot)
    assert len(index._records) <= index_journals._RECORDS_KEPT
    first, last = index.recorded(slots[0]), index.recorded(slots[-1])
    assert first is not None and first["text"] == slots[0]  # no longer decoded: from the journal's text
    assert last is not None and last["text"] == slots[-1]
    assert len(index._records) <= index_journals._RECORDS_KEPT
    again = ProjectIndex(root, tmp_path / "store")  # (another process)
    assert [again.recorded(slot)["text"] for slot in slots] == slots
