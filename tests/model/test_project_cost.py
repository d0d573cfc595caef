"""The project index's cost on a cold run (issues 13 and 20): a file no rule can run on needs no
dependency key, a run computes each key once, lookups are answered once per run, the callers question
summarises only files that name the function, the own file is read for its outline only, and the
collector stays off while summaries are built. Keys and findings stay those of the full work."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import pytest
from conftest import age, callers_project, counting

import trainlint.cache as cache_module
from trainlint.cache import ResultCache, may_run_rules
from trainlint.engine import lint_text
from trainlint.model import project as project_module
from trainlint.model.project import Project, dependency_key, forget_indexes
from trainlint.model.summary import outline, summarize
from trainlint.results import LintOptions
from trainlint.rule import registry

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = LintOptions(tuple(registry().ids()))
PAST = time.time() - 3600
HALF = "def convert(m):\n    m.half()\n"
TRAIN = (
    "import torch\nfrom helpers import convert\n\n"
    "def train(model, loader, opt):\n    convert(model)\n    scaler = torch.cuda.amp.GradScaler()\n"
    "    for x in loader:\n        scaler.scale(model(x)).backward()\n"
    "        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n        scaler.step(opt)\n"
)
PLAIN = "from helpers import convert\n\nVALUE = 1\n"  # imports from the project, but no rule can run


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "p"
    root.mkdir()
    (root / "pyproject.toml").write_text("")
    (root / "helpers.py").write_text(HALF)
    (root / "train.py").write_text(TRAIN)
    (root / "plain.py").write_text(PLAIN)
    age(root)
    forget_indexes()
    return root


def job(root: Path, name: str) -> tuple[str, str, LintOptions]:
    return (str(root / name), name, OPTIONS)


# -- which files need a dependency key, and how often it is computed --------------------------------------
def test_a_file_no_rule_can_run_on_keeps_its_plain_key(project: Path, tmp_path: Path, monkeypatch) -> None:
    assert not may_run_rules(PLAIN, OPTIONS) and may_run_rules(TRAIN, OPTIONS)
    calls = counting(monkeypatch, cache_module, "dependency_key")
    cache = ResultCache(tmp_path / "c")
    plain = cache.key(job(project, "plain.py"), PLAIN)
    assert calls == []
    salted = f"{PLAIN}\0no rules"
    assert plain == cache_module.entry_key(cache.fingerprint, "plain.py", OPTIONS, salted, cache.secret)
    assert cache.key(job(project, "train.py"), TRAIN) is None  # (its lint's recording keys it)
    train = cache.key(job(project, "train.py"), TRAIN, gate=False)  # (a store without a recording)
    assert [c[0] for c in calls] == [str(project / "train.py")]
    assert train != cache_module.entry_key(
        cache.fingerprint, "train.py", OPTIONS, f"{TRAIN}\0no rules", cache.secret
    )


def test_a_warm_lookup_of_a_file_no_rule_can_run_on_asks_no_prefilter(
    project: Path, tmp_path: Path, monkeypatch
) -> None:
    cache = ResultCache(tmp_path / "c")
    jobs = {name: job(project, name) for name in ("plain.py", "train.py")}
    for name, text in (("plain.py", PLAIN), ("train.py", TRAIN)):
        cache.get(jobs[name])
        cache.store(jobs[name], text, lint_text(text, name, OPTIONS))
    forget_indexes()
    warm = ResultCache(tmp_path / "c")
    with monkeypatch.context() as patched:
        patched.setattr(cache_module, "may_run_rules", lambda *_: pytest.fail("prefilter asked"))
        assert warm.get(jobs["plain.py"]) is not None
        hit = warm.get(jobs["train.py"])  # (its dependency record holds: keyed with it again)
    assert hit is not None and [f.rule for f in hit[0].findings] == ["TL101"]


def test_a_run_computes_each_key_once_for_its_lookup_and_its_store(
    project: Path, tmp_path: Path, monkeypatch
) -> None:
    """A run looks every file up before it lints the misses: a file with an active rule is keyed by
    its lint's recording, and no key of every import is computed, at the lookup or the store."""
    (project / "step.py").write_text(TRAIN.replace("def train", "def step"))
    age(project)
    calls = counting(monkeypatch, cache_module, "dependency_key")
    cache = ResultCache(tmp_path / "c")
    jobs = [job(project, "train.py"), job(project, "step.py")]
    texts = [TRAIN, TRAIN.replace("def train", "def step")]
    assert [cache.get(j) for j in jobs] == [None, None]
    for j, text in zip(jobs, texts, strict=True):
        with cache.recording(j, text) as found:
            result = lint_text(text, j[1], OPTIONS)
        cache.store(j, text, result, found)
    assert calls == []
    assert all(cache.get(j) is not None for j in jobs)  # stored under the keys the records give


