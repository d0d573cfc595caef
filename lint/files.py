"""File discovery and reading: which files are linted, their text decoded as Python declares it, and
the cheap pre-parse check that keeps pathological nesting away from the parsers.

Nothing here raises on odd input: unreadable files, folders that cannot be listed, broken or looping
links, binary content and oversized files all come back as a reason the engine reports as TL902.
"""

from __future__ import annotations

import errno
import fnmatch
import functools
import io
import os
import re
import stat
import tokenize
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

# Tool and environment folders only: ``build``/``dist`` are also names of ordinary packages
# (distributed-training code, exactly what TL5xx is about), so a project excludes them itself.
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
    "node_modules",
    "site-packages",
)


# The suffix of Jupyter notebooks (their code cells: see notebook.py). Kept here, not there: the command
# tells a notebook by its name without loading the notebook reader, which a run on Python files never needs.
NOTEBOOK = ".ipynb"
# Python sources and Jupyter notebooks
LINTED_SUFFIXES = (".py", ".pyi", NOTEBOOK)

# Larger files are reported (TL902) rather than parsed: libcst needs about 7 s and 700 MB of memory per
# megabyte of source, so a multi-megabyte generated file would stall a run or exhaust a worker's memory.
MAX_SOURCE_BYTES = 2 * 1024 * 1024


@dataclass(frozen=True)
class SourceText:
    text: str | None
    error: str | None = None


def _size(n: int) -> str:
    return f"{n / (1024 * 1024):.1f} MiB" if n >= 1024 * 1024 else f"{n / 1024:.0f} KiB"


def too_large(size: int, limit: int = MAX_SOURCE_BYTES) -> str:
    return (
        f"it is {_size(size)}, over the {_size(limit)} limit for one file (generated code? "
        "exclude it with `extend-exclude`)"
    )


# libcst's memory goes with lines and tokens more than bytes: about 8 KB per line (1.98 MB of one-letter
# lines took 8 GB) and 2 KB per token. These bound a file's parse near what 2 MiB of ordinary code takes
# (about 1.4 GB).
MAX_SOURCE_LINES = 150_000
MAX_SOURCE_TOKENS = 600_000
_TOKEN = re.compile(r"\w+|[^\w\s]")


def too_crowded(text: str) -> str | None:
    """Why ``text`` would cost the parser too much memory for its size, or None (cheap: a file
    shorter than the token limit is never counted)."""
    lines = text.count("\n") + 1
    if lines > MAX_SOURCE_LINES:
        return f"it has {lines:,} lines, over the {MAX_SOURCE_LINES:,} limit for one file (generated code?)"
    if len(text) > MAX_SOURCE_TOKENS:
        tokens = sum(1 for _ in _TOKEN.finditer(text))
        if tokens > MAX_SOURCE_TOKENS:
            return f"it has about {tokens:,} tokens, over the {MAX_SOURCE_TOKENS:,} limit for one file (generated code?)"
    return None


class ExcludePatterns(tuple[str, ...]):
    """Exclude patterns that carry their matcher, built on first use: a configuration's patterns are
    checked against every folder and file of a run, and hashing or indexing 100,000 of them each time
    would cost more than the walk."""

    @functools.cached_property
    def matcher(self) -> ExcludeMatcher:
        return ExcludeMatcher(self)


# Patterns alike enough to share one index entry are matched by one regular expression each; past
# this many, compiling and trying it would cost seconds per run (a configuration error instead).
MAX_ALIKE_PATTERNS = 2000


def _literal_runs(pattern: str) -> list[str]:
    """The fixed text of an ``fnmatch`` pattern between its wildcards (``*``, ``?``, ``[...]``, read as
    ``fnmatch.translate`` reads them): ``["a", "b", ""]`` for ``a*b?``; one run means no wildcard."""
    runs: list[str] = []
    current = ""
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        i += 1
        if c in "*?":
            runs.append(current)
            current = ""
        elif c == "[":
            j = i + (i < n and pattern[i] == "!")
            j += j < n and pattern[j] == "]"
            j = pattern.find("]", j)
            if j < 0:  # no closing bracket: a plain ``[``
                current += c
            else:
                runs.append(current)
                current = ""
                i = j + 1
        else:
            current += c
    return [*runs, current]


