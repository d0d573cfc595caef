"""The result cache: one small JSON file per (file content, trainlint code, rule set, options) key.

Layout: ``<cache dir>/<code fingerprint>/<key[:1]>/<key>.json``. The key hashes the file's decoded
text (what the engine sees), the path it is reported under and the per-file options (the active rules after ``per-file-ignores``,
severity overrides, the prefilter switch); the fingerprint hashes trainlint's own source, its version,
the Python and libcst versions (kept in the cache folder with the sources' stamps, signed: a run whose
sources have not changed reads none of them). Anything that can change a finding changes the key, so
entries are never invalidated in place: a changed file, rule selection or configuration simply looks up
another key.

The cache is trusted by whoever reads it, so it never lives where the linted code's author can write:
by default it is a per-user folder (``$XDG_CACHE_HOME/trainlint`` or ``~/.cache/trainlint``), one
subfolder per real project root. Keys are also salted with a per-user secret kept there, so even a
cache folder inside the repository (``--cache-dir``) cannot be planted with entries a run would read.
Links and non-regular files in the cache are never followed or read, reads are size-capped, and a
folder that is a link, not a folder, or someone else's is refused (the run goes on without a cache).

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
import hmac
import json
import os
import stat
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainlint import __version__
from trainlint.files import NOTEBOOK, read_source
from trainlint.model.dependency_keys import Recording, mark_full, marked_full, recorded_lint_key, recording
from trainlint.model.pins import pins_stamp
from trainlint.model.project import dependency_key, recorded_dependency_key
from trainlint.model.stamps import collector_paused
from trainlint.results import frame_text
from trainlint.rule import Finding

if TYPE_CHECKING:
    from collections.abc import Iterator

    from trainlint.results import FileResult, LintOptions

Job = tuple[str, str, "LintOptions"]
Outcome = tuple["FileResult", "str | None"]

FORMAT = 4  # bump when the entry layout changes
STALE_AFTER_S = 7 * 24 * 3600
MAX_ENTRY_BYTES = 4 * 1024 * 1024  # an entry is findings of one file of at most 2 MiB
MAX_IDS_BYTES = 64 * 1024
_MARKER = ".last-used"
_RULE_IDS = "rule-ids.json"
_SECRET = "secret"
_FINGERPRINT = "fingerprint.json"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# Keys whose outcome is no finding (most files of a run), one a line in a journal per writing process,
# not one entry file each: creating a file costs a cold run more CPU than parsing a small one, and a
# warm run reads the journals once instead of opening an entry per file
_QUIET_FOLDER = "quiet"
_QUIET_SUFFIX = ".keys"
MAX_JOURNAL_BYTES = 16 * 1024 * 1024  # 250,000 keys
_JOURNALS_MERGED_AFTER = 64
# this process's open journal per cache version folder, (process id, descriptor): shared by the cache
# objects a worker unpickles, one per file it lints; a forked worker opens its own
_JOURNALS: dict[str, tuple[int, int]] = {}
_PREPARED: set[str] = set()  # cache folders this process has set up


def _close_journal(root: str) -> None:
    """Forget this process's journal of a cache folder, closed if this process opened it."""
    journal = _JOURNALS.pop(root, None)
    if journal is not None and journal[0] == os.getpid():
        with contextlib.suppress(OSError):
            os.close(journal[1])


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


def _sources() -> list[tuple[str, Path]]:
    """trainlint's own source files, each with the name it is hashed under, in hashing order."""
    import trainlint
    import trainlint.rules

    found = []
    for package in (trainlint, trainlint.rules):
        for folder in package.__path__:
            found += [
                (path.relative_to(folder).as_posix(), path) for path in sorted(Path(folder).rglob("*.py"))
            ]
    return found


def _fingerprint_base() -> str:
    return f"{FORMAT}\0{__version__}\0{sys.version}\0{_libcst_version()}"


