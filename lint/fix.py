"""Applying fixes: text edits from findings, applied until none apply, re-parsed before anything is written."""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import stat
import tempfile
import tokenize
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

from trainlint.files import read_source
from trainlint.model import LINE_BREAK
from trainlint.rule import Applicability, Edit, Finding

MAX_ROUNDS = 10


def applicable(finding: Finding, unsafe: bool) -> bool:
    if finding.fix is None:
        return False
    return unsafe or finding.fix.applicability in (Applicability.SAFE, Applicability.VERIFIED)


def _offsets(text: str) -> list[int]:
    """Offsets of each line's start, splitting lines exactly where the parser does (\\n, \\r\\n, \\r)."""
    return [0, *(m.end() for m in LINE_BREAK.finditer(text))]


def newline_of(text: str) -> str:
    match = LINE_BREAK.search(text)
    return match.group() if match else "\n"


def apply_edits(text: str, fixes: list[tuple[Edit, ...]]) -> tuple[str, int]:
    """Apply whole fixes (every edit of a fix or none of them), skipping a fix that touches a range an
    earlier fix already changed. Inserted newlines follow the file's own line endings."""
    starts = _offsets(text)
    newline = newline_of(text)

    def offset(line: int, column: int) -> int:
        return starts[line - 1] + column - 1

    taken: list[tuple[int, int]] = []
    chosen: list[tuple[int, int, str]] = []
    applied = 0
    for edits in fixes:
        spans = [(offset(e.line, e.column), offset(e.end_line, e.end_column), e.content) for e in edits]
        if any(start <= b and a <= end for start, end, _ in spans for a, b in taken):
            continue
        taken.extend((start, end) for start, end, _ in spans)
        chosen.extend((start, end, content.replace("\n", newline)) for start, end, content in spans)
        applied += 1
    for start, end, content in sorted(chosen, key=lambda span: (span[0], span[1]), reverse=True):
        text = text[:start] + content + text[end:]
    return text, applied


@dataclass
class FixOutcome:
    text: str
    fixed: int = 0
    dropped: list[str] = field(default_factory=list)


def fix_text(text: str, lint: Callable[[str], list[Finding]], unsafe: bool) -> FixOutcome:
    """Lint, apply applicable fixes, re-parse; repeat until nothing changes (bounded)."""
    outcome = FixOutcome(text)
    for _ in range(MAX_ROUNDS):
        findings = [f for f in lint(outcome.text) if applicable(f, unsafe)]
        if not findings:
            break
        new_text, applied = apply_edits(outcome.text, [f.fix.edits for f in findings if f.fix])
        if applied == 0 or new_text == outcome.text:
            break
        try:
            cst.parse_module(new_text)
        except (cst.ParserSyntaxError, cst.CSTValidationError, RecursionError, MemoryError):
            outcome.dropped.append(
                "fixes for "
                + ", ".join(sorted({f.rule for f in findings}))
                + " would leave the file unparsable"
            )
            break
        outcome.text = new_text
        outcome.fixed += applied
    return outcome


def unified_diff(path: str, before: str, after: str) -> str:
    return "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True), after.splitlines(keepends=True), f"a/{path}", f"b/{path}"
        )
    )


def encode_like(original: bytes, text: str) -> bytes:
    """Encode ``text`` with the original file's declared encoding and BOM."""
    encoding, _ = tokenize.detect_encoding(io.BytesIO(original).readline)
    if encoding == "utf-8-sig":
        return b"\xef\xbb\xbf" + text.encode("utf-8")
    return text.encode(encoding)


def write_fixed(path: Path, linted: str, text: str) -> str | None:
    """Replace the file's text ``linted`` by ``text``, atomically; returns why not, or None.

    The file is read again first: if it no longer holds what was linted (the user saved meanwhile)
    nothing is written. The new bytes go to a temporary file in the same folder with the same mode,
    are flushed to disk and renamed over the file: a full disk or a kill at any moment leaves either
    the old file or the new one, never half of one. A link is written through to its target (the
    target is inside the linted folders: discovery skips links that leave them)."""
    real = os.path.realpath(path)
    try:
        info = os.stat(real)
        current = read_source(Path(real)).text
        if current is None or not stat.S_ISREG(info.st_mode):
            return "the file can no longer be read"
        if current != linted:
            return "the file changed since it was linted"
        if not os.access(real, os.W_OK):
            return "cannot write the file: permission denied"
        with open(real, "rb") as handle:
            data = encode_like(handle.read(), text)
        _replace(real, data, stat.S_IMODE(info.st_mode))
    except (OSError, UnicodeEncodeError, SyntaxError, LookupError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        return f"cannot write the file: {reason.lower()}"
    return None


def _replace(real: str, data: bytes, mode: int) -> None:
    folder, name = os.path.split(real)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".trainlint-tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a power cut
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
