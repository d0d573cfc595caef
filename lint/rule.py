"""Rule base class, findings and the registry that discovers rules in ``trainlint.rules``.

A rule knows nothing about files, formats or processes: it receives a file model and yields
``Diagnostic`` objects that point at CST nodes. The engine turns them into positioned ``Finding``s.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # only in annotations: a run answered from the cache never loads libcst
    import libcst as cst

    from trainlint.model import FileModel


class Severity(str, enum.Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def rank(self) -> int:
        return {"error": 0, "warning": 1, "info": 2}[self.value]


class Applicability(str, enum.Enum):
    SAFE = "safe"
    UNSAFE = "unsafe"
    VERIFIED = "verified"


@dataclass(frozen=True)
class Edit:
    """Replace the text between two 1-based positions (end exclusive) with ``content``."""

    line: int
    column: int
    end_line: int
    end_column: int
    content: str

    def to_json(self) -> dict[str, Any]:
        return {
            "line": self.line,
            "column": self.column,
            "end_line": self.end_line,
            "end_column": self.end_column,
            "content": self.content,
        }


@dataclass(frozen=True)
class Fix:
    applicability: Applicability
    description: str
    edits: tuple[Edit, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "applicability": self.applicability.value,
            "description": self.description,
            "edits": [e.to_json() for e in self.edits],
        }


@dataclass(frozen=True)
class Related:
    """A second location of a finding. ``label`` is the rule's name for the part the location plays
    (a class constant of the rule, e.g. ``UnscaleTwice.FIRST``): probes find it by that, never by the
    message's words."""

    path: str
    line: int
    column: int
    message: str
    label: str | None = None
    end_line: int | None = None  # exclusive end, as a finding's; None where only the start is known
    end_column: int | None = None
    cell: int | None = None  # in a notebook: the code cell (from 1) that ``line`` counts within

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "path": self.path,
            "line": self.line,
            "column": self.column,
            "end_line": self.end_line,
            "end_column": self.end_column,
            "message": self.message,
            "label": self.label,
        }
        if self.cell is not None:
            out["cell"] = self.cell
        return out


@dataclass(frozen=True)
class Finding:
    rule: str
    name: str
    severity: Severity
    path: str
    line: int
    column: int
    end_line: int
    end_column: int
    message: str
    related: tuple[Related, ...] = ()
    fix: Fix | None = None
    url: str | None = None
    verify: dict[str, Any] | None = None
    cell: int | None = None  # in a notebook: the code cell (from 1) that the lines count within

    @property
    def sort_key(self) -> tuple[str, int, int, int, str]:
        return (self.path, self.cell or 0, self.line, self.column, self.rule)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "rule": self.rule,
            "name": self.name,
            "severity": self.severity.value,
            "path": self.path,
            "line": self.line,
            "column": self.column,
            "end_line": self.end_line,
            "end_column": self.end_column,
            "message": self.message,
            "url": self.url,
            "related": [r.to_json() for r in self.related],
            "fix": self.fix.to_json() if self.fix else None,
        }
        if self.verify is not None:
            out["verify"] = self.verify
        if self.cell is not None:
            out["cell"] = self.cell
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Finding:
        fix = data.get("fix")
        return cls(
            rule=data["rule"],
            name=data["name"],
            severity=Severity(data["severity"]),
            path=data["path"],
            line=data["line"],
            column=data["column"],
            end_line=data["end_line"],
            end_column=data["end_column"],
            message=data["message"],
            related=tuple(Related(**r) for r in data.get("related", ())),
            fix=Fix(
                Applicability(fix["applicability"]),
                fix["description"],
                tuple(Edit(**e) for e in fix["edits"]),
            )
            if fix
            else None,
            url=data.get("url"),
            verify=data.get("verify"),
            cell=data.get("cell"),
        )


@dataclass(frozen=True)
class TextEditSpec:
    """A fix expressed against CST nodes; the engine converts node positions into an ``Edit``.

    ``anchor`` is a node; ``where`` is ``"before"`` (insert at the node's start), ``"after"``
    (insert at its end), ``"replace"`` (replace the node's whole range) or ``"delete_lines"`` (replace
    the whole physical lines the node spans, line breaks included, by ``content``).
    """

    anchor: cst.CSTNode
    where: str
    content: str


