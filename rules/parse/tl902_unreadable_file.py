"""TL902 unreadable-file."""

from trainlint.api import Rule, RuleDoc, Severity


class UnreadableFileRule(Rule):
    id = "TL902"
    name = "unreadable-file"
    severity = Severity.ERROR
    summary = "The file cannot be read or decoded as Python source."
    engine_only = True
    doc = RuleDoc(
        what=(
            "Reports a file that cannot be read (permissions, a vanished file) or decoded (binary "
            "content, NUL bytes, an unknown or wrong `# -*- coding: ... -*-` declaration)."
        ),
        why="trainlint cannot check what it cannot read; the file is reported so that it is not silently skipped.",
        example="# -*- coding: not-a-codec -*-\nx = 1",
        use_instead="# -*- coding: utf-8 -*-\nx = 1",
    )
