"""The catalog of automatic fixes: for every rule that has one, the before/after text written by hand next
to the rule's invalid examples (``Invalid(..., fix=...)``), a clean re-lint, idempotence, comments kept, line endings and tabs kept; the cases where a fix must not
be offered; and the end-to-end fixture run (`--fix --unsafe-fixes`, then lint)."""

from __future__ import annotations

import json
import re
import shutil
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainlint.cli import run
from trainlint.engine import lint_source
from trainlint.fix import fix_text
from trainlint.rule import Applicability, registry

ROOT = Path(__file__).resolve().parents[2]
SAFE, UNSAFE = Applicability.SAFE, Applicability.UNSAFE


@dataclass(frozen=True)
class Case:
    """An invalid example of a rule that carries the hand-written text after its fix."""

    rule: str
    index: int
    source: str
    expected: str
    applicability: Applicability


def _cases() -> list[Case]:
    cases = []
    for rule in registry():
        for index, example in enumerate(rule.invalid):
            for expected, applicability in ((example.fix, SAFE), (example.unsafe_fix, UNSAFE)):
                if expected is not None:
                    cases.append(Case(rule.id, index, example.code, expected, applicability))
    return cases


CASES = _cases()


FIXABLE = sorted(rule.id for rule in registry() if rule.has_fix)
COMMENT = re.compile(r"#.*$", re.MULTILINE)


def lint(rule: str, path: str = "train.py"):
    return lambda text: lint_source(text, path, [rule])


def case_id(case: Case) -> str:
    return f"{case.rule}-invalid-{case.index}"


def test_every_fixable_rule_has_cases_and_every_case_a_fixable_rule() -> None:
    assert FIXABLE, "no rule declares a fix"
    assert sorted({case.rule for case in CASES}) == FIXABLE


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_before_after_written_by_hand(case: Case) -> None:
    findings = lint_source(case.source, "train.py", [case.rule])
    assert len(findings) == 1, findings
    (finding,) = findings
    assert finding.fix is not None
    assert finding.fix.applicability is case.applicability
    outcome = fix_text(case.source, lint(case.rule), unsafe=True)
    assert outcome.text == case.expected
    assert outcome.fixed == 1
    assert not outcome.dropped


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_after_the_fix_the_rule_reports_nothing(case: Case) -> None:
    fixed = fix_text(case.source, lint(case.rule), unsafe=True).text
    assert lint_source(fixed, "train.py", [case.rule]) == []
    # and the hand-written text itself is clean, whatever the fixer produced
    assert lint_source(case.expected, "train.py", [case.rule]) == []


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fixing_twice_changes_nothing_the_second_time(case: Case) -> None:
    once = fix_text(case.source, lint(case.rule), unsafe=True)
    twice = fix_text(once.text, lint(case.rule), unsafe=True)
    assert twice.text == once.text
    assert twice.fixed == 0


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_comments_around_the_edit_are_kept(case: Case) -> None:
    before = Counter(COMMENT.findall(case.source))
    assert before, "every case carries comments around its edit"
    after = Counter(COMMENT.findall(fix_text(case.source, lint(case.rule), unsafe=True).text))
    # exactly the comments that the hand-written result leaves out (a deleted line takes its own along)
    assert before - after == before - Counter(COMMENT.findall(case.expected))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_safe_only_run_applies_exactly_the_safe_fixes(case: Case) -> None:
    outcome = fix_text(case.source, lint(case.rule), unsafe=False)
    assert outcome.text == (case.expected if case.applicability is SAFE else case.source)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_crlf_and_tabs_are_kept(case: Case) -> None:
    def convert(text: str) -> str:
        return text.replace("    ", "\t").replace("\n", "\r\n")

    outcome = fix_text(convert(case.source), lint(case.rule), unsafe=True)
    assert outcome.text == convert(case.expected)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_fix_works_inside_a_function_and_a_branch(case: Case) -> None:
    """The same edit one and two indentation levels deeper."""

    def nest(text: str) -> str:
        body = textwrap.indent(text.rstrip("\n"), "        ")
        return "def main():\n    if run:\n" + body + "\n"

    outcome = fix_text(nest(case.source), lint(case.rule), unsafe=True)
    assert outcome.text == nest(case.expected)


@pytest.mark.parametrize("rule_id", FIXABLE)
def test_embedded_examples_that_get_fixes_come_out_clean(rule_id: str) -> None:
    """Every invalid example whose findings all carry a fix is clean after fixing, and stays put on a
    second run; at least one example of each fixable rule gets a fix."""
    rule = registry().get(rule_id)
    assert rule is not None
    fixed_any = False
    for example in rule.invalid:
        code = textwrap.dedent(example.code)
        findings = lint_source(code, "example.py", [rule_id])
        if not findings or any(f.fix is None for f in findings):
            continue
        fixed_any = True
        outcome = fix_text(code, lint(rule_id, "example.py"), unsafe=True)
        assert outcome.text != code
        assert lint_source(outcome.text, "example.py", [rule_id]) == [], code
        again = fix_text(outcome.text, lint(rule_id, "example.py"), unsafe=True)
        assert (again.text, again.fixed) == (outcome.text, 0)
    assert fixed_any


# -- where no fix is offered -------------------------------------------------------------------------