@dataclass(frozen=True)
class FixSpec:
    applicability: Applicability
    description: str
    edits: tuple[TextEditSpec, ...]


@dataclass(frozen=True)
class Diagnostic:
    """What a rule yields: a node to report at, a message, and optional related nodes and fix.

    Each related entry is ``(node, message)`` or ``(node, message, label)``; a label is a class constant
    of the rule that a probe asks for (``ctx.related(UnscaleTwice.FIRST)``)."""

    node: cst.CSTNode
    message: str
    related: tuple[tuple[cst.CSTNode, str] | tuple[cst.CSTNode, str, str], ...] = ()
    fix: FixSpec | None = None
    # related locations in other files of the project: (path, line, column, message, label)
    elsewhere: tuple[tuple[str, int, int, str, str | None], ...] = ()

    def labelled_related(self) -> Iterator[tuple[cst.CSTNode, str, str | None]]:
        """The related entries as ``(node, message, label)``, label None where the rule gave none."""
        for node, message, *label in self.related:
            yield node, message, label[0] if label else None


@dataclass(frozen=True)
class Invalid:
    """An embedded example that must be reported once. ``line`` (1-based), when given, is checked too.

    ``fix`` is the file after the rule's safe fix, written by hand (Fixit's ``expected_replacement``);
    ``unsafe_fix`` the same for a fix applied only with ``--unsafe-fixes``. A rule with ``has_fix``
    carries at least one of them, or its tests fail."""

    code: str
    line: int | None = None
    fix: str | None = None
    unsafe_fix: str | None = None


@dataclass(frozen=True)
class RuleDoc:
    """The sections of a rule's documentation, as in Ruff's rule pages."""

    what: str
    why: str
    example: str
    use_instead: str
    fix_safety: str = "This rule has no automatic fix."
    references: tuple[str, ...] = ()


# -- prefilter groups --------------------------------------------------------------------------------
# What may stand right after a called name, however the call is laid out: its `(`, the `)` of a
# parenthesised callee (``(x.f)(...)``), a comment or line continuation, a line break, or blanks then
# one of those. A single space followed by anything else is prose ("backward compatible").
_AFTER_CALLED = "()#\\\t\n\r\f"


@dataclass(frozen=True)
class Call:
    """A prefilter group: a call of a function or method whose name ends with one of ``names`` (with
    ``method``: ``x.name(...)``, the name right after a ``.`` or a blank), or one of ``or_tokens``
    anywhere. Found by looking for the name, then at the characters around it: 10-18x faster than the
    equivalent regular expression, which tries every position of the file."""

    names: tuple[str, ...]
    method: bool = False
    or_tokens: tuple[str, ...] = ()

    def found(self, text: str) -> bool:
        if any(token in text for token in self.or_tokens):
            return True
        return any(self._called(name, text) for name in self.names)

    def _called(self, name: str, text: str) -> bool:
        at = text.find(name)
        while at >= 0:
            end = at + len(name)
            before = text[at - 1] if at else ""
            # ``[.\s]`` before: ``str.isspace`` is exactly the regular expressions' ``\s``
            if not self.method or before == "." or before.isspace():
                after = text[end : end + 1]
                if after and after in _AFTER_CALLED:
                    return True
                if after == " ":
                    following = text[end + 1 : end + 2]
                    if following and following in _AFTER_CALLED + " ":
                        return True
            at = text.find(name, at + 1)
        return False


@dataclass(frozen=True)
class CalledWord:
    """A prefilter group: a call whose callee's last name contains ``part`` and does not start with one
    of ``unless``: what ``(?<!\\w)(?!save_|load_)\\w*checkpoint\\w*\\s*\\(`` finds, found from
    ``part`` outwards. That expression, which starts with no fixed text, is tried at every position of
    a file: 60x slower on real code (and every file is asked)."""

    part: str
    unless: tuple[str, ...] = ()

    def found(self, text: str) -> bool:
        for match in _called_part(self.part).finditer(text):
            start = match.start()
            while start and (text[start - 1].isalnum() or text[start - 1] == "_"):  # (exactly ``\w``)
                start -= 1
            if not text.startswith(self.unless, start):
                return True
        return False


