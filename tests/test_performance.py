"""The speed machinery never changes results: result cache, prefilter, worker processes, fast traversal.

Nothing here is timed (bench/run.py measures speed); a CI smoke run of the benchmark script is at the end.
"""

from __future__ import annotations

import ast
import concurrent.futures
import inspect
import json
import os
import random
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import libcst as cst
import pytest

import trainlint.cli as cli
import trainlint.engine as engine
from trainlint.cache import ResultCache
from trainlint.engine import FileResult, LintOptions, lint_text
from trainlint.files import read_source
from trainlint.model import FileModel, walk, walk_scope
from trainlint.model.filemodel import _BUILDER_SKIPS, _Builder
from trainlint.model.syntax import child_fields
from trainlint.results import Problem, ProblemKind
from trainlint.rule import registry

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"
ALL_IDS = tuple(registry().ids())
RULES = [r for r in registry() if not r.engine_only]

BAD = "from torch.utils.checkpoint import checkpoint\n\ndef forward(block, x):\n    return checkpoint(block, x)\n"
FIXED = BAD.replace("checkpoint(block, x)", "checkpoint(block, x, use_reentrant=False)")

# Building blocks for the generated tree: real training-loop shapes, and files that stop early.
SNIPPETS = (
    "import torch\nscaler = torch.cuda.amp.GradScaler()\nfor x, y in loader:\n"
    "    with torch.autocast('cuda', dtype=torch.float16):\n        loss = model(x).float().mean()\n"
    "    scaler.scale(loss).backward()\n    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
    "    scaler.step(opt)\n    scaler.update()\n    opt.zero_grad()\n",
    "from torch.utils.checkpoint import checkpoint\n\ndef run(blocks, h):\n    for b in blocks:\n"
    "        h = checkpoint(b, h)\n    return h\n",
    "import torch\nmodel = model.half()\nopt = torch.optim.AdamW(model.parameters())\nfor x in data:\n"
    "    opt.zero_grad()\n    model(x.half()).sum().backward()\n    opt.step()\n",
    "total = 0\nfor i, (x, y) in enumerate(loader):\n    loss = crit(model(x), y) / accum\n"
    "    total += loss\n    loss.backward()\n    if (i + 1) % accum == 0:\n        opt.step()\n        opt.zero_grad()\n",
    "import time\nimport torch\nt0 = time.time()\nout = model(x.cuda())\nelapsed = time.time() - t0\n",
    "import torch\nfor step in range(10):\n    torch.cuda.empty_cache()\n    peak = torch.cuda.max_memory_allocated()\n",
    "def helper(values):\n    '''Nothing a rule looks at.'''\n    return sorted(v * 2 for v in values)\n",
    "global counter\ncounter = 0\n\ndef bump():\n    global counter\n    counter += 1\n",
    "class Config:\n    lr: float = 1e-3\n    warmup = 100\n\n    @property\n    def steps(self):\n        return self.warmup * 10\n",
    "import torch.nn.functional as F\nscores = q @ k.transpose(-2, -1) / d ** 0.5\nout = F.softmax(scores, dim=-1) @ v\n",
)
BROKEN = {
    "syntax_error.py": b"def train(:\n    pass\n",
    "syntax_error_with_tokens.py": b"loss.backward(\nscaler.step(opt\n",
    "latin1_no_cookie.py": b"name = '\xe9t\xe9'\nloss.backward()\n",
    "latin1_cookie.py": b"# -*- coding: latin-1 -*-\nname = '\xe9t\xe9'\nloss.backward()\n",
    "empty.py": b"",
    "bom.py": b"\xef\xbb\xbfimport torch\nx = torch.ones(2).half()\n",
    "bytes_concat.py": b"x = b'a' 'b'\nloss.backward()\n",
}


def example_sources() -> list[tuple[str, str]]:
    out = []
    for rule in RULES:
        for i, code in enumerate(rule.valid):
            out.append((f"{rule.id}_valid_{i}.py", code))
        for i, example in enumerate(rule.invalid):
            out.append((f"{rule.id}_invalid_{i}.py", example.code))
    return out