class _GlobIndex:
    """Patterns matched against a whole string, as ``fnmatch.fnmatchcase`` would: literals in a set,
    wildcard patterns filed under their longest fixed text (at the start, at the end or anywhere),
    so that a string is compared only with the patterns whose fixed text it holds there. Patterns
    without fixed text (``*``, ``?*``) form one group of their own."""

    def __init__(self) -> None:
        self.literals: set[str] = set()
        # where the text must be ("start", "end", "inside"), then the text: the patterns filed there
        self.groups: dict[str, dict[str, list[str]]] = {"start": {}, "end": {}, "inside": {}}
        self.anywhere: list[str] = []
        # each group's patterns as one regular expression, by (where, text), compiled when first needed
        self._regexes: dict[tuple[str, str], Callable[[str], re.Match[str] | None]] = {}

    def add(self, pattern: str) -> None:
        runs = _literal_runs(pattern)
        if len(runs) == 1:
            self.literals.add(runs[0])
            return
        inside = max(runs[1:-1], key=len, default="")
        where, key = max(("inside", inside), ("end", runs[-1]), ("start", runs[0]), key=lambda c: len(c[1]))
        if key:
            self.groups[where].setdefault(key, []).append(pattern)
        else:
            self.anywhere.append(pattern)

    def largest_group(self) -> tuple[int, str]:
        """The size and fixed text of the largest group of patterns matched together."""
        sizes = [(len(g), k) for table in self.groups.values() for k, g in table.items()]
        return max([*sizes, (len(self.anywhere), "")])

    @functools.cached_property
    def _lengths(self) -> dict[str, list[int]]:
        return {where: sorted({len(k) for k in table}) for where, table in self.groups.items()}

    def _candidates(self, text: str) -> Iterator[tuple[str, str]]:
        """Where (and under which text) the patterns that could match ``text`` are filed."""
        size = len(text)
        for where, lengths in self._lengths.items():
            table = self.groups[where]
            for n in lengths:
                if n > size:
                    break
                if where == "start":
                    keys: Iterable[str] = (text[:n],)
                elif where == "end":
                    keys = (text[size - n :],)
                else:
                    keys = {text[i : i + n] for i in range(size - n + 1)}
                for key in keys:
                    if key in table:
                        yield where, key
        if self.anywhere:
            yield "anywhere", ""

    def match(self, text: str) -> bool:
        if text in self.literals:
            return True
        return any(self._regex(place)(text) for place in self._candidates(text))

    def matching(self, text: str) -> list[str]:
        """Every pattern that matches ``text``."""
        found = [text] if text in self.literals else []
        for place in self._candidates(text):
            if self._regex(place)(text):
                found += [p for p in self._group(place) if _glob(p)(text)]
        return found

    def _group(self, place: tuple[str, str]) -> list[str]:
        where, key = place
        return self.anywhere if where == "anywhere" else self.groups[where][key]

    def _regex(self, place: tuple[str, str]) -> Callable[[str], re.Match[str] | None]:
        """The patterns filed at ``place`` as one regular expression, compiled when first needed: most
        groups of a long list never are."""
        regex = self._regexes.get(place)
        if regex is None:
            regex = self._regexes[place] = re.compile(
                "|".join(map(fnmatch.translate, self._group(place)))
            ).match
        return regex


@functools.lru_cache(maxsize=4096)
def _glob(pattern: str) -> Callable[[str], re.Match[str] | None]:
    return re.compile(fnmatch.translate(pattern)).match


def _too_alike(*indexes: _GlobIndex) -> str | None:
    size, text = max(index.largest_group() for index in indexes)
    if size <= MAX_ALIKE_PATTERNS:
        return None
    alike = f"share no fixed text but {text!r}" if text else "have no fixed text (such as `*` or `?*`)"
    return (
        f"{size:,} of the patterns {alike}: at most {MAX_ALIKE_PATTERNS:,} patterns this alike are "
        "allowed (name the folders instead, or use one wider pattern)"
    )


class GlobSet:
    """Patterns matched against whole names or paths as ``fnmatch.fnmatch`` matches them, indexed:
    which of them match costs about the text's length, however many patterns there are."""

    def __init__(self, patterns: Iterable[str]) -> None:
        self._index = _GlobIndex()
        self._given: dict[str, list[str]] = {}  # each pattern as folded, and as given
        for pattern in patterns:
            folded = _norm(pattern)
            if folded not in self._given:
                self._index.add(folded)
            self._given.setdefault(folded, []).append(pattern)

    def matching(self, text: str) -> list[str]:
        """The patterns, as given, that match ``text``."""
        return [given for folded in self._index.matching(_norm(text)) for given in self._given[folded]]

    def too_alike(self) -> str | None:
        return _too_alike(self._index)


