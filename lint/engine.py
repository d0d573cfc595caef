"""The per-file pipeline: prefilter, parse, file model, rules, suppressions, findings.

One file's failure (unreadable, unparsable, a rule raising) becomes a finding or an entry in
``errors``; it never stops the other rules or files.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from trainlint import bounded
from trainlint.files import (
    _UNSAFE_FOR_AST,
    MAX_BRACKET_DEPTH,
    MAX_NESTING,
    MAX_SOURCE_BYTES,
    Nesting,
    scan_nesting,
    too_crowded,
    too_large,
)
from trainlint.gates import (
    CodeFacts,
    Gate,
    callees_asked,
    code_facts,
    gates,
    names_as_written,
    pass_tree_checks,
    raw_answers,
    selected_gates,
)
from trainlint.model.stamps import parsed_before, project_root, text_digest
from trainlint.results import FileResult, LintOptions, Problem, ProblemKind, internal_error
from trainlint.rule import (
    Diagnostic,
    Edit,
    Finding,
    Fix,
    Related,
    Rule,
    Severity,
    TextEditSpec,
    load_rule,
    registry,
)

if TYPE_CHECKING:  # libcst, the file model, the project index and the rules load only when a file needs them
    import libcst as cst

    from trainlint.model import FileModel
    from trainlint.model.project import Fact

# Names this module once imported at its top, still its attributes (``__getattr__``), and the module
# each loads from; its own functions import what they use where they use it.
_LAZY = {
    "FileModel": "trainlint.model",
    "Fact": "trainlint.model.project",
    "Project": "trainlint.model.project",
    "Summary": "trainlint.model.summary",
    "outline": "trainlint.model.summary",
    "one_line_code": "trainlint.report.escape",
    "parse_suppressions": "trainlint.suppress",
}


def __getattr__(name: str) -> Any:
    """``FileModel`` (and with it libcst) and the project index load on first use: a run whose files
    no rule needs (an editor's keystroke on most files) never loads them."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = globals()[name] = getattr(importlib.import_module(module), name)
    return value


def load_for_kept_verdicts() -> None:
    """libcst, the file model and the active rules of the verdicts the result cache's lookups kept
    (the files it will lint), loaded once: before workers are forked, each would load them again."""
    verdicts = list(_VERDICTS.values())
    if any(v.active or v.crossfile for v in verdicts):
        _file_model_class()
        for rule_id in sorted({g.id for v in verdicts for g in v.active}):
            _rule(rule_id)


def _file_model_class() -> type[FileModel]:
    return globals().get("FileModel") or __getattr__("FileModel")


def _engine_finding(rule_id: str, path: str, line: int, column: int, message: str) -> Finding:
    rule = gates()[rule_id]
    return Finding(
        rule=rule.id,
        name=rule.name,
        severity=Severity(rule.severity),
        path=path,
        line=line,
        column=column,
        end_line=line,
        end_column=column,
        message=message,
    )


def unreadable(path: str, reason: str) -> Finding:
    return _engine_finding("TL902", path, 1, 1, f"Cannot lint this file: {reason}.")


_CONFLICT_MARKER = re.compile(r"^(?:<{7}|={7}|>{7})(?: |$)", re.MULTILINE)


def _sentence(message: str) -> str:
    message = message.strip()
    return message if message.endswith((".", "?", "!")) else message + "."


def _cpython_parse(text: str) -> tuple[ast.Module | None, BaseException | None]:
    """CPython's verdict on the text: its tree, or the exception its parser raised."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.parse(text), None
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        return None, exc


def _too_deep(path: str, line: int, detail: str) -> Finding:
    return _engine_finding(
        "TL901",
        path,
        max(line, 1),
        1,
        f"Cannot parse this file: it is nested too deeply ({detail}); "
        "simplify the expression or exclude the file.",
    )


def _is_depth_error(exc: BaseException | None) -> bool:
    if isinstance(exc, (RecursionError, MemoryError)):
        return True
    return isinstance(exc, SyntaxError) and any(
        marker in str(exc.msg) for marker in ("too many nested", "too complex", "nested too deeply")
    )


def _syntax_error(
    path: str, text: str, exc: BaseException, cpython: BaseException | bool | None = False
) -> Finding:
    """TL901 for a file libcst rejected (``exc``), located where users expect it.

    ``cpython`` is CPython's own verdict when already known (``False``: not yet asked)."""
    marker = _CONFLICT_MARKER.search(text)
    if marker is not None:
        line = text.count("\n", 0, marker.start()) + 1
        return _engine_finding(
            "TL901",
            path,
            line,
            1,
            f"Cannot parse this file: it contains a merge-conflict marker at line {line}; "
            "resolve the conflict first.",
        )
    if cpython is False:
        cpython = _cpython_parse(text)[1]
    if _is_depth_error(cpython):
        line = getattr(cpython, "lineno", None) or 1
        return _too_deep(path, line, f"more than Python's parser allows, near line {line}")
    if isinstance(cpython, SyntaxError):
        # CPython's parser locates most errors where users expect them (libcst often points at the
        # token after) and explains them better ("Missing parentheses in call to 'print'").
        line, column = cpython.lineno or 1, cpython.offset or 1
        return _engine_finding(
            "TL901", path, max(line, 1), max(column, 1), "Cannot parse this file: " + _sentence(cpython.msg)
        )
    import libcst as cst

    if isinstance(exc, (cst.ParserSyntaxError, cst.CSTValidationError)):
        if isinstance(exc, cst.ParserSyntaxError):
            line, column, detail = exc.editor_line, exc.editor_column, exc.message.strip().rstrip(".")
        else:
            line, column, detail = 1, 1, str(exc).strip().rstrip(".")
        if cpython is None:  # Python accepts it; libcst (newer syntax, or a libcst limit) does not
            detail = f"libcst, the parser trainlint uses, rejects it although Python accepts it: {detail}"
        return _engine_finding(
            "TL901", path, max(line, 1), max(column, 1), f"Cannot parse this file: {detail}."
        )
    if isinstance(cpython, ValueError):  # e.g. NUL characters
        return _engine_finding("TL901", path, 1, 1, "Cannot parse this file: " + _sentence(str(cpython)))
    return _too_deep(path, 1, "beyond what the parser can handle")


def _tree_depth(tree: ast.AST) -> tuple[int, int]:
    """The deepest nesting in a CPython tree, counted as libcst nests it (``a and b and c`` is one
    ``BoolOp`` here but a chain there), with the line where it occurs. Iterative: never recurses."""
    best, best_line = 0, 1
    stack: list[tuple[ast.AST, int, int]] = [(tree, 1, 1)]
    pop, push, node_type = stack.pop, stack.append, ast.AST
    while stack:
        node, depth, line = pop()
        line = getattr(node, "lineno", line)
        if depth > best:
            best, best_line = depth, line
        step = len(node.values) - 1 if isinstance(node, ast.BoolOp) else 1
        below = depth + max(step, 1)
        for field in node._fields:  # ``ast.iter_child_nodes``, without its generator's cost
            value = getattr(node, field, None)
            if type(value) is list:
                for child in value:
                    if isinstance(child, node_type):
                        push((child, below, line))
            elif isinstance(value, node_type):
                push((value, below, line))
    return best, best_line


def _nesting_problem(path: str, text: str, nesting: Nesting) -> Finding | None:
    """TL901 when the file is nested too deeply to hand to libcst safely (see ``scan_nesting``)."""
    if nesting.brackets > MAX_BRACKET_DEPTH:
        return _too_deep(
            path,
            nesting.brackets_line,
            f"{nesting.brackets} levels of brackets at line {nesting.brackets_line}; "
            f"Python allows at most {MAX_BRACKET_DEPTH}",
        )
    if nesting.bound <= MAX_NESTING:
        return None
    # The cheap bound is exceeded (long formulas and tables can do that): measure precisely.
    if sys.version_info < (3, 11) and nesting.bound > _UNSAFE_FOR_AST:
        return _too_deep(path, nesting.bound_line, f"a chain of about {nesting.bound} operations")
    tree, cpython = _cpython_parse(text)
    if tree is None:
        if _is_depth_error(cpython):
            line = getattr(cpython, "lineno", None) or nesting.bound_line
            return _too_deep(path, line, f"more than Python's parser allows, near line {line}")
        # An ordinary syntax error: report it without letting libcst near the deep part.
        return _syntax_error(path, text, ValueError(), cpython)
    depth, line = _tree_depth(tree)
    if depth > MAX_NESTING:
        return _too_deep(path, line, f"{depth} levels at line {line}; trainlint analyses up to {MAX_NESTING}")
    return None


# libcst's parser and visitors, and the file model, recurse once per nesting level. Files within the
# limits above need more than the default 1000 Python frames and 8 MB stack, so they are analysed in a
# thread with a large stack and a raised recursion limit.
_STACK_BYTES = 256 * 1024 * 1024
_RECURSION_LIMIT = 50_000


def _with_headroom(work: Callable[[], FileResult]) -> FileResult:
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = work()
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    try:
        previous = threading.stack_size(_STACK_BYTES)
    except (ValueError, RuntimeError):  # pragma: no cover - platforms without a settable stack size
        return work()
    try:
        worker = threading.Thread(target=target, name="trainlint-lint", daemon=True)
    finally:
        threading.stack_size(previous)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, _RECURSION_LIMIT))
    try:
        worker.start()
        started = True
    except RuntimeError:  # pragma: no cover - no thread could be started (resource limits)
        started = False
    try:
        if started:
            worker.join()
    finally:
        sys.setrecursionlimit(limit)
    if not started:  # pragma: no cover
        return work()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _to_finding(
    model: FileModel, rule: type[Rule], diag: Diagnostic, severity: Severity, path: str
) -> Finding:
    from trainlint.report.escape import one_line_code  # (loaded with the first finding)

    where = model.position(diag.node)
    related = []
    for node, message, label in diag.labelled_related():
        pos = model.position(node)
        end = (pos.end.line, pos.end.column + 1)
        related.append(Related(path, pos.start.line, pos.start.column + 1, message, label, *end))
    related.extend(Related(*entry) for entry in diag.elsewhere)
    fix = None
    if diag.fix is not None:
        fix = Fix(
            diag.fix.applicability,
            diag.fix.description,
            tuple(_to_edit(model, spec) for spec in diag.fix.edits),
        )
    return Finding(
        rule=rule.id,
        name=rule.name,
        severity=severity,
        path=path,
        line=where.start.line,
        column=where.start.column + 1,
        end_line=where.end.line,
        end_column=where.end.column + 1,
        message=one_line_code(diag.message),
        related=tuple(related),
        fix=fix,
    )


