"""What makes text from the linted files safe to display: a file name, a message quoting code, a
line of a code frame can hold anything its author wrote, and a terminal or a CI log acts on control
characters (ANSI escape sequences move the cursor or hide text; a line starting with ``::`` is a
GitHub Actions workflow command, so a newline smuggled into a name can issue one).

Every displayed path, message and snippet goes through ``escape_controls`` (C0 and C1 controls, DEL,
and the bidirectional overrides that reorder what a reader sees, shown as backslash escapes); JSON
output keeps its data exact and escapes the same characters as ``\\uXXXX``. Messages quote at most
one line of code, truncated (``one_line_code``).
"""

from __future__ import annotations

import re

_CONTROLS = "\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"
CONTROL = re.compile(f"[{_CONTROLS}]")
_RAW_IN_JSON = re.compile("[\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")  # json escapes C0 itself
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
MAX_CODE_CHARS = 100
_QUOTED = re.compile(r"`([^`]*)`")


def _escaped(char: str) -> str:
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(text: str, keep: str = "") -> str:
    """``text`` with every control character (but those in ``keep``) as a visible backslash escape."""
    if not CONTROL.search(text):
        return text
    return CONTROL.sub(lambda m: m.group() if m.group() in keep else _escaped(m.group()), text)


def json_safe(dumped: str) -> str:
    """JSON text (``ensure_ascii=False``) with the controls JSON leaves raw (C1, DEL, bidi) escaped
    as ``\\uXXXX``: they can only occur inside strings, so the data is unchanged."""
    return _RAW_IN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", dumped)


def _shorten(match: re.Match[str]) -> str:
    code = match.group(1)
    lines = code.strip().splitlines() or [""]
    first = lines[0].rstrip()
    if len(lines) == 1 and len(first) <= MAX_CODE_CHARS:
        return match.group()
    return f"`{first[:MAX_CODE_CHARS].rstrip()}…`"


def one_line_code(message: str) -> str:
    """A message whose quoted code (between backticks) is one line of at most ``MAX_CODE_CHARS``
    characters: a crafted multi-line string in the flagged code never reaches the output whole."""
    if "`" not in message:
        return message
    return _QUOTED.sub(_shorten, message)