class ExcludeMatcher:
    """Whether a relative path is excluded: some pattern matches the path or one of the folders above
    it (``fnmatch(rel, p)`` or ``fnmatch(rel, p + "/*")``), or a pattern without ``/`` matches one of
    its parts. A check costs about the path's length, however many patterns there are."""

    def __init__(self, patterns: Iterable[str]) -> None:
        self._whole = _GlobIndex()  # every pattern, against the path and each folder above it
        self._part = _GlobIndex()  # patterns without ``/``, against each part
        # the answers for folders (and parts), asked again for each file in them: patterns never change
        self._folders: dict[str, bool] = {}
        self.empty = True
        for pattern in patterns:
            self.empty = False
            pattern = _norm(pattern.rstrip("/"))
            if "/" in pattern:
                self._whole.add(pattern)
            elif len(_literal_runs(pattern)) > 1:  # a ``*`` matches ``/`` too: ``a*b`` matches ``ax/yb``
                self._whole.add(pattern)
                self._part.add(pattern)
            else:  # a name matches the whole path only where it matches its first part
                self._part.add(pattern)

    def too_alike(self) -> str | None:
        """Why these patterns would make every check slow (over ``MAX_ALIKE_PATTERNS`` of them with
        the same fixed text, or none), or None."""
        return _too_alike(self._whole, self._part)

    def matches(self, rel: str) -> bool:
        """``rel``: a path relative to the root, ``/``-separated and folded by ``_norm``."""
        folder, slash, name = rel.rpartition("/")
        if slash and self._folder_matches(folder):
            return True
        return self._whole.match(rel) or self._part.match(name)

    def _folder_matches(self, folder: str) -> bool:
        """Whether a pattern matches the folder, a folder above it, or a part of its path."""
        known = self._folders.get(folder)
        if known is None:
            above, slash, name = folder.rpartition("/")
            known = (
                (bool(slash) and self._folder_matches(above))
                or self._whole.match(folder)
                or self._part.match(name)
            )
            if len(self._folders) >= 65536:  # (a long editor session)
                self._folders.clear()
            self._folders[folder] = known
        return known


@functools.lru_cache(maxsize=64)
def _exclude_matchers(patterns: tuple[str, ...]) -> ExcludeMatcher:
    """Patterns given as a plain list (the LSP, tests): indexed once per distinct list."""
    return ExcludeMatcher(patterns)


def exclude_matcher(patterns: Iterable[str]) -> ExcludeMatcher:
    if isinstance(patterns, ExcludePatterns):
        return patterns.matcher
    return _exclude_matchers(tuple(patterns))


def _norm(path: str) -> str:
    """Case-folded as the platform compares names, with ``/`` separators (Windows' ``normcase`` turns
    them into backslashes; on POSIX a backslash is an ordinary character of a name)."""
    folded = os.path.normcase(path)
    return folded.replace("\\", "/") if os.path.normcase("/") != "/" else folded


@functools.lru_cache(maxsize=64)
def _realpath_of(anchor: str) -> str:
    """``anchor`` must be absolute: a relative one would be cached against one working folder."""
    return os.path.realpath(anchor)


def is_excluded(
    path: str | Path,
    patterns: Iterable[str] | ExcludeMatcher,
    root: Path,
    base: Path | None = None,
    real: str | None = None,
) -> bool:
    """A path is excluded when a pattern matches its path relative to ``root`` or any one part.

    A path outside ``root`` is matched relative to ``base`` (the folder given on the command line), so
    that folders above it (``/home/me/build/proj``, ``.../site-packages/pkg``) exclude nothing.
    """
    matcher = patterns if isinstance(patterns, ExcludeMatcher) else exclude_matcher(patterns)
    if matcher.empty:
        return False
    if real is None:  # the caller may know it already (``discover`` resolves each folder once)
        real = os.path.realpath(path)  # unlike Path.resolve on Python < 3.13, never raises on a loop
    rel = None
    for anchor in (root, base):
        if anchor is None:
            continue
        prefix = _realpath_of(os.path.abspath(anchor))
        if real == prefix:
            rel = "."
            break
        if real.startswith(prefix.rstrip(os.sep) + os.sep):
            rel = real[len(prefix.rstrip(os.sep)) + 1 :].replace(os.sep, "/")
            break
    if rel is None:
        rel = Path(path).as_posix()
    return matcher.matches(_norm(rel))