def _to_edit(model: FileModel, spec: TextEditSpec) -> Edit:
    pos = model.position(spec.anchor)
    if spec.where == "delete_lines":
        # the whole physical lines the anchor spans, their line break included
        if pos.end.line < len(model.lines):
            return Edit(pos.start.line, 1, pos.end.line + 1, 1, spec.content)
        return Edit(pos.start.line, 1, pos.end.line, len(model.lines[-1]) + 1, spec.content)
    if spec.where == "before":
        start = end = pos.start
    elif spec.where == "after":
        start = end = pos.end
    else:
        start, end = pos.start, pos.end
    return Edit(start.line, start.column + 1, end.line, end.column + 1, spec.content)


def with_configured_severity(finding: Finding, options: LintOptions) -> Finding:
    """An engine-made finding (TL901/TL902) with the severity the configuration sets for its rule."""
    level = dict(options.severity).get(finding.rule)
    return dataclasses.replace(finding, severity=Severity(level)) if level else finding


def lint_text(text: str, path: str, options: LintOptions) -> FileResult:
    """Lint one file's decoded text, reported under ``path``. Never raises for any input text."""
    result = FileResult(path)

    def report(finding: Finding) -> FileResult:
        if finding.rule in options.rule_ids:
            result.findings.append(with_configured_severity(finding, options))
        return result

    problem = _text_problem(path, text)
    if problem is not None:
        return report(problem)
    digest = text_digest(text) if _VERDICTS or parsed_before() else ""
    verdict = _VERDICTS.pop((digest, options), None) if _VERDICTS else None
    if verdict is not None:  # the result cache's lookup ran the gate on this very text
        active, crossfile, tree, nesting, facts = verdict.active, verdict.crossfile, None, *verdict.depth
        callees = verdict.callees
    elif digest and _summarised_and_quiet(text, digest, options):
        return result  # CPython parsed it (the index's summary of it says so), no rule can run on it
    else:
        active, crossfile, tree, nesting, facts, callees = _code_gate(text, options, path)
    run = _rules_to_run(text, path, active, crossfile, callees, verdict.imports if verdict else None, tree)
    if tree is not None or verdict is not None:
        if not run:
            return result  # CPython parsed it: no syntax error to report, no rule to run
        problem = _depth_problem(path, tree, facts) if nesting is None else None
    else:
        problem = _nesting_problem(path, text, nesting or scan_nesting(text))
    if problem is not None:
        return report(problem)
    if len(text) > ISOLATED_BYTES and bounded.available():
        return _lint_isolated(text, path, options, run, result)
    return _with_headroom(lambda: _lint_parsed(text, path, options, run, result))


