"""The prefilter data outside the rules (lint/gates_data.py) and the gate on CPython's tree: the data is
the rules' own, the call groups give the verdicts of the regular expressions they replaced, and a file
whose triggers are only in comments and docstrings is never handed to libcst, with the same findings."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, TORCH_PACKAGE

import trainlint.engine as engine
from trainlint import gates_data
from trainlint.engine import lint_text
from trainlint.gates import code_text, gates, record, rule_ids
from trainlint.results import LintOptions
from trainlint.rule import Call, Imports, registry

ALL = tuple(registry().ids())


def _examples() -> list[str]:
    out = []
    for rule in registry():
        out += [*rule.valid, *(example.code for example in rule.invalid)]
    return out + [p.read_text(encoding="utf-8") for p in sorted(FIXTURES.rglob("*.py"))]


def _torch_files(step: int) -> list[Path]:
    files = sorted(TORCH_PACKAGE.rglob("*.py"))[::step] if TORCH_PACKAGE.is_dir() else []
    return [p for p in files if p.stat().st_size < 200_000]


def test_the_prefilter_data_is_the_rules_own() -> None:
    expected = tuple(record(rule) for rule in registry())
    assert gates_data.RULES == expected, "stale: run python -m trainlint.gates"
    assert rule_ids() == ALL


@pytest.mark.parametrize("rule", [r for r in registry() if not r.engine_only], ids=lambda r: r.id)
def test_the_data_gives_the_rules_verdicts(rule) -> None:
    gate = gates()[rule.id]
    for text in _examples():
        assert gate.can_fire(text) == rule.can_fire(text)
        assert gate.can_fire_in_project(text) == rule.can_fire_in_project(text)


# -- call groups: find the name, then look around it ---------------------------------------------------
_AFTER = r"(?:[()#\\\t\n\r\f]| [ ()#\\\t\n\r\f])"


def _reference(group: Call) -> re.Pattern[str]:
    """The regular expression the group replaced (rule.py's ``call_pattern``/``method_call_pattern``)."""
    names = "|".join(map(re.escape, group.names))
    extra = "|" + "|".join(map(re.escape, group.or_tokens)) if group.or_tokens else ""
    before = r"[.\s]" if group.method else ""
    return re.compile(f"{before}(?:{names}){_AFTER}{extra}")


CALLS = sorted(
    {g for r in registry() for g in (*r.requires, *r.project_requires) if isinstance(g, Call)},
    key=repr,
)
ODD = [
    "x.backward(",
    "x.backward",
    "backward(",
    "x.\u00a0backward(",
    "x.\u2003step (",
    "x.step x",
    "x .step  (",
    "x.step \\\n(",
    "(x.step)()",
    "x.step #",
    "x.step\r\n",
    "x.step ",
    "xstep(",
    "x.steps(",
    "x.step\x0b(",
    "x\x1cstep(",
]


def test_call_groups_give_the_regular_expressions_verdicts() -> None:
    texts = _examples() + ODD + [p.read_text(encoding="utf-8", errors="replace") for p in _torch_files(4)]
    assert len(CALLS) > 5
    for group in CALLS:
        pattern = _reference(group)
        for text in texts:
            assert group.found(text) == (pattern.search(text) is not None), (group, text[:200])


def test_an_import_group_is_the_old_text_group_in_the_text_and_an_import_in_the_tree() -> None:
    group = Imports(("time", "timeit"))
    old = (" time", "\ttime", "\x0ctime", ",time", "\ntime", "\rtime")
    for text in [*_examples(), "time", "import os,time", "x\rtimeit", "xtime"]:
        assert group.found(text) == any(t in text for t in old), text
    code = code_text(ast.parse("import os.path, time as t\nfrom timeit import default_timer\n"))
    assert "\n\x01time\n" in code and "\n\x01timeit\n" in code and "\n\x01os\n" in code
    prose = code_text(ast.parse('"""At the same time as timeit."""\nx = time.time()  # import time\n'))
    assert "\x01" not in prose


# -- the gate ------------------------------------------------------------------------------------------
IN_PROSE = '''\
"""Train: loss.backward(), scaler.scale(loss), scaler.step(opt), scaler.update(), and
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) with torch.cuda.amp.autocast and
torch.utils.checkpoint.checkpoint(f, x); import time and torch.cuda.synchronize() - t0."""
import os

# loss.backward(); optimizer.step(); optimizer.zero_grad(); torch.cuda.empty_cache()
# model = DistributedDataParallel(model); sampler = DistributedSampler(data); time.time() - t0


def main(path):
    """Calls model.half() and torch.cuda.max_memory_allocated() for torch.optim.AdamW."""
    return os.path.exists(path)
'''


def test_triggers_only_in_comments_and_docstrings_never_reach_libcst() -> None:
    on = lint_text(IN_PROSE, "x.py", LintOptions(ALL))
    off = lint_text(IN_PROSE, "x.py", LintOptions(ALL, prefilter=False))
    text_only = [g.id for g in gates().values() if g.tokens and g.can_fire(IN_PROSE)]
    assert len(text_only) >= 5  # the raw-text prefilter alone would parse this file for these rules
    assert not on.parsed and off.parsed
    assert (on.findings, on.errors) == (off.findings, off.errors) == ([], [])


def test_the_same_trigger_in_code_reaches_libcst() -> None:
    # (a finding: the gate checks rule out code with the triggers in which no rule can report)
    steps = "scaler.scale(loss).backward()\n    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
    code = IN_PROSE.replace("return os.path.exists(path)", steps + "    scaler.step(opt)")
    code = code.replace("import os", "import os\nimport torch\nscaler = torch.cuda.amp.GradScaler()")
    done = lint_text(code, "x.py", LintOptions(ALL))
    assert done.parsed and [f.rule for f in done.findings] == ["TL101"]


def test_the_gate_never_changes_findings_on_real_code() -> None:
    """Files of the installed torch package that the raw-text prefilter sends to libcst: with the gate
    and with every rule run on every file, the same findings and problems."""
    files = [
        p for p in _torch_files(3) if any(g.can_fire(p.read_text(encoding="utf-8")) for g in gates().values())
    ]
    if not files:
        pytest.skip("torch is not installed")
    rejected = 0
    for path in files[::6]:
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(TORCH_PACKAGE).as_posix()
        on = lint_text(text, name, LintOptions(ALL))
        off = lint_text(text, name, LintOptions(ALL, prefilter=False))
        assert (on.findings, on.errors) == (off.findings, off.errors), name
        rejected += not on.parsed
    assert rejected  # the sample has files the gate keeps from libcst


# -- nothing heavy for a rejected file -----------------------------------------------------------------
LOADED = r"""
import sys
from trainlint.cli import run
code = run(sys.argv[1:])
heavy = sorted(m for m in sys.modules if m.split(".")[0] == "libcst" or m.startswith("trainlint.rules."))
print("LOADED", code, heavy)
"""


def _loaded(cwd: Path, *argv: str, stdin: str = "") -> tuple[int, list[str]]:
    done = subprocess.run(
        [sys.executable, "-c", LOADED, *argv],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = next(x for x in done.stdout.splitlines() if x.startswith("LOADED"))
    _, code, heavy = line.split(" ", 2)
    return int(code), ast.literal_eval(heavy)


def test_a_rejected_file_loads_neither_libcst_nor_a_rule(tmp_path: Path) -> None:
    (tmp_path / "prose.py").write_text(IN_PROSE)
    assert _loaded(tmp_path, "-", "--stdin-filename", "prose.py", stdin=IN_PROSE) == (0, [])
    assert _loaded(tmp_path, "--no-cache", "prose.py") == (0, [])
    assert _loaded(tmp_path, "--cache-dir", "c", ".") == (0, [])
    bad = "import torch\nfrom torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x)\n"
    code, heavy = _loaded(tmp_path, "-", "--stdin-filename", "bad.py", stdin=bad)
    assert code == 1 and "libcst" in heavy and any(m.startswith("trainlint.rules.") for m in heavy)


CHECKS_LOADED = r"""
import sys
from trainlint.gates import gates, tree_check
names = sorted({g.check for g in gates().values() if g.check})
for name in names:
    tree_check(name)
heavy = sorted(m for m in sys.modules if m.split(".")[0] == "libcst" or m.startswith("trainlint.rules."))
print("CHECKS", names, heavy)
"""


def test_the_gate_checks_load_neither_libcst_nor_a_rule() -> None:
    """``Rule.gate_check`` runs before libcst is needed: a file every check rules out must not pay for it."""
    done = subprocess.run([sys.executable, "-c", CHECKS_LOADED], capture_output=True, text=True, timeout=120)
    line = next(x for x in done.stdout.splitlines() if x.startswith("CHECKS"))
    names, heavy = line.split(" ", 1)[1].split("] ", 1)
    assert names.count(",") >= 3 and ast.literal_eval(heavy) == []


# -- large files: parsed in a child with bounded memory ------------------------------------------------
BIG = "import torch\nfrom torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x)\n" + "z = 1\n" * 3000


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and RLIMIT_AS: Linux only")
def test_a_large_file_is_parsed_in_a_bounded_child(monkeypatch: pytest.MonkeyPatch) -> None:
    in_process = lint_text(BIG, "big.py", LintOptions(ALL))
    monkeypatch.setattr(engine, "ISOLATED_BYTES", 1024)
    forks = []
    real_fork = engine.bounded.os.fork
    monkeypatch.setattr(engine.bounded.os, "fork", lambda: forks.append(1) or real_fork())
    isolated = lint_text(BIG, "big.py", LintOptions(ALL))
    assert forks and [f.rule for f in isolated.findings] == ["TL201"]
    assert (isolated.findings, isolated.errors) == (in_process.findings, in_process.errors)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and RLIMIT_AS: Linux only")
def test_a_parse_over_the_memory_limit_is_that_files_tl902(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "ISOLATED_BYTES", 1024)
    monkeypatch.setattr(engine, "PARSE_MEMORY", 1024 * 1024)  # far less than the parse needs
    monkeypatch.setattr(engine, "_STACK_BYTES", 1024 * 1024)
    huge = BIG + "z = 1\n" * 60_000  # libcst needs some 200 MB for it
    result = lint_text(huge, "big.py", LintOptions(ALL))
    assert [f.rule for f in result.findings] == ["TL902"], result
    assert "memory" in result.findings[0].message and not result.errors
    assert [f.rule for f in lint_text(BIG[:200], "small.py", LintOptions(ALL)).findings] == ["TL201"]


def test_tl402_needs_a_time_import_in_the_code_not_in_prose() -> None:
    body = "import torch\nt0 = time.time()\nloss.backward()\ndt = time.time() - t0\nx = torch.cuda.is_available()\n"
    prose = "# measured at the same time as the cuda kernels run\n" + body
    assert gates()["TL402"].can_fire(prose)  # " time" in the comment passes the raw-text prefilter
    assert not lint_text(prose, "x.py", LintOptions(("TL402",))).parsed
    assert lint_text("import time\n" + body, "x.py", LintOptions(("TL402",))).parsed


# -- identifiers CPython normalises ----------------------------------------------------------------------
# A full-width letter in an identifier is its ASCII letter in CPython's tree (NFKC) and stays as written
# in libcst's: a gate check that reads a name's absence (TL109: no scaler anywhere) would rule out a
# file the rule reports. Such a file gets no gate check.
FULL_WIDTH_SCALER = (
    "import torch\n"
    "\uff53caler = None\n"
    'with torch.autocast("cuda", dtype=torch.float16):\n'
    "    loss = model(x)\n"
    "loss.backward()\n"
)


def test_a_check_is_not_asked_where_cpython_respelled_an_identifier() -> None:
    from trainlint.gates import code_text, names_as_written

    tree = ast.parse(FULL_WIDTH_SCALER)
    assert not names_as_written(code_text(tree), FULL_WIDTH_SCALER)
    assert names_as_written(code_text(tree), FULL_WIDTH_SCALER.replace("\uff53", "s"))
    assert names_as_written(
        code_text(ast.parse("# \u00e9t\u00e9\nx = '\u00e9'\n")), "# \u00e9t\u00e9\nx = '\u00e9'\n"
    )
    on = lint_text(FULL_WIDTH_SCALER, "x.py", LintOptions(("TL109",)))
    off = lint_text(FULL_WIDTH_SCALER, "x.py", LintOptions(("TL109",), prefilter=False))
    assert [f.rule for f in off.findings] == ["TL109"] and on.findings == off.findings
