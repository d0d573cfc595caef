"""The project index's part of the result cache's key (``dependency_key``): the digests of the facts of
the files a file's findings can rest on (the modules it imports, through the ``__init__`` re-exports a
lookup follows, and the callers of a function that receives a GradScaler), recorded with the stamps
of the folders and files they came from so that a warm run checks them with stat calls."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from trainlint.model.index_imports import import_targets, may_receive_scaler, receives_scaler
from trainlint.model.project import Project, ProjectIndex, index_for
from trainlint.model.stamps import answer_digest, collector_paused, file_stamp, find_root, recorded_answer


def dependency_key(
    path: str,
    text: str,
    store: Path | None = None,
    batch: object | None = None,
    only: list[str] | None = None,
) -> str:
    """The digest of the other files' facts that linting ``path`` (with this text) can use: the
    summaries of the project modules it imports, and the calls of its functions made elsewhere when it
    has a function that receives a GradScaler (TL101 asks who passed it). Empty outside a project or
    when the file imports nothing of it. ``batch``: a token shared by the keys of one run, whose
    lookups are answered once for all its files (records keep the stamps taken before: a folder
    changed meanwhile fails their check in the next run). ``only``: the imports (targets, as the
    file's outline spells them) the outcome can rest on, where the engine's gate narrowed them
    (``engine.project_targets``); the GradScaler callers do not count then."""
    return _key(path, text, store, batch, recorded_only=False, only=only) or ""


def recorded_dependency_key(
    path: str, text: str, store: Path, batch: object | None = None, narrowed: bool = False
) -> str | None:
    """``dependency_key`` when the file's record for this very text holds (a warm run); else None.
    ``narrowed``: a record of a key made with ``only`` counts too (the result cache's lookup, whose
    entry under such a key is a no-finding outcome the gate and those imports decided)."""
    return _key(path, text, store, batch, recorded_only=True, narrowed=narrowed)


def _key(
    path: str,
    text: str,
    store: Path | None,
    batch: object | None,
    recorded_only: bool,
    only: list[str] | None = None,
    narrowed: bool = False,
) -> str | None:
    if recorded_only and not _may_be_recorded(path, store, batch):
        return None  # (no record to check: most files of a cold run)
    project = Project.for_file(path, None, store, batch)
    if project is None:
        return ""
    with collector_paused():
        found = _dependencies(project, text, batch, recorded_only, only, narrowed)
        if found is None:
            return None
        parts, scaler = found
        for name in scaler:
            parts.append(f"callers:{name}={_callers_digest(project, name, batch)}")
    project.index.save_manifest()
    return answer_digest(parts) if parts else ""


def _may_be_recorded(path: str, store: Path | None, batch: object | None) -> bool:
    """Whether the index of the file's project holds a record for it: its journal's slot names, read
    once, in memory (True outside a project: ``_key`` answers then)."""
    root = find_root(path, batch)
    if root is None or store is None:
        return True
    return index_for(str(root), str(store)).holds_record(os.path.abspath(path))


def _dependencies(
    project: Project,
    text: str,
    batch: object | None = None,
    recorded_only: bool = False,
    only: list[str] | None = None,
    narrowed: bool = False,
) -> tuple[list[str], list[str]] | None:
    """The project modules the file imports, through package ``__init__`` re-exports, as ``file=facts
    digest``; and its functions that receive a GradScaler. From the file's record while it holds: for
    the same text, or for a text with the same imports (an edit elsewhere in the file, pre-commit's
    case: the files they lead to are the record's, checked by their stamps). ``only``, ``narrowed``:
    see ``dependency_key``; a narrowed record (field ``narrowed``) answers only those asking for it."""
    index, slot = project.index, str(project.path)
    record = index.recorded(slot, batch)
    digest = index._digest(text)
    answer = recorded_answer(record, "text", digest) if only is None else None
    if answer is None and (narrowed or only is not None):
        answer = recorded_answer(record, "narrowed", digest)
    if answer is not None or recorded_only:
        return answer
    if only is not None:
        return _gathered(project, batch, only, [], narrowed=digest)
    # the import statements read in place, not the whole file parsed (a cold run keys every file
    # before it lints one); parsed when a function may receive a GradScaler (its params count)
    targets = None if may_receive_scaler(text) else import_targets(text)
    own = index.outline_of(text) if targets is None else {"imports": {}, "functions": {}}
    imports = sorted(set(own["imports"].values())) if targets is None and own else targets or []
    scaler = [
        name
        for name, facts in sorted(own["functions"].items() if own else ())
        if any(receives_scaler(p) for p in facts["params"])
    ]
    shape = answer_digest(imports)
    answer = recorded_answer(record, "imports", shape)
    if answer is not None and record is not None:
        index.update_record(slot, text=digest, scaler=scaler)
        return answer[0], scaler
    return _gathered(project, batch, imports if own is not None else None, scaler, text=digest, imports=shape)


def _gathered(
    project: Project, batch: object | None, leading: list[str] | None, scaler: list[str], **answer: str
) -> tuple[list[str], list[str]]:
    """The project files the imports ``leading`` there lead to, as ``file=facts digest``, through package ``__init__``
    re-exports; kept as the file's record with ``answer`` (the fields a later run asks it by)."""
    index, slot = project.index, str(project.path)
    found: dict[str, tuple[int, int]] = {}
    digests, keep = [], True
    with _consulting(index, batch) as folders:
        seen, followed = {str(project.path)}, set()
        queue = [(project.path, leading)] if leading is not None else []
        while queue:
            importer, targets = queue.pop(0)
            for target, file in zip(targets, index.imported_files(importer, targets), strict=True):
                if file is None:
                    continue
                if str(file) not in seen:
                    seen.add(str(file))
                    digests.append(index.facts_digest(file))
                    stamp = index._manifest().get(str(file))
                    keep = keep and stamp is not None and stamp[2] == digests[-1]  # else changed meanwhile
                    found[str(file)] = (stamp[0], stamp[1]) if stamp is not None else (-1, -1)
                if file.name == "__init__.py" and len(seen) < 64 and (str(file), target) not in followed:
                    followed.add((str(file), target))
                    further = _reexported(index, file, target, importer)
                    if further:  # a package re-exports: the facts are one import further
                        queue.append((file, further))
    if keep:
        index.keep_record(slot, folders, found, digests=" ".join(digests), scaler=scaler, **answer)
    return [f"{f}={d}" for f, d in zip(found, digests, strict=True)], scaler


@dataclass
class Recording:
    """What one lint asked of its project index: the folders whose entries decided its lookups and the
    files whose facts it read (by stamp, taken before the read)."""

    project: Project
    folders: dict[str, int] = field(default_factory=dict)
    files: dict[str, tuple[int, int]] = field(default_factory=dict)


@contextlib.contextmanager
def recording(path: str, store: Path, batch: object | None = None) -> Iterator[Recording | None]:
    """Record what the lint of ``path`` run inside asks of its project (None outside a project, or
    inside another recording or gathering). ``batch``: as for ``dependency_key`` (the run's token)."""
    project = Project.for_file(path, None, store, batch)
    index = project.index if project is not None else None
    if project is None or index is None or index._consulted is not None:
        yield None
        return
    found = Recording(project)
    index._consulted, index._read = found.folders, found.files
    try:
        yield found
    finally:
        index._consulted = index._read = None


def recorded_lint_key(found: Recording, text: str, narrowed: bool = False) -> str | None:
    """The dependency digest of a lint recorded as ``found``: the files it read facts of, by stamp
    (a depfile, as build systems keep one): what a cold run keys a file with an active rule on, so that
    it summarises only what the rules looked up, not every import. Kept as the file's record for its
    text (``recorded_dependency_key`` answers from it); None where it cannot be kept (a stamp too
    recent to tell a later change apart, or the lint asked another index): the outcome is not stored.
    ``narrowed``: ``found`` recorded the engine's choice of rules, which chose none (a record that
    answers the lookups asking for a narrowed key only)."""
    index = found.project.index
    if index_for(str(index.root)) is not index:
        return None
    stamps = [f"{mtime},{size}" for mtime, size in found.files.values()]
    if not index.keep_record(
        str(found.project.path),
        found.folders,
        found.files,
        **{"narrowed" if narrowed else "text": index._digest(text)},
        digests=" ".join(stamps),
        scaler=[],
    ):
        return None
    index.save_manifest()
    parts = [f"{file}={stamp}" for file, stamp in zip(found.files, stamps, strict=True)]
    return answer_digest(parts) if parts else ""


def mark_full(path: str, text: str, store: Path) -> None:
    """Note that ``path``'s outcome for this text is stored under its key of every import (its lint was
    not recorded, or the recording's stamps were too recent to keep): a lookup computes that key then,
    as it is made from the project's facts as they are (no stamp to trust)."""
    project = Project.for_file(path, None, store)
    if project is not None:
        project.index.keep_record(f"{project.path}\0full", {}, {}, full=project.index._digest(text))


def marked_full(path: str, text: str, store: Path, batch: object | None = None) -> bool:
    """Whether ``mark_full`` was noted for this very text."""
    project = Project.for_file(path, None, store, batch)
    if project is None:
        return False
    record = project.index.recorded(f"{project.path}\0full", batch)
    return record is not None and record.get("full") == project.index._digest(text)


def _reexported(index: ProjectIndex, package: Path, target: str, importer: Path) -> list[str]:
    """The imports of a package's ``__init__`` that a lookup of ``target`` may follow: of a name
    imported from the package (``from pkg import helper``), that name's own import there, as
    ``Project.lookup`` follows it; of the package itself (``import pkg``), every one (any name may be
    looked up through it)."""
    facts = index.summary(package)
    if facts is None:
        return []
    if index.module_file(target, importer) == package:  # the package itself
        return sorted(set(facts["imports"].values()))
    name = target.rpartition(".")[2]
    own = facts["imports"].get(name)
    return [own] if own is not None else []


def _callers_digest(project: Project, name: str, batch: object | None = None) -> str:
    """The digest of the calls of ``name`` (of the linted file) made in other project files; from its
    record while the project's folders and every file in them are as they were."""
    index, slot = project.index, f"{project.path}\0callers:{name}"
    record = index.recorded(slot, batch)
    if record is not None and isinstance(record.get("digest"), str):
        return str(record["digest"])
    project._walked = None  # walked afresh: the walk's folders are stamped
    with _consulting(index) as folders:
        digest = answer_digest(project.callers(project.path, name))
    stamps = {str(file): file_stamp(index._by_stat.get(str(file)), file) for file in project._files()}
    index.keep_record(slot, folders, stamps, digest=digest)
    return digest


@contextlib.contextmanager
def _consulting(index: ProjectIndex, batch: object | None = None) -> Iterator[dict[str, int]]:
    """Lookups stamping the folders they consult (yielded), answered afresh but for those asked
    before in the same ``batch`` (see ``dependency_key``)."""
    if batch is None or batch is not index._batch:
        index._asked.clear()
        index._expanded.clear()
        index._mtimes.clear()
        index._digested.clear()
        index._batch = batch
    index._consulted = folders = {}
    try:
        yield folders
    finally:
        index._consulted = None
