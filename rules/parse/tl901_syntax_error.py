"""TL901 syntax-error."""

from trainlint.api import Rule, RuleDoc, Severity


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