def discover(
    paths: Iterable[Path],
    excludes: Iterable[str],
    root: Path,
    errors: list[str],
    excluded: list[str] | None = None,
) -> Iterator[Path]:
    """``.py``, ``.pyi`` and ``.ipynb`` files under the given paths, sorted, each once. Explicit files
    are always included.

    Reading reports the problems of what is yielded (TL902): broken links, files that cannot be read,
    and folders that cannot be listed (yielded themselves, so that the report names them). Links that
    loop are skipped and named in ``errors`` (a looping path cannot even be displayed), as are named
    pipes, sockets and devices (reading one could block forever). Folders reached again through a link
    are not walked twice. Folders and files the excludes skip are appended to ``excluded``.
    """
    skipped = excluded if excluded is not None else []
    matcher = exclude_matcher(excludes)
    seen: set[Path] = set()
    paths = list(paths)  # (one path: a walk yields each file once, no absolute() per file to compare)
    for given, roots in _given_paths(paths, errors):
        kind = _kind(given)
        if kind == "loop":
            errors.append(f"{given}: the symbolic link loops; skipped")
            continue
        if kind == "special":
            errors.append(f"{given}: not a regular file or folder; skipped")
            continue
        if kind == "missing":
            errors.append(f"{given}: no such file or folder")
            continue
        if kind != "folder":
            key = given.absolute()
            if key not in seen:
                seen.add(key)
                yield given
            continue
        found: list[str] = []
        visited_dirs: set[str] = set()

        def onerror(exc: OSError, found: list[str] = found) -> None:
            if exc.filename is not None:
                found.append(os.fsdecode(exc.filename))
            else:  # pragma: no cover - os.walk always names the folder
                errors.append(f"cannot list folder: {exc.strerror}")

        for dirpath, dirnames, filenames in _walk_inside(given, roots, errors, onerror):
            real = os.path.realpath(dirpath)
            if real in visited_dirs:
                dirnames[:] = []
                continue
            visited_dirs.add(real)
            # plain strings here, Paths only for what is yielded: this loop is most of a warm run
            kept = []
            for d in dirnames:
                sub = os.path.join(dirpath, d)
                if is_excluded(sub, matcher, root, given, _real(real, dirpath, d)):
                    skipped.append(sub)
                else:
                    kept.append(d)
            dirnames[:] = sorted(kept)
            for filename in filenames:
                if not filename.endswith(LINTED_SUFFIXES):
                    continue
                candidate = os.path.join(dirpath, filename)
                kind = _kind(candidate)
                if kind == "loop":
                    errors.append(f"{Path(candidate)}: the symbolic link loops; skipped")
                elif kind not in ("special", "missing"):
                    if is_excluded(candidate, matcher, root, given, _real(real, dirpath, filename)):
                        skipped.append(candidate)
                    else:
                        found.append(candidate)
        for name in sorted(found, key=lambda f: f.split(os.sep)):  # the order of Path objects
            candidate = Path(name)
            key = candidate.absolute() if len(paths) > 1 else candidate
            if key not in seen:
                seen.add(key)
                yield candidate


LEAVES = "the symbolic link leads outside the linted folders; skipped"


def _within(real: str, roots: tuple[str, ...]) -> bool:
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def _given_paths(paths: Iterable[Path], errors: list[str]) -> Iterator[tuple[Path, tuple[str, ...]]]:
    """Each path to lint with the roots nothing may leave: the real given folders and the real
    folders of the given files. A given file that is a link leading elsewhere is skipped and named
    in ``errors``: a committed ``model.py -> ~/.ssh/id_rsa`` is never read, shown or fixed."""
    given = list(paths)
    roots = tuple(
        os.path.realpath(p if os.path.isdir(p) else os.path.dirname(os.path.abspath(p))) for p in given
    )
    for path in given:
        if os.path.islink(path) and os.path.exists(path) and not _within(os.path.realpath(path), roots):
            errors.append(f"{path}: {LEAVES}")
            continue
        yield path, roots


