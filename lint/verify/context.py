"""What a probe gets: the finding, the file model, and helpers to make edited variants of the file."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

from trainlint.model import FileModel, Site, split_lines
from trainlint.rule import Finding
from trainlint.verify.source import NotExecutable, Tree, node_span


@dataclass(frozen=True)
class TextEdit:
    """Replace text between two 1-based positions (end exclusive). Insertions at one position are
    applied in the order given."""

    line: int
    column: int
    end_line: int
    end_column: int
    content: str


def apply_text_edits(text: str, edits: list[TextEdit]) -> str:
    starts = [0]
    for line in split_lines(text, keepends=True):
        starts.append(starts[-1] + len(line))

    def offset(line: int, column: int) -> int:
        return starts[line - 1] + column - 1

    spans = [
        (offset(e.line, e.column), offset(e.end_line, e.end_column), i, e.content)
        for i, e in enumerate(edits)
    ]
    # apply from the end; for equal positions the later-given insertion goes first so that the
    # earlier one ends up in front of it
    for start, end, _, content in sorted(spans, key=lambda s: (s[0], s[1], s[2]), reverse=True):
        text = text[:start] + content + text[end:]
    return text


def insert_before(model: FileModel, node: cst.CSTNode, content: str) -> TextEdit:
    line, col, _, _ = node_span(model, node)
    return TextEdit(line, col, line, col, content)


def insert_after(model: FileModel, node: cst.CSTNode, content: str) -> TextEdit:
    _, _, line, col = node_span(model, node)
    return TextEdit(line, col, line, col, content)


def replace_node(model: FileModel, node: cst.CSTNode, content: str) -> TextEdit:
    return TextEdit(*node_span(model, node), content)


@dataclass
class ProbeContext:
    finding: Finding
    model: FileModel
    tree: Tree
    _variants: dict[str, FileModel] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.model.source

    def variant(self, edits: list[TextEdit]) -> FileModel:
        """The file model of the source with ``edits`` applied (cached by resulting text)."""
        new_text = apply_text_edits(self.text, edits)
        if new_text not in self._variants:
            try:
                self._variants[new_text] = FileModel.from_source(new_text, self.model.path)
            except cst.ParserSyntaxError as exc:
                raise NotExecutable(f"the edited snippet does not parse: {exc.message}") from exc
        return self._variants[new_text]

    def related(self, label: str) -> Site:
        """The call at the finding's related location that the rule labelled ``label`` (a class constant
        of the rule, e.g. ``UnscaleTwice.FIRST``)."""
        for rel in self.finding.related:
            if rel.label != label or (
                rel.path and Path(rel.path).resolve() != Path(self.finding.path).resolve()
            ):
                continue  # a location in another file (the project index's) is not a call of this one
            for site in self.model.calls:
                pos = self.model.position(site.node)
                if pos.start.line == rel.line and pos.start.column + 1 == rel.column:
                    return site
        elsewhere = [rel for rel in self.finding.related if rel.path and rel.label in (label, None)]
        elsewhere = [
            rel for rel in elsewhere if Path(rel.path).resolve() != Path(self.finding.path).resolve()
        ]
        if elsewhere:  # the index found it in another file: name that place, not the harness's label
            rel = elsewhere[0]
            raise NotExecutable(
                f"the {label.replace('-', ' ')} this finding rests on is in another file ({rel.path}, line"
                f" {rel.line}): the probe runs the statements of the flagged file only"
            )
        raise NotExecutable(f"the finding has no call labelled `{label}` among its related locations")

    def fix_edits(self) -> list[TextEdit]:
        """The finding's fix, each edit narrowed to the text it really changes (a fix that rewrites a
        whole block to delete one line becomes that deletion), so that it fits in a step window."""
        fix = self.finding.fix
        if fix is None:
            return []
        return [
            minimal_edit(self.text, TextEdit(e.line, e.column, e.end_line, e.end_column, e.content))
            for e in fix.edits
        ]


def minimal_edit(text: str, edit: TextEdit) -> TextEdit:
    """The same change as ``edit`` with the unchanged text at both ends left out."""
    starts = [0]
    for line in split_lines(text, keepends=True):
        starts.append(starts[-1] + len(line))
    begin = starts[edit.line - 1] + edit.column - 1
    end = starts[edit.end_line - 1] + edit.end_column - 1
    old, new = text[begin:end], edit.content
    prefix = 0
    while prefix < min(len(old), len(new)) and old[prefix] == new[prefix]:
        prefix += 1
    suffix = 0
    while suffix < min(len(old), len(new)) - prefix and old[-1 - suffix] == new[-1 - suffix]:
        suffix += 1

    def position(offset: int) -> tuple[int, int]:
        import bisect

        line = bisect.bisect_right(starts, offset) - 1
        line = min(line, len(starts) - 1)
        return line + 1, offset - starts[line] + 1

    line, column = position(begin + prefix)
    end_line, end_column = position(end - suffix)
    return TextEdit(line, column, end_line, end_column, new[prefix : len(new) - suffix])
