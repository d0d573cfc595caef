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

import ast
import functools
import hashlib
import json
import os
import re
import time
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
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


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
        # module name resolutions, kept while one file is linted (``forget_paths``): files come and
        # go between the files of an editor session, never within one file's lint
        self._modules: dict[tuple[str, str], Path | None] = {}
        self._real_root = os.path.realpath(root)
        self._real_folders: dict[str, str] = {}
        self._stamps: dict[str, list[Any]] | None = None  # the manifest: path -> [mtime, size, facts]
        self._unsaved: list[str] = []
        self._session: tuple[str, float] = ("", 0.0)

    def forget_paths(self, path: str) -> None:
        """Start a new file's lint: resolutions are kept only for the same file within a second (its
        cache key, then its lint), never across files of a long session."""
        now = time.monotonic()
        if self._session[0] != path or now - self._session[1] > 1.0:
            self._modules.clear()
            self._real_folders.clear()
            self._session = (path, now)

    # -- the manifest: each file's facts digest by its modification time and size ----------------------
    # One journal per project in the store, read once per process: a warm run that names one file
    # digests its imports' facts from stat calls, reading no other file. Lines are appended (a line
    # that two writers garble is skipped on reading, which only costs speed) and the journal is
    # rewritten when it holds more stale lines than live ones.
    def _manifest(self) -> dict[str, list[Any]]:
        if self._stamps is not None:
            return self._stamps
        self._stamps, lines = {}, 0
        path = self._manifest_path()
        try:
            text = path.read_text(encoding="utf-8") if path is not None else ""
        except (OSError, UnicodeDecodeError):
            text = ""
        for line in text.splitlines():
            lines += 1
            try:
                name, mtime, size, facts = json.loads(line)
            except (ValueError, TypeError):
                continue
            self._stamps[name] = [mtime, size, facts]
        if path is not None and lines > 2 * len(self._stamps) + 1000:
            self._rewrite_manifest(path)
        return self._stamps

    def _manifest_path(self) -> Path | None:
        if self.store is None:
            return None
        return self.store / f"manifest-{hashlib.sha256(str(self.root).encode()).hexdigest()[:16]}.jsonl"

    def _rewrite_manifest(self, path: Path) -> None:
        assert self._stamps is not None
        body = "".join(json.dumps([name, *entry]) + "\n" for name, entry in self._stamps.items())
        try:
            temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            temporary.write_text(body, encoding="utf-8")
            os.replace(temporary, path)
        except OSError:
            pass

    def save_manifest(self) -> None:
        """Append the digests computed since the last save to the project's journal."""
        path = self._manifest_path()
        if path is None or not self._unsaved:
            return
        body, self._unsaved = "".join(self._unsaved).encode("utf-8", "surrogatepass"), []
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o600)
        except OSError:
            return
        try:
            os.write(descriptor, body)
        except OSError:
            pass
        finally:
            os.close(descriptor)

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
        """The digest of a file's summary: what a dependent's cache key holds. Taken from the manifest
        while the file's modification time and size are those it was digested at."""
        try:
            stat = path.stat()
        except OSError:
            return _digest(None)
        stamp = [stat.st_mtime_ns, stat.st_size]
        known = self._manifest().get(str(path))
        if known is not None and known[:2] == stamp and isinstance(known[2], str):
            return known[2]
        summary = self.summary(path)
        seen = self._by_stat.get(str(path))
        if seen is None:
            return _digest(summary)
        if seen[1] not in self._facts_digests:
            self._facts_digests[seen[1]] = _digest(summary)
        digest = self._facts_digests[seen[1]]
        if list(seen[0]) == stamp:  # (not when the file changed between the two stat calls)
            self._manifest()[str(path)] = [*stamp, digest]
            self._unsaved.append(json.dumps([str(path), *stamp, digest]) + "\n")
        return digest

    @staticmethod
    def _digest(text: str) -> str:
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()

    def summary_of(self, text: str, tree: ast.Module | None = None) -> Summary | None:
        """The summary of a text; ``tree`` (CPython's tree of that text, where the caller has it)
        spares parsing it again."""
        digest = self._digest(text)
        if digest not in self._by_hash:
            self._by_hash[digest] = self._stored(digest, text, tree)
        return self._by_hash[digest]

    def _stored(self, digest: str, text: str, tree: ast.Module | None = None) -> Summary | None:
        if self.store is None:
            return summarize(text, tree)
        entry = self.store / digest[:2] / f"{digest}.json"
        try:
            return json.loads(entry.read_text(encoding="utf-8"))["summary"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            pass  # absent or damaged: summarise afresh
        summary = summarize(text, tree)
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
        question = (module, str(importer.parent))
        if question not in self._modules:
            self._modules[question] = self._module_file(module, importer)
        return self._modules[question]

    def _module_file(self, module: str, importer: Path) -> Path | None:
        # (plain strings: pathlib's object per step costs more than the stat calls on a warm run)
        folder = os.path.dirname(str(importer)) or "."
        if module.startswith("."):
            level = len(module) - len(module.lstrip("."))
            for _ in range(level - 1):
                folder = os.path.dirname(folder) or "."
            bases = [folder]
            module = module.lstrip(".")
        else:
            root = str(self.root)
            bases = [root, os.path.join(root, "src"), folder]
        parts = [p for p in module.split(".") if p]
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

    def _may_hold(self, folder: str | Path, head: str) -> bool:
        """Whether ``folder`` has an entry ``head`` or ``head.py`` (its listing, memoised while the
        folder's modification time stays the same)."""
        key = str(folder)
        known = self._listings.get(key)
        if known is not None and key in self._real_folders:
            return head in known[1] or f"{head}.py" in known[1]  # checked already for this file
        try:
            stamp = os.stat(key).st_mtime_ns
        except OSError:
            return False
        self._real_folders.setdefault(key, os.path.realpath(key))
        if known is None or known[0] != stamp:
            try:
                names = frozenset(os.listdir(key))
            except OSError:
                names = frozenset()
            known = self._listings[key] = (stamp, names)
        return head in known[1] or f"{head}.py" in known[1]

    def _inside(self, path: str) -> bool:
        folder = os.path.dirname(path)
        if folder not in self._real_folders:
            self._real_folders[folder] = os.path.realpath(folder)
        real = self._real_folders[folder]
        if os.path.islink(path):  # a link may lead out of the project
            real = os.path.realpath(path)
        return real == self._real_root or real.startswith(self._real_root.rstrip(os.sep) + os.sep)


_STORED: dict[str, ProjectIndex] = {}  # root -> the latest index with a store (the result cache's)


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

    @classmethod
    def for_file(cls, path: str, text: str | None = None, store: Path | None = None) -> Project | None:
        """The project of a file on disk, or None (stdin, a string, a file outside any project)."""
        if not path or path.startswith("<") or not os.path.isfile(path):
            return None
        root = find_root(path)
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
            if any(self.index._may_hold(base, head) for base in bases):
                return True
        return False

    def imported_facts(self, text: str, tree: ast.Module | None = None) -> list[Fact]:
        """The functions and classes of other project files that the text imports: a name imported
        from a module, or every definition of a module imported whole. ``tree``: the text's CPython
        tree, where the caller has parsed it (the engine's gate has)."""
        if not self.imports_from_project(text):
            return []
        own = self.index.summary_of(text, tree)
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
        return Path(os.path.realpath(file)) if file is not None else None


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
    seen = {str(project.path)}
    queue = [(project.path, project.own)]
    while queue:
        importer, summary = queue.pop(0)
        for target in sorted(summary["imports"].values()):
            file = project.index.imported_file(target, importer)
            if file is None or str(file) in seen:
                continue
            seen.add(str(file))
            parts.append(f"{file}={project.index.facts_digest(file)}")
            if file.name == "__init__.py" and len(seen) < 64:
                facts = project.index.summary(file)
                if facts is not None:
                    queue.append((file, facts))  # a package re-exports: the facts are one import further
    for name, facts in sorted(project.own["functions"].items()):
        if "." not in name and any(receives_scaler(p) for p in facts["params"]):
            parts.append(f"callers:{name}={_digest(project.callers(project.path, name))}")
    project.index.save_manifest()
    return _digest(parts) if parts else ""


def receives_scaler(param: list[Any]) -> bool:
    """A parameter that holds a GradScaler by its annotation or its name."""
    name, _default, annotation = param
    return (annotation or "").endswith("GradScaler") or "scaler" in name.lower()
