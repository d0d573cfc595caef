"""The project index: the other files of the linted file's project, as summaries (``summary``).

The root is the nearest folder at or above a file holding ``pyproject.toml``, ``setup.py``,
``setup.cfg`` or ``.git``. A dotted import resolves to a file under the root, under ``root/src`` or
beside the importing file (scripts run from their folder import their neighbours); relative imports
resolve against the importing file's package. Files are summarised on first use, memoised by their
text's hash in memory and, when the result cache gives a folder, on disk (``<cache>/summaries``), so
naming a few files (pre-commit) still sees the whole project; the full walk (``all_files``) runs only
for questions about callers.

``Project`` is the view of one linted file: rules ask it (through the model) what a name defined in
another file does. ``dependency_key`` is the part of the result cache's key that changes when the
facts of the files a finding can rest on change: the modules the file imports (and the modules a
package's ``__init__`` re-exports), and the callers of a function that receives a GradScaler.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainlint.model.summary import Summary, summarize

ROOT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")
_SKIP_DIRS = frozenset(
    {".git", ".hg", ".svn", ".tox", ".nox", ".venv", "venv", "__pycache__", "node_modules", "build", "dist"}
)
_IMPORT_HEAD = re.compile(r"^[ \t]*(?:from[ \t]+(\.+|\w+)|import[ \t]+(\w+))", re.MULTILINE)
_MAX_FILES = 5000  # a walk that finds more stops there: an index is a help, never a hang


def find_root(path: str | os.PathLike[str]) -> Path | None:
    """The project folder of a file: the nearest folder at or above it with a root marker."""
    start = Path(os.path.abspath(path)).parent
    for folder in (start, *start.parents):
        if any((folder / marker).exists() for marker in ROOT_MARKERS):
            return folder
    return None


@dataclass(frozen=True)
class Fact:
    """One answer of the index: the file it came from and the facts there (a summary's entry)."""

    path: str
    name: str
    kind: str  # function | class
    facts: dict[str, Any]


class ProjectIndex:
    """Summaries of one project's files, read on demand and memoised by text hash: in memory, and in
    ``store`` (a folder of small JSON files named by the hash) when the result cache gives one."""

    def __init__(self, root: Path, store: Path | None = None) -> None:
        self.root = root
        self.store = store
        self._by_hash: dict[str, Summary | None] = {}
        self._by_stat: dict[str, tuple[tuple[int, int], str]] = {}
        self._listings: dict[str, tuple[int, frozenset[str]]] = {}
        self._facts_digests: dict[str, str] = {}

    def summary(self, path: Path) -> Summary | None:
        try:
            stat = path.stat()
        except OSError:
            return None
        # an unchanged file (same size and modification time) is not read again
        seen = self._by_stat.get(str(path))
        if seen is not None and seen[0] == (stat.st_mtime_ns, stat.st_size):
            return self._by_hash.get(seen[1])
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError, ValueError):
            return None
        summary = self.summary_of(text)
        self._by_stat[str(path)] = ((stat.st_mtime_ns, stat.st_size), self._digest(text))
        return summary

    def facts_digest(self, path: Path) -> str:
        """The digest of a file's summary (memoised with it): what a dependent's cache key holds."""
        summary = self.summary(path)
        seen = self._by_stat.get(str(path))
        if seen is None:
            return _digest(summary)
        if seen[1] not in self._facts_digests:
            self._facts_digests[seen[1]] = _digest(summary)
        return self._facts_digests[seen[1]]

    @staticmethod
    def _digest(text: str) -> str:
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()

    def summary_of(self, text: str) -> Summary | None:
        digest = self._digest(text)
        if digest not in self._by_hash:
            self._by_hash[digest] = self._stored(digest, text)
        return self._by_hash[digest]

    def _stored(self, digest: str, text: str) -> Summary | None:
        if self.store is None:
            return summarize(text)
        entry = self.store / digest[:2] / f"{digest}.json"
        try:
            return json.loads(entry.read_text(encoding="utf-8"))["summary"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            pass  # absent or damaged: summarise afresh
        summary = summarize(text)
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            temporary = entry.with_name(f".{digest}.{os.getpid()}.tmp")
            temporary.write_text(json.dumps({"summary": summary}), encoding="utf-8")
            os.replace(temporary, entry)  # a reader never sees half an entry
        except OSError:
            pass  # a read-only or full disk only costs speed
        return summary

    def all_files(self) -> list[Path]:
        """Every ``.py`` file under the root (virtual environments, caches and builds skipped). Walked
        afresh each time: files come and go between runs of one process (an editor, the tests)."""
        found: list[Path] = []
        for folder, dirs, names in os.walk(self.root):
            dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
            found.extend(Path(folder, n) for n in sorted(names) if n.endswith(".py"))
            if len(found) > _MAX_FILES:
                break
        return found

    def module_file(self, module: str, importer: Path) -> Path | None:
        """The project file a dotted (or leading-dot relative) module name refers to."""
        if module.startswith("."):
            level = len(module) - len(module.lstrip("."))
            base = importer.parent
            for _ in range(level - 1):
                base = base.parent
            bases = [base]
            module = module.lstrip(".")
        else:
            bases = [self.root, self.root / "src", importer.parent]
        parts = [p for p in module.split(".") if p]
        for base in bases:
            if parts and not self._may_hold(base, parts[0]):
                continue  # most imports are of other packages: one listing answers them
            candidate = base.joinpath(*parts) if parts else base
            for option in (candidate.with_suffix(".py"), candidate / "__init__.py"):
                if parts and option.is_file() and self._inside(option):
                    return option
            if not parts and (candidate / "__init__.py").is_file():
                return candidate / "__init__.py"
        return None

    def _may_hold(self, folder: Path, head: str) -> bool:
        """Whether ``folder`` has an entry ``head`` or ``head.py`` (its listing, memoised while the
        folder's modification time stays the same)."""
        try:
            stamp = folder.stat().st_mtime_ns
        except OSError:
            return False
        known = self._listings.get(str(folder))
        if known is None or known[0] != stamp:
            try:
                names = frozenset(os.listdir(folder))
            except OSError:
                names = frozenset()
            known = self._listings[str(folder)] = (stamp, names)
        return head in known[1] or f"{head}.py" in known[1]

    def _inside(self, path: Path) -> bool:
        try:
            path.resolve().relative_to(self.root.resolve())
        except ValueError:
            return False
        return True


@functools.lru_cache(maxsize=16)
def index_for(root: str, store: str | None = None) -> ProjectIndex:
    return ProjectIndex(Path(root), Path(store) if store else None)


@dataclass
class Project:
    """What one linted file may ask about the rest of its project."""

    path: Path
    index: ProjectIndex
    own: Summary | None = None
    _answers: dict[str, Fact | None] = field(default_factory=dict)
    _walked: list[Path] | None = None  # the project's files, listed once per linted file

    @classmethod
    def for_file(cls, path: str, text: str | None = None, store: Path | None = None) -> Project | None:
        """The project of a file on disk, or None (stdin, a string, a file outside any project)."""
        if not path or path.startswith("<") or not os.path.isfile(path):
            return None
        root = find_root(path)
        if root is None:
            return None
        index = index_for(str(root), str(store) if store else None)
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
            if any(self.index._may_hold(base, head) for base in bases):
                return True
        return False

    def imported_facts(self, text: str) -> list[Fact]:
        """The functions and classes of other project files that the text imports: a name imported
        from a module, or every definition of a module imported whole."""
        if not self.imports_from_project(text):
            return []
        own = self.index.summary_of(text)
        out: list[Fact] = []
        for target in own["imports"].values() if own else ():
            fact = self.lookup(target)
            if fact is not None:
                out.append(fact)
                continue
            file = self.index.module_file(target, self.path)
            summary = self.index.summary(file) if file is not None else None
            if summary is not None:
                out += [Fact(str(file), n, "function", f) for n, f in summary["functions"].items()]
                out += [Fact(str(file), n, "class", f) for n, f in summary["classes"].items()]
        return out

    def lookup(self, target: str, *, importer: Path | None = None, depth: int = 0) -> Fact | None:
        """The function or class an imported dotted name (``pkg.mod.func``, ``..mod.Class.method``)
        refers to, following re-exports (``from .mod import func`` in a package's ``__init__``)."""
        importer = importer or self.path
        question = f"lookup:{importer}:{target}"
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
            if file is None or file.resolve() == self.path.resolve():
                continue
            summary = self.index.summary(file)
            if summary is None:
                return None
            name = ".".join(parts[cut:])
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
        summary = self.index.summary(Path(fact.path))
        if summary is None:
            return None
        head, _, rest = name.partition(".")
        base = summary["imports"].get(head)
        if base is None:
            return None
        return f"{base}.{rest}" if rest else base

    def callers(self, module_file: Path, function: str) -> list[tuple[str, dict[str, Any]]]:
        """Calls of ``function`` (defined in ``module_file``) anywhere in the project, as (path, call
        facts). Walks the whole project once per process."""
        out: list[tuple[str, dict[str, Any]]] = []
        wanted = module_file.resolve()
        for file in self._files():
            if file.resolve() == wanted:
                continue
            summary = self.index.summary(file)
            if summary is None:
                continue
            imported = {
                local
                for local, target in summary["imports"].items()
                if target.rsplit(".", 1)[-1] == function and self._target_file(target, file) == wanted
            }
            if not imported:
                continue
            for facts in summary["functions"].values():
                out.extend((str(file), call) for call in facts["calls"] if call["callee"] in imported)
        return out

    def _files(self) -> list[Path]:
        if self._walked is None:
            self._walked = self.index.all_files()
        return self._walked

    def _target_file(self, target: str, importer: Path) -> Path | None:
        module = (
            target.rsplit(".", 1)[0]
            if "." in target.lstrip(".")
            else target[: len(target) - len(target.lstrip("."))]
        )
        file = self.index.module_file(module, importer) if module else None
        return file.resolve() if file is not None else None


def _digest(answer: object) -> str:
    return hashlib.sha256(json.dumps(answer, sort_keys=True, default=str).encode()).hexdigest()[:16]


def dependency_key(path: str, text: str, store: Path | None = None) -> str:
    """The digest of the other files' facts that linting ``path`` (with this text) can use: the
    summaries of the project modules it imports, and the calls of its functions made elsewhere when it
    has a function that receives a GradScaler (TL101 asks who passed it). Empty outside a project or
    when the file imports nothing of it, so such files keep their plain key."""
    project = Project.for_file(path, text, store)
    if project is None or project.own is None:
        return ""
    parts: list[str] = []
    seen = {project.path.resolve()}
    queue = [(project.path, project.own)]
    while queue:
        importer, summary = queue.pop(0)
        for target in sorted(summary["imports"].values()):
            file = project.index.module_file(target, importer) or project._target_file(target, importer)
            if file is None or file.resolve() in seen:
                continue
            seen.add(file.resolve())
            facts = project.index.summary(file)
            parts.append(f"{file}={project.index.facts_digest(file)}")
            if facts is not None and file.name == "__init__.py" and len(seen) < 64:
                queue.append((file, facts))  # a package re-exports: the facts are one import further
    for name, facts in sorted(project.own["functions"].items()):
        if "." not in name and any(receives_scaler(p) for p in facts["params"]):
            parts.append(f"callers:{name}={_digest(project.callers(project.path, name))}")
    return _digest(parts) if parts else ""


def receives_scaler(param: list[Any]) -> bool:
    """A parameter that holds a GradScaler by its annotation or its name."""
    name, _default, annotation = param
    return (annotation or "").endswith("GradScaler") or "scaler" in name.lower()