def test_files_no_rule_can_run_on_have_no_finding_of_a_rule() -> None:
    """``may_run_rules`` is the engine's own first decision: on every fixture (the cross-file projects
    included) a file it turns away gets no rule's finding, so its outcome rests on no other file."""
    turned_away = 0
    for path in sorted((ROOT / "fixtures").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if may_run_rules(text, OPTIONS):
            continue
        turned_away += 1
        findings = lint_text(text, str(path), OPTIONS).findings
        assert {f.rule for f in findings} <= {"TL901", "TL902"}, path
    assert turned_away
    unfiltered = LintOptions(OPTIONS.rule_ids, prefilter=False)
    assert may_run_rules(PLAIN, unfiltered)  # without the prefilter every rule runs


# -- lookups, the callers question, the own file's outline, the collector --------------------------------
def test_a_runs_lookups_are_answered_once_and_a_later_run_sees_a_new_module(
    tmp_path: Path, monkeypatch
) -> None:
    root = tmp_path / "p"
    (root / "src").mkdir(parents=True)
    (root / "pyproject.toml").write_text("")
    (root / "src" / "helpers.py").write_text(HALF)
    text = "from helpers import convert\n"
    for name in ("a.py", "b.py"):
        (root / name).write_text(text)
    age(root)
    forget_indexes()
    store, batch = tmp_path / "store", object()
    lookups = counting(monkeypatch, project_module.ProjectIndex, "_module_file")
    first = dependency_key(str(root / "a.py"), text, store, batch)
    asked = len(lookups)
    assert dependency_key(str(root / "b.py"), text, store, batch) == first  # (one folder: same facts)
    assert len(lookups) == asked  # b.py's questions were a.py's
    # a module added where lookups look first: this run's answer stands, its record does not
    (root / "helpers.py").write_text("def convert(m):\n    m.float()\n")
    os.utime(root / "helpers.py", (PAST, PAST))
    os.utime(root, (PAST + 10, PAST + 10))
    os.utime(root / "b.py", (PAST + 10, PAST + 10))  # (b.py's record must be gathered again)
    assert dependency_key(str(root / "b.py"), text, store, batch) == first
    forget_indexes()
    later = dependency_key(str(root / "b.py"), text, store, object())
    forget_indexes()
    reference = dependency_key(str(root / "b.py"), text, tmp_path / "empty-store")
    assert later == reference != first


def test_the_callers_question_summarises_only_files_naming_the_function(tmp_path: Path, monkeypatch) -> None:
    root = callers_project(tmp_path / "p")
    forget_indexes()
    summarised = counting(monkeypatch, project_module, "summarize")
    project = Project.for_file(str(root / "train.py"))
    assert project is not None
    calls = project.callers(root / "train.py", "scaled_step")
    assert [(Path(path).name, call["callee"]) for path, call in calls] == [("a.py", "scaled_step")]
    assert len(summarised) == 1 and "scaled_step" in summarised[0][0]  # a.py's text only


def test_the_own_file_is_read_for_its_outline_not_summarised(
    project: Path, tmp_path: Path, monkeypatch
) -> None:
    summarised = counting(monkeypatch, project_module, "summarize")
    assert dependency_key(str(project / "train.py"), TRAIN, tmp_path / "store")
    assert [texts[0] for texts in summarised] == [HALF]  # the helper's facts, not the file's own


@pytest.mark.parametrize("path", sorted((ROOT / "fixtures").rglob("*.py")), ids=lambda p: p.name)
def test_the_outline_is_the_summarys_imports_and_parameters(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    full, brief = summarize(text), outline(text)
    if full is None:  # (a fixture CPython cannot parse)
        assert brief is None
        return
    assert brief is not None
    assert brief["imports"] == full["imports"]
    # (methods too: an updater's method may receive the GradScaler, see ``receives_scaler``)
    top = {name: {"params": facts["params"]} for name, facts in full["functions"].items()}
    assert brief["functions"] == top


def test_the_collector_is_off_while_summaries_are_built(project: Path, tmp_path: Path, monkeypatch) -> None:
    seen: list[bool] = []
    original = project_module.summarize
    monkeypatch.setattr(project_module, "summarize", lambda *a: seen.append(gc.isenabled()) or original(*a))
    assert gc.isenabled()
    assert dependency_key(str(project / "train.py"), TRAIN, tmp_path / "store")
    assert seen == [False] and gc.isenabled()
    gc.disable()  # a caller that turned it off keeps it off
    try:
        forget_indexes()
        dependency_key(str(project / "train.py"), TRAIN, tmp_path / "store2")
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_edit_that_keeps_the_imports_keeps_the_recorded_dependencies(
    project: Path, tmp_path: Path, monkeypatch
) -> None:
    """Pre-commit's case: the changed file's text is new, its imports are not."""
    store = tmp_path / "store"
    main = project / "train.py"
    first = dependency_key(str(main), TRAIN, store)
    edited = TRAIN + "\n# reviewed\n\ndef log(step):\n    print(step)\n"
    with monkeypatch.context() as patched:
        patched.setattr(project_module.ProjectIndex, "imported_file", lambda *_: pytest.fail("gathered"))
        forget_indexes()
        assert dependency_key(str(main), edited, store) == first
    forget_indexes()
    assert first == dependency_key(str(main), edited, tmp_path / "empty-store")
    # a new parameter that receives a GradScaler: the callers of that function now count
    scaled = TRAIN.replace("def train(model, loader, opt)", "def train(model, loader, opt, scaler)")
    forget_indexes()
    assert dependency_key(str(main), scaled, store) != first
    # a new import: gathered afresh
    imported = "import plain\n" + TRAIN
    forget_indexes()
    fresh = dependency_key(str(main), imported, store)
    forget_indexes()
    assert fresh == dependency_key(str(main), imported, tmp_path / "empty-store2") != first
