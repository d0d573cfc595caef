"""Fix builders: text edits that rules attach to their diagnostics, built from the file model's facts."""

from __future__ import annotations

import libcst as cst

from trainlint.model import FileModel, block_of, line_indent
from trainlint.rule import TextEditSpec


def delete_statement(model: FileModel, root: cst.CSTNode, statement: cst.CSTNode) -> TextEditSpec | None:
    """An edit removing ``statement`` with its whole lines (its trailing comment goes with it; the
    comment lines around it stay). ``pass`` stands in when it is its block's only statement."""
    block = block_of(root, statement)
    if block is None or line_indent(model, statement) is None:
        return None
    if len(block.body) == 1:
        return TextEditSpec(statement, "replace", "pass")
    return TextEditSpec(statement, "delete_lines", "")
