"""What decides, before any parse by libcst, which rules a file needs: the prefilter (substrings and calls
in the raw text) and the gate (the rules' trigger names as code, and used the way their findings need
them, in CPython's ``ast`` of the file: ``Rule.gate``, ``Rule.project_gate``).

Both read each rule's prefilter data from ``gates_data.py``, generated from the rule classes, so that a
file no rule can fire on is linted without importing libcst or any rule module. Regenerate it after
changing a rule's ``tokens``, ``requires``, ``project_requires``, ``gate``, ``project_gate`` or
``excludes``::

    python -m trainlint.gates

tests/test_gates.py fails while it is out of date.
"""

from __future__ import annotations

import ast
import functools
import keyword
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainlint.rule import Call, CalledWord, Group, Imports, cheapest_first, group_matches, passes

if TYPE_CHECKING:
    from trainlint.rule import Rule

DATA = Path(__file__).with_name("gates_data.py")
_IMPORTED = "\x01"  # marks the line of an imported module's top-level name in ``code_text``
_CALL = "\x02"  # marks a called name (the callee's last name: ``f`` of ``f(x)`` and of ``x.f()``)
_REF = "\x03"  # marks each part of an imported name, and an attribute read on anything but ``self``
_DEF = "\x04"  # marks the name of a function or method defined (``def``, ``async def``)
_LOOP = "\x05"  # marks a name called in a ``for``/``while`` statement, and ``+=`` for a total added to there
_IF = "\x06"  # marks a name called in an ``if`` statement
# marks ``self`` used on its own, not as the receiver of ``self.x``: passed to a call (``f(self)``),
# assigned or assigned to, returned... the ways a module ``self`` holds may reach or come out of a call
_BARE = "\x08"
# marks a name bound under another one: imported ``as`` another, or assigned to a plain name (``f = x.name``),
# the ways a call's qualified name can end with a name the callee does not (``FileModel.qualname``)
_ALIAS = "\x07"
_ATOM_MARKS = {
    "call": _CALL,
    "ref": _REF,
    "alias": _ALIAS,
    "import": _IMPORTED,
    "loop": _LOOP,
    "if": _IF,
    "def": _DEF,
    "bare": _BARE,
    "name": "",
}
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# ``KIND~PATTERN``: a pattern searched in the names of one kind (see ``Rule.gate``). Only what stays
# inside one name: words, groups, alternatives, lookaheads, ``\w``, ``*``/``+``/``?`` and ``^`` (the
# start of the name); ``(?i:...)`` ignores case.
_NAME_PATTERN = re.compile(r"\^?(?:[\w|()?!:*+]|\\w)+")
_PATTERN = "~"  # starts the stored line of a pattern atom (a regular expression over ``code_text``)


@dataclass(frozen=True)
class Gate:
    """One rule's prefilter data: everything the engine asks of a rule before it needs the class."""

    id: str
    name: str
    severity: str
    engine_only: bool
    tokens: tuple[str, ...]
    requires: tuple[Group, ...]  # cheapest first
    project_requires: tuple[Group, ...]
    project_callers: bool
    # groups of names one of which must occur as code (an identifier, an attribute, an imported name, a
    # keyword argument, a string that is not a docstring) for a finding of this file's own code
    code_names: tuple[tuple[str, ...], ...]
    excludes: tuple[str, ...] = ()
    # groups of code lines one of which must occur for a cross-file finding (``Rule.project_gate``)
    project_code: tuple[tuple[str, ...], ...] = ()
    # ``Rule.gate_check``: a condition on the whole tree, asked once the names are in the code
    check: str = ""
    # ``Rule.project_gate_check``: the same for the rule's cross-file findings
    project_check: str = ""
    # ``Rule.project_callees``: the callees (qualified names) a cross-file finding may rest on
    project_callees: str = ""

    def can_fire(self, text: str) -> bool:
        return passes(self.tokens, list(self.requires), text) and not any(w in text for w in self.excludes)

    def can_fire_in_project(self, text: str) -> bool:
        if not self.project_requires or any(word in text for word in self.excludes):
            return False
        return all(group_matches(g, text) for g in self.project_requires)

    def in_code(self, code: str) -> bool:
        """Whether every name group occurs in ``code`` (``code_text`` of the file's tree)."""
        return all(any(occurs(name, code) for name in group) for group in self.code_names)

    def in_project_code(self, code: str) -> bool:
        """Whether the file's code (``code_text``) allows one of the rule's cross-file findings."""
        return all(any(occurs(line, code) for line in group) for group in self.project_code)


