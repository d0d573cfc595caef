"""Shared helpers for the tests, and the scaffolding of the ``--verify`` test modules.

A verify test module registers its snippets (``SNIPPETS = Snippets()``, ``snippet = SNIPPETS.add``)
and names ``VERIFY_RULES`` (the rules whose probes it checks), ``VERIFY_FIXTURES`` and
``VERIFY_TIMEOUT``; its tests then take the module-scoped ``verified`` fixture: every snippet and
fixture linted and verified in one batch (one child process, torch imported once).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainlint.engine import lint_source
from trainlint.rule import Finding

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
# the installed torch package's sources, found without importing torch (a corpus of real code)
TORCH_PACKAGE = (
    Path(sys.prefix)
    / "lib"
    / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    / "site-packages"
    / "torch"
)


@pytest.fixture(autouse=True, scope="session")
def _private_user_cache(tmp_path_factory: pytest.TempPathFactory):
    """The default result cache is per user (~/.cache/trainlint): the tests use a folder of their own
    instead of the real one (subprocesses inherit the variable)."""
    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("user-cache"))
    yield
    if saved is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = saved


def findings_for(code: str, *rule_ids: str) -> list[Finding]:
    """Findings of the given rules (all rules when none) on dedented code."""
    return lint_source(textwrap.dedent(code), "snippet.py", rule_ids or None)


@pytest.fixture
def lint():
    return findings_for


def write_project(root: Path, files: dict[str, str]) -> Path:
    """A project at ``root``: a pyproject.toml and ``files`` (dedented)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text("")
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return root


def lint_project(root: Path, files: dict[str, str], target: str, monkeypatch, capsys) -> list[dict]:
    """Writes a project (a pyproject.toml and ``files``) and lints only ``target`` in it through the
    command line, as pre-commit would: the JSON findings."""
    import json

    from trainlint.cli import run

    write_project(root, files)
    monkeypatch.chdir(root)
    capsys.readouterr()
    assert run(["--no-cache", "--format", "json", target]) in (0, 1)
    return json.loads(capsys.readouterr().out)["findings"]


def callers_project(root: Path) -> Path:
    """A project whose ``train.scaled_step`` receives a GradScaler, called from ``jobs/a.py``, beside five
    files that never name it: the callers question must read only the first."""
    (root / "jobs").mkdir(parents=True)
    (root / "pyproject.toml").write_text("")
    (root / "train.py").write_text("def scaled_step(loss, scaler):\n    scaler.scale(loss).backward()\n")
    (root / "jobs" / "a.py").write_text(
        "from train import scaled_step\ndef run(l, s):\n    scaled_step(l, s)\n"
    )
    for i in range(5):
        (root / "jobs" / f"other{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n")
    return root


def age(root: Path, seconds: float = 3600) -> None:
    """Date ``root`` and every file and folder in it ``seconds`` back: dependency records of them are
    past the racy window (stamps within 2 s of the clock are never recorded)."""
    past = time.time() - seconds
    for path in [root, *root.rglob("*")]:
        os.utime(path, (past, past))


def touch(path: Path, seconds: float = 1800) -> None:
    """Date one file or folder ``seconds`` back: a stamp that moved (after ``age``), still past the
    racy window."""
    past = time.time() - seconds
    os.utime(path, (past, past))


def closed_pipe_run(command: list[str], cwd: Path, stderr_too: bool) -> subprocess.CompletedProcess[bytes]:
    """``command`` with stdout (and stderr) a pipe nobody reads: the first write of any output fails."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            command, cwd=cwd, stdout=write, stderr=write if stderr_too else subprocess.PIPE, timeout=300
        )
    finally:
        os.close(write)


def counting(monkeypatch, owner: object, name: str) -> list[tuple]:
    """Record the arguments of every call of ``owner.name`` (which still runs)."""
    calls: list[tuple] = []
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


class Snippets(dict[str, tuple[str, str]]):
    """name -> (rule id, dedented code); each snippet is linted as ``<name>.py`` with its rule only."""

    def add(self, name: str, rule: str, code: str) -> None:
        self[name] = (rule, textwrap.dedent(code))

    def pair(self, name: str, rule: str, code: str, old: str, new: str) -> None:
        """``<name>_a``: the code; ``<name>_b``: the code with ``old`` replaced by ``new`` (once)."""
        assert code.count(old) == 1, (name, old)
        self.add(f"{name}_a", rule, code)
        self.add(f"{name}_b", rule, code.replace(old, new))

    def findings(self, names: list[str]) -> tuple[list[Finding], dict[str, str]]:
        """The findings of the named snippets' rules, and the sources to verify them against."""
        sources = {f"{n}.py": self[n][1] for n in names}
        found = [f for n in names for f in lint_source(self[n][1], f"{n}.py", [self[n][0]])]
        return found, sources

    def line_of(self, name: str, text: str) -> int:
        """The 1-based line of the snippet that contains ``text``."""
        lines = self[name][1].splitlines()
        return next(i for i, line in enumerate(lines, 1) if text in line)


