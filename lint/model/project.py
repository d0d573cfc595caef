"""The project index: the other files of the linted file's project, as summaries (``summary``).

The root is the nearest folder at or above a file holding ``pyproject.toml``, ``setup.py``,
``setup.cfg`` or ``.git``. A dotted import resolves to a file under the root, under ``root/src`` or
beside the importing file (scripts run from their folder import their neighbours); relative imports
resolve against the importing file's package. Files are summarised on first use, memoised by their
text's hash in memory and, when the result cache gives a folder, on disk (``<cache>/summaries``), so
naming a few files (pre-commit) still sees the whole project; the full walk (``all_files``) runs only
for questions about callers. A lookup of one name reads that name's definition alone where it can
(``definitions``: the same entries, at a fraction of the parse), kept in memory only.

``Project`` is the view of one linted file: rules ask it (through the model) what a name defined in
another file does. ``dependency_key`` (in ``dependency_keys``, importable from here) is the part of
the result cache's key that changes when the facts of the files a finding can rest on change: the modules the file imports (and the modules a
package's ``__init__`` re-exports), and the callers of a function that receives a GradScaler. Both are
recorded in the store with the stamps of the folders and files they came from, so a warm run checks
them with stat calls instead of resolving every import again; the file's own text is read for its
outline only (imports, parameters)."""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainlint.model.definitions import definition
from trainlint.model.index_imports import binds_name
from trainlint.model.index_journals import IndexJournals
from trainlint.model.index_memory import Shelf
from trainlint.model.stamps import (
    RunStamps,
    answer_digest,
    collector_paused,
    folder_mtime,
    note_parsed,
    project_root,
    text_digest,
    write_atomic,
)
from trainlint.model.summary import Summary, instance_calls, outline, summarize

_SKIP_DIRS = frozenset(
    {".git", ".hg", ".svn", ".tox", ".nox", ".venv", "venv", "__pycache__", "node_modules", "build", "dist"}
)
_IMPORT_HEAD = re.compile(r"^[ \t]*(?:from[ \t]+(\.+|\w+)|import[ \t]+(\w+))", re.MULTILINE)
_MAX_FILES = 5000  # a walk that finds more stops there: an index is a help, never a hang


@dataclass(frozen=True)
class Fact:
    """One answer of the index: the file it came from and the facts there (a summary's entry)."""

    path: str
    name: str
    kind: str  # function | class
    facts: dict[str, Any]