def _walk_inside(
    top: Path, roots: tuple[str, ...], errors: list[str], onerror: Callable[[OSError], None]
) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk`` with links followed, but only to folders and files inside ``roots``: a committed
    ``vendor -> /usr/lib`` is named in ``errors`` and not walked, a linked file leading outside is
    named and not linted (nor fixed)."""
    for dirpath, dirnames, filenames in os.walk(top, onerror=onerror, followlinks=True):
        real = os.path.realpath(dirpath)
        if not _within(real, roots):
            errors.append(f"{Path(dirpath)}: {LEAVES}")
            dirnames[:] = []
            continue
        kept = []
        for name in filenames:
            path = os.path.join(dirpath, name)
            if name.endswith((".py", ".pyi")) and os.path.islink(path) and os.path.exists(path):
                if not _within(os.path.realpath(path), roots):
                    errors.append(f"{Path(path)}: {LEAVES}")
                    continue
            kept.append(name)
        yield dirpath, dirnames, kept


def _real(real_folder: str, folder: str, name: str) -> str:
    """``os.path.realpath`` of ``folder/name`` given the folder's: one ``lstat`` instead of one per part."""
    path = os.path.join(folder, name)
    return os.path.realpath(path) if os.path.islink(path) else os.path.join(real_folder, name)


