"""A cold run's lookups (issue 20): a file whose code rules every rule out (CPython's gate) is answered
by its lookup, with no dependency key and no lint, and found again by a later run; a file the lookup
gated is parsed once, not again by its lint; a notebook (JSON text) is never gated; the code
fingerprint is kept with its sources' stamps (a run with unchanged sources reads none of them), and a
changed source changes it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from conftest import age, counting

import trainlint.cache as cache_module
import trainlint.engine as engine
from trainlint.cache import ResultCache, may_run_rules
from trainlint.cli import main
from trainlint.engine import lint_text, outcome_needs_no_project
from trainlint.model.project import forget_indexes
from trainlint.results import LintOptions
from trainlint.rule import registry

OPTIONS = LintOptions(tuple(registry().ids()))
PAST = time.time() - 3600
# TL503's raw prefilter passes (its names are in the text), but only in an import's module path
QUIET = (
    "from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType\n\n"
    "class Config:\n    save_optimizer: bool = False\n"
)
TRAIN = (
    "import torch\n\n"
    "def train(model, loader, opt):\n    scaler = torch.cuda.amp.GradScaler()\n"
    "    for x in loader:\n        scaler.scale(model(x)).backward()\n"
    "        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n        scaler.step(opt)\n"
)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "p"
    root.mkdir()
    (root / "pyproject.toml").write_text("")
    (root / "config.py").write_text(QUIET)
    (root / "train.py").write_text(TRAIN)
    age(root)
    forget_indexes()
    engine._VERDICTS.clear()
    return root


def job(root: Path, name: str) -> tuple[str, str, LintOptions]:
    return (str(root / name), name, OPTIONS)


def findings(out: str) -> list[tuple[str, str, int]]:
    return sorted((f["rule"], f["path"], f["line"]) for f in json.loads(out)["findings"])


def test_the_texts_are_what_the_tests_need() -> None:
    assert may_run_rules(QUIET, OPTIONS) and outcome_needs_no_project(QUIET, OPTIONS)
    assert lint_text(QUIET, "config.py", OPTIONS).findings == []
    assert may_run_rules(TRAIN, OPTIONS) and not outcome_needs_no_project(TRAIN, OPTIONS)
    engine._VERDICTS.clear()


def test_a_file_the_code_gate_rules_out_is_answered_by_its_lookup(
    project: Path, tmp_path: Path, monkeypatch
) -> None:
    keys = counting(monkeypatch, cache_module, "dependency_key")
    lints = counting(monkeypatch, engine, "lint_text")
    cache = ResultCache(tmp_path / "c")
    hit = cache.get(job(project, "config.py"))
    assert hit is not None and hit[0].findings == [] and hit[0].errors == [] and not hit[0].parsed
    assert keys == [] and lints == []
    # a later run finds it under the key of its text, asking no gate and no index
    gates = counting(monkeypatch, cache_module.ResultCache, "_proven_quiet")
    again = ResultCache(tmp_path / "c").get(job(project, "config.py"))
    assert again is not None and again[0].findings == []
    assert gates == [] and keys == []


def test_a_file_the_code_gate_keeps_is_keyed_by_its_lint(project: Path, tmp_path: Path, monkeypatch) -> None:
    """Its lookup digests no import (the key is what its lint asks of the project, tests/
    test_cache_depfile_s11.py), and neither does its store when the lint was recorded."""
    keys = counting(monkeypatch, cache_module, "dependency_key")
    cache = ResultCache(tmp_path / "c")
    assert cache.get(job(project, "train.py")) is None
    assert keys == []


def test_a_file_the_lookup_gated_is_parsed_once(project: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    parses = counting(monkeypatch, engine, "_cpython_parse")
    args = ["--jobs", "1", "--exit-zero", "--format", "json", "--cache-dir", str(tmp_path / "c")]
    main([*args, str(project / "train.py")])
    cold = findings(capsys.readouterr().out)
    assert len(parses) == 1
    assert cold and cold == findings(_uncached(project / "train.py", capsys))
    assert engine._VERDICTS == {}  # taken by the lint


def test_a_changed_text_is_gated_afresh(project: Path, tmp_path: Path, capsys) -> None:
    args = ["--jobs", "1", "--exit-zero", "--format", "json", "--cache-dir", str(tmp_path / "c")]
    main([*args, str(project / "config.py")])
    assert findings(capsys.readouterr().out) == []
    # the same file now holds code a rule fires on: its quiet entry is not the new text's
    (project / "config.py").write_text(TRAIN)
    main([*args, str(project / "config.py")])
    assert findings(capsys.readouterr().out) == findings(_uncached(project / "config.py", capsys))
    assert findings(_uncached(project / "config.py", capsys))


def _uncached(path: Path, capsys) -> str:
    main(["--no-cache", "--exit-zero", "--format", "json", str(path)])
    return capsys.readouterr().out


# -- the code fingerprint, kept with its sources' stamps ---------------------------------------------------
@pytest.fixture
def sources(tmp_path: Path, monkeypatch) -> list[Path]:
    folder = tmp_path / "src"
    folder.mkdir()
    files = [folder / "a.py", folder / "b.py"]
    for file in files:
        file.write_text(f"# {file.name}\n")
        os.utime(file, (PAST, PAST))
    monkeypatch.setattr(cache_module, "_sources", lambda: [(f.name, f) for f in files])
    cache_module.code_fingerprint.cache_clear()
    cache_module.remembered_fingerprint.cache_clear()
    yield files
    cache_module.code_fingerprint.cache_clear()
    cache_module.remembered_fingerprint.cache_clear()


def _fresh(folder: Path, secret: bytes = b"s" * 32) -> str:
    cache_module.code_fingerprint.cache_clear()
    cache_module.remembered_fingerprint.cache_clear()
    return cache_module.remembered_fingerprint(folder, secret)


def test_unchanged_sources_are_not_read_again(sources: list[Path], tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "c").mkdir()
    first = _fresh(tmp_path / "c")
    assert first == cache_module.code_fingerprint()
    reads = counting(monkeypatch, Path, "read_bytes")
    assert _fresh(tmp_path / "c") == first
    assert [r for r in reads if r[0] in sources] == []


def test_a_changed_source_changes_the_fingerprint(sources: list[Path], tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    first = _fresh(tmp_path / "c")
    sources[1].write_text("# b.py, a rule changed\n")
    os.utime(sources[1], (PAST + 60, PAST + 60))
    changed = _fresh(tmp_path / "c")
    assert changed != first and changed == cache_module.code_fingerprint()


def test_a_memo_signed_with_another_secret_is_not_believed(sources: list[Path], tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    real = _fresh(tmp_path / "c", b"a" * 32)
    memo = tmp_path / "c" / "fingerprint.json"
    payload = json.loads(memo.read_text())
    payload["fingerprint"] = "0" * 64
    memo.write_text(json.dumps(payload))
    assert _fresh(tmp_path / "c", b"a" * 32) == real
    assert _fresh(tmp_path / "c", b"b" * 32) == real


def test_a_source_too_recent_is_not_remembered(sources: list[Path], tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    os.utime(sources[0])  # now: an edit in the same clock tick could follow
    _fresh(tmp_path / "c")
    assert not (tmp_path / "c" / "fingerprint.json").exists()


def test_a_notebook_is_never_answered_by_the_gate(project: Path, tmp_path: Path, capsys) -> None:
    # a notebook's text is JSON, which CPython parses as one dict display: its code is in strings,
    # where the code gate finds none of the calls TL503 needs (it would rule every rule out)
    code = registry().get("TL503").invalid[0].code
    cell = {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": code}
    notebook = project / "train.ipynb"
    notebook.write_text(json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    expected = findings(_uncached(notebook, capsys))
    assert expected
    args = [
        "--jobs",
        "1",
        "--exit-zero",
        "--format",
        "json",
        "--cache-dir",
        str(tmp_path / "c"),
        str(notebook),
    ]
    for _ in ("cold", "warm"):
        main(args)
        assert findings(capsys.readouterr().out) == expected


# -- the raw prefilters are asked once per text --------------------------------------------------------
@pytest.mark.parametrize("text", ["def helper(x):\n    return x + 1\n", QUIET, TRAIN])
def test_no_prefilter_is_asked_twice_for_one_text(monkeypatch, text: str) -> None:
    """The key's question (``may_run_rules``) and the gate (of the key or of the lint) share answers."""
    from trainlint.gates import _ANSWERS, Gate

    _ANSWERS.clear()
    fired = counting(monkeypatch, Gate, "can_fire")
    in_project = counting(monkeypatch, Gate, "can_fire_in_project")
    may_run_rules(text, OPTIONS)
    engine._code_gate(text, OPTIONS)
    engine._code_gate(text, OPTIONS)
    for calls in (fired, in_project):
        asked = [gate.id for gate, _text in calls]
        assert asked and len(asked) == len(set(asked))


@pytest.mark.parametrize("text", ["def helper(x):\n    return x + 1\n", QUIET, TRAIN])
def test_shared_answers_give_the_verdict_of_fresh_ones(text: str) -> None:
    from trainlint.gates import _ANSWERS

    _ANSWERS.clear()
    fresh = engine._code_gate(text, OPTIONS)
    _ANSWERS.clear()
    may_run_rules(text, OPTIONS)
    again = engine._code_gate(text, OPTIONS)
    assert [g.id for g in again[0]] == [g.id for g in fresh[0]]
    assert [g.id for g in again[1]] == [g.id for g in fresh[1]]