class ProjectIndex(IndexJournals):
    """Summaries of one project's files, read on demand and memoised by text hash: in memory, and in
    ``store`` (a folder of small JSON files named by the hash) when the result cache gives one."""

    def __init__(self, root: Path, store: Path | None = None) -> None:
        self.root = root
        self.store = store
        self._by_hash = Shelf()  # text digest -> summary (the latest as data, the rest as JSON text)
        self._by_stat: dict[str, tuple[tuple[int, int], str]] = {}
        self._listings: dict[str, tuple[int, frozenset[str]]] = {}
        self._facts_digests: dict[str, str] = {}
        # module name resolutions, kept while one file is linted (``forget_paths``): files come and
        # go between the files of an editor session, never within one file's lint
        self._modules: dict[tuple[str, str], Path | None] = {}
        self._real_root = os.path.realpath(root)
        self._real_folders: dict[str, str] = {}
        self._checked: set[str] = set()  # folders whose listing was checked against their mtime
        self._stamps: dict[str, list[Any]] | None = None  # the manifest: path -> [mtime, size, facts]
        self._unsaved: list[str] = []
        self._session: tuple[str, float] = ("", 0.0)
        # while a file's dependencies are gathered: each folder a lookup consulted -> its mtime
        self._consulted: dict[str, int] | None = None
        # while a lint is recorded (``dependency_keys.recording``): each file whose facts it asked for
        self._read: dict[str, tuple[int, int]] | None = None
        self._records: dict[str, dict[str, Any]] = {}  # slot (a path, a callers question) -> record
        self._journal: dict[str, str] | None = None  # the records' journal: slot name -> JSON text
        # within one gathering window: lookups answered (with the folders they consulted) and folder
        # modification times, shared by the files whose dependencies are gathered in it
        self._asked: dict[tuple[str, str], tuple[Path | None, dict[str, int]]] = {}
        self._expanded: dict[tuple[str, tuple[str, ...]], tuple[list[Path | None], dict[str, int]]] = {}
        self._mtimes: dict[str, int] = {}
        self._digested: dict[str, str] = {}  # facts digests taken in this batch: path -> digest
        self._batch: object | None = None
        self._stamped = RunStamps()  # the stamps ``recorded`` compares
        # (path, stamp, words, name) of the files ``summary`` found to hold no fact asked for
        self._lacking: set[tuple[str, tuple[int, int], tuple[str, ...], str | None]] = set()
        # (text digest, name) -> the summary of that name's definition alone, or None (``definition``)
        self._definitions: dict[tuple[str, str], Summary | None] = {}
        self._texts: dict[str, tuple[tuple[int, int], str]] = {}  # path -> (stamp, text): ``_text``
        # (a question of ``summary`` as for ``_lacking``, name) -> the summary of its definition alone
        self._partials: dict[
            tuple[tuple[str, tuple[int, int], tuple[str, ...], str | None], str], Summary
        ] = {}

    def forget_paths(self, path: str) -> None:
        """Start a new file's lint: resolutions are kept only for the same file within a second (its
        cache key, then its lint), never across files of a long session."""
        now = time.monotonic()
        if self._session[0] != path or now - self._session[1] > 1.0:
            self._modules.clear()
            self._real_folders.clear()
            self._checked.clear()
            self._session = (path, now)

    def summary(
        self,
        path: Path,
        mentioning: str | None = None,
        holding: tuple[str, ...] = (),
        bound: str | None = None,
        head: str | None = None,
    ) -> Summary | None:
        """A file's summary. ``mentioning``: None, without summarising it, when its text does not hold
        that word (a question about one name: most files cannot answer it). ``holding``: None, without
        summarising it, when no fact the question wants can be in its text (``may_hold_facts``, with
        ``bound``). ``head``: a question about that name only, which a summary of its definition
        alone (``definitions.definition``, without ``imports``) may answer where the file's whole
        summary is not at hand."""
        try:
            stat = path.stat()
        except OSError:
            if self._read is not None:
                self._read.setdefault(str(path), (-1, -1))
            return None
        # an unchanged file (same size and modification time) is not read again
        seen, stamp = self._by_stat.get(str(path)), (stat.st_mtime_ns, stat.st_size)
        if self._read is not None:  # (its stamp before its text: a change meanwhile fails the record)
            self._read.setdefault(str(path), stamp)
        if seen is not None and seen[0] == stamp:
            held = mentioning is None or self._by_hash.may_mention(seen[1], mentioning)
            return self._by_hash.get(seen[1]) if held else None  # (a text without the word: not decoded)
        question = (str(path), stamp, holding, bound)
        if holding and question in self._lacking:
            return None
        if head is not None and (question, head) in self._partials:
            return self._partials[(question, head)]  # (another file's lint asked the same)
        text = self._text(str(path), stamp, kept=head is not None)
        if text is None:
            return None
        if mentioning is not None and mentioning not in text:
            return None
        if holding and not may_hold_facts(text, holding, bound):
            if len(self._lacking) >= _LACKING_KEPT:
                self._lacking.clear()
            self._lacking.add(question)  # (the files of a package ask the same of its modules)
            return None
        if head is not None:
            partial = self._definition(text, head)
            if partial is not None:
                if len(self._partials) >= _LACKING_KEPT:
                    self._partials.clear()
                self._partials[(question, head)] = partial
                return partial
        summary = self.summary_of(text)
        self._by_stat[str(path)] = (stamp, self._digest(text))
        return summary

    def _text(self, path: str, stamp: tuple[int, int], kept: bool) -> str | None:
        """A file's text; ``kept``: held for the next questions about its other names (one asked
        for a name's definition alone is asked for several: read and hashed once)."""
        known = self._texts.get(path)
        if known is not None and known[0] == stamp:
            return known[1]
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError, ValueError):
            return None
        if kept:
            while len(self._texts) >= _TEXTS_KEPT:
                del self._texts[next(iter(self._texts))]
            self._texts[path] = (stamp, text)
        return text

    def facts_digest(self, path: Path) -> str:
        """The digest of a file's summary: what a dependent's cache key holds. From the manifest while
        the file's mtime and size are those it was digested at; once per batch (``dependency_key``)."""
        batched = self._batch is not None and self._consulted is not None  # (gathering, in a batch)
        if batched and str(path) in self._digested:
            return self._digested[str(path)]
        digest = self._facts_digest(path)
        if batched:
            self._digested[str(path)] = digest
        return digest

    def _facts_digest(self, path: Path) -> str:
        try:
            stat = path.stat()
        except OSError:
            return answer_digest(None)
        stamp = [stat.st_mtime_ns, stat.st_size]
        known = self._manifest().get(str(path))
        if known is not None and known[:2] == stamp and isinstance(known[2], str):
            return known[2]
        summary = self.summary(path)
        seen = self._by_stat.get(str(path))
        if seen is None:
            return answer_digest(summary)
        if seen[1] not in self._facts_digests:
            self._facts_digests[seen[1]] = answer_digest(summary)
        digest = self._facts_digests[seen[1]]
        if list(seen[0]) == stamp:  # (not when the file changed between the two stat calls)
            self._manifest()[str(path)] = [*stamp, digest]
            self._unsaved.append(json.dumps([str(path), *stamp, digest]) + "\n")
        return digest

    @staticmethod
    def _digest(text: str) -> str:
        return text_digest(text)

    def _definition(self, text: str, head: str) -> Summary | None:
        """The summary of ``head``'s definition alone (memoised by the text's digest), or None where
        the whole summary is to be made: it is at hand (in memory or in the store), or the definition
        cannot be read alone."""
        digest = self._digest(text)
        key = (digest, head)
        if key in self._definitions:
            return self._definitions[key]
        if digest in self._by_hash or (self.store is not None and self._entry(digest).is_file()):
            return None
        if len(self._definitions) >= _LACKING_KEPT:
            self._definitions.clear()
        with collector_paused():
            found = self._definitions[key] = definition(text, head, digest)
        return found

    def _entry(self, digest: str) -> Path:
        assert self.store is not None
        return self.store / digest[:1] / f"{digest}.json"

    def summary_of(self, text: str, tree: ast.Module | None = None) -> Summary | None:
        """The summary of a text; ``tree`` (CPython's tree of that text, where the caller has it)
        spares parsing it again."""
        digest = self._digest(text)
        if digest in self._by_hash:
            return self._by_hash.get(digest)
        summary, packed = self._stored(digest, text, tree)
        self._by_hash.put(digest, summary, packed)
        if summary is not None:
            note_parsed(digest)
        return summary

    def outline_of(self, text: str, tree: ast.Module | None = None) -> Summary | None:
        """The text's ``imports`` and module-level function ``params``: from its summary when at hand,
        else from its tree (``summary.outline``), with no walk of every body."""
        digest = self._digest(text)
        if digest in self._by_hash:
            return self._by_hash.get(digest)
        with collector_paused():
            return outline(text, tree)

    def _stored(self, digest: str, text: str, tree: ast.Module | None) -> tuple[Summary | None, str | None]:
        """The summary of a text, from the store or made (and stored), with its JSON text if made."""
        with collector_paused():
            if self.store is None:
                return summarize(text, tree), None
            entry = self._entry(digest)
            try:
                return json.loads(entry.read_text(encoding="utf-8"))["summary"], None
            except (OSError, ValueError, KeyError, TypeError, RecursionError):
                pass  # absent or damaged: summarise afresh
            summary = summarize(text, tree)
        packed = json.dumps(summary)
        write_atomic(entry, f'{{"summary": {packed}}}')  # (``json.dumps({"summary": summary})``)
        return summary, packed

    def all_files(self) -> list[Path]:
        """Every ``.py`` file under the root (virtual environments, caches and builds skipped). Walked
        afresh each time: files come and go between runs of one process (an editor, the tests)."""
        found: list[Path] = []
        for folder, dirs, names in os.walk(self.root):
            if self._consulted is not None:  # its listing decides which files there are
                self._consulted.setdefault(folder, folder_mtime(folder))
            dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
            found.extend(Path(folder, n) for n in sorted(names) if n.endswith(".py"))
            if len(found) > _MAX_FILES:
                break
        return found

    def module_file(self, module: str, importer: Path) -> Path | None:
        """The project file a dotted (or leading-dot relative) module name refers to."""
        question = (module, str(importer.parent))
        if self._consulted is not None:
            return self._gathered(question, importer)
        if question not in self._modules:
            self._modules[question] = self._module_file(*self._bases(module, importer))
        return self._modules[question]

    def _gathered(self, question: tuple[str, str], importer: Path) -> Path | None:
        """``module_file`` while a file's dependencies are gathered: the folders deciding the answer
        are stamped into ``_consulted``. Answers are kept with their stamps across the files of one
        batch (``_consulting``): the files of a package ask the same questions of its ``__init__``
        modules. A record keeps the stamps taken then, so a folder changed since fails its check
        next time, and the dependencies are gathered afresh."""
        assert self._consulted is not None
        known = self._asked.get(question)
        if known is None:
            bases, parts = self._bases(question[0], importer)
            stamps: dict[str, int] = {}
            self._stamp_folders(bases, parts, stamps)  # (before the lookup: see ``_stamp_folders``)
            known = self._asked[question] = (self._module_file(bases, parts), stamps)
        for folder, stamp in known[1].items():
            self._consulted.setdefault(folder, stamp)
        self._modules[question] = known[0]  # (kept for the file's lint, which follows its key)
        return known[0]

    def _bases(self, module: str, importer: Path) -> tuple[list[str], list[str]]:
        """The folders a module name is looked up in, in order, and its dotted parts."""
        # (plain strings: pathlib's object per step costs more than the stat calls on a warm run)
        folder = os.path.dirname(str(importer)) or "."
        if module.startswith("."):
            level = len(module) - len(module.lstrip("."))
            for _ in range(level - 1):
                folder = os.path.dirname(folder) or "."
            bases = [folder]
        else:
            root = str(self.root)
            bases = [root, os.path.join(root, "src"), folder]
        return bases, [p for p in module.lstrip(".").split(".") if p]

    def _stamp_folders(self, bases: list[str], parts: list[str], consulted: dict[str, int]) -> None:
        """Note the modification time of every folder whose entries decide a lookup, before the lookup:
        each base and the folders between it and the root, and from the base towards the candidate
        module as far as folders exist (a missing one is an entry its parent's time covers). An entry
        added, removed or replaced by a link in any of them changes that folder's time."""
        times, root = self._mtimes, str(self.root)
        for base in bases:
            up = base
            while base not in consulted and up.startswith(root + os.sep):
                up = os.path.dirname(up)
                if up not in consulted:
                    consulted[up] = times[up] if up in times else times.setdefault(up, folder_mtime(up))
            folder = base
            for part in ["", *parts]:
                folder = os.path.join(folder, part) if part else folder
                if folder not in consulted:
                    consulted[folder] = (
                        times[folder] if folder in times else times.setdefault(folder, folder_mtime(folder))
                    )
                if consulted[folder] < 0:
                    break

    def _module_file(self, bases: list[str], parts: list[str]) -> Path | None:
        for base in bases:
            if not parts:
                init = os.path.join(base, "__init__.py")
                if os.path.isfile(init):
                    return Path(init)
                continue
            if not self._may_hold(base, parts[0]):
                continue  # most imports are of other packages: one listing answers them
            candidate = os.path.join(base, *parts)
            for option in (candidate + ".py", os.path.join(candidate, "__init__.py")):
                if os.path.isfile(option) and self._inside(option):
                    return Path(option)
        return None

    def imported_file(self, target: str, importer: Path) -> Path | None:
        """The project file an import target comes from: the module ``a.b.c`` itself, or for a name
        imported from a module (``from a.b import c``), that module; a name imported from a plain
        module (not a package) is never a submodule, which spares the lookup."""
        bare = target.lstrip(".")
        dots = target[: len(target) - len(bare)]
        parent = dots + bare.rsplit(".", 1)[0] if "." in bare else dots
        owner = self.module_file(parent, importer) if parent and parent != target else None
        if owner is not None and owner.name != "__init__.py":
            return owner
        return self.module_file(target, importer) or owner

    def imported_files(self, importer: Path, targets: list[str]) -> list[Path | None]:
        """``imported_file`` of each target, while dependencies are gathered: answered once per
        importer and targets in a batch (the files of a package reach the same ``__init__`` modules),
        with the stamps of the folders the lookups consulted."""
        outer = self._consulted
        assert outer is not None
        question = (str(importer), tuple(targets))
        known = self._expanded.get(question)
        if known is None:
            self._consulted = {}
            try:
                known = ([self.imported_file(t, importer) for t in targets], self._consulted)
            finally:
                self._consulted = outer
            self._expanded[question] = known
        for folder, stamp in known[1].items():
            outer.setdefault(folder, stamp)
        return known[0]

    def _may_hold(self, folder: str | Path, head: str) -> bool:
        """Whether ``folder`` has an entry ``head`` or ``head.py`` (its listing, memoised while the
        folder's modification time stays the same)."""
        key = str(folder)
        known = self._listings.get(key)
        if known is not None and key in self._checked:
            return head in known[1] or f"{head}.py" in known[1]  # checked already for this file
        try:
            stamp = os.stat(key).st_mtime_ns
        except OSError:
            return False
        self._checked.add(key)
        if known is None or known[0] != stamp:
            try:
                names = frozenset(os.listdir(key))
            except OSError:
                names = frozenset()
            known = self._listings[key] = (stamp, names)
        return head in known[1] or f"{head}.py" in known[1]

    def real_path(self, path: str) -> str:
        """``os.path.realpath``, each folder resolved once while one file is linted (``forget_paths``)."""
        if os.path.islink(path):  # a link may lead out of the project
            return os.path.realpath(path)
        folder, name = os.path.split(path)
        if folder not in self._real_folders:
            self._real_folders[folder] = os.path.realpath(folder)
        return os.path.join(self._real_folders[folder], name)

    def _inside(self, path: str) -> bool:
        real = self.real_path(path)
        return real == self._real_root or real.startswith(self._real_root.rstrip(os.sep) + os.sep)