def make_tree(root: Path, generated: int = 60) -> Path:
    """Every rule's embedded examples, the fixtures, broken files, and a seeded random tree; over
    64 KiB in all, so that ``--jobs 2`` really starts worker processes."""
    (root / "examples").mkdir(parents=True)
    for name, code in example_sources():
        (root / "examples" / name).write_text(code, encoding="utf-8")
    if FIXTURES.is_dir():
        (root / "fixtures").mkdir()
        for path in sorted(FIXTURES.rglob("*.py")):
            (root / "fixtures" / path.name).write_bytes(path.read_bytes())
    (root / "broken").mkdir()
    for name, data in BROKEN.items():
        (root / "broken" / name).write_bytes(data)
    rng = random.Random(5)
    for i in range(generated):
        folder = root / "generated" / f"pkg{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        parts = [rng.choice(SNIPPETS) for _ in range(rng.randint(1, 12))]
        (folder / f"mod{i}.py").write_text("\n\n".join(parts), encoding="utf-8")
    return root


def tree_size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.py"))


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_tree(tmp_path_factory.mktemp("perf") / "tree")
    assert tree_size(root) > 64 * 1024  # else --jobs 2 would lint in-process and prove nothing
    return root


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    cli.run(["--format", "json", "--exit-zero", *argv])
    payload = json.loads(capsys.readouterr().out)
    payload["summary"].pop("elapsed_s")
    return payload


@pytest.fixture
def in_tree(tree: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tree.parent)
    return tree