# A cross-file candidate's callees (``Rule.project_callees``) by rule id: None where any import may count
Callees = dict[str, "frozenset[str] | None"]


@dataclasses.dataclass(frozen=True)
class _Verdict:
    """The gate's answer on a text CPython parsed: what ``lint_text`` computes before it asks the
    project, with what it needs of the tree after (its depth, or the nesting scan that bounded it)."""

    active: list[Gate]
    crossfile: list[Gate]
    depth: tuple[Nesting | None, CodeFacts | None]
    imports: list[str] | None  # the text's import targets (``import_targets_of``), where the project is asked
    callees: Callees


# Verdicts of the gate the result cache asked for (``outcome_needs_no_project``), by text digest and
# options, each taken by the lint of the same text: a run looks every file up before it lints any, so
# a text is parsed once, not twice. Kept small (no tree: the lint parses again where it needs one).
_VERDICTS: dict[tuple[str, LintOptions], _Verdict] = {}
_VERDICTS_KEPT = 8192


def _summarised_and_quiet(text: str, digest: str, options: LintOptions) -> bool:
    """Whether no rule's prefilter passes on the text and the project index summarised it (so CPython
    parsed it): its outcome is no finding, known without parsing it again. From Python 3.11 (3.10's
    parser must be guarded by the nesting scan first, which the index's parse is not)."""
    if not options.prefilter or sys.version_info < (3, 11) or not parsed_before(digest):
        return False
    from trainlint.cache import may_run_rules  # (the result cache's own first question)

    return not may_run_rules(text, options)