def occurs(line: str, code: str) -> bool:
    """Whether a line of the gate's data (``code_atom``, a name of ``code_names``) is in ``code``."""
    return line in code or (line[:1] == _PATTERN and re.search(line[1:], code) is not None)


# -- the generated data --------------------------------------------------------------------------------


def _encode(group: Group) -> tuple[Any, ...]:
    if isinstance(group, tuple):
        return ("any", group)
    if isinstance(group, Call):
        return ("method" if group.method else "call", group.names, group.or_tokens)
    if isinstance(group, Imports):
        return ("import", group.modules)
    if isinstance(group, CalledWord):
        return ("word", group.part, group.unless)
    return ("re", group.pattern, int(group.flags))


def _decode(data: tuple[Any, ...]) -> Group:
    kind = data[0]
    if kind == "any":
        return tuple(data[1])
    if kind in ("call", "method"):
        return Call(tuple(data[1]), kind == "method", tuple(data[2]))
    if kind == "import":
        return Imports(tuple(data[1]))
    if kind == "word":
        return CalledWord(data[1], tuple(data[2]))
    return re.compile(data[1], data[2])


def _names(group: Group) -> tuple[str, ...] | None:
    """The names of a group that must occur as code, or None when the group is not made of names (an
    operator, a pattern, text with punctuation, a keyword such as ``True`` that ``ast`` keeps as a
    value)."""
    if isinstance(group, Imports):  # a condition on the code by definition, whatever the rule reads
        return tuple(f"\n{_IMPORTED}{module}\n" for module in group.modules)
    if isinstance(group, Call):
        words: tuple[str, ...] = group.names + group.or_tokens
    elif isinstance(group, tuple):
        words = group
    else:
        return None
    if any(w in _TEXT_WORDS for w in words):
        return None
    if all(_WORD.fullmatch(w) and not keyword.iskeyword(w) and not keyword.issoftkeyword(w) for w in words):
        return words
    return None


# Rules may read the raw text, comments included (``"fsdp" in model.source``): a word they look for there
# can make a finding possible from a comment, so a group is a condition on the code only where no rule
# reads the text. ``_TEXT_WORDS`` are the words the file model itself looks for in the raw text
# (``TokenEvidence._configured_token_loss``: ``loss_fn.ignore_index``).
_READS_TEXT = re.compile(r"\.(?:source|lines)\b|\btext_mentions\(")
_TEXT_WORDS = frozenset({"ignore_index"})


def _reads_text(rule: type[Rule]) -> bool:
    """Whether the rule's module, or a module of ``trainlint.rules`` it imports, reads the raw text."""
    module = sys.modules[rule.__module__]
    seen: set[str] = set()
    todo = [module.__name__]
    while todo:
        name = todo.pop()
        if name in seen or name not in sys.modules:
            continue
        seen.add(name)
        source = Path(sys.modules[name].__file__ or "").read_text(encoding="utf-8")
        if _READS_TEXT.search(source):
            return True
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainlint.rules"):
                todo.append(node.module or "")
    return False