@functools.cache
def code_fingerprint() -> str:
    """A hash of everything besides the file and options that decides findings: trainlint's own
    source (a changed rule never serves stale results), its version, Python's and libcst's."""
    digest = hashlib.sha256(_fingerprint_base().encode())
    for name, path in _sources():
        digest.update(name.encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


@functools.cache
def remembered_fingerprint(folder: Path, secret: bytes) -> str:
    """``code_fingerprint``, kept in ``folder`` (a cache folder) with the stamps (name, modification
    time, size) of the sources it hashed: a run whose sources are as they were then reads none of them
    (pre-commit's runs: 163 files). Signed with the user's secret, as the rule ids are (a planted memo
    is never believed), and not kept while a source is too recent to tell a later edit in the same
    clock tick apart (as git treats "racy" entries)."""
    stamps, newest = hashlib.sha256(_fingerprint_base().encode()), 0
    try:
        for name, path in _sources():
            info = os.stat(path)
            stamps.update(f"{name}\0{info.st_mtime_ns}\0{info.st_size}\0".encode())
            newest = max(newest, info.st_mtime_ns)
    except OSError:
        return code_fingerprint()
    memo, stamp = folder / _FINGERPRINT, stamps.hexdigest()
    data = read_capped(memo, MAX_IDS_BYTES)
    try:
        payload = json.loads(data) if data is not None else None
        known, mac = payload["fingerprint"], payload["mac"]
        if (
            isinstance(known, str)
            and isinstance(mac, str)
            and hmac.compare_digest(mac, _memo_mac(secret, stamp, known))
        ):
            return known
    except (ValueError, TypeError, KeyError, RecursionError):
        pass  # absent or damaged: hashed afresh
    fingerprint = code_fingerprint()
    if newest < time.time_ns() - 2_000_000_000 and folder.is_dir() and folder_problem(folder) is None:
        with contextlib.suppress(OSError):
            ResultCache._write_json(
                memo, {"fingerprint": fingerprint, "mac": _memo_mac(secret, stamp, fingerprint)}
            )
    return fingerprint


def _memo_mac(secret: bytes, stamps: str, fingerprint: str) -> str:
    return hmac.new(secret, f"{stamps}\0{fingerprint}".encode(), hashlib.sha256).hexdigest()


def user_cache_base() -> Path | None:
    """``$XDG_CACHE_HOME/trainlint`` (an absolute one only, as the XDG spec says), else
    ``~/.cache/trainlint``; None when there is no home folder."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    try:
        base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    except RuntimeError:  # no HOME and no password entry
        return None
    return base / "trainlint"


def default_cache_dir(project_root: Path) -> Path | None:
    """The default cache folder of a project: per user, keyed by the project's real root."""
    base = user_cache_base()
    if base is None:
        return None
    real = os.path.realpath(project_root)
    return base / "projects" / hashlib.sha256(os.fsencode(real)).hexdigest()[:16]


def folder_problem(path: Path) -> str | None:
    """Why ``path`` cannot hold cache data (a link, not a folder, another user's), or None. A folder
    that does not exist yet is fine: it is created on the first write."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot examine it: {(exc.strerror or type(exc).__name__).lower()}"
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder"
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return "it belongs to another user"
    return None


def read_capped(path: str | Path, limit: int, dir_fd: int | None = None) -> bytes | None:
    """A regular file's bytes, never following a link and never more than ``limit``; None otherwise."""
    flags = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return None
        data = os.read(fd, limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) <= limit else None


@functools.cache
def user_secret() -> bytes:
    """The per-user key that salts every cache key, created once in the user cache folder (mode
    0600). When it cannot be kept, a fresh one per process: the cache then never hits, but nothing
    anyone else wrote is ever read."""
    base = user_cache_base()
    if base is None or folder_problem(base) is not None:
        return os.urandom(32)
    path = base / _SECRET
    secret = read_capped(path, 64)
    if secret is not None and len(secret) == 32:
        return secret
    fresh = os.urandom(32)
    with contextlib.suppress(OSError):
        base.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(fresh)
        return fresh
    secret = read_capped(path, 64)  # another run created it first
    return secret if secret is not None and len(secret) == 32 else fresh


def may_run_rules(text: str, options: LintOptions) -> bool:
    """Whether the engine may run any rule on ``text`` (``engine.lint_text``'s first decision, from the
    raw text: a rule's prefilter, or a cross-file finding the project could give). When none can run,
    the outcome (a syntax or decoding error at most) rests on no other file of the project."""
    if not options.prefilter:
        return True
    from trainlint.gates import raw_answers, selected_gates  # the generated data: no libcst, no rules

    selected, answers = selected_gates(options.rule_ids), raw_answers(text)
    # (the cheap prefilters first: a project prefilter may hold a pattern, searched through the text;
    # the answers are kept for the engine's gate on the same text)
    return any(answers.can_fire(g, text) for g in selected) or any(
        answers.can_fire_in_project(g, text) for g in selected
    )


def entry_key(fingerprint: str, shown: str, options: LintOptions, text: str, secret: bytes = b"") -> str:
    digest = _options_digest(fingerprint, options, secret).copy()
    digest.update(shown.encode("utf-8", "surrogatepass"))
    digest.update(b"\0")
    digest.update(text.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


@functools.lru_cache(maxsize=256)
def _options_digest(fingerprint: str, options: LintOptions, secret: bytes = b"") -> Any:
    """The hash state after the parts shared by every file linted with these options."""
    digest = hashlib.sha256(secret)
    for part in (fingerprint, repr(options)):
        digest.update(part.encode("utf-8", "surrogatepass"))
        digest.update(b"\0")
    return digest


def open_cache(given: str | None, project_root: Path) -> ResultCache | None:
    """The cache of this run: ``given`` (``--cache-dir``) or the per-user default; None, with one
    warning line on stderr, when the folder is refused."""
    folder = Path(given) if given else default_cache_dir(project_root)
    if folder is None:
        return None
    cache = ResultCache(folder)
    problem = cache.problem()
    if problem is not None:
        from trainlint.report.escape import escape_controls

        warning = f"not using the cache folder {folder}: {problem}"
        print(f"trainlint: warning: {escape_controls(warning)}", file=sys.stderr)
        return None
    return cache


class ResultCache:
    """Lookups happen in the main process; ``store`` runs wherever the file was linted. Picklable."""

    def __init__(self, folder: Path, fingerprint: str | None = None, secret: bytes | None = None) -> None:
        self.folder = Path(folder)
        self.secret = user_secret() if secret is None else secret
        self.fingerprint = fingerprint or remembered_fingerprint(self.folder, self.secret)
        self.root = self.folder / self.fingerprint[:16]
        self._root = str(self.root)
        self._keys: dict[Job, tuple[bytes, str]] = {}  # looked up, not stored yet: (text digest, key)
        self._quiet: dict[Job, str] = {}  # keyed as proven quiet by the gate, not answered yet
        self._batch = object()  # this run's keys share their module lookups (``dependency_key``)
        self._ready: set[str] = set()  # entry folders this run made or found safe to write into
        self._journaled: set[str] | None = None  # the journals' keys, read on the first lookup
        self._faulted: set[Job] = set()  # files the cache's own code failed on: linted without it

    _UNPICKLED = ("_keys", "_quiet", "_batch", "_ready", "_journaled", "_faulted")

    def __getstate__(self) -> dict[str, Any]:
        # workers get the folder and secrets, not the keys of the files looked up (nor the journals)
        return {k: v for k, v in self.__dict__.items() if k not in self._UNPICKLED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._keys, self._quiet, self._batch, self._ready = {}, {}, object(), set()
        self._journaled, self._faulted = None, set()

    def problem(self) -> str | None:
        """Why this cache must not be used (its folder or version folder is a link, a file, another
        user's), or None."""
        for folder in (self.folder, self.root):
            problem = folder_problem(folder)
            if problem is not None:
                return problem if folder == self.folder else f"{folder.name}: {problem}"
        return None

    # -- reading -------------------------------------------------------------------------------------
    def key(self, job: Job, text: str, gate: bool = True, found: Recording | None = None) -> str | None:
        # a miss looks the key up, lints, then stores under the same key: computed once for both (a
        # run looks every file up before it lints the misses, so the keys of misses are kept until
        # stored; workers, which get the cache without them, compute their own). ``gate``: False
        # spares asking the engine's gate (``store``: a linted file is one the gate did not rule out).
        # None: a lookup of a file with no record whose rules run (a miss: the key is what its lint
        # asks of the project, ``found``, the lint's recording; where that could not be kept, the key
        # of every import, noted by ``mark_full``)
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
        known = self._keys.get(job)
        if known is not None and known[0] == digest:
            return known[1]
        # a finding may rest on other project files' facts (the project index): their digest counts,
        # unless no rule can run on the text at all (its outcome cannot rest on any other file then).
        # A file keyed with its dependencies before (its record holds) is keyed so again, unasked.
        self._quiet.pop(job, None)
        facts = recorded_dependency_key(job[0], text, self.root / "summaries", self._batch, narrowed=gate)
        if facts is None and "gradient_checkpointing" not in text and not may_run_rules(text, job[2]):
            key = self._no_rules_key(job, text)
        elif facts is None and gate and self._proven_quiet(job, text):
            # the code gate (CPython's tree) rules every rule out: the outcome is no finding, answered
            # by ``get`` from the key of its text alone, with no lint and no dependency digest
            key = self._no_rules_key(job, text)
            self._quiet[job] = key
        else:
            narrowed = self._narrowed_quiet(job, text) if facts is None and gate else None
            if facts is None and narrowed is None:
                if gate and not marked_full(job[0], text, *self._summaries()):
                    return None  # (not the digest of every import: what the lint asks decides it)
                facts = recorded_lint_key(found, text) if found is not None and not gate else None
                if facts is None:
                    facts = dependency_key(job[0], text, *self._summaries())
                    if not gate:
                        mark_full(job[0], text, self.root / "summaries")
            elif facts is None:
                facts = narrowed
            if "gradient_checkpointing" in text:  # TL205 reads the project's version pins: their stamps count
                facts += pins_stamp(job[0])
            key = entry_key(
                self.fingerprint, job[1], job[2], f"{text}\0{facts}" if facts else text, self.secret
            )
            if narrowed is not None:  # no finding, answered by ``get`` without a lint
                self._quiet[job] = key
        self._keys[job] = (digest, key)
        return key

    @staticmethod
    def _proven_quiet(job: Job, text: str) -> bool:
        """Whether the engine's gate proves that no rule runs on ``text`` and that it parses (TL205's
        pins stamp aside: a text naming ``gradient_checkpointing`` is keyed with it, as before)."""
        if "gradient_checkpointing" in text or not job[2].prefilter or job[0].endswith(NOTEBOOK):
            return False
        from trainlint.engine import outcome_needs_no_project  # (a miss only: the lint loads it anyway)

        with collector_paused():  # (as the lint that follows: a parse's objects hold no cycle)
            return outcome_needs_no_project(text, job[2])

    def _narrowed_quiet(self, job: Job, text: str) -> str | None:
        """The dependency digest of a text the gate kept only for cross-file candidates with callees
        (``engine.project_targets``), when the imports reached through those callees give no rule to
        run: the outcome is no finding, resting on what that decision read of the project alone (the
        files it looked definitions up in, by stamp, as ``recorded_lint_key`` keeps a lint's), not on
        every import's facts (most of a cold run's project index). None otherwise."""
        from trainlint.engine import no_rule_chosen, project_targets  # (loaded by ``_proven_quiet``)

        targets = project_targets(text, job[2])
        if targets is None:
            return None
        with recording(job[0], self.root / "summaries", self._batch) as found:
            if not no_rule_chosen(text, job[0], job[2]):
                return None
        facts = recorded_lint_key(found, text, narrowed=True) if found is not None else None
        if facts is None:  # (a stamp too recent to keep: those imports' facts, digested)
            facts = dependency_key(job[0], text, *self._summaries(), only=targets)
        return facts

    def _summaries(self) -> tuple[Path, object]:
        return self.root / "summaries", self._batch

    def _no_rules_key(self, job: Job, text: str) -> str:
        """The key of a text no rule can run on. Only such a text is stored under it, and whether a rule
        can run depends on the text and the options alone (both in the key): an entry found there
        answers without the rules' prefilters being asked (most of a warm run's time otherwise)."""
        return entry_key(self.fingerprint, job[1], job[2], f"{text}\0no rules", self.secret)

    def _file(self, key: str) -> str:
        return os.path.join(self._root, key[:1], key + ".json")  # (16 folders: a cold run makes each)

    def _read(self, key: str) -> bytes | None:
        """An entry's bytes, reached through no link at any level below the cache folder."""
        flags = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_DIRECTORY", 0)
        try:
            folder = os.open(os.path.join(self._root, key[:1]), flags)
        except OSError:
            return None
        try:
            return read_capped(key + ".json", MAX_ENTRY_BYTES, dir_fd=folder)
        finally:
            os.close(folder)

    def get(self, job: Job) -> Outcome | None:
        """The cached outcome of linting ``job``'s file as it is now on disk, or None (also where the
        cache's own code fails on the file: ``_fault``)."""
        try:
            return self._get(job)
        except Exception as exc:
            self._fault(job, exc)
            return None

    def _fault(self, job: Job, exc: Exception) -> None:
        """A failure of the cache's own code (its key's computation) on one file: that file is linted
        and not stored, with one warning line a run; the other files keep the cache."""
        from trainlint.report.escape import escape_controls

        self._keys.pop(job, None)
        self._quiet.pop(job, None)
        if not self._faulted:
            what = f"{type(exc).__name__}: {exc}"
            print(
                f"trainlint: warning: the result cache failed on {escape_controls(job[1])} ({escape_controls(what)}); "
                "linted without it",
                file=sys.stderr,
            )
        self._faulted.add(job)

    def _get(self, job: Job) -> Outcome | None:
        from trainlint.results import FileResult, Problem

        text = read_source(Path(job[0])).text  # safe on FIFOs, huge files, undecodable bytes
        if text is None:
            return None  # unreadable: linted (and reported) afresh, never cached
        quiet = self._no_rules_key(job, text) if "gradient_checkpointing" not in text else ""
        if quiet and quiet in self._journaled_keys():
            return FileResult(job[1]), None
        data = self._read(quiet) if quiet else None
        if data is None:
            key = self.key(job, text)
            if key is None:
                return None  # (its lint records what it asks of the project: ``store`` keys it so)
            if key != quiet and key in self._journaled_keys():
                self._keys.pop(job, None)
                return FileResult(job[1]), None
            data = self._read(key) if key != quiet else None
            if data is None and self._quiet.pop(job, None) == key:
                return self._answer_quiet(job, text)
            if data is None:
                return None  # (its key is kept for the store that follows the lint)
        self._keys.pop(job, None)
        try:
            payload = json.loads(data)
            findings = [Finding.from_json(f) for f in payload["findings"]]
            errors = [Problem.from_cache(e) for e in payload["errors"]]
            result = FileResult(job[1], findings, errors, payload["parsed"])
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return None
        # the text is only needed for code frames (and fixes) when there are findings
        return result, frame_text(job[0], findings, text)

    def _answer_quiet(self, job: Job, text: str) -> Outcome:
        """The outcome of a text the gate proved no rule runs on (``_proven_quiet``), stored under the
        key of its text: a later run reads it without asking the gate."""
        from trainlint.results import FileResult

        result = FileResult(job[1])
        self.store(job, text, result)
        return result, None

    def _ids_mac(self, ids: list[str]) -> str:
        message = json.dumps([self.fingerprint, ids]).encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def recorded_rule_ids(self) -> tuple[str, ...] | None:
        """The rule ids an earlier run of this very code recorded here (see ``record_rule_ids``):
        only a record signed with this user's secret, and one that still has the engine's own rules,
        so a planted record can never narrow the selection."""
        data = read_capped(self.root / _RULE_IDS, MAX_IDS_BYTES)
        try:
            payload = json.loads(data) if data is not None else None
            ids, mac = payload["ids"], payload["mac"]
        except (ValueError, TypeError, KeyError, RecursionError):
            return None
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            return None
        if not isinstance(mac, str) or not hmac.compare_digest(mac, self._ids_mac(ids)):
            return None
        if not {"TL901", "TL902"} <= set(ids):
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
            self._write_json(self.root / _RULE_IDS, {"ids": list(ids), "mac": self._ids_mac(list(ids))})

    @contextlib.contextmanager
    def recording(self, job: Job, text: str) -> Iterator[Recording | None]:
        """What the lint run inside asks of the project (``store``'s key for a file with no record);
        nothing for a text no rule can run on (its key is its text's alone)."""
        if job in self._faulted or ("gradient_checkpointing" not in text and not may_run_rules(text, job[2])):
            yield None
            return
        try:
            started = recording(job[0], self.root / "summaries", self._batch)
            found = started.__enter__()
        except Exception as exc:
            self._fault(job, exc)
            yield None
            return
        try:
            yield found
        finally:
            started.__exit__(None, None, None)

    def store(self, job: Job, text: str, result: FileResult, found: Recording | None = None) -> None:
        """Record the outcome of linting ``text`` (exactly what was linted, not the file as it is now);
        ``found``: what that lint asked of the project (``recording``)."""
        if not result.cacheable:
            return  # never cache the tool's own failures
        payload: dict[str, Any] = {
            "findings": [f.to_json() for f in result.findings],
            "errors": [e.to_cache() for e in result.errors],
            "parsed": result.parsed,
        }
        if job in self._faulted:
            return
        try:
            key = self.key(job, text, gate=False, found=found)
        except Exception as exc:
            self._fault(job, exc)
            return
        self._keys.pop(job, None)
        assert key is not None  # (a store always has one: ``found``'s, or every import's)
        try:
            self._prepare()
            if not (result.findings or result.errors or result.parsed) and self._journal_key(key):
                return
            target = self._file(key)
            if self._entry_folder_ready(os.path.dirname(target)):
                self._write_json(target, payload)
        except OSError:
            pass  # a read-only or full disk only costs speed

    # -- the journals of no-finding outcomes ---------------------------------------------------------
    def _journaled_keys(self) -> set[str]:
        if self._journaled is None:
            self._journaled = self._read_journals()
        return self._journaled

    def _read_journals(self) -> set[str]:
        """The keys of every journal (regular files only, never through a link); many journals are
        merged into one, so that a lookup reads a few files however many runs wrote them."""
        folder = self.root / _QUIET_FOLDER
        if folder_problem(folder) is not None:
            return set()
        try:
            names = sorted(n for n in os.listdir(folder) if n.endswith(_QUIET_SUFFIX))
        except OSError:
            return set()
        keys: set[str] = set()
        for name in names:
            data = read_capped(folder / name, MAX_JOURNAL_BYTES)
            if data is not None:  # (a line cut short by a crash is no key: it matches nothing)
                keys.update(line for line in data.decode("ascii", "replace").split("\n") if len(line) == 64)
        if len(names) > _JOURNALS_MERGED_AFTER:
            self._merge_journals(folder, names, keys)
        return keys

    def _merge_journals(self, folder: Path, names: list[str], keys: set[str]) -> None:
        """One journal with ``keys`` in place of the ``names`` read (a key another process appends to one
        of them meanwhile may be lost: it is linted again, never answered wrong)."""
        try:
            self._prepare()
            self._write_text(folder / f"merged-{os.getpid()}-{os.urandom(4).hex()}{_QUIET_SUFFIX}", keys)
        except OSError:
            return  # (the journals stay as they are)
        for name in names:
            with contextlib.suppress(OSError):  # (another process merged it first)
                os.unlink(folder / name)

    @staticmethod
    def _write_text(target: Path, keys: set[str]) -> None:
        fd = os.open(target.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as handle:
            handle.write("".join(f"{key}\n" for key in sorted(keys)))
        os.replace(target.with_suffix(".tmp"), target)

    def _journal_key(self, key: str) -> bool:
        """Append ``key`` to this process's journal (made on the first key); False where it cannot be."""
        journal = _JOURNALS.get(self._root)
        if journal is None or journal[0] != os.getpid():
            folder = self.root / _QUIET_FOLDER
            if not self._entry_folder_ready(str(folder)):
                return False
            name = f"{os.getpid()}-{os.urandom(4).hex()}{_QUIET_SUFFIX}"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | _NOFOLLOW
            while len(_JOURNALS) >= 8:  # (a long process, the tests: many caches, few descriptors)
                _close_journal(next(iter(_JOURNALS)))
            _close_journal(self._root)
            journal = _JOURNALS[self._root] = (os.getpid(), os.open(folder / name, flags, 0o600))
        os.write(journal[1], f"{key}\n".encode("ascii"))  # (one line, one write: never interleaved)
        if self._journaled is not None:
            self._journaled.add(key)
        return True

    def _entry_folder_ready(self, folder: str) -> bool:
        """Whether entries may be written into ``folder``, made if needed: never through a planted link.
        Checked once per run (this cache object) and folder: a cold run stores an entry for every file,
        a mkdir and an lstat call each, where 256 folders hold them all."""
        if folder in self._ready:
            return True
        os.makedirs(folder, exist_ok=True)
        if folder_problem(Path(folder)) is not None:
            return False
        self._ready.add(folder)
        return True

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
        """Once per process that writes: checks, the folder's .gitignore, the use marker, stale
        versions. Raises ``OSError`` when the folders are not safe to write into."""
        if os.path.abspath(self.root) in _PREPARED:  # absolute: the working folder may change
            return
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        problem = self.problem()
        if problem is not None:
            raise OSError(problem)
        _PREPARED.add(os.path.abspath(self.root))
        with contextlib.suppress(OSError):  # O_EXCL: never through a (dangling) link, never twice
            fd = os.open(self.folder / ".gitignore", os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write("*\n")
        marker = self.root / _MARKER
        now = time.time()
        try:
            fresh = now - os.lstat(marker).st_mtime < 3600
        except OSError:
            fresh = False
        if fresh:
            return
        with contextlib.suppress(OSError):
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | _NOFOLLOW, 0o644))
            os.utime(marker, follow_symlinks=False)
        self._remove_stale(now)

    def _remove_stale(self, now: float) -> None:
        with os.scandir(self.folder) as entries:
            for entry in entries:
                if entry.name == self.root.name or not entry.is_dir(follow_symlinks=False):
                    continue
                try:
                    last = os.lstat(os.path.join(entry.path, _MARKER)).st_mtime
                except OSError:
                    continue  # not one of ours: leave it alone
                if now - last > STALE_AFTER_S:
                    import shutil

                    shutil.rmtree(entry.path, ignore_errors=True)