@functools.lru_cache(maxsize=32)
def _called_part(part: str) -> re.Pattern[str]:
    """``part``, the rest of its word and a call's ``(``: a pattern starting with fixed text, which the
    regular expression engine looks for as fast as ``str.find``."""
    return re.compile(re.escape(part) + r"\w*\s*\(")


@dataclass(frozen=True)
class Imports:
    """A prefilter group: an import of one of ``modules`` (``import time``, ``import os, time``, ``from
    time import perf_counter``). The raw text needs the name after a blank or a comma; the gate, which
    reads CPython's tree, needs the import itself, so prose ("at the same time") does not count."""

    modules: tuple[str, ...]

    def found(self, text: str) -> bool:
        for name in self.modules:
            at = text.find(name)
            while at >= 0:
                if at and text[at - 1] in " \t\f\n\r,":
                    return True
                at = text.find(name, at + 1)
        return False


Group = tuple[str, ...] | re.Pattern[str] | Call | CalledWord | Imports


def group_matches(group: Group, text: str) -> bool:
    if isinstance(group, tuple):
        return any(token in text for token in group)
    if isinstance(group, Call | CalledWord | Imports):
        return group.found(text)
    return group.search(text) is not None


def called_word(part: str, unless: tuple[str, ...] = ()) -> CalledWord:
    """A prefilter group: a call whose callee's last name contains ``part`` (and does not start with
    one of ``unless``)."""
    return CalledWord(part, unless)


def imported(*modules: str) -> Imports:
    """A prefilter group: an import of one of these modules (a rule that resolves names through it)."""
    return Imports(modules)


def call_pattern(*names: str, or_tokens: tuple[str, ...] = ()) -> Call:
    """A prefilter group matching a call of a function or method whose name ends with one of these
    (or, when given, one of ``or_tokens`` anywhere)."""
    return Call(names, False, or_tokens)


def method_call_pattern(*names: str, or_tokens: tuple[str, ...] = ()) -> Call:
    """A prefilter group matching ``x.name(...)`` for one of these names, in any layout: the name follows
    the ``.`` or blanks after it (``x . name``, a continuation line). Or one of ``or_tokens`` anywhere."""
    return Call(names, True, or_tokens)


def cheapest_first(groups: tuple[Group, ...]) -> list[Group]:
    """The order to test groups in: plain substrings first (fewest first), calls and patterns last."""
    return sorted(groups, key=lambda g: (not isinstance(g, tuple), len(g) if isinstance(g, tuple) else 0))


def passes(tokens: tuple[str, ...], groups: list[Group], text: str) -> bool:
    """The prefilter's verdict: one of ``tokens`` and every group (in the order given) in ``text``."""
    return any(token in text for token in tokens) and all(group_matches(g, text) for g in groups)


_CHEAPEST_FIRST: dict[type, list[Group]] = {}


def example_text(block: str) -> str:
    """An example as a rule writes it (a triple-quoted block, indented like the code around it) as the
    file it stands for: dedented, without the line break after the opening quotes."""
    import textwrap  # (its patterns: examples are read for docs and tests, never by a lint)

    text = textwrap.dedent(block)
    return text[1:] if text.startswith("\n") else text