def _kind(path: Path) -> str:
    """file, folder, special (pipe, socket, device), loop, broken (a dangling link, or a path that
    cannot be examined: reading it says why), or missing."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "loop"
        if exc.errno in (errno.ENOENT, errno.ENOTDIR) and not os.path.lexists(path):
            return "missing"
        return "broken"
    if stat.S_ISDIR(mode):
        return "folder"
    return "file" if stat.S_ISREG(mode) else "special"


def _second_line_end(data: bytes) -> int:
    """Where the second line ends: a coding cookie (PEP 263) can only be in the first two lines."""
    end = -1
    for _ in range(2):
        end = data.find(b"\n", end + 1)
        if end < 0:
            return len(data)
    return end + 1


def decode(data: bytes) -> SourceText:
    """Decode Python source bytes using its BOM or coding cookie (PEP 263), as Python would."""
    if b"\x00" in data:
        return SourceText(None, "binary content (NUL bytes): not a Python source file")
    if not data.startswith(b"\xef\xbb\xbf") and b"coding" not in data[: _second_line_end(data)]:
        # no BOM and no cookie: UTF-8, exactly what detect_encoding would say; on an error it is
        # asked anyway, for its message
        try:
            return SourceText(data.decode("utf-8"))
        except UnicodeDecodeError:
            pass
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


def _os_reason(exc: OSError) -> str:
    return (exc.strerror or type(exc).__name__).lower()


def read_source(path: Path, max_bytes: int = MAX_SOURCE_BYTES) -> SourceText:
    """The decoded text of a file, or why it cannot be linted. Never raises for I/O problems."""
    if os.path.islink(path) and not os.path.exists(path):
        try:
            os.stat(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return SourceText(None, "cannot read: the symbolic link loops")
        return SourceText(None, f"cannot read: broken symbolic link (to {os.readlink(path)!r})")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return SourceText(None, "cannot read: the file no longer exists (deleted during the run?)")
    except OSError as exc:
        return SourceText(None, f"cannot read: {_os_reason(exc)}")
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            return _folder_reason(path)
        if not stat.S_ISREG(info.st_mode):
            return SourceText(None, "cannot read: not a regular file")
        if info.st_size > max_bytes:
            return SourceText(None, too_large(info.st_size, max_bytes))
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            if sum(map(len, chunks)) > max_bytes:  # grew while being read
                return SourceText(None, too_large(sum(map(len, chunks)), max_bytes))
        data = b"".join(chunks)
    except OSError as exc:
        return SourceText(None, f"cannot read: {_os_reason(exc)}")
    finally:
        os.close(fd)
    return decode(data)


def _folder_reason(path: Path) -> SourceText:
    """Discovery yields a folder only when it could not be listed: say why."""
    try:
        with os.scandir(path):
            pass
    except OSError as exc:
        return SourceText(None, f"cannot list this folder: {_os_reason(exc)}")
    return SourceText(None, "cannot read: it is a folder")


# --- Nesting check -------------------------------------------------------------------------------
#
# Parsers recurse once per nesting level. CPython rejects more than 200 nested brackets, but libcst's
# native parser crashes the whole process (a stack overflow, not an exception) on a few thousand
# brackets or on long chains such as ``not not not ...``, and is quadratic on long operator chains;
# Python 3.10's own ``ast.parse`` overflows on left-recursive chains of ~10^5 operators. So before any
# parser sees a file, one regular-expression pass (strings and comments skipped) measures bracket
# depth and bounds expression depth; only files past the bound get a precise (``ast``) measurement.

MAX_BRACKET_DEPTH = 200  # CPython's own limit ("too many nested parentheses")
MAX_NESTING = 1000  # expression/statement nesting trainlint analyses
_UNSAFE_FOR_AST = 20_000  # Python 3.10's parser may overflow the C stack beyond this

_STRING = r"""(?:[rRbBuUfF]{1,3})?(?:'''(?:[^'\\]|\\.|'(?!''))*(?:'''|\Z)|\"\"\"(?:[^"\\]|\\.|"(?!""))*(?:\"\"\"|\Z)|'(?:[^'\\\r\n]|\\.)*'?|"(?:[^"\\\r\n]|\\.)*"?)"""


@functools.cache
def _scanner() -> re.Pattern[str]:
    # compiled on first use (5 ms): on Python 3.11+ only a text CPython rejects is scanned, and an
    # editor's run on a file no rule needs never is
    return re.compile(
        r"(?P<comment>\#[^\r\n]*)"
        rf"|(?P<string>{_STRING})"
        r"|(?P<open>[(\[{])"
        r"|(?P<close>[)\]}])"
        r"|(?P<sep>[,;]|(?<![=!<>:*/%@&|^+\-])=(?!=))"
        r"|(?P<newline>\\\r?\n|\r\n|\n|\r)"
        r"|(?P<elif>\belif\b)"
        r"|(?P<op>\*\*|//|<<|>>|[-+*/%@&|^~.]|\b(?:and|or|not|lambda|if|await)\b)",
        re.DOTALL,
    )


_HEADS = ("elif", "else")
_GAP = re.compile(r"(?:\s|\\|#[^\r\n]*)*")


@dataclass(frozen=True)
class Nesting:
    """What the pre-parse scan found: bracket depth, and an upper bound on expression nesting."""

    brackets: int
    brackets_line: int
    bound: int
    bound_line: int


def scan_nesting(text: str) -> Nesting:
    """One pass over the text. ``bound`` over-approximates how deeply a parser will recurse: operators
    and adjacent string literals between two commas (at any bracket level, summed along the bracket
    path), and the ``elif`` branches of one top-level statement."""
    depth = max_depth = depth_line = 0
    line = 1
    chain = 0  # operators so far in the current comma-separated part, plus the enclosing parts
    saved: list[int] = []  # chain value of the enclosing part at each open bracket
    elifs = 0
    best = best_line = 0
    after_string = -1  # end offset of the previous string literal, for implicit concatenation
    for m in _scanner().finditer(text):
        kind = m.lastgroup
        if kind == "comment":
            continue
        if kind == "string":
            if after_string >= 0 and _GAP.fullmatch(text, after_string, m.start()):
                chain += 1
            after_string = m.end()
            line += m.group().count("\n")
        elif kind == "newline":
            line += 1
            if saved or m.group().startswith("\\"):
                continue  # the logical line goes on
            chain = 0
            after_string = -1
            following = text[m.end() : m.end() + 4]
            if following[:1] not in ("", " ", "\t", "\f", "#", "\r", "\n") and following not in _HEADS:
                elifs = 0  # a new top-level statement
            continue
        else:
            after_string = -1
            if kind == "op":
                chain += 1
            elif kind == "open":
                saved.append(chain)
                chain += 1
                depth += 1
                if depth > max_depth:
                    max_depth, depth_line = depth, line
            elif kind == "close":
                if saved:
                    chain = saved.pop() + 1  # ``f(...)``, ``a[...]``: one more link of the outer chain
                    depth -= 1
            elif kind == "sep":
                chain = saved[-1] + 1 if saved else 0
            elif kind == "elif":
                elifs += 1
                if elifs > best:
                    best, best_line = elifs, line
                continue
        if chain > best:
            best, best_line = chain, line
    return Nesting(max_depth, depth_line, best, best_line)


def physical_path(path: str | Path, cwd: str) -> str:
    """The path with its folders resolved (links, ``..``) but not its last part: a link is still
    named as itself, and a path reached through a linked folder is seen where it really is."""
    joined = os.path.join(cwd, path)
    folder, name = os.path.split(joined)
    return os.path.join(os.path.realpath(folder), name) if name else os.path.realpath(joined)


def display_path(path: Path, cwd: str | None = None) -> str:
    """The path relative to the working folder when it lies inside it, else as given."""
    folder = cwd if cwd is not None else os.getcwd()
    prefix = folder if folder.endswith(os.sep) else folder + os.sep
    absolute = os.path.abspath(path)
    if not absolute.startswith(prefix):  # resolve folders only when needed: this runs once per file
        absolute = physical_path(path, folder)
    if absolute.startswith(prefix):
        return Path(absolute[len(prefix) :]).as_posix()
    return path.as_posix()
