"""The import targets of a file's text, read without parsing the whole file (the project index's
cache keys: issue 20).

A cache key needs the modules a file imports, before the file is linted (a cold run asks the keys of
every file first, so CPython's tree of the file, parsed later by the engine's gate, is not at hand).
Parsing the whole file for its imports cost as much as the rest of the key. Here each ``import``
word of the text is read in place instead: a statement at the start of a line is parsed alone (a
small text), a word in a comment is skipped, and anything else (an ``import`` after ``if x:`` or a
``;``, a word in running prose, a statement continued from the line before) makes the answer None,
so that the caller parses the whole file. A doctest's line (``>>> from pkg import f``) is inside a
string and skipped; other lines of strings that read as statements count as imports: a key resting
on one module more is only recomputed more often, never wrong, where a key missing a module would be
stale when that module changes. ``tests/model/test_index_imports_s6.py`` holds the answers to the
parser's on real code.
"""

from __future__ import annotations

import ast
import re
import unicodedata
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# what may precede ``import`` on its line in a statement read here: nothing, or ``from <module>``
# (``from .a``, ``from.a``, ``from . import``), maybe after a doctest prompt
_PREFIX = re.compile(r"[ \t]*((?:>>>|\.\.\.)[ \t]+)?(from(?:[ \t]+[\w.]+|[ \t]*\.[\w.]*)[ \t]*)?")
# the one-line forms most statements take, read without a parse
_SIMPLE_FROM = re.compile(r"from[ \t]*(\.*)[ \t]*([\w.]*)[ \t]+import[ \t]+([\w \t,]+)")
_SIMPLE_IMPORT = re.compile(r"import[ \t]+([\w. \t,]+)")
_ALIAS = re.compile(r"[ \t]*([\w.]+)(?:[ \t]+as[ \t]+(\w+))?[ \t]*")


def import_targets(text: str) -> list[str] | None:
    """The dotted targets of every import statement of the text, as ``summary.summarize`` writes
    them (``import a.b`` -> ``a``, ``import a.b as c`` -> ``a.b``, ``from .m import f`` -> ``.m.f``),
    sorted and without repeats; maybe more (statements inside strings), never fewer. None when a
    statement could not be read in place: the caller parses the file."""
    found = _bindings(text)
    return None if found is None else sorted({target for _, target in found})


def import_targets_of(text: str, tree: ast.Module) -> list[str]:
    """``import_targets``, or where a statement cannot be read in place, those of the text's tree (the
    engine's gate has parsed it)."""
    found = import_targets(text)
    if found is not None:
        return found
    from trainlint.model.summary import outline  # (a statement read in place is the rule)

    own = outline(text, tree)
    return sorted(set(own["imports"].values())) if own is not None else []


def imports_name(text: str, name: str) -> bool | None:
    """Whether an import statement of the text binds ``name`` (``import a.b`` binds ``a``, ``from m
    import f as g`` binds ``g``); maybe True where none does (a statement inside a string), never
    False where one does; None as for ``import_targets`` (or where a statement that mentions the
    name could not be read). The text's statements are read once for all the names asked of it."""
    read = _read_of(text)
    if read.names is None:
        return None
    if name in read.names:
        return True
    return None if any(name in statement for statement in read.unread) else False


def binds_name(text: str, name: str) -> bool:
    """``imports_name``, or where it cannot tell, whether the text's tree binds ``name`` by an import
    (``summary.outline``: parsed once per text, for all the names asked of it)."""
    answer = imports_name(text, name)
    if answer is not None:
        return answer
    read = _read_of(text)
    if read.outlined is None:
        from trainlint.model.summary import outline  # (a statement read in place is the rule)

        outlined = outline(text)
        read.outlined = set(outlined["imports"]) if outlined is not None else set()
    return name in read.outlined


@dataclass
class _Reading:
    """A text's import statements as read in place (``imports_name``), held with the text itself so
    that its id, the memo's key, is not reused."""

    text: str
    names: set[str] | None  # bound by the statements read (None: a statement could not be found)
    unread: list[str]  # the statements found but not read
    outlined: set[str] | None = None  # bound by its tree's imports (``binds_name``; None: not parsed)


def _read_of(text: str) -> _Reading:
    """The reading of a text's import statements, memoised by identity (the latest texts asked)."""
    read = _READ.get(id(text))
    if read is None or read.text is not text:
        unread: list[str] = []
        found = _bindings(text, unread=unread)
        read = _Reading(text, None if found is None else {bound for bound, _ in found}, unread)
        while len(_READ) >= _READ_KEPT:
            del _READ[next(iter(_READ))]
        _READ[id(text)] = read
    return read


_READ: dict[int, _Reading] = {}
_READ_KEPT = 16


def bindings(text: str, quoted: Callable[[int], bool]) -> set[tuple[str, str]] | None:
    """(name bound, dotted target) of every import statement of the text, exactly: ``quoted`` tells
    where a word belongs to a string or comment (no statement); None as for ``import_targets``."""
    return _bindings(text, quoted=quoted)


