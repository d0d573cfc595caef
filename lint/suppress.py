"""Suppression comments: ``# noqa[: TL201, TL203]`` on a line and ``# trainlint: disable-file=...``,
read from comment tokens only (text inside strings and docstrings never suppresses)."""

from __future__ import annotations

import io
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass, field

# A noqa comment with a colon names full codes (TL201, TL203), as in Ruff; a list that does not
# parse suppresses nothing (never everything). Prefixes such as `TL4` are for disable-file only.
NOQA = re.compile(
    r"#\s*noqa(?P<colon>\s*:\s*(?P<ids>[A-Za-z]+[0-9]+(?:[\s,]+[A-Za-z]+[0-9]+)*)?)?", re.IGNORECASE
)
DISABLE_FILE = re.compile(r"^\s*#\s*trainlint:\s*disable-file\s*=\s*(?P<ids>[A-Za-z0-9, ]+)", re.IGNORECASE)


@dataclass
class Suppressions:
    by_line: dict[int, set[str] | None] = field(default_factory=dict)  # None: bare noqa, all ids
    file_ids: set[str] = field(default_factory=set)

    def suppresses(self, rule_id: str, line: int) -> bool:
        if any(rule_id.startswith(p) for p in self.file_ids):
            return True
        if line not in self.by_line:
            return False
        ids = self.by_line[line]
        return ids is None or rule_id in ids


def _ids(text: str) -> set[str]:
    return {part.upper() for part in re.split(r"[\s,]+", text) if part}


def _comments(source: str) -> Iterator[tuple[int, str, bool]]:
    """``(line, text, alone)`` of every comment token: its text from ``#`` to the end of the line,
    and whether only indentation precedes it (a disable-file comment must stand alone). Only real
    comments count: ``"# noqa"`` in a string or a docstring line is not one."""
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                yield token.start[0], token.string, not token.line[: token.start[1]].strip()
    except (tokenize.TokenError, SyntaxError):
        return  # not tokenizable: nothing is suppressed (the file was parsed, so this is rare)


def parse_suppressions(source: str) -> Suppressions:
    out = Suppressions()
    if "noqa" not in source.lower() and "trainlint:" not in source:
        return out
    for number, comment, alone in _comments(source):
        disable = DISABLE_FILE.match(comment) if alone else None
        if disable:
            out.file_ids |= _ids(disable.group("ids"))
            continue
        match = NOQA.search(comment)
        if match is None:
            continue
        if match.group("colon") is None:
            out.by_line[number] = None
        elif match.group("ids"):
            out.by_line[number] = _ids(match.group("ids"))
    return out
