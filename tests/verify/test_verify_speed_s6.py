"""Session 6's cuts in ``--verify``'s time: the parent stops waiting for the child once every result is
in (the child's exit took up to 2 s), and parent maps of the CST built without libcst's ``children``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import libcst as cst
import pytest

from trainlint.model import walk
from trainlint.verify import runner
from trainlint.verify.source import parents

ROOT = Path(__file__).resolve().parents[2]


class NeverEnds:
    """A child process that does not exit by itself (its teardown, a worker it waits for)."""

    def poll(self) -> int | None:
        return None


class EndsAtOnce:
    def poll(self) -> int | None:
        return 0


def channel_with(lines: list[dict]) -> runner._Channel:
    read_end, write_end = os.pipe()
    os.write(write_end, b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    os.close(write_end)
    return runner._Channel(read_end)


def messages(ids: list[str]) -> list[dict]:
    out: list[dict] = []
    for probe_id in ids:
        out += [{"id": probe_id, "started": True}, {"id": probe_id, "status": "confirmed", "detail": ""}]
    return out


PROBES = [{"id": "0"}, {"id": "1"}]


def test_the_parent_stops_waiting_once_every_result_is_in() -> None:
    channel = channel_with(messages(["0", "1"]))
    try:
        # a batch limit of 0.5 s: without the stop, the watch ends on it and blames the last probe
        assert runner._watch(NeverEnds(), channel, 0.5, 0.5, PROBES) == (None, None)
    finally:
        os.close(channel.fd)


def test_a_missing_result_still_waits_for_the_child() -> None:
    for proc, limit, why_starts in (
        (EndsAtOnce(), 0.5, "the snippet ended"),
        (NeverEnds(), 0.2, "the snippet did"),
    ):
        channel = channel_with([*messages(["0"]), {"id": "1", "started": True}])
        try:
            code, why = runner._watch(proc, channel, limit, limit, PROBES)
        finally:
            os.close(channel.fd)
        assert why is not None and why.startswith(why_starts), why
        assert code == proc.poll()


@pytest.mark.parametrize("name", ["bad_checkpoint_side_effect.py", "bad_accumulation_loop.py"])
def test_parent_maps_match_libcsts_children_on_syntax_nodes(name: str) -> None:
    path = next((ROOT / "fixtures").rglob(name))
    module = cst.parse_module(path.read_text(encoding="utf-8"))
    full: dict[int, cst.CSTNode] = {}
    stack: list[cst.CSTNode] = [module]
    while stack:
        node = stack.pop()
        for child in node.children:
            full[id(child)] = node
            stack.append(child)
    fast = parents(module)
    nodes = list(walk(module))[1:]
    assert len(nodes) > 100
    for node in nodes:
        assert fast[id(node)] is full[id(node)]
