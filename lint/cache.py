"""The result cache: one small JSON file per (file content, trainlint code, rule set, options) key.

Layout: ``<cache dir>/<code fingerprint>/<key[:2]>/<key>.json``. The key hashes the file's decoded
text (what the engine sees), the path it is reported under and the per-file options (the active rules after ``per-file-ignores``,
severity overrides, the prefilter switch); the fingerprint hashes trainlint's own source, its version,
the Python and libcst versions. Anything that can change a finding changes the key, so entries are
never invalidated in place: a changed file, rule selection or configuration simply looks up another key.

Entries are written by whoever linted the file (a worker process or the main one), from the very text
it linted, to a temporary file renamed into place: concurrent runs never read half an entry, and two
runs writing the same key write the same content. A damaged or unreadable entry is a miss, and a
read-only or full disk only costs speed. Folders of other trainlint versions left unused for a week
are removed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainlint import __version__
from trainlint.files import read_source
from trainlint.rule import Finding

if TYPE_CHECKING:
    from trainlint.results import FileResult, LintOptions

Job = tuple[str, str, "LintOptions"]
Outcome = tuple["FileResult", "str | None"]

FORMAT = 3  # bump when the entry layout changes
STALE_AFTER_S = 7 * 24 * 3600
_MARKER = ".last-used"
_RULE_IDS = "rule-ids.json"
_PREPARED: set[str] = set()  # cache folders this process has set up


def _libcst_version() -> str:
    """libcst's version without importing it (a warm run need not load the parser)."""
    import importlib.util

    spec = importlib.util.find_spec("libcst")  # every finder, an editable install's too
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            return (Path(folder) / "_version.py").read_text(encoding="utf-8")
        except OSError:
            continue
    return ""


@functools.cache
def code_fingerprint() -> str:
    """A hash of everything besides the file and options that decides findings: trainlint's own
    source (a changed rule never serves stale results), its version, Python's and libcst's."""
    digest = hashlib.sha256(f"{FORMAT}\0{__version__}\0{sys.version}\0{_libcst_version()}".encode())
    import trainlint
    import trainlint.rules

    for package in (trainlint, trainlint.rules):
        for folder in package.__path__:
            for path in sorted(Path(folder).rglob("*.py")):
                digest.update(path.relative_to(folder).as_posix().encode())
                digest.update(b"\0")
                digest.update(path.read_bytes())
                digest.update(b"\0")
    return digest.hexdigest()


def entry_key(fingerprint: str, shown: str, options: LintOptions, text: str) -> str:
    digest = _options_digest(fingerprint, options).copy()
    digest.update(shown.encode("utf-8", "surrogatepass"))
    digest.update(b"\0")
    digest.update(text.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


@functools.lru_cache(maxsize=256)
def _options_digest(fingerprint: str, options: LintOptions) -> Any:
    """The hash state after the parts shared by every file linted with these options."""
    digest = hashlib.sha256()
    for part in (fingerprint, repr(options)):
        digest.update(part.encode("utf-8", "surrogatepass"))
        digest.update(b"\0")
    return digest


class ResultCache:
    """Lookups happen in the main process; ``store`` runs wherever the file was linted. Picklable."""

    def __init__(self, folder: Path, fingerprint: str | None = None) -> None:
        self.folder = Path(folder)
        self.fingerprint = fingerprint or code_fingerprint()
        self.root = self.folder / self.fingerprint[:16]
        self._root = str(self.root)

    # -- reading -------------------------------------------------------------------------------------
    def key(self, job: Job, text: str) -> str:
        return entry_key(self.fingerprint, job[1], job[2], text)

    def _file(self, key: str) -> str:
        return os.path.join(self._root, key[:2], key + ".json")

    def get(self, job: Job) -> Outcome | None:
        """The cached outcome of linting ``job``'s file as it is now on disk, or None."""
        from trainlint.results import FileResult, Problem

        text = read_source(Path(job[0])).text  # safe on FIFOs, huge files, undecodable bytes
        if text is None:
            return None  # unreadable: linted (and reported) afresh, never cached
        try:
            with open(self._file(self.key(job, text)), encoding="utf-8") as handle:
                payload = json.load(handle)
            findings = [Finding.from_json(f) for f in payload["findings"]]
            errors = [Problem.from_cache(e) for e in payload["errors"]]
            result = FileResult(job[1], findings, errors, payload["parsed"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        # the text is only needed for code frames (and fixes) when there are findings
        return result, (text if findings else None)

    def recorded_rule_ids(self) -> tuple[str, ...] | None:
        """The rule ids an earlier run of this very code recorded here (see ``record_rule_ids``)."""
        try:
            with open(self.root / _RULE_IDS, encoding="utf-8") as handle:
                ids = json.load(handle)
        except (OSError, ValueError):
            return None
        if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
            return None
        return tuple(ids)

    # -- writing -------------------------------------------------------------------------------------
    def record_rule_ids(self, ids: tuple[str, ...]) -> None:
        """Keep the registry's rule ids next to the entries: a later run answered entirely from the
        cache then validates its selectors without importing the rule modules (and libcst)."""
        if self.recorded_rule_ids() == tuple(ids):
            return
        with contextlib.suppress(OSError):
            self._prepare()
            self._write_json(self.root / _RULE_IDS, list(ids))

    def store(self, job: Job, text: str, result: FileResult) -> None:
        """Record the outcome of linting ``text`` (exactly what was linted, not the file as it is now)."""
        if not result.cacheable:
            return  # never cache the tool's own failures
        payload: dict[str, Any] = {
            "findings": [f.to_json() for f in result.findings],
            "errors": [e.to_cache() for e in result.errors],
            "parsed": result.parsed,
        }
        target = self._file(self.key(job, text))
        try:
            self._prepare()
            os.makedirs(os.path.dirname(target), exist_ok=True)
            self._write_json(target, payload)
        except OSError:
            pass  # a read-only or full disk only costs speed

    @staticmethod
    def _write_json(target: str | Path, payload: object) -> None:
        """Write to a temporary file renamed into place: a reader never sees half of it."""
        import tempfile  # writing only: a warm run never loads it

        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(payload, handle, separators=(",", ":"))
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _prepare(self) -> None:
        """Once per process that writes: the folder's .gitignore, the use marker, stale versions."""
        if str(self.root) in _PREPARED:
            return
        _PREPARED.add(str(self.root))
        self.root.mkdir(parents=True, exist_ok=True)
        gitignore = self.folder / ".gitignore"
        if not gitignore.exists():
            gitignore.write_text("*\n", encoding="utf-8")
        marker = self.root / _MARKER
        now = time.time()
        try:
            fresh = now - marker.stat().st_mtime < 3600
        except OSError:
            fresh = False
        if fresh:
            return
        marker.touch()
        with os.scandir(self.folder) as entries:
            for entry in entries:
                if entry.name == self.root.name or not entry.is_dir(follow_symlinks=False):
                    continue
                try:
                    last = os.stat(os.path.join(entry.path, _MARKER)).st_mtime
                except OSError:
                    continue  # not one of ours: leave it alone
                if now - last > STALE_AFTER_S:
                    import shutil

                    shutil.rmtree(entry.path, ignore_errors=True)