def _valid_files(examples: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(example_text(code) for code in examples)


def _invalid_files(examples: tuple[Invalid, ...]) -> tuple[Invalid, ...]:
    return tuple(
        dataclasses.replace(
            ex,
            code=example_text(ex.code),
            fix=None if ex.fix is None else example_text(ex.fix),
            unsafe_fix=None if ex.unsafe_fix is None else example_text(ex.unsafe_fix),
        )
        for ex in examples
    )


class _Examples:
    """A rule class's ``valid`` or ``invalid``: what the class wrote, converted on first read."""

    def __init__(self, written: Any, convert: Callable[[Any], Any]) -> None:
        self.written, self.convert, self.files = written, convert, None

    def __get__(self, instance: object, owner: type) -> Any:
        if self.files is None:
            self.files = self.convert(self.written)
        return self.files


class Rule:
    """Base class for every rule. Subclasses set the class variables and implement ``check``."""

    id: ClassVar[str] = ""
    name: ClassVar[str] = ""
    severity: ClassVar[Severity] = Severity.WARNING
    summary: ClassVar[str] = ""
    doc: ClassVar[RuleDoc | None] = None
    # Source tokens at least one of which must appear in a file for the rule to be able to fire.
    # Empty means the rule is emitted by the engine itself (parse problems).
    tokens: ClassVar[tuple[str, ...]] = ()
    # Further conditions of the prefilter: each group (tokens, one of which must appear, or a pattern
    # that must match) must be a necessary condition of every finding the rule can report.
    requires: ClassVar[tuple[Group, ...]] = ()
    # The prefilter of the findings that rest on another file's facts (the project index): in a file
    # that is part of a project the rule also runs when all these groups match. Empty: it has none.
    project_requires: ClassVar[tuple[Group, ...]] = ()
    # True when those findings rest on the callers of the file's functions (found by walking the
    # project), not on what the file imports: the engine then runs the rule without an import test.
    project_callers: ClassVar[bool] = False
    # Conditions on the code itself, checked in CPython's tree (``trainlint.gates.code_text``) before
    # libcst is asked: each group holds atoms one of which must occur, and each group must be a
    # necessary condition of every finding that rests on this file alone (findings that rest on other
    # files' facts are the project prefilter's). An atom is ``"call:NAME"`` (a call whose callee's last
    # name is NAME: ``NAME(...)``, ``x.NAME(...)``), ``"ref:NAME"`` (NAME as a part of an imported name
    # or an attribute read on anything but ``self``), ``"alias:NAME"`` (NAME imported ``as`` another
    # name, or assigned to one: ``f = x.NAME``), ``"import:NAME"`` (an absolute import of NAME or of a
    # module under it), ``"loop:NAME"``/``"if:NAME"`` (NAME called inside a ``for``/``while`` or an
    # ``if`` statement), ``"loop:+="`` (``t += x`` or ``t = t + x`` inside a loop), ``"def:NAME"`` (a
    # function or method NAME defined), ``"bare:self"`` (``self`` on its own, not as the receiver of
    # ``self.x``: passed to a call, assigned, returned) or ``"name:NAME"`` (NAME as a whole identifier,
    # attribute, keyword, imported module or string of the code); ``"KIND~PATTERN"`` is a regular
    # expression searched in the names of one kind but ``name`` and ``bare``
    # (``"call~^(?!save_)\\w*checkpoint"``: a callee's last name that says checkpoint; ``"def~(?i:loss)"``:
    # a function whose name has "loss" in any case). The
    # conditions follow ``FileModel``'s resolution: a call's qualified name ends with its callee's last
    # name unless the name was bound under another one (an alias); ``self.x`` resolves to nothing (``self``
    # is a parameter).
    gate: ClassVar[tuple[tuple[str, ...], ...]] = ()
    # A condition on the whole of CPython's tree that atoms cannot say (a call without a keyword, two
    # uses in one loop): ``"module.function"`` of ``trainlint.model``, a function of an ``ast.Module``
    # that returns False only where no finding resting on this file alone is possible. Asked after
    # ``gate`` holds, once per tree (``trainlint.gates.TreeChecks``).
    gate_check: ClassVar[str] = ""
    # The same for the findings that rest on other files' facts (``project_gate``'s): a check of this
    # file's tree that each of them needs, asked before the project index is (its summaries and keys).
    project_gate_check: ClassVar[str] = ""
    # The same for the findings that rest on other files' facts: conditions on this file's code that
    # each of them needs too (the engine asks the project index about the rule only when they hold).
    project_gate: ClassVar[tuple[tuple[str, ...], ...]] = ()
    # Which imported definitions a cross-file finding can rest on: ``"module.function"`` of
    # ``trainlint.model``, a function of this file's tree returning the qualified names of the callees
    # (through the file's imports and aliases) at whose calls the rule may report. The engine then asks
    # ``wants_fact`` only of the definitions reached through those names (a file that imports a class
    # with the wanted facts but never uses it so is not parsed for the rule).
    project_callees: ClassVar[str] = ""
    # Words one of which the text of another file must hold for any of its definitions to pass
    # ``wants_fact`` (the facts it asks for can be written only with one): the index does not summarise a
    # file without any for the rule's question. Empty: no such words (any file may hold a wanted fact).
    fact_words: ClassVar[tuple[str, ...]] = ()
    # Text in whose presence the rule reports nothing at all (its ``check`` returns first when the file
    # says it: TL505 and ``set_epoch``): the prefilter rejects the file for the rule.
    excludes: ClassVar[tuple[str, ...]] = ()
    valid: ClassVar[tuple[str, ...]] = ()
    invalid: ClassVar[tuple[Invalid, ...]] = ()
    has_fix: ClassVar[bool] = False
    # True when ``trainlint.verify.probes.PROBES`` has a runtime probe for this rule's findings (a test
    # holds the two to each other; --list-rules and the README's probe column read this).
    probe: ClassVar[bool] = False
    engine_only: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # the examples as the class writes them become the files they stand for when first read (tests,
        # docs): a run that only lints never reads them, and making them costs it 3 ms
        for name, convert in (("valid", _valid_files), ("invalid", _invalid_files)):
            if name in vars(cls):
                setattr(cls, name, _Examples(vars(cls)[name], convert))

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        return iter(())

    @classmethod
    def can_fire(cls, text: str) -> bool:
        """The prefilter's verdict from the raw text: False only when no finding is possible."""
        order = _CHEAPEST_FIRST.get(cls)
        if order is None:
            order = _CHEAPEST_FIRST[cls] = cheapest_first(cls.requires)
        return passes(cls.tokens, order, text) and not any(word in text for word in cls.excludes)

    @classmethod
    def wants_fact(cls, kind: str, facts: dict[str, Any]) -> bool:
        """Whether a function or class (``kind``) of another project file that the file imports, with
        these summary facts, could take part in one of the rule's cross-file findings: the engine's
        last test before parsing a file for them."""
        return False

    @classmethod
    def can_fire_in_project(cls, text: str) -> bool:
        """The prefilter's verdict for the rule's cross-file findings (see ``project_requires``)."""
        if not cls.project_requires or any(word in text for word in cls.excludes):
            return False
        return all(group_matches(g, text) for g in cls.project_requires)

    @classmethod
    def has_probe(cls) -> bool:
        return cls.probe

    @classmethod
    def explain(cls) -> str:
        """The rule's documentation as Markdown, in the sections of the design guide."""
        doc = cls.doc
        head = f"# {cls.id} ({cls.name})\n\nSeverity: {cls.severity.value}\n"
        if doc is None:
            return head + f"\n{cls.summary}\n"
        parts = [
            head,
            "## What it does\n\n" + doc.what.strip(),
            "## Why is this bad?\n\n" + doc.why.strip(),
            "## Example\n\n```python\n" + doc.example.strip("\n") + "\n```",
            "## Use instead\n\n```python\n" + doc.use_instead.strip("\n") + "\n```",
            "## Fix safety\n\n" + doc.fix_safety.strip(),
        ]
        if doc.references:
            parts.append("## References\n\n" + "\n".join(f"- {r}" for r in doc.references))
        return "\n\n".join(parts) + "\n"


@dataclass
class Registry:
    rules: dict[str, type[Rule]] = field(default_factory=dict)

    def __iter__(self) -> Iterator[type[Rule]]:
        return iter(self.rules[k] for k in sorted(self.rules))

    def get(self, rule_id: str) -> type[Rule] | None:
        return self.rules.get(rule_id.upper())

    def ids(self) -> list[str]:
        return sorted(self.rules)


_KNOWN_IDS: tuple[str, ...] | None = None


def use_known_ids(ids: tuple[str, ...] | None) -> None:
    """Install the rule ids recorded by an earlier run of this very code (the result cache keeps them
    next to its entries), so that ``rule_ids`` need not import the rule modules and libcst; ``None``
    goes back to the registry."""
    global _KNOWN_IDS
    _KNOWN_IDS = tuple(sorted(ids)) if ids is not None else None


def rule_ids() -> tuple[str, ...]:
    """Every rule id, sorted: the installed record when there is one, else the prefilter data's (the
    registry's, without importing the rule modules: tests/test_gates.py holds the two together)."""
    if _KNOWN_IDS is not None:
        return _KNOWN_IDS
    from trainlint.gates import rule_ids as recorded

    return recorded()


def load_rule(rule_id: str) -> type[Rule] | None:
    """One rule's class by id, importing only the module that defines it: a run on one file needs the
    few rules its gates let through, and importing all forty modules costs a pre-commit run about
    80 ms. The whole registry where it is loaded already or the module's name does not tell."""
    rule_id = rule_id.upper()
    if registry.cache_info().currsize:
        return registry().get(rule_id)
    name = _rule_modules().get(rule_id)
    if name is not None:
        for rule in _rules_in(importlib.import_module(name)):
            if rule.id == rule_id:
                return rule
    return registry().get(rule_id)


# a rule's module is named after its id: ``trainlint/rules/<family>/tl101_clip_before_unscale.py``
_RULE_MODULE = re.compile(r"(tl\d+)_\w+")


@functools.cache
def _rule_modules() -> dict[str, str]:
    """Rule id -> the name of the module that defines it, read from the module names
    (tests/test_lazy_rules_s6.py holds names to classes). The families' folders are listed, neither
    their packages nor their modules imported: ``pkgutil`` takes a pre-commit run 4 ms for the same."""
    import trainlint.rules as pkg

    try:
        return _rule_files(pkg.__name__, pkg.__path__)
    except OSError:  # not plain folders (a zip): the import system's own listing
        pass
    import pkgutil

    out = {}
    for family in pkgutil.iter_modules(pkg.__path__, prefix=f"{pkg.__name__}."):
        if not family.ispkg:
            continue
        path = importlib.import_module(family.name).__path__
        for info in pkgutil.iter_modules(path, prefix=f"{family.name}."):
            match = _RULE_MODULE.fullmatch(info.name.rpartition(".")[2])
            if match is not None and not info.ispkg:
                out[match[1].upper()] = info.name
    return out


def _rule_files(package: str, folders: Iterable[str]) -> dict[str, str]:
    """``_rule_modules`` from the files in the families' folders (a family: a folder holding an
    ``__init__.py``), looked at in the order ``pkgutil`` lists them."""
    out: dict[str, str] = {}
    for folder in folders:
        for family in sorted(os.listdir(folder)):
            path = os.path.join(folder, family)
            if not family.isidentifier() or not os.path.isfile(os.path.join(path, "__init__.py")):
                continue
            for name in sorted(os.listdir(path)):
                stem, _, suffix = name.partition(".")
                match = _RULE_MODULE.fullmatch(stem)
                if match is not None and suffix == "py" and os.path.isfile(os.path.join(path, name)):
                    out[match[1].upper()] = f"{package}.{family}.{stem}"
    return out


def _rules_in(module: Any) -> list[type[Rule]]:
    """The rule classes a module defines or imports."""
    return [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, Rule) and obj is not Rule and obj.id
    ]


@functools.cache
def registry() -> Registry:
    """Every rule class found in the modules of ``trainlint.rules``, keyed by id."""
    import pkgutil

    import trainlint.rules as pkg

    found = Registry()
    modules = pkgutil.walk_packages(pkg.__path__, prefix=f"{pkg.__name__}.")
    for info in sorted(modules, key=lambda m: m.name):
        for rule in _rules_in(importlib.import_module(info.name)):
            if rule.id in found.rules and found.rules[rule.id] is not rule:
                raise RuntimeError(f"duplicate rule id {rule.id}")
            found.rules[rule.id] = rule
    return found
