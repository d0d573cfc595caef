"""One name's entries of a file's summary, read from the statements that define it (issue 20).

A lookup asks another file for one name (``from pkg.mod import helper``), yet the whole file was
parsed and summarised for it: half of the index's cost in a cold run, most of it spent on the
definitions nobody asked about. A function or class defined at the top of a module is a statement
that starts at the beginning of a line, outside any string; it ends where the next such line
starts. ``definition`` finds those lines with a scan of the strings and comments (a regular
expression: a few percent of a parse), parses each statement alone and summarises it as
``summary.summarize`` does: the same entries, equal as data.

Where that is not sure to give the same entries, it answers None and the caller summarises the
whole file: the name not defined so (it may be re-exported), a definition line inside a string, a
statement that does not parse alone (a line of a bracket continued at the start of a line), a
header continued with a backslash, a form feed, a name spelt beyond ASCII, and facts that need the
rest of the module: an ``apply`` callback defined beside the function, a constructor's call of a
plain name where an import statement could not be read in place. A file with a syntax error
elsewhere than in those statements is read all the same (its whole summary would be None).

A file asked for many names (a package's models, each imported by many pipelines) is read alone
until half of its text was parsed so for other names: the whole summary, made once, answers the
rest at less cost than the remaining definitions one by one.
"""

from __future__ import annotations

import ast
import bisect
import functools
import re
import warnings
from typing import Any

from trainlint.model.index_imports import bindings
from trainlint.model.summary import Incomplete, Summary, add_entries, class_methods

# the strings and comments of a text (a string's prefix letters aside: they do not change its span)
_STRINGS = re.compile(
    r"""
      \#[^\n]*
    | '''[^'\\]*(?:(?:\\.|'(?!''))[^'\\]*)*'''
    | \"\"\"[^"\\]*(?:(?:\\.|"(?!""))[^"\\]*)*\"\"\"
    | '[^'\\\n]*(?:\\.[^'\\\n]*)*'
    | "[^"\\\n]*(?:\\.[^"\\\n]*)*"
    """,
    re.VERBOSE | re.DOTALL,
)
# a line starting at its first column (a closing bracket there ends a header written over lines:
# ``def f(\n    x,\n) -> int:``, no statement)
_LINE_START = re.compile(r"^[^\s#)\]}]", re.MULTILINE)
# what may stand before a definition's name on its line: its header's keywords, from the first column
_HEADS = {
    "def": re.compile(r"(?:async[ \t]+)?def[ \t]+"),
    "any": re.compile(r"(?:(?:async[ \t]+)?def|class)[ \t]+"),
}
# a definition's header continued on the next line (``def \``), or with a name spelt beyond ASCII
# (the parser normalises it: another spelling may name the same definition)
_CONTINUED_HEADER = re.compile(r"(?:async|def|class)[ \t]*\\")
_WIDE_NAME = re.compile(r"(?:def|class)[ \t]+\w*[^\x00-\x7f]")


def _headers(text: str, name: str, kinds: str = "any") -> list[int]:
    """Where the lines start whose text begins with the header of a definition of ``name`` (of
    ``kinds``: ``def`` for functions only), found from the name's occurrences (``str.find``: a
    regular expression anchored at every line start costs several times more)."""
    head, found = _HEADS[kinds], []
    at = text.find(name)
    while at >= 0:
        end = at + len(name)
        after = text[end : end + 1]
        if not (after.isalnum() or after == "_"):
            start = text.rfind("\n", 0, at) + 1
            if head.fullmatch(text, start, at):
                found.append(start)
        at = text.find(name, end)
    return found


def _odd_headers(text: str) -> bool:
    """Whether a definition's header may not read as ``_headers`` finds them."""
    at = text.find("\\\n")
    while at >= 0:
        if _CONTINUED_HEADER.match(text, text.rfind("\n", 0, at) + 1):
            return True
        at = text.find("\\\n", at + 2)
    return not text.isascii() and _WIDE_NAME.search(text) is not None


