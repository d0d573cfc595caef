"""Dependency records: a warm run takes the files a cache key rests on from a record checked by stat
calls, and gathers them afresh whenever a folder a lookup consulted or a file found has changed."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from trainlint.model import project as project_module
from trainlint.model.project import dependency_key, forget_indexes

HALF = "def convert(m):\n    m.half()\n"
FLOAT = "def convert(m):\n    m.float()\n"
PAST = time.time() - 3600  # one time for every aging: a stamp changes only where a test changes it


def age(root: Path) -> None:
    """Date every file and folder an hour back: a record of them is past the racy window."""
    for path in [root, *root.rglob("*")]:
        os.utime(path, (PAST, PAST))


def touch(path: Path, step: int) -> None:
    """Move one stamp on, still past the racy window (as a change made a while ago)."""
    os.utime(path, (PAST + step, PAST + step))


def fresh_key(main: Path, text: str, store: Path) -> str:
    """The key as a new process computes it."""
    forget_indexes()
    return dependency_key(str(main), text, store)


def reference_key(main: Path, text: str, tmp_path: Path) -> str:
    """The key gathered from scratch (an empty store: no record, no manifest)."""
    forget_indexes()
    key = dependency_key(str(main), text, tmp_path / f"empty-{time.monotonic_ns()}")
    forget_indexes()
    return key


@pytest.fixture
def src_layout(tmp_path: Path) -> tuple[Path, Path, str]:
    root = tmp_path / "p"
    (root / "src").mkdir(parents=True)
    (root / "pyproject.toml").write_text("")
    (root / "src" / "helpers.py").write_text(HALF)
    text = "from helpers import convert\n"
    (root / "main.py").write_text(text)
    age(root)
    return root, root / "main.py", text


def test_a_warm_key_comes_from_the_record_without_gathering(src_layout, tmp_path: Path, monkeypatch) -> None:
    _root, main, text = src_layout
    store = tmp_path / "store"
    first = fresh_key(main, text, store)
    assert first and list(store.glob("records-*.jsonl"))

    def gather(*_args: object) -> None:
        raise AssertionError("gathered although the record holds")

    monkeypatch.setattr(project_module.ProjectIndex, "imported_file", gather)
    assert fresh_key(main, text, store) == first


def test_a_module_added_where_lookups_look_first_changes_the_key(src_layout, tmp_path: Path) -> None:
    root, main, text = src_layout
    store = tmp_path / "store"
    first = fresh_key(main, text, store)
    (root / "helpers.py").write_text(FLOAT)  # the root is searched before src: it now answers
    age(root)
    touch(root, 10)  # only the root folder's listing tells the difference
    changed = fresh_key(main, text, store)
    assert changed != first
    assert changed == reference_key(main, text, tmp_path)


def test_a_package_module_that_appears_later_changes_the_key(tmp_path: Path) -> None:
    root, store = tmp_path / "p", tmp_path / "store"
    (root / "pkg").mkdir(parents=True)
    (root / "setup.py").write_text("")
    (root / "pkg" / "__init__.py").write_text("")
    text = "from pkg.sub import convert\n"
    (root / "main.py").write_text(text)
    age(root)
    first = fresh_key(main := root / "main.py", text, store)
    (root / "pkg" / "sub.py").write_text(HALF)
    changed = fresh_key(main, text, store)
    assert changed != first
    assert changed == reference_key(main, text, tmp_path)


def test_a_reexporting_init_edited_changes_the_key(tmp_path: Path) -> None:
    root, store = tmp_path / "p", tmp_path / "store"
    (root / "pkg").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "pkg" / "__init__.py").write_text("from .impl import convert\n")
    (root / "pkg" / "impl.py").write_text(HALF)
    (root / "pkg" / "other.py").write_text(FLOAT)
    text = "from pkg import convert\n"
    (root / "main.py").write_text(text)
    age(root)
    first = fresh_key(main := root / "main.py", text, store)
    (root / "pkg" / "__init__.py").write_text("from .other import convert\n")
    touch(root / "pkg" / "__init__.py", 10)
    changed = fresh_key(main, text, store)  # (recorded again, with the new __init__)
    assert changed != first
    assert changed == reference_key(main, text, tmp_path)
    (root / "pkg" / "other.py").write_text(HALF + "# longer\n")  # found through the new __init__ only
    touch(root / "pkg" / "other.py", 20)
    assert fresh_key(main, text, store) == reference_key(main, text, tmp_path) != changed


def _the_record(store: Path) -> tuple[Path, str, str, str]:
    """The records' journal of a store holding one record: its path, its line, the slot's name, the
    record's JSON text."""
    (journal,) = store.glob("records-*.jsonl")
    (line,) = journal.read_text().splitlines()
    name, _, body = line.partition("\t")
    return journal, line, name, body


