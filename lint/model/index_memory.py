"""The project index's summaries held in memory, by text digest: the latest used as data, the others
as their JSON text (issue 20's memory bound).

A run keeps every summary it made: a cache key is the digest of its imports' facts, and the lint of
each file asks them again. As Python data a summary takes about 8 times its JSON text (diffusers'
947 summaries: 80 MiB), which made the index half of a long run's peak. Only the ``kept`` latest
used stay decoded (the package ``__init__`` modules every key walks through, the modules the file
being linted imports); the others are decoded again when asked (about 0.1 ms for 10 KB of text).
Decoding gives back the same data in the same order (summaries are JSON data: the store holds them
so), so no answer depends on which form a summary was held in.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

Summary = dict[str, Any]
KEPT = 128  # summaries held as data


class Shelf:
    """Summaries (or None, for a text CPython cannot parse) by the digest of their file's text."""

    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self._decoded: OrderedDict[str, Summary | None] = OrderedDict()
        self._packed: dict[str, str] = {}

    def __contains__(self, digest: str) -> bool:
        return digest in self._decoded or digest in self._packed

    def get(self, digest: str) -> Summary | None:
        """The summary held under ``digest``; None when there is none (or it is None)."""
        decoded = self._decoded
        if digest in decoded:
            decoded.move_to_end(digest)
            return decoded[digest]
        packed = self._packed.get(digest)
        if packed is None:
            return None
        summary = json.loads(packed)
        self._hold(digest, summary)
        return summary

    def may_mention(self, digest: str, word: str) -> bool:
        """False only when the summary is held as JSON text that does not hold ``word`` (an ASCII
        word: others are escaped there): no string of the summary holds it then, and it is not
        decoded to find that out."""
        packed = self._packed.get(digest)
        return digest in self._decoded or packed is None or not word.isascii() or word in packed

    def put(self, digest: str, summary: Summary | None, packed: str | None = None) -> None:
        """Hold a summary; ``packed``: its ``json.dumps`` text, where the caller has made it."""
        if packed is not None:
            self._packed[digest] = packed
        self._hold(digest, summary)

    def _hold(self, digest: str, summary: Summary | None) -> None:
        decoded = self._decoded
        decoded[digest] = summary
        decoded.move_to_end(digest)
        while len(decoded) > self.kept:
            oldest, value = decoded.popitem(last=False)
            if oldest not in self._packed:
                self._packed[oldest] = json.dumps(value)

    def __len__(self) -> int:
        return len(self._decoded.keys() | self._packed.keys())
