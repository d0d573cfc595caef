"""A warm run checks every file's dependency record, and the records of one project list mostly the
same folders and files: within one run (a batch) each is stamped once for all the records, and a new
run stamps afresh, so a change between runs still makes a record fail its check."""

from __future__ import annotations

import os
import time
from pathlib import Path

from conftest import counting

from trainlint.model import stamps as stamps_module
from trainlint.model.project import ProjectIndex

PAST = time.time() - 3600


def _project(tmp_path: Path) -> tuple[ProjectIndex, dict[str, int], dict[str, tuple[int, int]]]:
    root = tmp_path / "p"
    folders, files = {}, {}
    for n in range(4):
        folder = root / f"pkg{n}"
        folder.mkdir(parents=True)
        module = folder / "mod.py"
        module.write_text(f"X = {n}\n")
        os.utime(module, (PAST, PAST))
        os.utime(folder, (PAST, PAST))
        folders[str(folder)] = folder.stat().st_mtime_ns
        files[str(module)] = (module.stat().st_mtime_ns, module.stat().st_size)
    index = ProjectIndex(root, tmp_path / "store")
    for slot in ("a.py", "b.py", "c.py"):
        index.keep_record(str(root / slot), folders, files, text=slot)
    return index, folders, files


def test_one_batch_stamps_each_folder_and_file_once(tmp_path: Path, monkeypatch) -> None:
    index, folders, files = _project(tmp_path)
    stats = counting(monkeypatch, stamps_module.os, "stat")
    batch = object()
    for slot in ("a.py", "b.py", "c.py"):
        record = index.recorded(str(index.root / slot), batch)
        assert record is not None and record["text"] == slot
    assert sorted(str(call[0]) for call in stats) == sorted([*folders, *files])


def test_without_a_batch_every_check_stamps_afresh(tmp_path: Path, monkeypatch) -> None:
    index, folders, files = _project(tmp_path)
    stats = counting(monkeypatch, stamps_module.os, "stat")
    for slot in ("a.py", "b.py"):
        assert index.recorded(str(index.root / slot)) is not None
    assert len(stats) == 2 * (len(folders) + len(files))


def test_a_change_fails_the_check_in_the_next_batch_not_in_the_same(tmp_path: Path) -> None:
    index, _folders, files = _project(tmp_path)
    batch = object()
    a, b = str(index.root / "a.py"), str(index.root / "b.py")
    assert index.recorded(a, batch) is not None
    changed = next(iter(files))
    Path(changed).write_text("X = 'changed'\n")
    # the run goes on with the stamps it took (as its lookups do: see ``dependency_key``)
    assert index.recorded(b, batch) is not None
    assert index.recorded(b, object()) is None
    assert index.recorded(a) is None