def code_atom(atom: str) -> str:
    """The line of ``code_text`` that a rule's ``gate`` atom stands for (see ``Rule.gate``), or for
    ``KIND~PATTERN``, ``~`` and the regular expression that finds such a line."""
    kind, tilde, pattern = atom.partition("~")
    if tilde and kind in _ATOM_MARKS and kind not in ("name", "bare") and _NAME_PATTERN.fullmatch(pattern):
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"not a gate atom: {atom!r}: {exc}") from None
        start = "" if pattern.startswith("^") else r"\w*"
        return f"{_PATTERN}\n{re.escape(_ATOM_MARKS[kind])}{start}(?:{pattern.lstrip('^')})"
    kind, _, name = atom.partition(":")
    plain = _WORD.fullmatch(name) is not None and (kind != "bare" or name == "self")  # only ``self`` is bare
    if kind in _ATOM_MARKS and (plain or atom == "loop:+="):
        return f"\n{_ATOM_MARKS[kind]}{name}\n"
    raise ValueError(f"not a gate atom: {atom!r} (see Rule.gate)")


def record(rule: type[Rule]) -> tuple[Any, ...]:
    """One rule's line of the generated data."""
    imports = tuple(g for g in rule.requires if isinstance(g, Imports))
    groups = (rule.tokens, *imports) if _reads_text(rule) else (rule.tokens, *rule.requires)
    names = [n for n in map(_names, groups) if n is not None]
    names += [tuple(map(code_atom, group)) for group in rule.gate]
    code_names = tuple(dict.fromkeys(names)) if rule.tokens else ()
    for check in (rule.gate_check, rule.project_gate_check, rule.project_callees):
        tree_check(check)  # (raises for a name that is no check)
    return (
        rule.id,
        rule.name,
        rule.severity.value,
        rule.engine_only,
        rule.tokens,
        tuple(_encode(g) for g in cheapest_first(rule.requires)),
        tuple(_encode(g) for g in rule.project_requires),
        rule.project_callers,
        code_names,
        rule.excludes,
        tuple(tuple(map(code_atom, group)) for group in rule.project_gate),
        rule.gate_check,
        rule.project_gate_check,
        rule.project_callees,
    )


def render() -> str:
    """The text of ``gates_data.py`` for the rules as they are now."""
    from trainlint.rule import registry

    lines = [
        '"""Generated by ``python -m trainlint.gates`` from the rule classes: do not edit."""',
        "",
        "# (id, name, severity, engine_only, tokens, requires, project_requires, project_callers,",
        "#  code_names, excludes, project_code, check, project_check, project_callees); a group is (kind, ...): any (tokens), call/method (names, or_tokens), word (part, unless), re (pattern, flags)",
        "RULES = (",
    ]
    lines += [f"    {record(rule)!r}," for rule in registry()]
    lines += [")", ""]
    return "\n".join(lines)


class RawAnswers:
    """One text's answers to the rules' raw-text prefilters (``Gate.can_fire``,
    ``Gate.can_fire_in_project``), each asked at most once: bits by the rule's place in ``gates()``,
    one pair of masks (asked, passed) per kind of prefilter."""

    __slots__ = ("asked", "passed")

    def __init__(self) -> None:
        self.asked = [0, 0]
        self.passed = [0, 0]

    def can_fire(self, gate: Gate, text: str) -> bool:
        return self._answer(0, gate.id, gate.can_fire, text)

    def can_fire_in_project(self, gate: Gate, text: str) -> bool:
        return self._answer(1, gate.id, gate.can_fire_in_project, text)

    def _answer(self, kind: int, rule_id: str, ask: Callable[[str], bool], text: str) -> bool:
        bit = _bits()[rule_id]
        if not self.asked[kind] & bit:
            self.asked[kind] |= bit
            if ask(text):
                self.passed[kind] |= bit
        return bool(self.passed[kind] & bit)


# The answers of the texts asked last, by digest (not the texts: a cold run keys every file, asking the
# prefilters, before it lints one, which asks them again; a project prefilter such as TL204's pattern
# is tried at every word of a text).
_ANSWERS: dict[str, RawAnswers] = {}
_ANSWERS_KEPT = 16_384