@pytest.fixture
def baseline(in_tree: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    return cli_json(capsys, "--no-cache", "--jobs", "1", in_tree.name)


@pytest.fixture
def lint_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Paths linted in this process (``--jobs 1`` lints in-process)."""
    calls: list[str] = []
    real = engine.lint_text

    def counting(text: str, path: str, options: LintOptions) -> FileResult:
        calls.append(path)
        return real(text, path, options)

    monkeypatch.setattr(engine, "lint_text", counting)  # the CLI imports it where it lints
    return calls


# -- workers, cache and prefilter never change findings -----------------------------------------------


def test_baseline_is_not_trivial(baseline: dict) -> None:
    rules_found = {f["rule"] for f in baseline["findings"]}
    assert len(rules_found) >= 10, rules_found  # the comparisons below compare real findings
    assert {"TL901", "TL902"} <= rules_found
    assert baseline["summary"]["files"] > 400


def test_two_workers_give_the_same_output_in_the_same_order(in_tree, baseline, capsys, monkeypatch) -> None:
    pools: list[int] = []
    real_pool = concurrent.futures.ProcessPoolExecutor

    class CountingPool(real_pool):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs) -> None:
            pools.append(kwargs.get("max_workers") or args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", CountingPool)  # imported when needed
    assert cli_json(capsys, "--no-cache", "--jobs", "2", in_tree.name) == baseline
    assert pools == [2]  # the comparison went through worker processes


def test_cold_and_warm_cache_give_the_same_output(in_tree, baseline, capsys, tmp_path, lint_calls) -> None:
    cache = tmp_path / "cache"
    assert cli_json(capsys, "--cache-dir", str(cache), "--jobs", "2", in_tree.name) == baseline
    lint_calls.clear()
    assert cli_json(capsys, "--cache-dir", str(cache), "--jobs", "1", in_tree.name) == baseline
    assert lint_calls == []  # everything came from the cache
    assert cli_json(capsys, "--cache-dir", str(cache), "--jobs", "2", in_tree.name) == baseline


WARM_PROBE = """
import sys
from trainlint.cli import main
code = main(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m == "libcst" or m.startswith(("trainlint.rules.", "rich")))
print("LOADED", code, loaded)
"""


def test_a_run_answered_from_the_cache_loads_neither_libcst_nor_the_rules(tmp_path: Path) -> None:
    """The warm path: nothing changed, so nothing needs parsing, rules or rich (see README, Performance)."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text(BAD)
    (tmp_path / "src" / "other.py").write_text(FIXED)
    (tmp_path / "clean").mkdir()
    (tmp_path / "clean" / "other.py").write_text(FIXED)
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}

    def probe(*argv: str) -> tuple[int, list[str], str]:
        done = subprocess.run(
            [sys.executable, "-c", WARM_PROBE, "--cache-dir", "cache", *argv],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        line = next(x for x in done.stdout.splitlines() if x.startswith("LOADED"))
        _, code, loaded = line.split(" ", 2)
        return int(code), ast.literal_eval(loaded), done.stdout

    code, loaded, _ = probe("--select", "TL2", "src", "clean")
    assert code == 1 and "libcst" in loaded  # cold: parsed and linted
    code, loaded, out = probe("--select", "TL2", "src", "clean")
    assert code == 1 and loaded and all(m.startswith("rich") for m in loaded)  # rich draws the finding
    assert "src/train.py:4:12: TL201" in out  # the finding, with its code frame, from the cache
    code, loaded, out = probe("--select", "TL2", "clean")
    assert (code, loaded) == (0, [])  # nothing to draw: not even rich
    assert "All checks passed! (1 file checked)" in out
    code, loaded, _ = probe("--select", "TL1,TL2", "clean")  # another rule set: linted afresh (parsed
    assert code == 0 and "libcst" in loaded  # for TL201, whose names are in its code)
    code, _, out = probe("--select", "TL999", "clean")  # selectors are checked against the recorded ids
    assert code == 2


def test_the_uncoloured_summary_is_riches_without_markup(tmp_path, capsys, monkeypatch) -> None:
    from rich.text import Text

    from trainlint.report import RunReport
    from trainlint.report.text import summary_line

    monkeypatch.chdir(tmp_path)
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text(FIXED)
    assert cli.run(["--no-cache", "--jobs", "1", "."]) == 0
    plain = capsys.readouterr().out
    assert plain == Text.from_markup(summary_line(RunReport([], [], 2, 0.0, {}))).plain + "\n"


def test_text_output_with_code_frames_is_the_same_from_the_cache(in_tree, capsys, tmp_path) -> None:
    def text(*argv: str) -> str:
        cli.run(["--exit-zero", "--jobs", "1", *argv, in_tree.name])
        return capsys.readouterr().out

    fresh = text("--no-cache")
    cache = str(tmp_path / "cache")
    text("--cache-dir", cache)
    assert text("--cache-dir", cache) == fresh
    assert "^" in fresh  # there are code frames to compare


def test_prefilter_never_changes_findings(tree: Path) -> None:
    files = sorted(tree.rglob("*.py"))
    compared = 0
    for path in files:
        source = read_source(path).text
        if source is None:
            continue
        name = path.relative_to(tree).as_posix()
        on = lint_text(source, name, LintOptions(ALL_IDS))
        off = lint_text(source, name, LintOptions(ALL_IDS, prefilter=False))
        assert on.findings == off.findings, name
        assert on.errors == off.errors, name
        compared += 1
    assert compared > 400


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.id)
def test_prefilter_with_one_rule_selected(rule) -> None:
    """With one rule the prefilter may skip libcst altogether: syntax errors must still be reported."""
    ids = (rule.id, "TL901", "TL902")
    sources = [*rule.valid, *(example.code for example in rule.invalid)]
    sources += [p.read_text(encoding="utf-8") for p in sorted(FIXTURES.rglob("*.py"))]
    sources += [data.decode("latin-1") for data in BROKEN.values()]
    for code in sources:
        on = lint_text(code, "x.py", LintOptions(ids))
        off = lint_text(code, "x.py", LintOptions(ids, prefilter=False))
        assert (on.findings, on.errors) == (off.findings, off.errors), code


# -- cache invalidation ---------------------------------------------------------------------------------


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text(BAD)
    (tmp_path / "src" / "other.py").write_text(FIXED)
    return tmp_path


def rules_of(payload: dict) -> list[tuple[str, str, int]]:
    return [(f["rule"], f["path"], f["line"]) for f in payload["findings"]]


