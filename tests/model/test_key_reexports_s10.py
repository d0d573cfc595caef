"""A cache key follows a package's ``__init__`` only as far as a lookup can: for a name imported from
the package, that name's own re-export; for the package imported whole, every one. A package that
re-exports forty modules no longer costs forty summaries for a file that imports one name of it."""

from __future__ import annotations

from pathlib import Path

from test_dependency_records import FLOAT, HALF, age, fresh_key, reference_key

from trainlint.model import project as project_module


def _first_key(tmp_path: Path, text: str, monkeypatch) -> tuple[Path, list[str], str]:
    """A package re-exporting `convert` (impl.py) and `keep` (other.py), a main.py importing from it as
    ``text``: its path, the files summarised for its first key, and that key."""
    root = tmp_path / "p"
    (root / "pkg").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "pkg" / "__init__.py").write_text("from .impl import convert\nfrom .other import keep\n")
    (root / "pkg" / "impl.py").write_text(HALF)
    (root / "pkg" / "other.py").write_text(FLOAT.replace("convert", "keep"))
    (root / "main.py").write_text(text)
    age(root)
    seen: list[str] = []
    summary = project_module.ProjectIndex.summary

    def noted(self, path, *args, **kwargs):
        seen.append(Path(path).name)
        return summary(self, path, *args, **kwargs)

    monkeypatch.setattr(project_module.ProjectIndex, "summary", noted)
    return root / "main.py", seen, fresh_key(root / "main.py", text, tmp_path / "store")


def test_a_name_imported_from_a_package_follows_its_own_reexport_only(tmp_path: Path, monkeypatch) -> None:
    text = "from pkg import convert\n"
    main, seen, first = _first_key(tmp_path, text, monkeypatch)
    assert "impl.py" in seen and "other.py" not in seen
    (main.parent / "pkg" / "other.py").write_text(HALF.replace("convert", "keep"))  # not reached by `convert`
    assert fresh_key(main, text, tmp_path / "store") == first
    (main.parent / "pkg" / "impl.py").write_text(FLOAT)  # the imported name's own module
    changed = fresh_key(main, text, tmp_path / "store")
    assert changed != first and changed == reference_key(main, text, tmp_path)


def test_a_package_imported_whole_follows_every_reexport(tmp_path: Path, monkeypatch) -> None:
    text = "import pkg\n"
    main, seen, first = _first_key(tmp_path, text, monkeypatch)
    assert {"impl.py", "other.py"} <= set(seen)
    (main.parent / "pkg" / "other.py").write_text(HALF.replace("convert", "keep"))
    changed = fresh_key(main, text, tmp_path / "store")
    assert changed != first and changed == reference_key(main, text, tmp_path)


def test_a_reexport_cycle_between_packages_ends(tmp_path: Path) -> None:
    root, store = tmp_path / "p", tmp_path / "store"
    (root / "a" / "b").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "a" / "__init__.py").write_text("from .b import f\n")
    (root / "a" / "b" / "__init__.py").write_text("from .. import f\n")
    text = "from a import f\n"
    (root / "main.py").write_text(text)
    age(root)
    assert fresh_key(root / "main.py", text, store)