def raw_answers(text: str) -> RawAnswers:
    """The prefilters' answers for ``text``: those already given for the same text, and room for more."""
    from trainlint.model.stamps import text_digest

    digest = text_digest(text)
    answers = _ANSWERS.get(digest)
    if answers is None:
        if len(_ANSWERS) >= _ANSWERS_KEPT:  # (a long editor session)
            _ANSWERS.clear()
        answers = _ANSWERS[digest] = RawAnswers()
    return answers


@functools.cache
def _bits() -> dict[str, int]:
    return {rid: 1 << place for place, rid in enumerate(gates())}


def selected_gates(rule_ids: tuple[str, ...]) -> list[Gate]:
    """The gates of the selected rules that the engine runs (not TL901/TL902), in selection order."""
    table = gates()
    return [g for g in (table.get(i.upper()) for i in rule_ids) if g is not None and not g.engine_only]


@functools.cache
def gates() -> dict[str, Gate]:
    """Every rule's gate, by id (upper case), in id order."""
    from trainlint.gates_data import RULES

    out = {}
    for rid, name, severity, engine_only, tokens, requires, project, callers, code_names, *code in RULES:
        out[rid] = Gate(
            rid,
            name,
            severity,
            engine_only,
            tokens,
            tuple(map(_decode, requires)),
            tuple(map(_decode, project)),
            callers,
            code_names,
            *code,
        )
    return out


def rule_ids() -> tuple[str, ...]:
    return tuple(sorted(gates()))


def tree_check(name: str) -> Callable[[ast.Module], bool] | None:
    """The function a rule's ``gate_check`` names (``"module.function"`` of ``trainlint.model``), or None
    for ``""``. Raises ValueError when it names none (when the data is made, not during a run)."""
    if not name:
        return None
    return _tree_check(name)


@functools.cache
def _tree_check(name: str) -> Callable[[ast.Module], bool]:
    import importlib

    module, _, function = name.rpartition(".")
    try:
        found = getattr(importlib.import_module(f"trainlint.model.{module}"), function)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"not a gate check: {name!r} ({exc})") from None
    if not callable(found):
        raise ValueError(f"not a gate check: {name!r} is not a function")
    return found


def pass_tree_checks(gates: list[Gate], tree: ast.Module, project: bool = False) -> list[Gate]:
    """``gates`` less the rules whose ``gate_check`` (``project``: ``project_gate_check``, for cross-file
    candidates) rules out the tree; a check two rules share is asked once."""
    answers: dict[str, bool] = {}
    kept = []
    for gate in gates:
        check = gate.project_check if project else gate.check
        if check:
            if check not in answers:
                answers[check] = _asked(check, tree)
            if not answers[check]:
                continue
        kept.append(gate)
    return kept


def names_as_written(code: str, text: str) -> bool:
    """Whether every identifier of ``code`` (``code_text`` of the text's tree) is spelled so in ``text``.
    CPython normalises identifiers (NFKC: a full-width letter is its ASCII one in its tree) where libcst
    keeps them as written, so a check that reads a name's absence (TL109's scaler) may only be asked
    where none was changed. Always true of an ASCII text."""
    if text.isascii():
        return True
    written = set(re.findall(r"\w+", text))
    return all(line in written for line in code.split("\n") if line.isidentifier())


def _asked(name: str, tree: ast.Module) -> bool:
    """A check's answer; True where it fails (a check only spares work: its bug must not hide the file
    from the rule, nor lose the other rules' findings on it)."""
    try:
        return bool(_tree_check(name)(tree))
    except Exception:
        return True


def callees_asked(name: str, tree: ast.Module) -> frozenset[str] | None:
    """The answer of a rule's ``project_callees`` function on the tree; None (any imported name may
    count) where it fails, for the same reason as ``_asked``."""
    try:
        return frozenset(_tree_check(name)(tree))  # type: ignore[arg-type]
    except Exception:
        return None