_LACKING_KEPT = 8192
_TEXTS_KEPT = 16


def _defines(summary: Summary, name: str) -> bool:
    return name in summary["functions"] or name in summary["classes"]


_STORED: dict[str, ProjectIndex] = {}  # root -> the latest index with a store (the result cache's)


def may_hold_facts(text: str, words: tuple[str, ...], bound: str | None = None) -> bool:
    """Whether the summary of ``text`` may hold a fact that can be written only with one of ``words``
    (``Rule.fact_words``), or an import binding the name ``bound`` (a lookup of that name in the file
    follows such an import to another file, whose facts may be wanted)."""
    # (the parser normalises non-ASCII identifiers, so such a text may spell a word otherwise)
    if not text.isascii() or any(word in text for word in words):
        return True
    if bound is None or bound not in text:
        return False
    return binds_name(text, bound)  # (read in place, else parsed: once per text for all its names)


@functools.lru_cache(maxsize=16)
def _index(root: str, store: str | None) -> ProjectIndex:
    return ProjectIndex(Path(root), Path(store) if store else None)


def index_for(root: str, store: str | None = None) -> ProjectIndex:
    """The index of a project root. Asked without a store (the engine), the one the result cache
    opened for that root in this process, if any: its summaries are on disk already."""
    if store is None and root in _STORED:
        return _STORED[root]
    index = _index(root, store)
    if store is not None:
        _STORED[root] = index
    return index