def _code_gate(
    text: str, options: LintOptions, path: str | None = None
) -> tuple[list[Gate], list[Gate], ast.Module | None, Nesting | None, CodeFacts | None, Callees]:
    """The rules that may fire on the text (``active``) and the cross-file candidates (not active,
    their project prefilter passed, not ruled out by the code; none for a ``path`` outside any
    project), with CPython's tree of the text (None where it rejects it or the prefilter is off), the
    nesting scan where made, the code's facts and the candidates' callees."""
    rules = selected_gates(options.rule_ids)
    if not options.prefilter:
        return rules, [], None, None, None, {}
    answers = raw_answers(text)  # (those the result cache's key asked already are not asked again)
    active = [g for g in rules if answers.can_fire(g, text)]
    tree, nesting = _cpython_tree(text)
    facts = None
    if tree is not None and active:
        # CPython's tree is 12x cheaper than libcst's: a rule whose names are only in comments and
        # docstrings, or not used the way its findings need them, cannot fire, and the file is not
        # handed to libcst for it. The same walk measures the depth for the nesting guard.
        facts = code_facts(tree)
        active = [g for g in active if g.in_code(facts.text)]
        if any(g.check for g in active) and names_as_written(facts.text, text):  # (``Rule.gate_check``)
            active = pass_tree_checks(active, tree)
    # asked once per file: a project prefilter such as TL204's pattern is tried at every word of the text
    crossfile = [g for g in rules if g not in active and answers.can_fire_in_project(g, text)]
    if crossfile and path is not None and project_root(path) is None:
        crossfile = []  # no other file's facts to rest on (``Project.for_file``): its checks would be wasted
    callees: Callees = {}
    if tree is not None:
        crossfile, facts, callees = _project_candidates(tree, facts, crossfile, text)
        _forget_walked_trees()
    return active, crossfile, tree, nesting, facts, callees


