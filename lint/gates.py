"""What decides, before any parse by libcst, which rules a file needs: the prefilter (substrings and calls
in the raw text) and the gate (the rules' trigger names as code, in CPython's ``ast`` of the file).

Both read each rule's prefilter data from ``gates_data.py``, generated from the rule classes, so that a
file no rule can fire on is linted without importing libcst or any rule module. Regenerate it after
changing a rule's ``tokens``, ``requires`` or ``project_requires``::

    python -m trainlint.gates

tests/test_gates.py fails while it is out of date.
"""

from __future__ import annotations

import ast
import functools
import keyword
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainlint.rule import Call, Group, Imports, cheapest_first, group_matches, passes

if TYPE_CHECKING:
    from trainlint.rule import Rule

DATA = Path(__file__).with_name("gates_data.py")
_IMPORTED = "\x01"  # marks the line of an imported module's top-level name in ``code_text``
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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

    def can_fire(self, text: str) -> bool:
        return passes(self.tokens, list(self.requires), text)

    def can_fire_in_project(self, text: str) -> bool:
        return bool(self.project_requires) and all(group_matches(g, text) for g in self.project_requires)

    def in_code(self, code: str) -> bool:
        """Whether every name group occurs in ``code`` (``code_text`` of the file's tree)."""
        return all(any(name in code for name in group) for group in self.code_names)


# -- the generated data --------------------------------------------------------------------------------


def _encode(group: Group) -> tuple[Any, ...]:
    if isinstance(group, tuple):
        return ("any", group)
    if isinstance(group, Call):
        return ("method" if group.method else "call", group.names, group.or_tokens)
    if isinstance(group, Imports):
        return ("import", group.modules)
    return ("re", group.pattern, int(group.flags))


def _decode(data: tuple[Any, ...]) -> Group:
    kind = data[0]
    if kind == "any":
        return tuple(data[1])
    if kind in ("call", "method"):
        return Call(tuple(data[1]), kind == "method", tuple(data[2]))
    if kind == "import":
        return Imports(tuple(data[1]))
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


def record(rule: type[Rule]) -> tuple[Any, ...]:
    """One rule's line of the generated data."""
    imports = tuple(g for g in rule.requires if isinstance(g, Imports))
    groups = (rule.tokens, *imports) if _reads_text(rule) else (rule.tokens, *rule.requires)
    code_names = tuple(dict.fromkeys(n for n in map(_names, groups) if n is not None)) if rule.tokens else ()
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
    )


def render() -> str:
    """The text of ``gates_data.py`` for the rules as they are now."""
    from trainlint.rule import registry

    lines = [
        '"""Generated by ``python -m trainlint.gates`` from the rule classes: do not edit."""',
        "",
        "# (id, name, severity, engine_only, tokens, requires, project_requires, project_callers,",
        "#  code_names); a group is (kind, ...): any (tokens), call/method (names, or_tokens), re (pattern, flags)",
        "RULES = (",
    ]
    lines += [f"    {record(rule)!r}," for rule in registry()]
    lines += [")", ""]
    return "\n".join(lines)


@functools.cache
def gates() -> dict[str, Gate]:
    """Every rule's gate, by id (upper case), in id order."""
    from trainlint.gates_data import RULES

    out = {}
    for rid, name, severity, engine_only, tokens, requires, project, callers, code_names in RULES:
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
        )
    return out


def rule_ids() -> tuple[str, ...]:
    return tuple(sorted(gates()))


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


def code_text(tree: ast.AST) -> str:
    """Every name and string of the code, one a line, and each imported module's top-level name
    marked: what the gate looks for the rules' names in. Comments are not in a tree; docstrings (a
    string standing alone as a statement) are left out."""
    out: list[str] = []
    add = out.append
    stack: list[Any] = [tree]
    pop, push, extend = stack.pop, stack.append, stack.extend
    name_type, constant, expr, node_type = ast.Name, ast.Constant, ast.Expr, ast.AST
    while stack:
        node = pop()
        kind = type(node)
        if kind is name_type:
            add(node.id)
            continue
        if kind is constant:
            if type(node.value) is str:
                add(node.value)
            continue
        if kind is expr and type(node.value) is constant:
            continue
        if kind is ast.Import:
            out += [_IMPORTED + alias.name.partition(".")[0] for alias in node.names]
        elif kind is ast.ImportFrom and not node.level and node.module:
            add(_IMPORTED + node.module.partition(".")[0])
        for field in _NAME_FIELDS.get(kind, ()):
            value = getattr(node, field, None)
            if isinstance(value, str):
                add(value)
            elif isinstance(value, list):
                out.extend(value)
        for field in node._fields:
            value = getattr(node, field, None)
            if type(value) is list:
                extend(v for v in value if isinstance(v, node_type))
            elif isinstance(value, node_type):
                push(value)
    return "\n" + "\n".join(out) + "\n"


def main() -> int:
    import subprocess

    DATA.write_text(render(), encoding="utf-8")
    # formatted as the project's code is (the test compares the data, not the text)
    subprocess.run([sys.executable, "-m", "ruff", "format", "--quiet", str(DATA)], check=False)
    print(f"wrote {DATA}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