def _bindings(
    text: str, quoted: Callable[[int], bool] | None = None, unread: list[str] | None = None
) -> set[tuple[str, str]] | None:
    """(name bound, dotted target) of every import statement read in place (``quoted``: as for
    ``bindings``); None as for ``import_targets``. ``unread``: where given, a statement found but not
    read is put there instead (its bindings left out)."""
    found: set[tuple[str, str]] = set()
    covered = 0  # the end of the last statement read (its trailing comment may say "import")
    for at in _words(text):
        if at < covered or (quoted is not None and quoted(at)):
            continue
        start = text.rfind("\n", 0, at) + 1
        prefix = text[start:at]
        if "#" in prefix and "'" not in prefix and '"' not in prefix:
            # in a comment (or a string's line); with a quote the ``#`` may be inside a string that
            # closes before the word (``#"""; import x``): read as any other prefix then
            continue
        shape = _PREFIX.fullmatch(prefix)
        if shape is None:
            return None
        if shape.group(1):
            continue  # a doctest's line (``>>> import x``): inside a string, never a statement
        if _continued(text, start):
            return None
        begin = start + shape.start(2) if shape.group(2) else at
        statement, covered = _statement(text, begin)
        # (an identifier beyond ASCII is normalised by the parser: a full-width ``mod`` imports ``mod``)
        targets = _read(statement) if statement is not None and statement.isascii() else None
        if targets is None and unread is not None and statement is not None:
            unread.append(statement)
            continue
        if targets is None:
            return None
        found.update(targets)
    return found


def _words(text: str) -> Iterator[int]:
    """Where the word ``import`` starts in the text, not as part of a longer name (``str.find``
    first: a regular expression's scan of the whole text costs several times more)."""
    at = text.find("import")
    while at >= 0:
        before = text[at - 1] if at else " "
        after = text[at + 6 : at + 7]
        # (after a dot too: ``from .import x`` is a statement)
        if not (before.isalnum() or before == "_" or after.isalnum() or after == "_"):
            yield at
        at = text.find("import", at + 6)


def _continued(text: str, start: int) -> bool:
    """Whether the line starting at ``start`` continues the one before (a backslash ends it)."""
    if start < 2:
        return False
    before = text[: start - 1].rstrip("\r")
    return before.endswith("\\")


def _statement(text: str, begin: int) -> tuple[str | None, int]:
    """The statement's text from ``begin`` to its end (a newline or ``;`` outside parentheses),
    comments dropped and continuation lines joined, and where it ends; None when it does not end
    where it should."""
    size = len(text)
    end = text.find("\n", begin)
    end = size if end < 0 else end
    line = text[begin:end]
    if "(" not in line and ")" not in line and "\\" not in line and ";" not in line and "\r" not in line:
        return line.partition("#")[0], end  # (one line: most statements)
    depth, out, index = 0, [], begin
    while index < size:
        char = text[index]
        if char == "#":
            end = text.find("\n", index)
            index = size if end < 0 else end
            continue
        if char == "\\" and text.startswith("\n", index + 1):
            out.append(" ")
            index += 2
            continue
        if char == "\\" and text.startswith("\r\n", index + 1):
            out.append(" ")
            index += 3
            continue
        if char in "\r\n" or char == ";":
            if depth == 0:
                break
            out.append(" ")
        elif char == "(":
            depth += 1
            out.append(char)
        elif char == ")":
            depth -= 1
            if depth < 0:
                return None, index
            out.append(char)
        else:
            out.append(char)
        index += 1
    return ("".join(out) if depth == 0 else None), index


def _read(statement: str) -> list[tuple[str, str]] | None:
    """The (name bound, target) pairs of one import statement's text; None when it is not one."""
    simple = _SIMPLE_FROM.fullmatch(statement)
    if simple is not None:
        dots, module, names = simple.groups()
        return _from_targets(dots + module, names)
    simple = _SIMPLE_IMPORT.fullmatch(statement)
    if simple is not None:
        return _import_targets(simple.group(1))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            body = ast.parse(statement).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if len(body) != 1 or not isinstance(body[0], ast.Import | ast.ImportFrom):
        return None
    node = body[0]
    if isinstance(node, ast.Import):
        return [
            (alias.asname, alias.name) if alias.asname else (alias.name.split(".")[0],) * 2
            for alias in node.names
        ]
    base = "." * node.level + (node.module or "")
    return [
        (alias.asname or alias.name, _joined(base, alias.name)) for alias in node.names if alias.name != "*"
    ]


def _from_targets(base: str, names: str) -> list[tuple[str, str]] | None:
    out = []
    for part in names.split(","):
        alias = _ALIAS.fullmatch(part)
        if alias is None or "." in alias.group(1) or not base:
            return None  # (``from m import a.b`` is no statement: parsed, it is rejected)
        out.append((alias.group(2) or alias.group(1), _joined(base, alias.group(1))))
    return out


def _import_targets(names: str) -> list[tuple[str, str]] | None:
    out = []
    for part in names.split(","):
        alias = _ALIAS.fullmatch(part)
        if alias is None or alias.group(1).startswith(".") or alias.group(1).endswith("."):
            return None
        name = alias.group(1)
        out.append((alias.group(2), name) if alias.group(2) else (name.split(".")[0],) * 2)
    return out


def _joined(base: str, name: str) -> str:
    """``summary._imports``'s target of ``from <base> import <name>``."""
    return f"{base}.{name}" if base and not base.endswith(".") else base + name


def may_receive_scaler(text: str) -> bool:
    """Whether a function of the text may have a parameter that ``receives_scaler`` (an identifier
    beyond ASCII is normalised by the parser: compared in that form)."""
    # (``lower`` then a plain search: 6 times faster than a case-blind regular expression)
    return "scaler" in (text if text.isascii() else unicodedata.normalize("NFKC", text)).lower()


def receives_scaler(param: list[Any]) -> bool:
    """A parameter that holds a GradScaler by its annotation or its name."""
    name, _default, annotation = param
    return (annotation or "").endswith("GradScaler") or "scaler" in name.lower()