def _forget_walked_trees() -> None:
    """Let the gate checks' walks drop the file's tree (``pyast.forget_trees``). Their memos live in
    ``pyast``, loaded with the first check: a run that asked none holds no tree, and a rejected file
    (an editor's stdin) loads no module of the model for it."""
    pyast = sys.modules.get("trainlint.model.pyast")
    if pyast is not None:
        pyast.forget_trees()


def outcome_needs_no_project(text: str, options: LintOptions) -> bool:
    """Whether ``lint_text`` proves, from the text and the options alone, that no rule runs on the
    text and that it parses: its outcome is then no finding, whatever the rest of the project holds
    (the result cache answers such a file without a key of its dependencies, and without a lint)."""
    if _text_problem("", text) is not None:
        return False
    active, crossfile, tree, nesting, facts, callees = _code_gate(text, options)
    if tree is None:
        return False
    if not active and not crossfile:
        return True
    while len(_VERDICTS) >= _VERDICTS_KEPT:  # (looked up, never linted: a run that stopped early)
        del _VERDICTS[next(iter(_VERDICTS))]
    if nesting is None:  # (the depth alone: the names' text is not needed after the gate)
        depth, line = (facts.depth, facts.depth_line) if facts is not None else _tree_depth(tree)
        facts = CodeFacts("", depth, line)
    imports = None
    if any(not g.project_callers for g in crossfile):
        from trainlint.model.index_imports import import_targets_of

        imports = import_targets_of(text, tree)
    _VERDICTS[(text_digest(text), options)] = _Verdict(active, crossfile, (nesting, facts), imports, callees)
    return False


def project_targets(text: str, options: LintOptions) -> list[str] | None:
    """Of the imports of a text the gate kept (``outcome_needs_no_project``), those its outcome can
    rest on when every rule left is a cross-file candidate with callees (``Rule.project_callees``):
    the imports reached through one of them. None where any import may count: an active rule (its
    check may look any imported name up), a candidate without callees or reported at its callers."""
    verdict = _VERDICTS.get((text_digest(text), options))
    if verdict is None or verdict.active or verdict.imports is None:
        return None
    names = _reaching(verdict.crossfile, verdict.callees)
    if names is None:
        return None
    from trainlint.model.pyast import reached_through  # (a file with candidates only)

    return [t for t in verdict.imports if reached_through(t, names)]


def no_rule_chosen(text: str, path: str, options: LintOptions) -> bool:
    """Whether, of the gate's verdict on the text (``outcome_needs_no_project``), the project index
    chooses no rule to run (``_rules_to_run``): its outcome is then no finding, and it is not linted."""
    verdict = _VERDICTS.get((text_digest(text), options))
    if verdict is None or verdict.active:
        return False
    chosen = _rules_to_run(text, path, [], verdict.crossfile, verdict.callees, verdict.imports)
    if not chosen:
        _VERDICTS.pop((text_digest(text), options), None)
    return not chosen