def test_a_changed_file_is_linted_again(project, capsys, lint_calls) -> None:
    args = ("--cache-dir", "c", "--jobs", "1", "src")
    assert rules_of(cli_json(capsys, *args)) == [("TL201", "src/train.py", 4)]
    (project / "src" / "train.py").write_text(FIXED)
    lint_calls.clear()
    assert rules_of(cli_json(capsys, *args)) == []
    assert lint_calls == ["src/train.py"]
    (project / "src" / "train.py").write_text(BAD)  # back to content the cache has seen
    lint_calls.clear()
    assert rules_of(cli_json(capsys, *args)) == [("TL201", "src/train.py", 4)]
    assert lint_calls == []


@pytest.mark.parametrize(
    "selection",
    [("--select", "TL202"), ("--ignore", "TL201"), ("--select", "TL2"), ("--extend-select", "ALL")],
)
def test_a_changed_rule_selection_is_never_served_stale(project, capsys, selection) -> None:
    (project / "src" / "reentrant.py").write_text(
        "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x, use_reentrant=True)\n"
    )
    cli_json(capsys, "--cache-dir", "c", "src")  # fill the cache with the default selection
    cached = cli_json(capsys, "--cache-dir", "c", *selection, "src")
    assert cached == cli_json(capsys, "--no-cache", *selection, "src")


@pytest.mark.parametrize(
    "config",
    [
        '[tool.trainlint]\nseverity = { TL201 = "error" }\n',
        '[tool.trainlint]\nignore = ["TL201"]\n',
        '[tool.trainlint]\nper-file-ignores = { "src/train.py" = ["TL201"] }\n',
        '[tool.trainlint]\nselect = ["TL202"]\n',
    ],
)
def test_a_changed_configuration_is_never_served_stale(project, capsys, config) -> None:
    before = cli_json(capsys, "--cache-dir", "c", "src")
    (project / "pyproject.toml").write_text(config)
    cached = cli_json(capsys, "--cache-dir", "c", "src")
    assert cached == cli_json(capsys, "--no-cache", "src")
    assert cached != before


def test_other_trainlint_code_never_reads_these_entries(tmp_path: Path) -> None:
    path = tmp_path / "a.py"
    path.write_text(BAD)
    job = (str(path), "a.py", LintOptions(ALL_IDS))
    old = ResultCache(tmp_path / "c", fingerprint="a" * 64)
    result = lint_text(BAD, "a.py", job[2])
    old.store(job, BAD, result)
    assert old.get(job) is not None
    assert ResultCache(tmp_path / "c", fingerprint="b" * 64).get(job) is None


def test_an_entry_is_keyed_by_the_text_that_was_linted(tmp_path: Path) -> None:
    """A file edited while it is being linted: the entry describes the old text, never the new one."""
    path = tmp_path / "a.py"
    path.write_text(BAD)
    job = (str(path), "a.py", LintOptions(ALL_IDS))
    cache = ResultCache(tmp_path / "c")
    result, _ = cli._lint_one(job, cache)
    assert [f.rule for f in result.findings] == ["TL201"]
    path.write_text(FIXED)  # the edit lands after the worker read the file
    assert cache.get(job) is None
    path.write_text(BAD)
    hit = cache.get(job)
    assert hit is not None and hit[0].findings == result.findings and hit[1] == BAD


def test_failures_and_unreadable_files_are_not_cached(tmp_path: Path) -> None:
    cache = ResultCache(tmp_path / "c")
    path = tmp_path / "a.py"
    path.write_text(BAD)
    job = (str(path), "a.py", LintOptions(ALL_IDS))
    failed = FileResult(
        "a.py", errors=[Problem(ProblemKind.INTERNAL, "a.py", "internal error in TL201: boom")]
    )
    cache.store(job, BAD, failed)
    assert cache.get(job) is None
    binary = tmp_path / "b.py"
    binary.write_bytes(b"x = 1\x00\n")
    bjob = (str(binary), "b.py", LintOptions(ALL_IDS))
    result, _ = cli._lint_one(bjob, cache)
    assert [f.rule for f in result.findings] == ["TL902"]
    assert cache.get(bjob) is None
    assert not list((tmp_path / "c").rglob("*.json"))


