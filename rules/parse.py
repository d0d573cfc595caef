"""TL9xx: problems that stop a file from being linted at all (reported by the engine)."""

from trainlint.rule import Rule, RuleDoc, Severity


class SyntaxErrorRule(Rule):
    id = "TL901"
    name = "syntax-error"
    severity = Severity.ERROR
    summary = "The file does not parse, so no other rule could check it."
    engine_only = True
    doc = RuleDoc(
        what="Reports a file that the Python parser rejects, at the parser's line and column.",
        why=(
            "A file that does not parse cannot be analysed, so every other rule is silent on it. "
            "The rest of the run goes on: other files are still linted and reported."
        ),
        example="def train(:\n    pass",
        use_instead="def train():\n    pass",
    )


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