def _reaching(crossfile: list[Gate], callees: Callees) -> frozenset[str] | None:
    """The callees of every candidate together, where each has some (``Rule.project_callees``) and
    none is reported at its callers (``Rule.project_callers``); else None (any import may count)."""
    names: set[str] = set()
    for gate in crossfile:
        own = callees.get(gate.id)
        if gate.project_callers or own is None:
            return None
        names |= own
    return frozenset(names)


# Larger files are parsed by libcst in a child process allowed ``PARSE_MEMORY`` of address space beyond
# what it starts with: their parse can take gigabytes (torch's 1.4 MB common_methods_invocations.py
# peaks at about 780 MiB), and a failed allocation in libcst's native parser aborts the process. A file
# parsed in the linting process adds about 0.5 MiB per KB to its peak (torch's 245 KB common_modules.py:
# 128 MiB), on top of the project index a long run holds; below 128 KB a fork (50-90 ms from a 200 MiB
# process) costs more than it saves. Smaller files (99% of torch's files) never pay for the fork.
ISOLATED_BYTES = 128 * 1024
PARSE_MEMORY = 2 * 1024**3


def _project_candidates(
    tree: ast.Module, facts: CodeFacts | None, crossfile: list[Gate], text: str
) -> tuple[list[Gate], CodeFacts | None, Callees]:
    """``crossfile`` less the rules whose cross-file findings the file's code rules out
    (``Rule.project_gate``, ``Rule.project_gate_check``): the project index is not asked about them (its
    summaries of the imported modules cost as much as a parse each). With the walk of the tree, when it
    had to be made."""
    if any(g.project_code for g in crossfile):
        facts = facts or code_facts(tree)
        crossfile = [g for g in crossfile if not g.project_code or g.in_project_code(facts.text)]
    callees: Callees = {}
    if any(g.project_check or g.project_callees for g in crossfile):
        facts = facts or code_facts(tree)
        if names_as_written(facts.text, text):  # (else every candidate is kept, with any callee)
            crossfile = pass_tree_checks(crossfile, tree, project=True)
            callees = {g.id: callees_asked(g.project_callees, tree) for g in crossfile if g.project_callees}
    return crossfile, facts, callees


def _lint_isolated(
    text: str, path: str, options: LintOptions, run: list[type[Rule]], result: FileResult
) -> FileResult:
    outcome = bounded.run_bounded(
        lambda: _with_headroom(lambda: _lint_parsed(text, path, options, run, result, memory_errors=True)),
        PARSE_MEMORY + _STACK_BYTES,  # the analysing thread's stack is address space too
    )
    if outcome.value is not None:
        return outcome.value
    if "TL902" in options.rule_ids:
        reason = f"{outcome.failure}; exclude it or split it"
        result.findings.append(with_configured_severity(unreadable(path, reason), options))
    return result


def _text_problem(path: str, text: str) -> Finding | None:
    """TL902 for a text that is not Python source or would cost the parser too much."""
    if "\x00" in text:  # the same verdict for a file and for stdin
        return unreadable(path, "binary content (NUL bytes): not a Python source file")
    if len(text) > MAX_SOURCE_BYTES:
        return unreadable(path, too_large(len(text)))
    crowded = too_crowded(text)
    if crowded is not None:
        return unreadable(path, crowded)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # lone surrogates: undecodable bytes smuggled in (stdin)
            line = text.count("\n", 0, exc.start) + 1
            return unreadable(path, f"cannot decode: undecodable bytes on line {line}")
    return None


