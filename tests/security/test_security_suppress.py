"""Suppressions come from comments only: text that looks like one inside a string or a docstring of
a pull request must not silence a finding."""

from __future__ import annotations

import textwrap

from trainlint.engine import lint_source

CALL = "y = checkpoint(f, x)"


def rules(code: str) -> list[str]:
    return [f.rule for f in lint_source(textwrap.dedent(code), "train.py", ["TL201"])]


def test_noqa_inside_a_string_on_the_flagged_line_suppresses_nothing() -> None:
    code = f"""\
        from torch.utils.checkpoint import checkpoint
        {CALL}; note = "# noqa"
        """
    assert rules(code) == ["TL201"]
    assert rules(code.replace('; note = "# noqa"', "  # noqa")) == []  # a real comment still works


def test_noqa_with_codes_inside_a_string_suppresses_nothing() -> None:
    assert rules(f'from torch.utils.checkpoint import checkpoint\n{CALL}; s = "x  # noqa: TL201"\n') == [
        "TL201"
    ]


def test_disable_file_on_a_docstring_line_suppresses_nothing() -> None:
    code = f'''\
        """Training helpers.
        # trainlint: disable-file=TL
        """
        from torch.utils.checkpoint import checkpoint
        {CALL}
        '''
    assert rules(code) == ["TL201"]
    comment = code.replace('"""Training helpers.\n', "").replace('\n"""\n', "\n", 1)
    assert rules(comment) == []  # the same line as a comment disables the file


def test_disable_file_after_code_on_a_line_is_not_a_file_directive() -> None:
    code = f"from torch.utils.checkpoint import checkpoint\nx = 1  # trainlint: disable-file=TL\n{CALL}\n"
    assert rules(code) == ["TL201"]
