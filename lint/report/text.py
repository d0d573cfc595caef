"""Human-readable output: each finding with a code frame, then a one-line summary (rich)."""

from __future__ import annotations

from collections import Counter

from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape as escape_markup

from trainlint.model.text import split_lines
from trainlint.report import RunReport, describe_verify
from trainlint.report.escape import escape_controls
from trainlint.rule import Applicability, Finding, Severity

# The one place that maps severities to colours.
STYLES = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}
CONTEXT_LINES = 2


def escape(text: str) -> str:
    """Text of the linted files as rich prints it: no markup, no control characters."""
    return escape_markup(escape_controls(text))


def _frame(finding: Finding, source: str | None) -> list[str]:
    if source is None:
        return []
    if finding.cell is not None:  # a notebook: the source is its JSON, the lines count within a cell
        lines = _cell_lines(source, finding.cell)
    else:
        lines = [line.rstrip("\r\n") for line in split_lines(source, keepends=True)]
    if not 1 <= finding.line <= len(lines):
        return []
    first = max(1, finding.line - CONTEXT_LINES)
    last = min(len(lines), finding.line + (1 if finding.end_line == finding.line else 0))
    width = len(str(last))
    out = []
    for number in range(first, last + 1):
        text = lines[number - 1].expandtabs(4) if "\t" in lines[number - 1] else lines[number - 1]
        marker = ">" if number == finding.line else " "
        out.append(f"[dim]{marker} {number:>{width}} │[/dim] {escape(text)}")
        if number == finding.line:
            # columns count code points; the terminal counts cells (a CJK character takes two, a tab
            # was expanded above)
            raw = lines[number - 1]
            start = finding.column - 1
            end = finding.end_column - 1 if finding.end_line == finding.line else len(raw)
            before = cell_len(raw[:start].expandtabs(4))
            caret = " " * before + "^" * max(1, cell_len(raw[:end].expandtabs(4)) - before)
            out.append(f"[dim]  {'':>{width}} │[/dim] [{STYLES[finding.severity]}]{caret}[/]")
    return out


def _cell(cell: int | None) -> str:
    """A notebook position names its cell first, as Ruff does: ``nb.ipynb:cell 3:2:5``."""
    return f"cell {cell}:" if cell is not None else ""


def _cell_lines(notebook_json: str, cell: int) -> list[str]:
    from trainlint.notebook import NotANotebook, read_notebook

    try:
        notebook = read_notebook(notebook_json)
    except NotANotebook:
        return []
    return notebook.cell_lines(cell) if 1 <= cell <= len(notebook.starts) else []


def fixable(finding: Finding, unsafe: bool) -> bool:
    if finding.fix is None:
        return False
    return unsafe or finding.fix.applicability in (Applicability.SAFE, Applicability.VERIFIED)


def render_text(
    report: RunReport, console: Console, *, quiet: bool = False, unsafe_fixes: bool = False
) -> None:
    for f in report.findings:
        style = STYLES[f.severity]
        mark = " [bold][*][/bold]" if fixable(f, unsafe_fixes) else ""
        console.print(
            f"[bold]{escape(f.path)}[/bold]:{_cell(f.cell)}{f.line}:{f.column}: [{style}]{f.rule}[/] "
            f"[{style}]\\[{f.severity.value}][/] {escape(f.message)}{mark}",
            highlight=False,
        )
        for line in _frame(f, report.sources.get(f.path)):
            console.print(line, highlight=False)
        for r in f.related:
            console.print(
                f"  [dim]note:[/dim] {escape(r.path)}:{_cell(r.cell)}{r.line}:{r.column}: {escape(r.message)}",
                highlight=False,
            )
        if f.verify:
            console.print(f"  [bold]verify:[/bold] {escape(describe_verify(f.verify))}", highlight=False)
        console.print()
    if quiet:
        return
    console.print(summary_line(report, unsafe_fixes=unsafe_fixes), highlight=False)


def summary_line(report: RunReport, *, unsafe_fixes: bool = False) -> str:
    n = len(report.findings)
    if n == 0 and report.errors:
        text = f"No findings ({report.checked()}), but some checks could not run."
    elif n == 0:
        text = f"[green]All checks passed![/green] ({report.checked()})"
    else:
        counts = Counter(f.severity for f in report.findings)
        parts = [
            f"{counts[s]} {s.value}{'s' if counts[s] != 1 and s != Severity.INFO else ''}"
            for s in Severity
            if counts[s]
        ]
        with_findings = len({f.path for f in report.findings})
        text = (
            f"Found {n} finding{'s' if n != 1 else ''} ({', '.join(parts)}) in {with_findings} "
            f"file{'s' if with_findings != 1 else ''} ({report.checked()})."
        )
        safe = sum(1 for f in report.findings if fixable(f, False))
        unsafe = sum(1 for f in report.findings if fixable(f, True)) - safe
        if safe or (unsafe and unsafe_fixes):
            text += (
                f"\n[bold][*][/bold] {safe + (unsafe if unsafe_fixes else 0)} fixable with `trainlint --fix`."
            )
        if unsafe and not unsafe_fixes:
            text += (
                f"\n{unsafe} hidden fix{'es' if unsafe != 1 else ''} can be enabled with `--unsafe-fixes`."
            )
    if report.fixed:
        text = f"Fixed {report.fixed} finding{'s' if report.fixed != 1 else ''}.\n" + text
    if report.errors:
        text += f"\n[red]{len(report.errors)} error{'s' if len(report.errors) != 1 else ''} while linting (see above).[/red]"
    return text


def render_statistics(report: RunReport, console: Console) -> None:
    counts = Counter(f.rule for f in report.findings)
    for rule_id, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        of_rule = [f for f in report.findings if f.rule == rule_id]
        fix = "[*]" if any(fixable(f, False) for f in of_rule) else "[ ]"
        # plain print: rich would expand the tabs that scripts split on
        print(f"{count:>5}\t{rule_id}\t{fix} {of_rule[0].name}", file=console.file)