def test_damaged_entries_are_misses_and_get_rewritten(in_tree, baseline, capsys, tmp_path) -> None:
    cache = tmp_path / "cache"
    cli_json(capsys, "--cache-dir", str(cache), in_tree.name)
    entries = sorted(cache.rglob("*.json"))
    assert entries
    for i, entry in enumerate(entries):
        entry.write_text(["", "{", '{"findings": 3}', "[]"][i % 4])
    assert cli_json(capsys, "--cache-dir", str(cache), in_tree.name) == baseline
    for entry in entries:
        json.loads(entry.read_text())  # rewritten whole
    assert cli_json(capsys, "--cache-dir", str(cache), in_tree.name) == baseline


def test_stale_versions_are_removed_and_foreign_folders_kept(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    stale, recent, foreign = folder / ("0" * 16), folder / ("1" * 16), folder / "foreign"
    for f in (stale, recent, foreign):
        (f / "ab").mkdir(parents=True)
    for f in (stale, recent):
        (f / ".last-used").touch()
    old = 30 * 24 * 3600
    os.utime(stale / ".last-used", (os.path.getmtime(stale) - old,) * 2)
    path = tmp_path / "a.py"
    path.write_text(FIXED)
    job = (str(path), "a.py", LintOptions(ALL_IDS))
    ResultCache(folder).store(job, FIXED, lint_text(FIXED, "a.py", job[2]))
    assert not stale.exists()
    assert recent.exists() and foreign.exists()
    assert (folder / ".gitignore").read_text() == "*\n"


# -- concurrency ------------------------------------------------------------------------------------------


def test_concurrent_runs_sharing_one_cache_folder(in_tree, baseline, tmp_path) -> None:
    cache = tmp_path / "shared-cache"
    command = [
        sys.executable,
        "-m",
        "trainlint",
        "--format",
        "json",
        "--exit-zero",
        "--cache-dir",
        str(cache),
    ]
    runs = [
        subprocess.Popen(
            [*command, "--jobs", str(1 + i % 2), in_tree.name],
            cwd=in_tree.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    for process in runs:
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err
        payload = json.loads(out)
        payload["summary"].pop("elapsed_s")
        assert payload == baseline
    assert not [p for p in cache.rglob("*") if p.name.endswith(".tmp")]
    for entry in cache.rglob("*.json"):
        json.loads(entry.read_text())
    warm = subprocess.run(
        [*command, in_tree.name], cwd=in_tree.parent, capture_output=True, text=True, timeout=600
    )
    payload = json.loads(warm.stdout)
    payload["summary"].pop("elapsed_s")
    assert payload == baseline


def test_threads_storing_the_same_entries_concurrently(tmp_path: Path) -> None:
    cache = ResultCache(tmp_path / "c")
    jobs = []
    for i in range(8):
        path = tmp_path / f"m{i}.py"
        code = BAD if i % 2 else FIXED
        path.write_text(code)
        job = (str(path), path.name, LintOptions(ALL_IDS))
        jobs.append((job, code, lint_text(code, path.name, job[2])))

    def writer() -> None:
        for _ in range(20):
            for job, code, result in jobs:
                cache.store(job, code, result)

    threads = [threading.Thread(target=writer) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for job, _code, result in jobs:
        hit = cache.get(job)
        assert hit is not None and hit[0].findings == result.findings


# -- the fast traversal matches libcst's --------------------------------------------------------------


def _libcst_visit_orders() -> dict[str, list[str]]:
    """For every node class: the fields libcst's own traversal visits, in its order, read from the
    source of ``_visit_and_replace_children``."""
    orders: dict[str, list[str]] = {}
    for name in dir(cst):
        cls = getattr(cst, name)
        if not (isinstance(cls, type) and issubclass(cls, cst.CSTNode)):
            continue
        method = cls.__dict__.get("_visit_and_replace_children")
        if method is None:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
        seen: list[str] = []

        def collect(node: ast.AST, seen: list[str] = seen) -> None:
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id.startswith("visit_") and len(node.args) >= 2:
                    field = node.args[1]
                    if isinstance(field, ast.Constant) and field.value not in seen:
                        seen.append(field.value)
            for child in ast.iter_child_nodes(node):
                collect(child)

        collect(tree)
        orders[name] = seen
    return orders


def test_child_fields_follow_libcsts_source_order() -> None:
    orders = _libcst_visit_orders()
    assert len(orders) > 100
    for name, libcst_order in orders.items():
        ours = child_fields(getattr(cst, name))
        # (our extra fields hold plain values, never nodes, or libcst would visit them)
        assert [f for f in libcst_order if f in ours] == [f for f in ours if f in libcst_order], name


def test_nodes_the_builder_skips_never_have_syntax_children() -> None:
    orders = _libcst_visit_orders()
    for cls in _BUILDER_SKIPS:
        assert not set(child_fields(cls)) & set(orders.get(cls.__name__, ())), cls.__name__
        assert not any(hasattr(_Builder, f"{kind}_{cls.__name__}") for kind in ("visit", "leave"))


TRIVIA = (
    cst.BaseParenthesizableWhitespace,
    cst.TrailingWhitespace,
    cst.EmptyLine,
    cst.Comment,
    cst.Newline,
    cst.LeftParen,
    cst.RightParen,
    cst.LeftSquareBracket,
    cst.RightSquareBracket,
    cst.LeftCurlyBrace,
    cst.RightCurlyBrace,
    cst.Comma,
    cst.Dot,
    cst.Colon,
    cst.Semicolon,
    cst.AssignEqual,
    cst.Asynchronous,
)

SYNTAX_TOUR = '''\
"""Docstring."""
from __future__ import annotations
import a.b as c, d
from .e import (f as g, h)
from . import *
@deco(1, *args, k=2, **kw)
@other
class K(Base, metaclass=Meta):
    x: int = 1
    @property
    def m(self, a, /, b=2, *c, d, e=3, **f) -> int:
        global G
        nonlocal_ = lambda p, q=1, *r, s, **t: p if q else s
        return [i * 2 for i in range(3) if i for j in k] or {k: v for k, v in d.items()}
async def co(x):
    async with a as (b, c), d:
        async for i in x:
            await y
    yield from z
    return (yield)
try:
    pass
except (A, B) as e:
    raise C from e
else:
    del q[1:2:3], r.s
finally:
    assert x, "m"
try:
    pass
except* D:
    pass
while (n := n - 1) > 0 and not done or -x ** 2 >= y is not z:
    if a: continue
    elif b: break
    else: pass
match cmd:
    case [1, *rest] if rest: pass
    case {"k": v, **kw}: pass
    case Point(x=0, y=_) | None: pass
    case str() as s: pass
x = f"{a!r:>{w}} {b=}" "c"; bb = b"d"[::2]
y = a if b else c; z = {1, 2}; t = (1,); u = ...
def generic[T: int, *Ts, **P](x: T) -> T: return x
type Alias[T] = list[T]
with (open(a) as f, open(b) as g): pass
for i, (j, *k) in enumerate(x): print(i, end="")
'''


def _libcst_order(module: cst.Module) -> list[int]:
    order: list[int] = []

    class Recorder(cst.CSTVisitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            if not isinstance(node, TRIVIA):
                order.append(id(node))
            return True

    module.visit(Recorder())
    return order


def test_walk_visits_libcsts_nodes_in_libcsts_order_less_trivia() -> None:
    sources = [SYNTAX_TOUR] + [code for _, code in example_sources()]
    sources += [p.read_text(encoding="utf-8") for p in sorted(FIXTURES.rglob("*.py"))]
    for source in sources:
        module = cst.parse_module(source)
        assert [id(n) for n in walk(module)] == _libcst_order(module), source[:200]


def test_positions_are_libcsts_for_every_node() -> None:
    """The model's own position pass gives what libcst's PositionProvider gives, node for node."""
    from libcst.metadata import MetadataWrapper, PositionProvider

    sources = [text for _, text in example_sources()]
    sources += [p.read_text(encoding="utf-8") for p in sorted(FIXTURES.glob("*.py"))]
    sources += ["x = 1\r\ny = (1,\r 2)\n", "if x:\n\tpass\n# trailing\n", "", "\n\n", "a = '''\nb\n'''  # c"]
    nodes = 0
    for text in sources:
        module = cst.parse_module(text)
        expected = dict(MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider))
        model = FileModel(module, "x.py", text)
        for node, where in expected.items():
            assert model.position(node) == where, (text, type(node).__name__)
        nodes += len(expected)
    assert nodes > 10_000


def test_walk_scope_stops_at_nested_definitions() -> None:
    module = cst.parse_module("def f():\n    g()\n    def h():\n        k()\n    lambda: m()\n")
    func = module.body[0]
    nodes = list(walk_scope(func))
    names = {n.value for n in nodes if isinstance(n, cst.Name)}
    assert "g" in names
    assert not {"k", "m"} & names
    assert any(isinstance(n, cst.FunctionDef) and n.name.value == "h" for n in nodes)
    assert any(isinstance(n, cst.Lambda) for n in nodes)


def test_module_level_global_statement_does_not_hang() -> None:
    """``global x`` at module level is legal; name lookup used to loop forever on it."""
    model = FileModel.from_source("global x\nimport torch as x\ny = x.nn.Linear(2, 2)\n")
    done: list[str | None] = []
    worker = threading.Thread(
        target=lambda: done.append(model.qualname(model.calls[0].node.func, model.module_scope)),
        daemon=True,
    )
    worker.start()
    worker.join(timeout=10)
    assert done == ["torch.nn.Linear"]


# -- the benchmark script (a smoke run: no comparison venv, no network) ----------------------------------


def test_benchmark_smoke_run(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.py").write_text(BAD)
    (corpus / "clean.py").write_text(FIXED)
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "run.py"),
            "--tools",
            "trainlint,libcst",
            "--rounds",
            "1",
            "--no-warmup",
            "--json",
            str(out),
            str(corpus),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "installing" not in done.stderr  # nothing to install for these tools
    assert "| trainlint, cold cache |" in done.stdout
    assert "warm <= 0.05 x cold" in done.stdout
    payload = json.loads(out.read_text())
    assert payload["corpus"]["files"] == 2
    rows = payload["rows"]
    assert {"trainlint-cold", "trainlint-warm", "libcst-1"} <= set(rows)
    for name in ("trainlint-cold", "trainlint-warm"):
        (run,) = rows[name]["runs"]
        assert run["findings"] == 1  # the checkpoint call in train.py, cold and from the cache
        assert 0 < run["peak_mib"] < 1024 and run["wall"] > 0


def test_benchmark_rejects_unknown_tools(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--tools", "trainlint,ruff", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "unknown tool(s) ruff" in done.stderr


@pytest.mark.slow
def test_linting_leaves_no_syntax_tree_to_the_cyclic_collector() -> None:
    """The CLI lints with the cyclic collector off and never runs it per file: a cycle between the
    file model and a cached view of it (``training``, token evidence) would keep a whole syntax tree
    alive until some later collection. Every rule runs on every example and fixture; no tree node and
    no model may be left for the collector (small closures of the standard library's
    ``ast.literal_eval`` are)."""
    import gc

    sources = [text for _, text in example_sources()]
    sources += [p.read_text(encoding="utf-8") for p in sorted(FIXTURES.glob("*.py"))]
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    leftovers: dict[int, int] = {}
    try:
        for i, text in enumerate(sources):
            lint_text(text, f"f{i}.py", LintOptions(ALL_IDS, prefilter=False))
            gc.collect()
            kept = [o for o in gc.garbage if isinstance(o, cst.CSTNode | FileModel)]
            if kept:
                leftovers[i] = len(kept)
            gc.garbage.clear()
    finally:
        gc.set_debug(0)
        if was_enabled:
            gc.enable()
    assert not leftovers, {i: sources[i][:80] for i in list(leftovers)[:3]}