class Verified(dict[str, list[Finding]]):
    """Snippet name (or fixture path) -> its findings, verified."""

    def pair(self, name: str) -> tuple[dict, dict]:
        """The verdicts of a ``Snippets.pair``: the code as written, and with its one change."""
        return self.one(f"{name}_a").verify, self.one(f"{name}_b").verify  # type: ignore[return-value]

    def one(self, name: str) -> Finding:
        found = self.get(name, [])
        assert len(found) == 1, f"{name}: expected one finding, got {[f.rule for f in found]}"
        assert found[0].verify is not None
        return found[0]

    def status(self, name: str) -> str:
        return self.one(name).verify["status"]  # type: ignore[index]

    def assert_each_snippet_reported_once(self, snippets: Snippets) -> None:
        """Every snippet gives exactly one finding, of its own rule (else its verdict says nothing)."""
        for name, (rule, _) in snippets.items():
            assert [f.rule for f in self.get(name, [])] == [rule], name

    def assert_each_rule_confirms_and_names_what_it_cannot_bind(self, snippets: Snippets, rules) -> None:
        """Every rule's snippets include a true bug (confirmed) and an unbindable one (not-executable)."""
        for rule in rules:
            names = [n for n, (r, _) in snippets.items() if r == rule]
            if rule.startswith("TL50"):  # the data-parallel probes need gloo
                gloo_or_skip(self.one(names[0]).verify)
            assert {"confirmed", "not-executable"} <= {self.status(n) for n in names}, rule

    def assert_confirmed(self, path: str, rule: str, line: int | None = None) -> None:
        """The planted mistake ``rule`` in fixture ``path`` (at ``line`` when given) is confirmed."""
        found = [f for f in self.get(path, []) if f.rule == rule and line in (None, f.line)]
        assert found, f"{rule} not reported at {path}:{line}"
        for finding in found:
            assert finding.verify["status"] == "confirmed", finding.verify["detail"]  # type: ignore[index]
            assert finding.verify["evidence"]  # type: ignore[index]


def planted_mistakes(rules: tuple[str, ...]) -> list[tuple[str, str, int]]:
    """(fixture, rule, line) for every ``# expect:`` mistake planted in fixtures/*.py by these rules."""
    out = []
    for path in sorted((ROOT / "fixtures").glob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            match = re.search(r"#\s*expect:\s*(TL\d+)", line)
            if match and match.group(1) in rules:
                out.append((f"fixtures/{path.name}", match.group(1), number))
    return out


def gloo_or_skip(verify: dict) -> dict:
    """Skip a data-parallel check on a torch build without gloo (only then)."""
    if verify["status"] == "not-executable" and "gloo" in verify["detail"]:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_gloo_available()):
            pytest.skip("torch.distributed with gloo is not available")
    return verify


@pytest.fixture(scope="module")
def verified(request) -> Verified:
    """The calling module's snippets and fixtures, linted and verified in one run."""
    from trainlint.verify import verify_findings

    module = request.module
    snippets: Snippets = module.SNIPPETS
    findings, sources = snippets.findings(list(snippets))
    for fixture in module.VERIFY_FIXTURES:
        text = (ROOT / fixture).read_text(encoding="utf-8")
        sources[fixture] = text
        findings.extend(lint_source(text, fixture, list(module.VERIFY_RULES)))
    out = Verified()
    for finding in verify_findings(findings, sources, device="cpu", timeout=module.VERIFY_TIMEOUT):
        key = finding.path.removesuffix(".py") if finding.path.startswith("tl") else finding.path
        out.setdefault(key, []).append(finding)
    return out


def gate_check_keeps_findings(rule_id: str, check, extra: list[str] = ()) -> int:
    """For a rule's ``gate_check``: on every example of the rule, each fixture and ``extra``, the
    findings are the same with the gates on and off, and the check holds wherever the rule reports.
    Returns how many texts the rule reported on."""
    import ast as _ast

    from trainlint.engine import lint_text
    from trainlint.results import LintOptions
    from trainlint.rule import registry

    rule = registry().get(rule_id)
    texts = [e.code for e in rule.invalid] + list(rule.valid) + list(extra)
    texts += [p.read_text(encoding="utf-8") for p in sorted(FIXTURES.rglob("*.py"))]
    reported = 0
    for text in texts:
        try:
            tree = _ast.parse(text)
        except SyntaxError:
            continue
        on = lint_text(text, "x.py", LintOptions((rule_id,)))
        off = lint_text(text, "x.py", LintOptions((rule_id,), prefilter=False))
        assert (on.findings, on.errors) == (off.findings, off.errors), text
        if any(f.rule == rule_id for f in off.findings):
            reported += 1
            assert check(tree), text
    assert reported >= len(rule.invalid)
    return reported