# -- names as code -------------------------------------------------------------------------------------
# The fields of ``ast`` nodes that hold a name as a plain string (``Name``, ``Constant`` are handled
# first: most nodes are one of those two).
_NAME_FIELDS: dict[type, tuple[str, ...]] = {
    ast.Attribute: ("attr",),
    ast.alias: ("name", "asname"),
    ast.keyword: ("arg",),
    ast.arg: ("arg",),
    ast.FunctionDef: ("name",),
    ast.AsyncFunctionDef: ("name",),
    ast.ClassDef: ("name",),
    ast.ImportFrom: ("module",),
    ast.Global: ("names",),
    ast.Nonlocal: ("names",),
    ast.ExceptHandler: ("name",),
    ast.MatchAs: ("name",),
    ast.MatchStar: ("name",),
    ast.MatchMapping: ("rest",),
    ast.MatchClass: ("kwd_attrs",),
}
for _kind in ("TypeVar", "ParamSpec", "TypeVarTuple"):  # Python 3.12's type parameters
    if hasattr(ast, _kind):
        _NAME_FIELDS[getattr(ast, _kind)] = ("name",)


@dataclass(frozen=True)
class CodeFacts:
    """What the gate and the nesting guard read from one walk of CPython's tree: ``text`` (see
    ``code_text``), and the deepest nesting counted as libcst nests it (``a and b and c`` is one
    ``BoolOp`` here but a chain there) with the line where it first occurs."""

    text: str
    depth: int
    depth_line: int


def code_text(tree: ast.AST) -> str:
    """Every name and string of the code, one a line, with each imported module's top-level name, each
    called name and each name that can start a reference to an imported object marked: what the gate
    looks for the rules' names in. Comments are not in a tree; docstrings (a string standing alone as a
    statement) are left out."""
    return code_facts(tree).text


def code_facts(tree: ast.AST) -> CodeFacts:
    """``code_text`` and the tree's depth in one walk (each walk of a tree costs about as much as
    CPython's parse of it). Iterative: never recurses."""
    out: list[str] = []
    add = out.append
    best, best_line = 0, 1
    # (node, depth, line of the nearest node that has one, _IN_LOOP | _IN_IF of the statements around)
    stack: list[tuple[Any, int, int, int]] = [(tree, 1, 1, 0)]
    pop, push = stack.pop, stack.append
    name_type, constant, attribute, call, expr = ast.Name, ast.Constant, ast.Attribute, ast.Call, ast.Expr
    node_type, bool_op, plain = ast.AST, ast.BoolOp, _PLAIN
    while stack:
        node, depth, line, around = pop()
        kind = type(node)
        line = getattr(node, "lineno", line)
        if kind is name_type:  # its ``ctx`` is one level below, without a line of its own
            add(node.id)
            if node.id == "self":  # not the receiver of ``self.x`` (never walked): passed, assigned...
                add(_BARE + "self")
            if depth + 1 > best:
                best, best_line = depth + 1, line
            continue
        if depth > best:
            best, best_line = depth, line
        if kind is constant:
            if type(node.value) is str:
                add(node.value)
            continue
        if kind is expr and type(node.value) is constant:  # a docstring: no names, one level below
            if depth + 1 > best:
                best, best_line = depth + 1, node.value.lineno
            continue
        if kind is attribute:
            value = node.value
            add(node.attr)
            if type(value) is name_type and value.id == "self":
                # ``self.x``: its ``self`` is not walked (not a bare ``self``); it is one level below, its
                # context one more
                add("self")
                if depth + 2 > best:
                    best, best_line = depth + 2, value.lineno
                continue
            add(_REF + node.attr)
            # the value alone: the context beside it (one level below) is never deeper than the value
            push((value, depth + 1, line, around))
            continue
        if kind is call:
            func = node.func
            called = func.id if type(func) is name_type else func.attr if type(func) is attribute else None
            if called is not None:
                add(_CALL + called)
                if around & _IN_LOOP:
                    add(_LOOP + called)
                if around & _IN_IF:
                    add(_IF + called)
        elif kind not in plain:
            around = _note(node, kind, around, out)
        below = depth + (max(len(node.values) - 1, 1) if kind is bool_op else 1)
        for field in node._fields:  # ``ast.iter_child_nodes``, without its generator's cost
            value = getattr(node, field, None)
            if type(value) is list:
                for child in value:
                    if isinstance(child, node_type):
                        push((child, below, line, around))
            elif isinstance(value, node_type):
                push((value, below, line, around))
    return CodeFacts("\n" + "\n".join(out) + "\n", best, best_line)


