"""Re-parsing only what an edit changed, for the language server.

The server keeps, per document, the libcst module of the last text it linted and the layout of each
top-level statement (its lines and the positions of its nodes relative to its first line). When the
text changes, the top-level statements the change touches are parsed again, alone, and put in place
of the old ones (libcst nodes are immutable: the new module shares every untouched statement with the
old one), and only their positions are computed; the others' are shifted by the lines the edit added.

The text is cut only where the old tree says a top-level statement's own code starts at column 0
(after the comment and blank lines it owns) and the text before the cut is unchanged, so that the
tokenizer is in the same state there as when the whole file is parsed. Anything that could make the
result differ from parsing the whole text (a change of the file's indentation unit or line break,
lines whose owner is unclear) falls back to the whole parse; a piece that does not parse alone (most
often the text is being typed and does not parse either), and a text the engine would not hand to
libcst as it is (binary, too large, nested too deeply), go to ``lint_text``, which says why.
tests/lsp/test_incremental.py checks the trees and findings against whole parses for many edits.
"""

from __future__ import annotations

import itertools
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import libcst as cst

from trainlint.engine import lint_module, lint_text
from trainlint.files import MAX_SOURCE_BYTES, scan_nesting, too_crowded
from trainlint.model.filemodel import Span, _PositionState
from trainlint.model.text import line_starts
from trainlint.results import FileResult, LintOptions

__all__ = ["Documents", "Parsed", "PieceUnparsable", "parse_full", "reparse"]

# Pieces and files nested deeper than ordinary code are left to ``lint_text``, which parses them on a
# large stack after checking them precisely.
_MAX_NESTING = 100
# Documents whose trees are kept (the open ones, as an editor has them; the server forgets a closed
# one): a 1,000-line file's tree and layouts take about 7 MB.
_KEPT_DOCUMENTS = 8


@dataclass(frozen=True)
class Layout:
    """One top-level statement's lines and node positions, relative to its first line (``1``):
    ``base`` shifted down by ``shift`` lines, except the nodes in ``own`` (a statement that kept its
    children but got new leading lines)."""

    base: Mapping[cst.CSTNode, Span]
    shift: int
    own: Mapping[cst.CSTNode, Span]
    lines: int
    leading: int
    blocks: bool  # has an indented block: the module's indentation unit applies to it
    hidden: frozenset[cst.CSTNode] = frozenset()  # nodes of ``base`` no longer in the statement

    def find(self, node: cst.CSTNode) -> Span | None:
        found = self.own.get(node)
        if found is not None:
            return found
        found = self.base.get(node)
        if found is not None and node in self.hidden:
            return None
        if found is None or not self.shift:
            return found
        return _moved(found, self.shift)


def _moved(span: Span, lines: int) -> Span:
    (start_line, start_column), (end_line, end_column) = span
    return (start_line + lines, start_column), (end_line + lines, end_column)


def _codegen(
    node: cst.CSTNode, module: cst.Module, line: int = 1
) -> tuple[dict[cst.CSTNode, Span], int, int]:
    """Positions of ``node`` and its descendants when its code starts at ``line``, column 0, and the
    line and column where its code ends."""
    state = _PositionState(module.default_indent, module.default_newline)
    state.line = line
    node._codegen(state)
    return state.computed, state.line, state.column


def layout_of(stmt: cst.BaseStatement, module: cst.Module) -> Layout:
    computed, line, column = _codegen(stmt, module)
    if column != 0:  # a top-level statement's code ends with its line break
        raise ValueError("a top-level statement that does not end a line")
    blocks = any(type(node) in (cst.IndentedBlock, cst.Match) for node in computed)
    return Layout(computed, 0, {}, line - 1, len(stmt.leading_lines), blocks)


def _releaded(old: Layout, before: cst.BaseStatement, after: cst.BaseStatement, module: cst.Module) -> Layout:
    """The layout of ``after``: ``before`` (laid out as ``old``) with other leading lines, its
    children's positions shifted instead of generated again (the statement may be a long class)."""
    leading = len(after.leading_lines)
    own: dict[cst.CSTNode, Span] = {}
    for number, line in enumerate(after.leading_lines, start=1):
        own.update(_codegen(line, module, number)[0])
    span = old.find(before)
    if span is None:
        raise ValueError("a statement without a position")
    own[after] = _moved(span, leading - old.leading)
    hidden = old.hidden | {before, *_subtrees(before.leading_lines)}
    lines = old.lines + leading - old.leading
    return Layout(old.base, old.shift + leading - old.leading, own, lines, leading, old.blocks, hidden)


def _subtrees(nodes: Sequence[cst.CSTNode]) -> Iterator[cst.CSTNode]:
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children)


