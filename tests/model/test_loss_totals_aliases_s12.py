"""TL302's gate asks whether a name may resolve to an import through the file's aliases (``name =
chain``), as ``FileModel.qualname`` follows them up to 9 deep. It followed every way there: on a file
whose names alias each other back and forth (one of torch's) that was 44 million calls, half of a
cold run over torch. Now each name is visited once, at its least distance, with the same answers."""

from __future__ import annotations

import ast
import random

import pytest

from trainlint.model.gate_loss_totals import _Walk, kept_loss_callees


def _every_way(walk: _Walk, name: str, depth: int = 0) -> bool:
    """The answer as the gate computed it before: every alias path, up to 9 deep."""
    if depth > 9:
        return False
    if name in walk.imports:
        return True
    return any(_every_way(walk, chain.partition(".")[0], depth + 1) for chain in walk.aliases.get(name, ()))


def _graph(seed: int) -> tuple[_Walk, list[str]]:
    """A walk whose imports and aliases are a random graph of 12 names (chains with attributes too)."""
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(12)]
    walk = _Walk(ast.parse(""))
    walk.all_bindings = True  # (nothing left to read: the graph is all there is)
    walk.imports = {name: ["pkg." + name] for name in rng.sample(names, rng.randint(0, 2))}
    for name in names:
        for _ in range(rng.randint(0, 2)):
            walk.aliases.setdefault(name, []).append(rng.choice(names) + rng.choice(["", ".attr"]))
    return walk, names


@pytest.mark.parametrize("seed", range(40))
def test_the_answers_are_those_of_every_way(seed: int) -> None:
    walk, names = _graph(seed)
    assert {name: walk._imported(name) for name in names} == {name: _every_way(walk, name) for name in names}


def test_the_graphs_hold_both_answers() -> None:
    """(so that the comparison above can fail either way)"""
    answers = {_every_way(walk, name) for walk, names in map(_graph, range(40)) for name in names}
    assert answers == {True, False}


class _Counting(dict):
    asked = 0

    def get(self, *args):
        _Counting.asked += 1
        return super().get(*args)


def test_names_aliasing_each_other_are_each_visited_once() -> None:
    """Four names that each alias the other three: every way 9 deep is 4**9 lookups; once each is 4."""
    names = ["a", "b", "c", "d"]
    assigns = "".join(f"    {x} = {y}\n" for x in names for y in names if x != y)
    text = (
        "import torch\n\ndef fit(loader):\n    total = 0\n"
        f"{assigns}"
        "    for batch in loader:\n        loss = a(batch)\n        loss.backward()\n        total += a(batch)\n"
    )
    walk = _Walk(ast.parse(text))
    walk.run()
    walk.aliases = _Counting(walk.aliases)
    _Counting.asked = 0
    assert not walk._imported("a")  # (none of them is imported)
    assert _Counting.asked <= 2 * len(names) * 10
    assert kept_loss_callees(ast.parse(text)) == frozenset()
