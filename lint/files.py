"""File discovery and reading: which files are linted, and their text decoded as Python declares it."""

from __future__ import annotations

import fnmatch
import io
import os
import tokenize
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_EXCLUDES = (
    ".git",
    ".hg",
    ".svn",
    ".bzr",
    ".venv",
    "venv",
    ".env",
    "__pycache__",
    "__pypackages__",
    ".tox",
    ".nox",
    ".eggs",
    "*.egg-info",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    ".trainlint_cache",
    "build",
    "dist",
    "node_modules",
    "site-packages",
)


@dataclass(frozen=True)
class SourceText:
    text: str | None
    error: str | None = None


def is_excluded(path: Path, patterns: Iterable[str], root: Path) -> bool:
    """A path is excluded when a pattern matches its path relative to ``root`` or any one part."""
    try:
        rel = path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        rel = path.as_posix()
    parts = rel.split("/")
    for pattern in patterns:
        pattern = pattern.rstrip("/")
        if fnmatch.fnmatch(rel, pattern) or fnmatch.fnmatch(rel, pattern + "/*"):
            return True
        if "/" not in pattern and any(fnmatch.fnmatch(part, pattern) for part in parts):
            return True
    return False


def discover(paths: Iterable[Path], excludes: Iterable[str], root: Path, errors: list[str]) -> Iterator[Path]:
    """``.py`` files under the given paths, sorted, each once. Explicit files are always included.

    Folders that cannot be listed and links that loop are reported into ``errors`` and skipped.
    """
    excludes = tuple(excludes)
    seen: set[Path] = set()
    for given in paths:
        if given.is_file() or (not given.exists() and given.is_symlink()):
            key = given.absolute()
            if key not in seen:
                seen.add(key)
                yield given
            continue
        found: list[Path] = []
        visited_dirs: set[str] = set()

        def onerror(exc: OSError) -> None:
            errors.append(f"{exc.filename}: cannot list folder: {exc.strerror}")

        for dirpath, dirnames, filenames in os.walk(given, onerror=onerror, followlinks=True):
            real = os.path.realpath(dirpath)
            if real in visited_dirs:
                dirnames[:] = []
                continue
            visited_dirs.add(real)
            base = Path(dirpath)
            dirnames[:] = sorted(d for d in dirnames if not is_excluded(base / d, excludes, root))
            for filename in filenames:
                if not filename.endswith((".py", ".pyi")):
                    continue
                candidate = base / filename
                if not is_excluded(candidate, excludes, root):
                    found.append(candidate)
        for candidate in sorted(found):
            key = candidate.absolute()
            if key not in seen:
                seen.add(key)
                yield candidate


def decode(data: bytes) -> SourceText:
    """Decode Python source bytes using its BOM or coding cookie (PEP 263), as Python would."""
    if b"\x00" in data:
        return SourceText(None, "binary content (NUL bytes): not a Python source file")
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as exc:
        return SourceText(None, f"cannot decode: {exc}")
    try:
        text = data.decode(encoding)
    except (UnicodeDecodeError, LookupError) as exc:
        return SourceText(None, f"cannot decode as {encoding}: {exc}")
    if text.startswith("\ufeff"):
        text = text[1:]
    return SourceText(text)


def read_source(path: Path) -> SourceText:
    try:
        data = path.read_bytes()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        return SourceText(None, f"cannot read: {reason}")
    return decode(data)
