"""A long run hands the memory its large trees took back to the system (the C heap keeps freed pages
otherwise, and a run's resident size became its worst file's plus everything since)."""

from __future__ import annotations

import pytest

from trainlint import bounded

PAGE_MIB = 2**20


@pytest.mark.skipif(
    not bounded.available() or bounded._malloc_trim() is None, reason="glibc's malloc_trim on Linux"
)
def test_freed_memory_goes_back_once_the_process_has_grown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bounded, "_trimmed_at", [bounded._resident()])
    # what a large tree leaves behind: many medium blocks, most freed, a few kept (fragmentation)
    blocks = [bytearray(4000) for _ in range(60_000)]
    kept = blocks[::64]
    del blocks
    grown = bounded._resident()
    bounded.give_back_memory()
    after = bounded._resident()
    assert grown - after > 100 * PAGE_MIB, (grown / PAGE_MIB, after / PAGE_MIB)
    assert bounded._trimmed_at[0] == after
    assert len(kept) == 938  # alive until here


def test_small_growth_costs_no_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(bounded, "_trimmed_at", [bounded._resident()])
    monkeypatch.setattr(bounded, "_malloc_trim", lambda: calls.append)
    bounded.give_back_memory()
    assert calls == []