_IN_LOOP, _IN_IF = 1, 2
# The kinds of node ``_note`` has nothing to say about (most nodes: skipping the call is cheaper)
_PLAIN = frozenset(
    {ast.Load, ast.Store, ast.Del, ast.Subscript, ast.BinOp, ast.Compare, ast.Tuple, ast.List, ast.Return}
    | {ast.UnaryOp, ast.Dict, ast.Slice, ast.JoinedStr, ast.FormattedValue, ast.Starred, ast.Expr}
    | {ast.BoolOp, ast.IfExp, ast.Lambda, ast.comprehension, ast.ListComp, ast.GeneratorExp}
    | {ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Eq, ast.NotEq, ast.Not, ast.And, ast.Or, ast.USub}
)


def _note(node: Any, kind: type, around: int, out: list[str]) -> int:
    """Adds the lines of a node other than a name, a string, an attribute or a call to ``out``; returns
    the flags of the statements around its children."""
    if kind is ast.Import:
        for alias in node.names:
            out.append(_IMPORTED + alias.name.partition(".")[0])
            out += [_REF + part for part in alias.name.split(".")]
            if alias.asname:
                out.append(_ALIAS + alias.name.rpartition(".")[2])
    elif kind is ast.ImportFrom:
        if not node.level and node.module:
            out.append(_IMPORTED + node.module.partition(".")[0])
        out += [_REF + alias.name for alias in node.names]
        out += [_ALIAS + alias.name for alias in node.names if alias.asname]
    elif kind is ast.For or kind is ast.While or kind is ast.AsyncFor:
        around |= _IN_LOOP
    elif kind is ast.If:
        around |= _IN_IF
    elif kind is ast.FunctionDef or kind is ast.AsyncFunctionDef:
        out.append(_DEF + node.name)
    else:
        if kind is ast.Assign or kind is ast.AnnAssign or kind is ast.NamedExpr:
            value = node.value
            if type(value) is ast.Name:
                out.append(_ALIAS + value.id)
            elif type(value) is ast.Attribute:
                out.append(_ALIAS + value.attr)
        if around & _IN_LOOP and _adds_to_a_total(node, kind):
            out.append(_LOOP + "+=")
    for field in _NAME_FIELDS.get(kind, ()):
        value = getattr(node, field, None)
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, list):
            out.extend(value)
    return around


def _adds_to_a_total(node: Any, kind: type) -> bool:
    """``t += x``, or ``t = t + x``/``t = x + t`` (a name, or any attribute or subscript target)."""
    if kind is ast.AugAssign:
        return type(node.op) is ast.Add
    if kind is not ast.Assign or len(node.targets) != 1:
        return False
    value, target = node.value, node.targets[0]
    if type(value) is not ast.BinOp or type(value.op) is not ast.Add:
        return False
    if type(target) is not ast.Name:
        return type(target) in (ast.Attribute, ast.Subscript)
    return any(type(side) is ast.Name and side.id == target.id for side in (value.left, value.right))


def main() -> int:
    import subprocess

    DATA.write_text(render(), encoding="utf-8")
    # formatted as the project's code is (the test compares the data, not the text)
    subprocess.run([sys.executable, "-m", "ruff", "format", "--quiet", str(DATA)], check=False)
    print(f"wrote {DATA}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