def forget_indexes() -> None:
    """Drop every index of this process (what a new process starts from)."""
    _index.cache_clear()
    _STORED.clear()


@dataclass
class Project:
    """What one linted file may ask about the rest of its project."""

    path: Path
    index: ProjectIndex
    own: Summary | None = None
    _answers: dict[str, Fact | None] = field(default_factory=dict)
    _walked: list[Path] | None = None  # the project's files, listed once per linted file
    # (a Project lives for one file's lint, in which files do not change: see ``_summary``)
    _summaries: dict[str, Summary | None] = field(default_factory=dict)
    _reals: dict[str, str] = field(default_factory=dict)
    # while a question wants only facts written with one of these words (``Rule.fact_words``): a file
    # holding none of them is not summarised for it (its definitions count as none)
    fact_words: tuple[str, ...] = ()

    @classmethod
    def for_file(
        cls, path: str, text: str | None = None, store: Path | None = None, batch: object | None = None
    ) -> Project | None:
        """The project of a file on disk, or None (stdin, a string, a file outside any project)."""
        root = project_root(path, batch)
        if root is None:
            return None
        index = index_for(str(root), str(store) if store else None)
        index.forget_paths(path)
        own = index.summary_of(text) if text is not None else None
        return cls(Path(os.path.abspath(path)), index, own)

    def imports_from_project(self, text: str) -> bool:
        """Whether the text imports a module of the project (a relative import, or a name at the root,
        under ``src`` or beside the file): a cheap test on the text that spares the parse of files
        whose findings could not rest on another file."""
        for match in _IMPORT_HEAD.finditer(text):
            head = match.group(1) or match.group(2)
            if head.startswith("."):
                return True
            bases = (self.index.root, self.index.root / "src", self.path.parent)
            if self.index._consulted is not None:  # (an entry added to one could make it one)
                for base in bases:
                    self.index._consulted.setdefault(str(base), folder_mtime(str(base)))
            if any(self.index._may_hold(base, head) for base in bases):
                return True
        return False

    def imported_facts(
        self, text: str, tree: ast.Module | None = None, imports: list[str] | None = None
    ) -> list[Fact]:
        """The functions and classes of other project files that the text imports: a name imported
        from a module, or every definition of a module imported whole. ``tree``: the text's CPython
        tree, where the caller has parsed it (the engine's gate has); ``imports``: its import targets,
        where the caller has read them (``index_imports.import_targets_of``)."""
        return [fact for _, fact in self.imported_facts_by_target(text, tree, imports)]

    def imported_facts_by_target(
        self,
        text: str,
        tree: ast.Module | None = None,
        imports: list[str] | None = None,
        words: Callable[[str], tuple[str, ...] | None] | None = None,
    ) -> list[tuple[str, Fact]]:
        """``imported_facts``, each with the import target it was reached through (``pkg.mod.f``, or
        the module ``pkg.mod`` for a module imported whole). ``words``: of a target, the words one
        of which a file must hold for its definitions to be asked for (``fact_words``; none: any
        file's), or None where none of them are (the target is not looked up)."""
        if not self.imports_from_project(text):
            return []
        if imports is None:
            own = self.index.outline_of(text, tree)
            imports = list(own["imports"].values()) if own else []
        out: list[tuple[str, Fact]] = []
        try:
            for target in imports:
                wanted = words(target) if words is not None else ()
                if wanted is None:
                    continue  # (not summarised: none of its definitions could count)
                self.fact_words = wanted
                out += self._imported_definitions(target)
        finally:
            self.fact_words = ()
        return out

    def _imported_definitions(self, target: str) -> list[tuple[str, Fact]]:
        """The definition an import target names, or every definition of the module it names."""
        fact = self.lookup(target)
        if fact is not None:
            return [(target, fact)]
        file = self.index.module_file(target, self.path)
        summary = self._summary(file) if file is not None else None
        if summary is None:
            return []
        return [(target, Fact(str(file), n, "function", f)) for n, f in summary["functions"].items()] + [
            (target, Fact(str(file), n, "class", f)) for n, f in summary["classes"].items()
        ]

    def lookup(self, target: str, *, importer: Path | None = None, depth: int = 0) -> Fact | None:
        """The function or class an imported dotted name (``pkg.mod.func``, ``..mod.Class.method``)
        refers to, following re-exports (``from .mod import func`` in a package's ``__init__``)."""
        importer = importer or self.path
        question = f"lookup:{importer}:{target}:{self.fact_words}"
        if question in self._answers:
            return self._answers[question]
        answer = self._answers[question] = self._lookup(target, importer, depth)
        return answer

    def _lookup(self, target: str, importer: Path, depth: int) -> Fact | None:
        if depth > 4:
            return None
        dots = len(target) - len(target.lstrip("."))
        parts = target.lstrip(".").split(".")
        # the longest prefix that is a module; the rest names a def (or Class.method) in it
        for cut in range(len(parts) - 1, 0, -1):
            module = "." * dots + ".".join(parts[:cut])
            file = self.index.module_file(module, importer)
            if file is None or self._real(file) == self._real(self.path):
                continue
            name = ".".join(parts[cut:])
            summary = self._summary(file, bound=parts[cut], head=parts[cut])
            if summary is not None and "imports" not in summary and not _defines(summary, name):
                summary = self._summary(file, bound=parts[cut])  # (``Class.attribute``: the whole file's)
            if summary is None:
                return None
            if name in summary["functions"]:
                return Fact(str(file), name, "function", summary["functions"][name])
            if name in summary["classes"]:
                return Fact(str(file), name, "class", summary["classes"][name])
            head, _, rest = name.partition(".")
            reexport = summary["imports"].get(head)
            if reexport is not None:
                return self._lookup(f"{reexport}.{rest}" if rest else reexport, file, depth + 1)
            return None
        return None

    def resolve_in(self, fact: Fact, name: str) -> str | None:
        """A name as written in ``fact``'s file, as a dotted target importable from there."""
        head, _, rest = name.partition(".")
        summary = self._summary(Path(fact.path), head=head)  # (a name imported there: its entry alone)
        if summary is not None and "imports" not in summary:
            summary = self._summary(Path(fact.path))  # (defined there too: the whole file's imports)
        if summary is None:
            return None
        base = summary["imports"].get(head)
        if base is None:
            return None
        return f"{base}.{rest}" if rest else base

    def callers(self, module_file: Path, function: str) -> list[tuple[str, dict[str, Any]]]:
        """Calls of ``function`` (defined in ``module_file``) anywhere in the project, as (path, call
        facts). Walks the whole project once per process."""
        out: list[tuple[str, dict[str, Any]]] = []
        wanted = self._real(module_file)
        # ``Class.method``: called on an instance the caller's class holds (``self.x = Class(...)``)
        owner, _, method = function.rpartition(".")
        name = owner or function
        for file in self._files():
            if self._real(file) == wanted:
                continue
            summary = self.index.summary(file, mentioning=name)  # (an import of it names it)
            if summary is None:
                continue
            imported = {
                local
                for local, target in summary["imports"].items()
                if target.rsplit(".", 1)[-1] == name and self._target_file(target, file) == wanted
            }
            if not imported:
                continue
            for key, facts in summary["functions"].items():
                callees = imported if not owner else instance_calls(summary, key, imported, method)
                out.extend((str(file), call) for call in facts["calls"] if call["callee"] in callees)
        return out

    def _real(self, path: Path) -> str:
        """A path with every link resolved (a lookup compares the file it found with the linted one
        for each dotted prefix of every name it resolves: the folders' answers are kept)."""
        if str(path) not in self._reals:
            self._reals[str(path)] = self.index.real_path(str(path))
        return self._reals[str(path)]

    def _summary(self, path: Path, bound: str | None = None, head: str | None = None) -> Summary | None:
        """``ProjectIndex.summary``, asked once per file while this file is linted (not with a stat
        call for each name the rules resolve through it). ``bound``: the name a lookup asks the file
        for, which it may import (with ``fact_words``); ``head``: the name whose definition alone
        may answer (see ``ProjectIndex.summary``)."""
        slot = f"{path}\0{bound}\0{self.fact_words}" if self.fact_words else str(path)
        if head is not None:
            slot += f"\0{head}"
        if slot not in self._summaries:
            self._summaries[slot] = self.index.summary(path, holding=self.fact_words, bound=bound, head=head)
        return self._summaries[slot]

    def _files(self) -> list[Path]:
        if self._walked is None:
            self._walked = self.index.all_files()
        return self._walked

    def _target_file(self, target: str, importer: Path) -> str | None:
        module = (
            target.rsplit(".", 1)[0]
            if "." in target.lstrip(".")
            else target[: len(target) - len(target.lstrip("."))]
        )
        file = self.index.module_file(module, importer) if module else None
        return self._real(file) if file is not None else None


def __getattr__(name: str) -> Any:
    """``dependency_key`` and ``recorded_dependency_key``, which live in ``dependency_keys`` (the
    result cache's part of the index), importable from here as before."""
    if name in ("dependency_key", "recorded_dependency_key"):
        from trainlint.model import dependency_keys

        return getattr(dependency_keys, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
