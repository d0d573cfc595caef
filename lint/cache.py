"""The result cache: one JSON file per (file content, trainlint code, rule set, options) key.

Writes go to a temporary file renamed into place, so concurrent runs never read half a file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from trainlint import __version__
from trainlint.files import decode
from trainlint.rule import Finding

if TYPE_CHECKING:
    from trainlint.engine import FileResult, LintOptions

Job = tuple[str, str, "LintOptions"]


@functools.cache
def code_fingerprint() -> str:
    """A hash of trainlint's own source, so that a changed rule never serves stale results."""
    digest = hashlib.sha256(__version__.encode())
    import trainlint
    import trainlint.rules

    for package in (trainlint, trainlint.rules):
        for folder in package.__path__:
            for path in sorted(Path(folder).rglob("*.py")):
                digest.update(path.name.encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


class ResultCache:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._keys: dict[str, tuple[str, bytes]] = {}

    def _key(self, job: Job) -> tuple[str, bytes] | None:
        fs_path, shown, options = job
        try:
            data = Path(fs_path).read_bytes()
        except OSError:
            return None
        digest = hashlib.sha256()
        for part in (code_fingerprint(), shown, repr(options)):
            digest.update(part.encode())
            digest.update(b"\0")
        digest.update(data)
        return digest.hexdigest(), data

    def _file(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.json"

    def get(self, job: Job) -> tuple[FileResult, str | None] | None:
        from trainlint.engine import FileResult

        keyed = self._key(job)
        if keyed is None:
            return None
        key, data = keyed
        self._keys[job[0]] = keyed
        try:
            payload = json.loads(self._file(key).read_text(encoding="utf-8"))
            findings = [Finding.from_json(f) for f in payload["findings"]]
            result = FileResult(job[1], findings, payload["errors"], payload["parsed"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        text = decode(data).text if findings else None
        return result, text

    def put(self, job: Job, outcome: tuple[FileResult, str | None] | None) -> None:
        if outcome is None:
            return
        result = outcome[0]
        if any("internal error" in e.get("message", "") for e in result.errors):
            return  # never cache the tool's own failures
        keyed = self._keys.get(job[0]) or self._key(job)
        if keyed is None:
            return
        target = self._file(keyed[0])
        payload = {
            "findings": [f.to_json() for f in result.findings],
            "errors": result.errors,
            "parsed": result.parsed,
        }
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            gitignore = self.folder / ".gitignore"
            if not gitignore.exists():
                gitignore.write_text("*\n", encoding="utf-8")
            fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(payload, handle)
            os.replace(tmp, target)
        except OSError:
            pass  # a read-only or full disk only costs speed