def _cpython_tree(text: str) -> tuple[ast.Module | None, Nesting | None]:
    """CPython's tree of the text (None where CPython rejects it: libcst then says why), and on Python
    3.10 the nesting scan that must come first (its parser can overflow the C stack; 3.11+ raises)."""
    nesting = None
    if sys.version_info < (3, 11):
        nesting = scan_nesting(text)
        if _nesting_problem("", text, nesting) is not None:
            return None, nesting
    return _cpython_parse(text)[0], nesting


def _depth_problem(path: str, tree: ast.Module | None, facts: CodeFacts | None = None) -> Finding | None:
    """TL901 when CPython's tree is nested deeper than libcst may be given (see ``scan_nesting``: the
    tree's depth is what its bound over-approximates; CPython itself refuses over 200 brackets).
    ``facts``: the gate's walk of the same tree, which measured it already (``tree`` may be None then)."""
    if facts is None:
        assert tree is not None
        depth, line = _tree_depth(tree)
    else:
        depth, line = facts.depth, facts.depth_line
    if depth > MAX_NESTING:
        return _too_deep(path, line, f"{depth} levels at line {line}; trainlint analyses up to {MAX_NESTING}")
    return None


def _rules_to_run(
    text: str,
    path: str,
    active: list[Gate],
    crossfile: list[Gate],
    callees: Callees | None = None,
    imports: list[str] | None = None,
    tree: ast.Module | None = None,
) -> list[type[Rule]]:
    """The rule classes to run on the file: the ``active`` ones, and those of the ``crossfile``
    candidates (not active, their project prefilter passed) whose cross-file findings the project index
    says are possible, through one of their ``callees`` (the gate's). Loads only those rules' modules.
    ``tree``: the gate's CPython tree of the text, which the index's summary of the file reuses;
    ``imports``: the text's import targets, where the gate kept them without the tree."""
    chosen = list(active)
    project = None
    if crossfile:
        from trainlint.model.project import Project

        project = Project.for_file(path)
    if project is not None:
        # findings that rest on another file's facts need less of this file's text; most need an
        # import of a definition with the right facts too (read with ``ast``: cheaper than libcst)
        imported = (
            project.imported_facts_by_target(text, tree, imports, _words_by_target(crossfile, callees or {}))
            if any(not g.project_callers for g in crossfile)
            else []
        )
        chosen += [
            g
            for g in crossfile
            if g.project_callers or _wants_any(_rule(g.id), imported, (callees or {}).get(g.id))
        ]
    return [_rule(g.id) for g in chosen]


def _wants_any(rule: type[Rule], imported: list[tuple[str, Fact]], callees: frozenset[str] | None) -> bool:
    """Whether an imported definition could take part in one of the rule's cross-file findings
    (``Rule.wants_fact``), reached through one of ``callees`` (``Rule.project_callees``, asked by the
    gate; None: through any import)."""
    from trainlint.model.pyast import reached_through  # (a file with candidates only)

    return any(
        rule.wants_fact(f.kind, f.facts) and (callees is None or reached_through(target, callees))
        for target, f in imported
    )


def _words_by_target(crossfile: list[Gate], callees: Callees) -> Callable[[str], tuple[str, ...] | None]:
    """Of an import target, the words one of which another file must hold for its definitions to take
    part in the cross-file findings of a candidate reached through it (``Rule.fact_words``; none
    where such a candidate has none); None where no candidate is (one reported at its callers asks
    for no imported fact)."""
    from trainlint.model.pyast import reached_through  # (a file with candidates only)

    asking = [(callees.get(g.id), _rule(g.id).fact_words) for g in crossfile if not g.project_callers]

    def words(target: str) -> tuple[str, ...] | None:
        found: set[str] = set()
        reached = False
        for names, own in asking:
            if names is None or reached_through(target, names):
                if not own:
                    return ()
                reached = True
                found.update(own)
        return tuple(sorted(found)) if reached else None

    return words


def _rule(rule_id: str) -> type[Rule]:
    rule = load_rule(rule_id)
    if rule is None:  # pragma: no cover - tests/test_gates.py holds the data to the registry
        raise LookupError(f"{rule_id}: in the prefilter data but not a rule (run python -m trainlint.gates)")
    return rule