def test_a_damaged_record_is_gathered_afresh(src_layout, tmp_path: Path) -> None:
    _root, main, text = src_layout
    store = tmp_path / "store"
    first = fresh_key(main, text, store)
    journal, _line, name, body = _the_record(store)
    for damage in ("{", json.dumps({"text": "x"}), json.dumps([1]), '{"text": 1, "folders": 2}', "\t"):
        journal.write_text(f"{name}\t{damage}\n")
        assert fresh_key(main, text, store) == first
    payload = json.loads(body)
    payload["digests"] += " extra"  # not one digest per file
    journal.write_text(f"{name}\t{json.dumps(payload)}\n")
    assert fresh_key(main, text, store) == first


def test_the_latest_line_of_a_slot_is_its_record(src_layout, tmp_path: Path, monkeypatch) -> None:
    """Records are appended: a later line for the same file replaces an earlier one, garbled lines
    are skipped, and a journal mostly of stale lines is rewritten with the live ones."""
    _root, main, text = src_layout
    store = tmp_path / "store"
    first = fresh_key(main, text, store)
    journal, line, name, body = _the_record(store)
    stale = json.dumps({**json.loads(body), "file_stamps": "1,1"})  # (its file was not so: no record)
    journal.write_text(f"{name}\t{stale}\n" * 1200 + "garbled\n" + line + "\n")

    def gather(*_args: object) -> None:
        raise AssertionError("gathered although the latest record holds")

    with monkeypatch.context() as patched:
        patched.setattr(project_module.ProjectIndex, "imported_file", gather)
        assert fresh_key(main, text, store) == first
    assert journal.read_text() == line + "\n"
    journal.write_text(line + "\n" + f"{name}\t{stale}\n")
    assert fresh_key(main, text, store) == first  # (gathered afresh, and recorded again)
    assert journal.read_text().splitlines()[-1] == line


def test_a_just_written_tree_is_not_recorded(tmp_path: Path) -> None:
    """Stamps from the current clock tick could miss a change made within it: no record then."""
    root, store = tmp_path / "p", tmp_path / "store"
    root.mkdir()
    (root / "pyproject.toml").write_text("")
    (root / "helpers.py").write_text(HALF)
    text = "from helpers import convert\n"
    (root / "main.py").write_text(text)
    assert fresh_key(root / "main.py", text, store)
    assert not list(store.glob("records-*"))


def test_callers_of_a_scaler_taking_function_come_from_a_record_until_the_project_changes(
    tmp_path: Path, monkeypatch
) -> None:
    root, store = tmp_path / "p", tmp_path / "store"
    (root / "jobs").mkdir(parents=True)
    (root / "pyproject.toml").write_text("")
    text = "def step(loss, scaler):\n    scaler.scale(loss).backward()\n"
    (root / "train.py").write_text(text)
    (root / "jobs" / "a.py").write_text("from train import step\ndef run(loss, s):\n    step(loss, s)\n")
    (root / "tools").mkdir()
    (root / "tools" / "util.py").write_text("x = 1\n")  # (a folder no import lookup consults)
    age(root)
    main = root / "train.py"
    first = fresh_key(main, text, store)
    assert first
    with monkeypatch.context() as patched:
        patched.setattr(project_module.Project, "callers", lambda *_: pytest.fail("walked again"))
        assert fresh_key(main, text, store) == first
    # a new caller in a new file: only the folder's listing (its time) tells
    (root / "tools" / "b.py").write_text("from train import step\ndef go(loss):\n    step(loss, None)\n")
    age(root)
    touch(root / "tools", 10)
    second = fresh_key(main, text, store)  # (and recorded)
    assert second != first
    assert second == reference_key(main, text, tmp_path)
    (root / "tools" / "b.py").write_text("from train import step\ndef go(loss):\n    step(None, loss)\n")
    touch(root / "tools" / "b.py", 20)  # (same size: the time tells)
    assert fresh_key(main, text, store) == reference_key(main, text, tmp_path) != second