NO_FIX = [
    # TL104: the per-micro-step form
    (
        "TL104",
        """
        import torch
        scaler = torch.amp.GradScaler()
        for i, x in enumerate(data):
            scaler.scale(model(x)).backward()
            scaler.unscale_(opt)
            if (i + 1) % accum == 0:
                scaler.step(opt)
                scaler.update()
        """,
    ),
    # TL104: not alone on its line
    (
        "TL104",
        """
        def step(scaler, opt, loss):
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.unscale_(opt); log(opt)
            scaler.step(opt)
            scaler.update()
        """,
    ),
    # TL106: not the block's last statement
    (
        "TL106",
        """
        import torch
        with torch.autocast("cuda"):
            loss = model(x)
            loss.backward()
            stats = measure(model)
        """,
    ),
    # TL106: the with block would become empty
    (
        "TL106",
        """
        import torch
        loss = model(x)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss.backward()
        """,
    ),
    # TL106: the with also holds another context manager
    (
        "TL106",
        """
        import torch
        with model.no_sync(), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x)
            loss.backward()
        """,
    ),
    # TL106: still inside an enabled outer region after the move
    (
        "TL106",
        """
        import torch
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
            if train:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = crit(out)
                    loss.backward()
        """,
    ),
    # TL106: inside an if in the block
    (
        "TL106",
        """
        import torch
        with torch.autocast("cuda"):
            loss = model(x)
            if train:
                loss.backward()
        """,
    ),
    # TL106: the region is a decorator
    (
        "TL106",
        """
        import torch
        @torch.autocast("cuda", dtype=torch.float16)
        def train_step(x):
            loss = model(x).mean()
            loss.backward()
        """,
    ),
    # TL106: not alone on its line
    (
        "TL106",
        """
        import torch
        with torch.autocast("cuda"):
            loss = model(x)
            loss.backward(); step()
        """,
    ),
    # TL303: two steps of the optimizer in the loop
    (
        "TL303",
        """
        import torch
        scaler = torch.amp.GradScaler()
        for i, b in enumerate(loader):
            optimizer.zero_grad()
            model(b).loss.backward()
            if (i + 1) % accum == 0:
                if use_scaler:
                    scaler.step(optimizer)
                else:
                    optimizer.step()
        """,
    ),
    # TL303: zero_grad is the only statement of its with block
    (
        "TL303",
        """
        for i, b in enumerate(loader):
            with timer("zero"):
                optimizer.zero_grad()
            model(b).loss.backward()
            if (i + 1) % accum == 0:
                optimizer.step()
        """,
    ),
    # TL303: the step is on a one-line if
    (
        "TL303",
        """
        for i, b in enumerate(loader):
            optimizer.zero_grad()
            model(b).loss.backward()
            if (i + 1) % accum == 0: optimizer.step()
        """,
    ),
    # TL303: zero_grad inside a try block
    (
        "TL303",
        """
        for i, b in enumerate(loader):
            try:
                optimizer.zero_grad()
                model(b).loss.backward()
            except RuntimeError:
                continue
            if (i + 1) % accum == 0:
                optimizer.step()
        """,
    ),
]


@pytest.mark.parametrize(("rule_id", "code"), NO_FIX, ids=[f"{r}-{i}" for i, (r, _) in enumerate(NO_FIX)])
def test_no_fix_where_the_edit_is_not_clear_cut(rule_id: str, code: str) -> None:
    findings = lint_source(textwrap.dedent(code), "train.py", [rule_id])
    assert len(findings) == 1, findings
    assert findings[0].fix is None


def test_a_file_with_lone_carriage_returns_deletes_exactly_one_line() -> None:
    # Lines end in a lone "\r" here: the deletion must stop at the next line, not run to the end.
    code = (
        "import torch\nscaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()\n"
        "scaler.unscale_(opt)\nscaler.unscale_(opt)\nscaler.step(opt)\nscaler.update()\nprint('end')\n"
    ).replace("\n", "\r")
    expected = (
        "import torch\nscaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()\n"
        "scaler.unscale_(opt)\nscaler.step(opt)\nscaler.update()\nprint('end')\n"
    ).replace("\n", "\r")
    outcome = fix_text(code, lint("TL104"), unsafe=False)
    assert outcome.text == expected
    assert outcome.fixed == 1


def test_bom_crlf_and_tabs_survive_a_moving_fix_through_the_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # TL303's first hand-written fix moves zero_grad() to the top of the loop
    case = next(c for c in CASES if c.rule == "TL303")
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "train.py"
    path.write_bytes(b"\xef\xbb\xbf" + case.source.replace("    ", "\t").replace("\n", "\r\n").encode())
    run(["--no-cache", "--select", "TL303", "--fix", "--unsafe-fixes", "train.py"])
    capsys.readouterr()
    expected = case.expected.replace("    ", "\t").replace("\n", "\r\n")
    assert path.read_bytes() == b"\xef\xbb\xbf" + expected.encode()


def test_fix_over_the_fixtures_leaves_exactly_the_findings_without_a_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(ROOT / "fixtures", tmp_path / "fixtures")
    monkeypatch.chdir(tmp_path)

    def findings() -> list[dict]:
        run(["--no-cache", "--format", "json", "fixtures"])
        return json.loads(capsys.readouterr().out)["findings"]

    original = findings()
    assert any(f["fix"] is not None for f in original)
    run(["--no-cache", "--fix", "--unsafe-fixes", "fixtures"])
    capsys.readouterr()
    first = {p.name: p.read_text() for p in (tmp_path / "fixtures").glob("*.py")}
    remaining = findings()
    assert all(f["fix"] is None for f in remaining)
    # nothing new appears; a fix may also settle a neighbour (TL302's `.item()` synchronises, which
    # closes TL402's timing interval in bad_accumulation_loop.py)
    assert Counter(f["rule"] for f in remaining) <= Counter(f["rule"] for f in original if f["fix"] is None)
    assert {f["rule"] for f in remaining} >= {"TL105", "TL203", "TL301", "TL405"}
    run(["--no-cache", "--fix", "--unsafe-fixes", "fixtures"])
    capsys.readouterr()
    assert {p.name: p.read_text() for p in (tmp_path / "fixtures").glob("*.py")} == first