def _lint_parsed(
    text: str,
    path: str,
    options: LintOptions,
    active: list[type[Rule]],
    result: FileResult,
    memory_errors: bool = False,
) -> FileResult:
    """``memory_errors``: let a failed allocation through (a bounded child reports it as such)."""
    import libcst as cst

    try:
        module = cst.parse_module(text)
    except (cst.ParserSyntaxError, cst.CSTValidationError, RecursionError, MemoryError) as exc:
        if memory_errors and isinstance(exc, MemoryError):
            raise
        # CSTValidationError: libcst's tokenizer accepted what its node checks reject (an identifier
        # with a character Python does not allow, found by the fuzz tests).
        if "TL901" in options.rule_ids:
            result.findings.append(with_configured_severity(_syntax_error(path, text, exc), options))
        return result
    except BaseException as exc:  # libcst's native parser panicking (PanicException is a BaseException)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        result.errors.append(internal_error(path, exc, "in the parser (libcst)"))
        return result
    result.parsed = True
    return _lint_module(module, text, path, options, active, result)


def lint_module(
    module: cst.Module,
    text: str,
    path: str,
    options: LintOptions,
    positions: Mapping[cst.CSTNode, Any] | None = None,
) -> FileResult:
    """Lint a module the caller has already parsed from ``text`` (an editor reusing unchanged
    statements, for one), with its nodes' positions when the caller knows them. Every selected rule
    runs: the prefilter only decides what to parse."""
    reg = registry()
    rules = [r for r in (reg.get(i) for i in options.rule_ids) if r is not None and not r.engine_only]
    result = FileResult(path)
    result.parsed = True
    return _with_headroom(lambda: _lint_module(module, text, path, options, rules, result, positions))


def _lint_module(
    module: cst.Module,
    text: str,
    path: str,
    options: LintOptions,
    active: list[type[Rule]],
    result: FileResult,
    positions: Mapping[cst.CSTNode, Any] | None = None,
) -> FileResult:
    if not active:
        return result
    try:
        model_class = _file_model_class()
        model = model_class(module, path, text, positions) if positions else model_class(module, path, text)
    except RecursionError:
        result.errors.append(
            Problem(ProblemKind.UNANALYSABLE, path, "file model: nested too deeply to analyse")
        )
        return result
    from trainlint.model.project import Project  # (loaded with the file model already, for its rules)

    model.project = Project.for_file(path)
    try:
        _run_rules(model, text, path, options, active, result)
    finally:
        model.release()
    result.findings.sort(key=lambda f: f.sort_key)
    return result


def _run_rules(
    model: FileModel, text: str, path: str, options: LintOptions, active: list[type[Rule]], result: FileResult
) -> None:
    from trainlint.suppress import parse_suppressions  # (a file no rule runs on needs none)

    severity = dict(options.severity)
    suppressions = parse_suppressions(text)
    for rule in active:
        try:
            found = [
                _to_finding(model, rule, diag, Severity(severity.get(rule.id, rule.severity)), path)
                for diag in rule().check(model)
            ]
        except Exception as exc:  # a rule's bug must not hide other rules' findings
            result.errors.append(internal_error(path, exc, f"in {rule.id}", rule=rule.id))
            continue
        seen: set[tuple[int, int, str]] = set()
        for finding in found:
            key = (finding.line, finding.column, finding.message)
            if key in seen or suppressions.suppresses(finding.rule, finding.line):
                continue
            seen.add(key)
            result.findings.append(finding)


def lint_source(text: str, path: str = "<string>", rule_ids: Sequence[str] | None = None) -> list[Finding]:
    """Convenience for tests and embedding: the findings of the given (or all) rules on a text."""
    ids = tuple(rule_ids) if rule_ids is not None else tuple(registry().ids())
    return lint_text(text, path, LintOptions(rule_ids=ids)).findings