class Positions(Mapping[cst.CSTNode, Span]):
    """Every node's position in a module, from its statements' layouts (looked up, not copied)."""

    def __init__(self, module: cst.Module, layouts: Sequence[Layout]) -> None:
        self.layouts = layouts
        self.firsts: list[int] = []
        line = len(module.header) + 1
        for layout in layouts:
            self.firsts.append(line)
            line += layout.lines
        self.extra: dict[cst.CSTNode, Span] = {}
        for number, empty in enumerate(module.header, start=1):
            self.extra.update(_codegen(empty, module, number)[0])
        for number, empty in enumerate(module.footer, start=line):
            self.extra.update(_codegen(empty, module, number)[0])
        self.extra[module] = ((1, 0), (line + len(module.footer), 0))
        self._last = 0

    def __getitem__(self, node: cst.CSTNode) -> Span:
        found = self.extra.get(node)
        if found is not None:
            return found
        count = len(self.layouts)
        # nodes are asked for in clusters (a finding, its related nodes, its fix): start where the
        # last one was found
        for index in itertools.chain(range(self._last, count), range(self._last)):
            relative = self.layouts[index].find(node)
            if relative is not None:
                self._last = index
                return _moved(relative, self.firsts[index] - 1)
        raise KeyError(node)

    def __iter__(self) -> Iterator[cst.CSTNode]:
        yield from self.extra
        for layout in self.layouts:
            yield from layout.own
            yield from (node for node in layout.base if node not in layout.hidden)

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclass(frozen=True)
class Parsed:
    """A text, its module, and what an edit of it needs: each top-level statement's layout and the
    offset where its own code starts (``anchors[0]`` is 0: the header goes with the first one)."""

    text: str
    module: cst.Module
    layouts: tuple[Layout, ...]
    anchors: tuple[int, ...]

    def positions(self) -> Positions:
        return Positions(self.module, self.layouts)


def _build(text: str, module: cst.Module, layouts: Sequence[Layout]) -> Parsed | None:
    starts = line_starts(text)
    line = len(module.header) + 1
    anchors = []
    for layout in layouts:
        anchors.append(starts[line + layout.leading - 1] if anchors else 0)
        line += layout.lines
    # the lines the layouts account for must be the text's (its last line may lack a line break)
    if line + len(module.footer) - 1 not in (len(starts), len(starts) - 1) or not layouts:
        return None
    return Parsed(text, module, tuple(layouts), tuple(anchors))


def _readable(text: str) -> bool:
    """Whether the engine would hand this text to libcst as it is (see ``lint_text``'s checks), but
    for its nesting: a whole text's is checked by ``_parse``, an edited one's in the re-parsed piece."""
    if "\x00" in text or len(text) > MAX_SOURCE_BYTES or too_crowded(text) is not None:
        return False
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return False
    return True


def _parse(text: str) -> cst.Module | None:
    nesting = scan_nesting(text)
    if nesting.brackets > _MAX_NESTING or nesting.bound > _MAX_NESTING:
        return None
    try:
        return cst.parse_module(text)
    except Exception:  # a syntax error: the caller's whole parse (or lint_text) reports it
        return None
    except BaseException as exc:  # libcst's native parser panicking
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return None


def parse_full(text: str) -> Parsed | None:
    """The text parsed whole, with its layouts; None when ``lint_text`` should handle it."""
    module = _parse(text) if _readable(text) else None
    if module is None:
        return None
    try:
        layouts = [layout_of(stmt, module) for stmt in module.body]
    except (ValueError, RecursionError):
        return None
    return _build(text, module, layouts)


def _common_prefix(a: str, b: str) -> int:
    low, high = 0, min(len(a), len(b))
    while low < high:  # string comparisons run in C: a binary search is faster than a loop
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _common_suffix(a: str, b: str, limit: int) -> int:
    low, high = 0, min(len(a), len(b), limit)
    while low < high:
        middle = (low + high + 1) // 2
        if a[len(a) - middle :] == b[len(b) - middle :]:
            low = middle
        else:
            high = middle - 1
    return low


def _segment(anchors: Sequence[int], offset: int) -> int:
    """The top-level statement whose segment (its own code, up to the next one's) holds ``offset``."""
    return max(bisect_right(anchors, offset) - 1, 0)


def _indentation_kept(old: Parsed, piece: cst.Module, blocks: bool, first: int, last: int) -> bool:
    """Whether the module keeps its indentation unit (libcst takes the first indented block's): the
    untouched statements' blocks are recorded relative to it, the piece's relative to its own."""
    if blocks:
        return piece.default_indent == old.module.default_indent
    old_first = next((k for k, layout in enumerate(old.layouts) if layout.blocks), None)
    return old_first is None or not first <= old_first <= last