def definition(text: str, name: str, digest: str | None = None) -> Summary | None:
    """``summarize(text)``'s entries for ``name`` defined at the top of the module: ``functions``
    holding the function ``name`` and the methods ``name.method`` of a class ``name``, ``classes``
    holding the class; no ``imports``. None where they cannot be told from those statements alone
    (see the module's notes): the caller summarises the whole text. ``digest``: the text's, under
    which the scan of its strings is kept for the next name asked of it."""
    strings = _scanned(text, digest)
    if strings.odd or strings.parsed * 2 > len(text):
        return None  # (half of it parsed for other names already: the whole summary costs less now)
    starts = _headers(text, name)
    if not starts:
        return _imported_only(name, strings)
    if any(strings.inside(start) for start in starts):
        return None
    functions: dict[str, Any] = {}
    classes: dict[str, Any] = {}

    def module_defines(function: str) -> bool:  # (an ``apply`` callback's name)
        return bool(_headers(text, function, "def"))

    try:
        for start in starts:  # (in the text's order: a later definition replaces an earlier one)
            node = _statement(text, start, strings, name)
            if node is None:
                return None
            add_entries(node, functions, classes, None, module_defines)
        for facts in classes.values():
            class_methods(name, facts, functions, strings.imported)
    except Incomplete:
        return None
    return {"functions": functions, "classes": classes}


def _imported_only(name: str, strings: _Scan) -> Summary | None:
    """The summary of a name no definition of the text's top level has: its ``imports`` entry (a
    re-export the lookup follows), where every import statement reads in place and those binding
    the name agree on its target (the last binding in the tree's order would win otherwise)."""
    found = strings.bindings
    if found is None:
        return None
    targets = {target for bound, target in found if bound == name}
    if len(targets) > 1:
        return None
    return {"imports": {name: targets.pop()} if targets else {}, "functions": {}, "classes": {}}


def _statement(text: str, start: int, strings: _Scan, name: str) -> ast.stmt | None:
    """The definition of ``name`` whose header starts at ``start``, parsed alone (with its line
    numbers), or None where its text does not parse as that one statement."""
    end = len(text)
    newline = text.find("\n", start)
    for match in _LINE_START.finditer(text, newline + 1 if newline >= 0 else end):
        if not strings.inside(match.start()):
            end = match.start()
            break
    line = text.count("\n", 0, start) + 1
    strings.parsed += end - start
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            body = ast.parse("\n" * (line - 1) + text[start:end]).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    node = body[0] if len(body) == 1 else None
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) or node.name != name:
        return None
    return node if node.lineno == line else None


_SCANS: dict[str, _Scan] = {}  # text digest -> its scan (a lint asks a module for several names)
_SCANS_KEPT = 16


def _scanned(text: str, digest: str | None) -> _Scan:
    if digest is None:
        return _Scan(text)
    scan = _SCANS.get(digest)
    if scan is None:
        while len(_SCANS) >= _SCANS_KEPT:
            del _SCANS[next(iter(_SCANS))]
        scan = _SCANS[digest] = _Scan(text)
    return scan


class _Scan:
    """Where a text's strings and comments are, and what its import statements bind (read on first
    use: None where one cannot be read in place)."""

    def __init__(self, text: str) -> None:
        self.text = text
        # a text whose definitions may not read as ``_headers`` finds them: left to the whole summary
        self.odd = "\f" in text or "\r" in text or text.startswith("\ufeff") or _odd_headers(text)
        self.spans = [] if self.odd else [(m.start(), m.end()) for m in _STRINGS.finditer(text)]
        self._starts = [start for start, _ in self.spans]
        self.parsed = 0  # the characters of the definitions parsed alone so far

    def inside(self, at: int) -> bool:
        """Whether the text at ``at`` belongs to a string or comment begun before it."""
        index = bisect.bisect_right(self._starts, at) - 1
        return index >= 0 and self.spans[index][0] < at < self.spans[index][1]

    @functools.cached_property
    def bindings(self) -> set[tuple[str, str]] | None:
        """(name bound, dotted target) of every import statement (``index_imports.bindings``)."""
        return bindings(self.text, self.inside)

    @functools.cached_property
    def _names(self) -> set[str] | None:
        found = self.bindings
        return None if found is None else {bound for bound, _ in found}

    def imported(self, name: str) -> bool:
        """Whether an import statement binds the name (``Incomplete`` where one cannot be read)."""
        if self._names is None:
            raise Incomplete(name)
        return name in self._names