class PieceUnparsable(Exception):
    """The statements an edit touched do not parse on their own: the whole text does not either
    (unless the edit made a string or bracket span statements), so a whole parse would only repeat
    the failure; ``lint_text`` says where it is."""


def reparse(old: Parsed, text: str) -> Parsed | None:
    """``text`` parsed by re-parsing only the top-level statements that differ from ``old.text``'s;
    None when only a whole parse can say (the caller then parses the whole text). Raises
    ``PieceUnparsable``."""
    if text == old.text:
        return old
    if not _readable(text):
        return None
    prefix = _common_prefix(old.text, text)
    suffix = _common_suffix(old.text, text, min(len(old.text), len(text)) - prefix)
    old_end, delta, count = len(old.text) - suffix, len(text) - len(old.text), len(old.layouts)
    # Both cuts are at a statement's anchor with unchanged text on both sides of it, and not at the
    # change's edges: there, the change could make the anchor's line a comment, or a continuation.
    first = _segment(old.anchors, prefix - 1) if prefix else 0
    last = max(first, _segment(old.anchors, old_end))
    start = old.anchors[first]
    stop = old.anchors[last + 1] + delta if last + 1 < count else len(text)
    piece = _parse(text[start:stop])
    if piece is None:
        raise PieceUnparsable
    if not piece.body or piece.default_newline != old.module.default_newline:
        return None
    body = list(piece.body)
    if first > 0:
        if piece.header or body[0].leading_lines:
            return None
        body[0] = body[0].with_changes(leading_lines=old.module.body[first].leading_lines)
    after = list(old.module.body[last + 1 :])
    if after and not _same_lines(piece.footer, after[0].leading_lines):
        # the lines after the piece's last statement that its blocks do not own lead the next one
        after[0] = after[0].with_changes(leading_lines=piece.footer)
    ends = last + 1 == count
    module = old.module.with_changes(
        header=piece.header if first == 0 else old.module.header,
        body=[*old.module.body[:first], *body, *after],
        footer=piece.footer if ends else old.module.footer,
        has_trailing_newline=piece.has_trailing_newline if ends else old.module.has_trailing_newline,
        encoding=piece.encoding if first == 0 else old.module.encoding,
    )
    try:
        layouts = [layout_of(stmt, module) for stmt in body]
        if not _indentation_kept(old, piece, any(layout.blocks for layout in layouts), first, last):
            return None
        following = list(old.layouts[last + 1 :])
        if after and after[0] is not old.module.body[last + 1]:
            following[0] = _releaded(following[0], old.module.body[last + 1], after[0], module)
    except (ValueError, RecursionError):
        return None
    return _build(text, module, [*old.layouts[:first], *layouts, *following])


def _same_lines(a: Sequence[cst.EmptyLine], b: Sequence[cst.EmptyLine]) -> bool:
    return len(a) == len(b) and all(x.deep_equals(y) for x, y in zip(a, b, strict=True))


class Documents:
    """The last parse of each document the server lints, reused for the next text of that document."""

    def __init__(self, kept: int = _KEPT_DOCUMENTS) -> None:
        self.kept = kept
        self._parsed: OrderedDict[str, Parsed] = OrderedDict()
        self.reused = 0  # texts linted after a partial parse (for tests and the bench)

    def parse(self, name: str, text: str) -> Parsed | None:
        """The parse of ``text``, the document's new text (partial when possible), or None: the
        text does not parse, or ``lint_text`` must look at it first."""
        known = self._parsed.get(name)
        try:
            parsed = reparse(known, text) if known is not None else None
        except PieceUnparsable:  # the last text that parsed stays: the next one is compared with it
            return None
        if parsed is not None and parsed is not known:
            self.reused += 1
        return self._keep(name, parsed if parsed is not None else parse_full(text))

    def _keep(self, name: str, parsed: Parsed | None) -> Parsed | None:
        if parsed is not None:
            self._parsed[name] = parsed
            self._parsed.move_to_end(name)
            while len(self._parsed) > self.kept:
                self._parsed.popitem(last=False)
        return parsed

    def lint(self, name: str, text: str, options: LintOptions) -> FileResult:
        """What ``lint_text(text, name, options)`` finds, reusing the document's last parse."""
        parsed = self.parse(name, text)
        if parsed is None:  # not parsable, or not as it is: the engine's own checks and messages
            result = lint_text(text, name, options)
            known = self._parsed.get(name)
            if result.parsed and known is not None and known.text != text:
                # it parses whole after all (a string opened in one statement and closed in another):
                # the next edit is compared with this text
                self._keep(name, parse_full(text))
            return result
        return lint_module(parsed.module, text, name, options, parsed.positions())

    def forget(self, name: str) -> None:
        self._parsed.pop(name, None)
